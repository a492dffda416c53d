"""Trajectories -> trainer Samples, and group-relative advantages per episode.

Each trajectory segment becomes one Sample: prompt_ids = the segment's ids before the first sampled
token, response_ids = everything after it (sampled turns *and* the template/tool tokens between them),
loss_mask = 1 on the sampled tokens only. The trainer attends to every token but puts loss only under
the mask (rollwise.train.trainer). Trailing tokens after the last sampled turn carry no loss and are cut.

A split episode gives several Samples; they all carry the episode's reward and advantage, and the
GRPO group statistics count the episode once (`assign_episode_advantages`).
"""

from __future__ import annotations

from typing import Literal

import torch

from rollwise.agent.trajectory import Trajectory
from rollwise.rollout.types import Sample
from rollwise.train.grpo import group_advantages


def trajectory_samples(traj: Trajectory, *, problem_id: str, group_id: str, episode_id: str,
                       response_text: str = "") -> list[Sample]:
    samples = []
    for k, seg in enumerate(traj.segments):
        if not seg.spans:
            continue  # a segment nothing was sampled in (e.g. a split right before a limit) teaches nothing
        start, end = seg.prompt_len, seg.spans[-1].end
        samples.append(Sample(
            sample_id=f"{episode_id}/seg{k}", group_id=group_id, problem_id=problem_id,
            prompt_ids=seg.token_ids[:start], response_ids=seg.token_ids[start:end],
            behaviour_logprobs=seg.logprobs[start:end], versions=seg.versions[start:end],
            finish_reason=traj.finish_reason or seg.spans[-1].finish_reason, response_text=response_text,
            loss_mask=seg.loss_mask[start:end],
            routed_experts=seg.routed_experts.head(end - 1) if seg.routed_experts is not None else None,
            extra={"episode_id": episode_id, "segment": k, "turns": len(seg.spans), "split_reason": seg.split_reason},
        ))
    return samples


def assign_episode_advantages(samples: list[Sample], mode: Literal["mean_std", "mean"]) -> float:
    """GRPO advantages with one entry per episode (a split episode's segments share it), in place.
    A group with fewer than two episodes that sampled anything teaches nothing (advantage 0).
    Returns the fraction of groups with zero reward variance (such groups included)."""
    groups: dict[str, dict[str, list[Sample]]] = {}
    for s in samples:
        groups.setdefault(s.group_id, {}).setdefault(s.extra.get("episode_id", s.sample_id), []).append(s)
    flat = 0
    for episodes in groups.values():
        eps = list(episodes.values())
        rewards = torch.tensor([[ep[0].reward for ep in eps]], dtype=torch.float32)
        if len(eps) < 2 or float(rewards.std()) == 0.0:
            flat += 1
            advantages = [0.0] * len(eps)
        else:
            advantages = group_advantages(rewards, mode)[0].tolist()
        for ep, a in zip(eps, advantages):
            for s in ep:
                s.advantage = a
    return flat / max(len(groups), 1)
