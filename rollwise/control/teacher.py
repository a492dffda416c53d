"""The teacher of on-policy distillation (`train.teacher`): an engine that scores the student's sampled tokens.

The teacher is served by an engine like the student's (the engine contract's `score_tokens`: a prefill over
prompt + response, the log-prob of each response token, nothing sampled, a batch of samples a call): built from
train.teacher.model (a reference or vLLM engine from the teacher's weights, sized by train.teacher's engine fields) in
this process, or under placement: ray on a teacher actor in the run's placement group (its own bundle,
ray.teacher_cpus / ray.teacher_gpus: rollwise.control.ray.teacher_actor); or an engine server already serving it
(train.teacher.url: `rollwise serve engine --model TEACHER`, POST /score). Either way
the driver scores each step's samples after the rollout and sets their per-token distillation rewards
(rollwise.train.distill). Both are checked before any engine of the run starts: the teacher must share the
student's tokenizer, since it scores the student's token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import httpx
import torch

from rollwise.config import ConfigError, RunConfig
from rollwise.engine.client import EngineClient, EngineServerError
from rollwise.control.teacher_engine import build_teacher_engine
from rollwise.engine.factory import resolve_engine_kind
from rollwise.engine.scoring import prefix_batches
from rollwise.model.loading import tokenizer_fingerprint
from rollwise.train.distill import set_distill_rewards
from rollwise.types.sample import Sample
from rollwise.types.score import ScoreSequence
from rollwise.types.sft_config import TeacherConfig


class TokenScorer(Protocol):
    """What the teacher needs of an engine: Engine.score_tokens (an in-process engine, or EngineClient over HTTP)."""

    def score_tokens(self, sequences: Sequence[ScoreSequence], temperature: float = 1.0) -> list[list[float]]: ...


class Teacher:
    def __init__(self, scorer: TokenScorer, cfg: TeacherConfig, *, temperature: float,
                 close: Callable[[], None] | None = None, where: str = "") -> None:
        self.scorer = scorer
        self.where = where  # for the console: which engine serves the teacher
        self.cfg = cfg
        # the behaviour log-probs are at the rollout temperature (greedy rows: 1), and so must the teacher's be
        self.temperature = temperature if temperature > 0 else 1.0
        self._close = close

    @classmethod
    def for_run(cls, cfg: RunConfig, student_tokenizer: Any) -> Teacher:
        """The run's teacher (cfg.train.teacher): at its url, or an engine built from train.teacher.model, on a Ray
        actor of the run's placement group under placement: ray (rollwise.control.ray.teacher_actor), else in this
        process. ConfigError naming the train.teacher field when it cannot serve this run."""
        assert cfg.train.teacher is not None
        teacher, temperature, max_model_len = cfg.train.teacher, cfg.rollout.temperature, cfg.engine.max_model_len
        if teacher.url is None and cfg.engines_at == "ray":
            from rollwise.control.ray.teacher_actor import start_teacher_actor  # Ray is imported only for ray

            scorer, where = start_teacher_actor(cfg, student_tokenizer)
            return cls(scorer, teacher, temperature=temperature, close=scorer.close, where=where)
        student_engine = resolve_engine_kind(cfg.engine.kind, cfg.model) if cfg.placement == "local" else "remote"
        return cls.start(teacher, student_tokenizer, temperature=temperature, max_model_len=max_model_len,
                         student_engine=student_engine)

    @classmethod
    def start(cls, cfg: TeacherConfig, student_tokenizer: Any, *, temperature: float, max_model_len: int,
              student_engine: str = "reference") -> Teacher:
        """The teacher engine of `cfg` (ConfigError naming the train.teacher field when it cannot serve this run)."""
        if cfg.url is not None:
            return cls._remote(cfg, student_tokenizer, temperature=temperature, max_model_len=max_model_len)
        engine = build_teacher_engine(cfg, student_tokenizer.get_vocab(), temperature=temperature,
                                      max_model_len=max_model_len, student_engine=student_engine)
        return cls(engine, cfg, temperature=temperature, close=engine.close,
                   where=f"{cfg.model} on an engine in this process: {engine.describe()}")

    @classmethod
    def _remote(cls, cfg: TeacherConfig, student_tokenizer: Any, *, temperature: float, max_model_len: int) -> Teacher:
        client = EngineClient(str(cfg.url))
        try:
            info = client.model_info()
        except (EngineServerError, httpx.HTTPError) as exc:
            client.close()
            raise ConfigError(f"train.teacher.url={cfg.url!r}: no engine server answers there ({exc}); start one "
                              "with `rollwise serve engine --model TEACHER`") from None
        theirs, ours = info.get("tokenizer_fingerprint"), tokenizer_fingerprint(student_tokenizer)
        problem = None
        if theirs is not None and theirs != ours:
            problem = ("the server's tokenizer differs from the student's (model:); the teacher scores the student's "
                       "token ids, so it must share the student's tokenizer")
        elif info.get("engine") == "vllm" and temperature not in (0.0, 1.0):
            problem = (f"a vLLM engine scores at temperature 1 only, but rollout.temperature={temperature}: serve the "
                       "teacher with --engine reference, or set rollout.temperature=1")
        elif int(info.get("max_model_len", 0)) < max_model_len:
            problem = (f"the server's max_model_len={info.get('max_model_len')} is below the student's sequences' "
                       f"{max_model_len} (engine.max_model_len): restart it with --max-model-len {max_model_len}")
        if problem is not None:
            client.close()
            raise ConfigError(f"train.teacher.url={cfg.url!r}: {problem}")
        return cls(client, cfg, temperature=temperature, close=client.close,
                   where=f"{info.get('model', '?')} on the engine server {cfg.url}")

    @torch.no_grad()
    def token_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """The teacher's log-prob of each sample's trained (sampled) tokens, one fp32 tensor per sample: the samples
        scored a batch a call (prefix_batches: at most SCORE_BATCH_TOKENS tokens, what one POST /score takes; a
        group's samples together)."""
        sequences = [ScoreSequence(token_ids=[*s.prompt_ids, *s.response_ids], start=len(s.prompt_ids))
                     for s in samples]
        scores: list[list[float]] = [[] for _ in samples]
        for batch in prefix_batches(sequences):  # a group's samples together: its prompt computed once
            for i, logprobs in zip(batch, self.scorer.score_tokens([sequences[i] for i in batch], self.temperature)):
                scores[i] = logprobs
        return [torch.tensor([lp for lp, m in zip(lps, s.trained_mask) if m], dtype=torch.float32)
                for lps, s in zip(scores, samples)]

    def reward(self, samples: list[Sample]) -> dict[str, float]:
        """Score `samples` and set their per-token distillation rewards; the step's distillation metrics."""
        return set_distill_rewards(samples, self.token_logprobs(samples), self.cfg.coefficient)

    def describe(self) -> str:
        return (f"{self.where}; per-token reward {self.cfg.coefficient:g} x (log p_teacher - log p_student), "
                f"mode={self.cfg.mode}, temperature {self.temperature:g}")

    def close(self) -> None:
        if self._close is not None:
            self._close()

