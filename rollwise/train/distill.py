"""On-policy distillation (`train.teacher`): the student samples, a teacher scores the same token ids, and
the reverse KL on those tokens is the reward.

For a response y sampled by the student S, each sampled token t gives log p_T(y_t | y_<t) - log p_S(y_t | y_<t):
minus the single-sample estimate of the per-token reverse KL(S || T). Its sum over the response,
log p_T(y) - log p_S(y), times train.teacher.coefficient, is the sample's reward (mode=replace), or is added
to the task's reward (mode=add); the configured advantage estimator and policy loss then train on it as on any
reward. REINFORCE on that reward is exactly the gradient of -KL(S || T) (E_S[grad log p_S(y) (log p_T(y) -
log p_S(y))]), so the student moves toward the teacher on its own samples.

log p_S is the engine's log-prob of the token as sampled (the behaviour log-prob every sample carries, at the
rollout temperature); the teacher scores at the same temperature, so a teacher equal to the student gives 0 up
to the engine's and trainer's float round-off. The teacher runs in this process, no_grad, with the trainer's
chunked log-prob path (rollwise.train.trainer.collate); its vocabulary must be the student's: the ids it
scores are the student's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rollwise.config import ConfigError
from rollwise.model.loading import load_model
from rollwise.types.sample import Sample
from rollwise.types.sft_config import TeacherConfig
from rollwise.train.logprobs import LogprobOptions
from rollwise.train.trainer import collate, to_device

REVERSE_KL = "distill/reverse_kl"  # mean over the batch's sampled tokens of log p_S - log p_T


class Teacher:
    def __init__(self, model: nn.Module, cfg: TeacherConfig, *, temperature: float, pad_token_id: int,
                 chunk_tokens: int = 1024):
        self.model = model.eval().requires_grad_(False)
        self.cfg = cfg
        self.options = LogprobOptions(temperature, chunk_tokens)
        self.pad_token_id = pad_token_id

    @classmethod
    def load(cls, cfg: TeacherConfig, student_tokenizer: Any, *, temperature: float,
             chunk_tokens: int = 1024) -> Teacher:
        """The teacher model of `cfg`; a ConfigError naming train.teacher.model when it cannot be loaded or its
        vocabulary differs from the student's."""
        try:
            model, tokenizer = load_model(cfg.model)
        except ValueError as exc:
            raise ConfigError(f"train.teacher.model={cfg.model!r}: {exc}") from None
        if tokenizer.get_vocab() != student_tokenizer.get_vocab():
            raise ConfigError(f"train.teacher.model={cfg.model!r}: its tokenizer's vocabulary differs from the "
                              "student's (model:); the teacher scores the student's token ids, so it must share the "
                              "student's tokenizer: choose a teacher of the same model family")
        pad = student_tokenizer.pad_token_id
        return cls(model, cfg, temperature=temperature, chunk_tokens=chunk_tokens,
                   pad_token_id=pad if pad is not None else student_tokenizer.eos_token_id)

    @torch.no_grad()
    def token_logprobs(self, samples: list[Sample]) -> list[Tensor]:
        """The teacher's log-prob of each sample's trained (sampled) tokens, one tensor per sample."""
        out: list[Tensor] = []
        device = next(self.model.parameters()).device
        for i in range(0, len(samples), self.cfg.micro_batch_size):
            chunk = samples[i:i + self.cfg.micro_batch_size]
            mb = to_device(collate(chunk, torch.zeros(0), self.pad_token_id), device)
            logp, _ = mb.logprobs(self.model, self.options)
            out.extend(logp.float().cpu().split([s.trained_tokens for s in chunk]))
        return out

    def reward(self, samples: list[Sample]) -> dict[str, float]:
        """Set each sample's reward from the teacher (see the module doc); the task's reward stays in
        extra["task_reward"]. Returns the step's distillation metrics."""
        teacher = self.token_logprobs(samples)
        kl_sum, n_tokens, rewards, task = 0.0, 0, [], []
        for s, t_logp in zip(samples, teacher):
            s_logp = torch.tensor([lp for lp, m in zip(s.behaviour_logprobs, s.trained_mask) if m], dtype=torch.float32)
            log_ratio = t_logp - s_logp  # per token: minus the reverse-KL estimate
            kl_sum += float(-log_ratio.sum())
            n_tokens += log_ratio.numel()
            distill = self.cfg.coefficient * float(log_ratio.sum())
            s.extra["task_reward"] = s.reward
            task.append(s.reward)
            s.reward = distill if self.cfg.mode == "replace" else s.reward + distill
            rewards.append(distill)
        n = max(len(samples), 1)
        return {REVERSE_KL: kl_sum / max(n_tokens, 1), "distill/reward_mean": sum(rewards) / n,
                "distill/task_reward_mean": sum(task) / n}
