"""The engine of train.teacher.model (on-policy distillation's teacher), built and checked the same way wherever it
runs: in the driver (rollwise.control.teacher) or on a Ray teacher actor (rollwise.control.ray.teacher_actor)."""

from __future__ import annotations

from rollwise.config import ConfigError
from rollwise.engine.contract import Engine
from rollwise.engine.factory import EngineSettings, create_engine, resolve_engine_kind
from rollwise.model.loading import load_model
from rollwise.types.sft_config import TeacherConfig


def build_teacher_engine(cfg: TeacherConfig, student_vocab: dict[str, int], *, temperature: float, max_model_len: int,
                         student_engine: str) -> Engine:
    """The engine of train.teacher.model, where it runs (this process, or a Ray teacher actor); ConfigError naming
    the train.teacher field when it cannot serve the run. `student_engine`: the student's in-process engine kind
    beside it ("remote": none in this process)."""
    try:
        model, tokenizer = load_model(cfg.model)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"train.teacher.model={cfg.model!r}: {exc}") from None
    if tokenizer.get_vocab() != student_vocab:
        raise ConfigError(f"train.teacher.model={cfg.model!r}: its tokenizer's vocabulary differs from the "
                          "student's (model:); the teacher scores the student's token ids, so it must share the "
                          "student's tokenizer: choose a teacher of the same model family")
    try:
        kind = resolve_engine_kind(cfg.engine, cfg.model or "")
    except ValueError as exc:  # vLLM asked for and not installed
        raise ConfigError(f"train.teacher.engine={cfg.engine}: {exc}") from None
    if kind == "vllm" and temperature not in (0.0, 1.0):
        raise ConfigError(f"train.teacher.engine=vllm scores at temperature 1 only (vLLM's prompt logprobs are "
                          f"the raw model's), but rollout.temperature={temperature}: set "
                          "train.teacher.engine=reference, or rollout.temperature=1")
    if kind == "vllm" and student_engine == "vllm":
        raise ConfigError("train.teacher.engine=vllm beside the run's in-process vLLM engine: vLLM runs one "
                          "engine per process; serve the teacher apart (`rollwise serve engine --model TEACHER`, "
                          "then train.teacher.url) or set train.teacher.engine=reference")
    # The reference engine scores with no KV cache (one packed forward a batch): its generation cache is built
    # at the least it takes (one slot) and let go at once (sleep(): weights kept, KV freed; it never generates).
    settings = EngineSettings(kind=kind, max_num_seqs=1 if kind == "reference" else cfg.max_num_seqs,
                              dtype=cfg.dtype, max_model_len=cfg.max_model_len or max_model_len)
    engine = create_engine(settings, model, tokenizer, model_name=cfg.model or "teacher")
    del model  # the engine holds its own copy of the weights
    if kind == "reference":
        engine.sleep()
    return engine
