"""Trajectories -> trainer Samples, and group-relative advantages per episode.

Each trajectory segment becomes one Sample: prompt_ids = the segment's ids before the first sampled
token, response_ids = everything after it (sampled turns *and* the template/tool tokens between them),
loss_mask = 1 on the sampled tokens only. The trainer attends to every token but puts loss only under
the mask (rollwise.train.trainer). Trailing tokens after the last sampled turn carry no loss and are cut.

A split episode gives several Samples; they all carry the episode's reward and advantage, and the
GRPO group statistics count the episode once (`assign_episode_advantages`).
"""

from __future__ import annotations

from rollwise.agent.trajectory import Trajectory
from rollwise.types.sample import Sample
from rollwise.train.advantages import RewardGroups, estimate


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


def assign_episode_advantages(samples: list[Sample], mode: str) -> float:
    """Advantages by the estimator `mode` (train.advantage, rollwise.train.advantages) with one entry per
    episode (a split episode's segments share it, and count its trained tokens), in place. A group with
    fewer than two episodes that sampled anything gets no group baseline (advantage 0 from the group-relative
    estimators). Returns the fraction of groups with zero reward variance (such groups included)."""
    groups: dict[str, dict[str, list[Sample]]] = {}
    for s in samples:
        groups.setdefault(s.group_id, {}).setdefault(s.extra.get("episode_id", s.sample_id), []).append(s)
    episodes = [list(g.values()) for g in groups.values()]
    rewards = RewardGroups.of([[ep[0].reward for ep in eps] for eps in episodes],
                              [[sum(s.trained_tokens for s in ep) for ep in eps] for eps in episodes])
    flat = sum(len(r) < 2 or float(r.std()) == 0.0 for r in rewards.rewards)
    for eps, advantages in zip(episodes, estimate(mode, rewards)):
        for ep, a in zip(eps, advantages.tolist()):
            for s in ep:
                s.advantage = a
    return flat / max(len(groups), 1)
