"""Typed run configuration: YAML file + dotted command-line overrides (`train.lr=1e-5`).

Every section forbids unknown keys, so a typo fails before any work starts, with the key named,
the allowed keys listed and the closest match suggested.
"""

from __future__ import annotations

import difflib
import re
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from rollwise.reward.scoring import RewardConfig
from rollwise.tasks import TaskConfig
from rollwise.tasks.prompts import PromptConfig
from rollwise.types.critic_config import check_token_advantage_placement, token_advantage_reason
from rollwise.types.config_section import ConfigSection
from rollwise.types.engine_config import EngineConfig
from rollwise.types.ray_config import RayConfig
from rollwise.types.train_config import TrainConfig, TrainerConfig
from rollwise.types.logging_config import LoggingConfig
from rollwise.types.sft_config import SftConfig


class _Section(ConfigSection):
    """No unknown keys, finite numbers, no true/false for a number (rollwise.types.config_section)."""


class RolloutConfig(_Section):
    prompts_per_step: int = Field(8, ge=1, description="GRPO groups generated per training step")
    group_size: int = Field(8, ge=2, description="samples per prompt (the GRPO group)")
    max_tokens: int = Field(64, ge=1, description="generation budget per sample")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    mode: Literal["sync", "sorted", "async"] = Field(
        "sync",
        description="sync: generate the batch, then train; sorted: saturated engine, complete groups "
        "train in completion order (SortedRL); async: generation never waits, admission bounded by "
        "max_staleness (AReaL)",
    )
    max_staleness: int = Field(
        1, ge=0, description="eta: most policy versions between sampling a token and training on it"
    )
    partial_rollout: Literal["continue", "abort"] = Field(
        "continue",
        description="samples still running at a weight update: continue from their cached prefix under "
        "the new weights, or abort and regenerate them",
    )
    oversubscription: float = Field(
        2.0, ge=1.0,
        description="sorted/async: groups started and not yet trained (the batch in training included) = "
        "oversubscription x prompts_per_step; beyond max_staleness + 1 they wait too many updates and "
        "get regenerated",
    )
    # Issue 26 (rollwise.rollout.admission): how many complete groups one update trains.
    update_batch: Literal["fixed", "flexible"] = Field(
        "fixed",
        description="sorted/async: fixed trains prompts_per_step groups per update; flexible trains every "
        "complete group (prompts_per_step .. max_batch_factor x prompts_per_step) and caps the groups "
        "generating at oversubscription x prompts_per_step, so engines stay full while the trainer trains",
    )
    max_batch_factor: float = Field(
        2.0, ge=1.0, description="update_batch=flexible: most groups per update = this x prompts_per_step"
    )


class PoolConfig(_Section):
    """Attach to a shared engine pool (`rollwise serve pool`) instead of starting engines (rollwise.pool)."""

    url: str | None = Field(None, description="the pool's URL, e.g. http://127.0.0.1:8300; None: own engines")
    job: str | None = Field(None, description="this job's name in the pool (default: MODEL-PID)")
    priority: float = Field(1.0, gt=0, description="share of engine time relative to other jobs")


# Which weight sender carries the trainer's weights to the engines, for each place the engines run
# (rollwise.sync.senders; rollwise.control.placement uses the one this names). `auto` picks it.
SENDER_FOR_PLACEMENT = {"local": "inprocess", "ray": "ray", "pool": "http"}
# Senders a placement takes besides its own: Ray engine actors can also join a weight group and
# receive each update as one gloo/NCCL broadcast from the driver (rollwise.control.ray.fleet_collective).
OTHER_SENDERS = {"ray": ("collective",)}


class SyncConfig(_Section):
    """How weight updates reach the engines (rollwise.sync): every sender ends in the checked commit."""

    sender: Literal["auto", "inprocess", "ray", "http", "collective"] = Field(
        "auto", description="auto: the placement's own (local: inprocess, ray: ray object store, pool.url: http); "
        "collective: placement=ray only, each update one torch.distributed broadcast from the driver to every "
        "engine actor (NCCL when the engines are on GPUs, gloo otherwise)")


class EvalConfig(_Section):
    size: int = Field(100, ge=0, description="held-out problems scored before and after training")
    every: int = Field(0, ge=0, description="also evaluate every N steps (0: only before and after)")
    max_tokens: int | None = Field(None, ge=1, description="default: rollout.max_tokens")


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="save every N steps (0: only at the end)")
    resume: str | None = Field(None, description="checkpoint dir to resume from, or 'auto' (latest in output_dir)")
    keep_last: int = Field(2, ge=1)


ToolName = Literal["calculator", "python", "bash"]


class AgentConfig(_Section):
    """The `agent:` section: train on multi-turn, tool-using episodes (rollwise.agent). Here, not in
    rollwise.agent, because the agent code imports config (one way)."""

    tools: list[ToolName] = Field(default_factory=lambda: ["calculator"],
                                  description="calculator; python/bash run in a sandbox per episode")
    max_turns: int = Field(3, ge=1, description="engine turns per episode")
    max_tokens: int = Field(256, ge=1, description="sampled tokens per episode (all turns)")
    max_tokens_per_turn: int = Field(64, ge=1)
    max_tool_calls_per_turn: int = Field(16, ge=1, description="tool calls run per model turn; extra calls get "
                                         "one error result naming this limit (hostile or runaway replies)")
    parser: str = Field("hermes", description="tool-call format (rollwise.agent.toolcalls)")
    describe_tools: bool = Field(True, description="tell the model about the tools in the system message")
    concurrency: int = Field(64, ge=1, description="episodes running at once")
    demo: list[dict[str, str]] = Field(
        default_factory=list,
        description="a worked episode shown before the question (after the system message), as chat "
        "messages, e.g. user -> assistant tool call -> tool -> assistant answer: a format hint for models "
        "that never call tools unprompted; {answer_open}/{answer_close} are the reward's tags")


class RunConfig(_Section):
    model: str = "bundled:smollm2-135m-instruct"
    seed: int = 0
    output_dir: str = "runs/{model_name}-{task_name}-{timestamp}"
    threads: int = Field(0, ge=0, description="torch CPU threads (0: all cores)")
    task: TaskConfig
    prompt: PromptConfig = PromptConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    engine: EngineConfig = EngineConfig()
    train: TrainConfig = TrainConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    # Where engines, trainer and reward workers run: `local` (one process, the default) or `ray`
    # (actors on a Ray cluster, same config otherwise). pool.url attaches to a shared engine pool.
    placement: Literal["local", "ray"] = "local"
    ray: RayConfig = RayConfig()
    pool: PoolConfig = PoolConfig()
    sync: SyncConfig = SyncConfig()
    tensorboard: bool = True
    # Experiment trackers (rollwise.observe.trackers): `logging.backends: [tensorboard, wandb, mlflow]`;
    # `tensorboard: false` leaves TensorBoard out of them.
    logging: LoggingConfig = LoggingConfig()
    # Multi-turn, tool-using episodes instead of single completions (rollwise.agent); e.g.
    # `rollwise train agent.tools=[calculator]`. None: the single-turn loop.
    agent: AgentConfig | None = None
    # `rollwise sft`: supervised fine-tuning on chat JSONL (rollwise.train.sft); `rollwise train` ignores it.
    sft: SftConfig = SftConfig()

    @model_validator(mode="after")
    def _agent_needs_sync(self) -> RunConfig:
        if self.agent is not None and self.rollout.mode != "sync":
            raise ValueError(f"agent: episodes are rolled out in rollout.mode=sync only, got "
                             f"rollout.mode={self.rollout.mode!r}; set rollout.mode=sync")
        return self

    @model_validator(mode="after")
    def _sharded_trainer_is_local(self) -> RunConfig:
        if self.trainer.world_size > 1 and self.placement == "ray":
            raise ValueError(f"trainer.world_size={self.trainer.world_size} starts its ranks from this process; "
                             f"with placement=ray the ranks are Ray actors: set ray.trainer_ranks="
                             f"{self.trainer.world_size} (and trainer.world_size=1)")
        return self

    @model_validator(mode="after")
    def _token_advantages_placement(self) -> RunConfig:
        check_token_advantage_placement(token_advantage_reason(self.train.advantage, self.train.kl_penalty,
                                                               self.train.kl_coef, self.train.teacher is not None),
                                        self.agent is not None)
        return self

    @model_validator(mode="after")
    def _lora_placement(self) -> RunConfig:
        """train.lora pushes adapters, which the in-process engines and the shared pool (pool.url: a LoRA job
        sharing its base's engines) load (rollwise.sync.adapters); the object-store sender and the sharded
        trainer carry full weights only so far."""
        if self.train.lora is None:
            return self
        if self.trainer.world_size > 1 or self.placement == "ray":
            raise ValueError("train.lora runs with placement=local or pool.url, and trainer.world_size=1, for now "
                             "(adapter-only sync reaches in-process engines and the pool only): unset train.lora, "
                             "or use those")
        if self.engine.max_loras < 1:
            if "max_loras" not in self.engine.model_fields_set:
                # Left at its default: serve the one adapter this run trains (vLLM needs LoRA enabled at
                # start; with engine.kind=auto the engine is not known yet, and the reference engine ignores it).
                self.engine.max_loras = 1
            elif self.engine.kind in ("vllm", "auto"):
                raise ValueError("train.lora on vLLM serves the adapter through vLLM's LoRA support: set "
                                 "engine.max_loras=1 (or leave it unset)")
        return self

    @model_validator(mode="after")
    def _lora_not_with_fsdp_policies(self) -> RunConfig:
        # The sharded trainer wraps the whole model in FSDP2's policies; a PEFT model's frozen base and
        # its adapters under bf16 mixed precision or CPU offload are not supported (the ranks die at start).
        if self.train.lora is not None:
            fsdp = [f"trainer.{k}={v}" for k, v in (("mixed_precision", self.trainer.mixed_precision),
                                                    ("cpu_offload", "true" if self.trainer.cpu_offload else "false"))
                    if v not in ("none", "false")]
            if fsdp:
                raise ValueError(f"train.lora does not combine with {' and '.join(fsdp)} (FSDP2 policies for "
                                 "full-parameter training): unset train.lora, or set trainer.mixed_precision=none "
                                 "and trainer.cpu_offload=false")
        return self

    @model_validator(mode="after")
    def _requests_fit_engine(self) -> RunConfig:
        # A pool's engines have their own sizes: the pool attach checks against those (rollwise.control.pool_backend).
        if self.engines_at != "pool":
            check_engine_fits(self, self.engine.max_num_seqs, self.engine.max_model_len)
        return self

    @model_validator(mode="after")
    def _one_engine_source(self) -> RunConfig:
        if self.pool.url and self.placement == "ray":
            raise ValueError("pool.url attaches to a shared engine pool, placement=ray starts engine actors: "
                             "choose one (unset pool.url, or use placement=local)")
        return self

    def output_path(self, task_name: str) -> Path:
        """output_dir with {model_name}, {task_name} and {timestamp} (now) filled in: the run's directory."""
        model_name = re.sub(r"[^A-Za-z0-9_.-]+", "-", self.model.split("/")[-1].replace("bundled:", ""))
        return Path(self.output_dir.format(model_name=model_name, task_name=task_name,
                                           timestamp=datetime.now().strftime("%Y%m%d-%H%M%S")))

    @property
    def engines_at(self) -> Literal["local", "ray", "pool"]:
        """Where the engines run: in this process, as Ray actors, or in a shared pool (pool.url)."""
        return "pool" if self.pool.url else self.placement

    @property
    def weight_sender(self) -> str:
        """The sender the run uses: sync.sender, or the placement's own when it is auto."""
        return SENDER_FOR_PLACEMENT[self.engines_at] if self.sync.sender == "auto" else self.sync.sender

    @model_validator(mode="after")
    def _sender_fits_placement(self) -> RunConfig:
        # Each placement has one way to reach its engines; a sender that cannot reach them is refused
        # here, before anything starts (e.g. the Ray object store with engines in this process).
        sender, at = self.sync.sender, self.engines_at
        if sender not in ("auto", SENDER_FOR_PLACEMENT[at], *OTHER_SENDERS.get(at, ())):
            where = {"local": "placement=local", "ray": "placement=ray", "pool": "pool.url"}[at]
            fits = {v: k for k, v in SENDER_FOR_PLACEMENT.items()}.get(sender)
            fits = fits or next((k for k, extra in OTHER_SENDERS.items() if sender in extra), None)
            how = ({"local": "placement=local (and no pool.url)", "ray": "placement=ray",
                    "pool": "pool.url=http://..."}[fits] if fits else "no placement in training yet")
            raise ValueError(f"sync.sender={sender!r} cannot reach the engines of {where} (its sender is "
                             f"{SENDER_FOR_PLACEMENT[at]!r}); set sync.sender=auto or "
                             f"sync.sender={SENDER_FOR_PLACEMENT[at]!r}" + (f", or use {how}" if fits else
                             f" ({sender!r} is used by {how})"))
        return self

    @model_validator(mode="after")
    def _resolve_auto(self) -> RunConfig:
        # Tokens sampled by an older policy need a correction; sync mode trains only on-policy tokens.
        if self.train.off_policy_correction == "auto":
            self.train.off_policy_correction = "none" if self.rollout.mode == "sync" else "tis"
        return self


def check_engine_fits(cfg: RunConfig, max_num_seqs: int, max_model_len: int,
                      names: tuple[str, str] = ("engine.max_num_seqs", "engine.max_model_len")) -> None:
    """ValueError naming the fields when a request this run sends cannot fit the engines it runs on: a GRPO
    group is one request whose samples share one prefill and run together, so rollout.group_size must not
    exceed max_num_seqs; every generation budget must leave its prompt room in max_model_len. `names`: how
    the message names the two sizes (this config's engine section, or a pool's own)."""
    seqs, length = names
    if cfg.agent is None and cfg.rollout.group_size > max_num_seqs:  # agent episodes are requests of one
        raise ValueError(f"rollout.group_size={cfg.rollout.group_size} exceeds {seqs}={max_num_seqs} (a group's "
                         f"samples run together): set rollout.group_size to at most {max_num_seqs}, or raise {seqs}")
    budgets = {"rollout.max_tokens": cfg.rollout.max_tokens, "eval.max_tokens": cfg.eval.max_tokens}
    if cfg.agent is not None:
        budgets |= {"agent.max_tokens": cfg.agent.max_tokens, "agent.max_tokens_per_turn": cfg.agent.max_tokens_per_turn}
    for name, tokens in budgets.items():
        if tokens is not None and tokens >= max_model_len:
            raise ValueError(f"{name}={tokens} leaves no room for the prompt in {length}={max_model_len} (prompt + "
                             f"generated tokens): set {name} below {max_model_len}, or raise {length}")


# Names other frameworks use, mapped to ours, for "did you mean" hints.
COMMON_NAMES = {
    "learning_rate": "lr",
    "num_steps": "steps",
    "max_steps": "steps",
    "total_steps": "steps",
    "batch_size": "prompts_per_step",
    "num_generations": "group_size",
    "n_samples": "group_size",
    "max_new_tokens": "max_tokens",
    "max_response_length": "max_tokens",
    "kl_beta": "kl_coef",
    "beta": "kl_coef",
    "epsilon": "clip_low",
    "epsilon_high": "clip_high",
    "staleness": "max_staleness",
    "max_head_offpolicyness": "max_staleness",
    "rollout_mode": "mode",
}

# Short names people type most (`rollwise train lr=1e-5 steps=20`).
ALIASES = {
    "lr": "train.lr",
    "steps": "train.steps",
    "group_size": "rollout.group_size",
    "prompts_per_step": "rollout.prompts_per_step",
    "max_tokens": "rollout.max_tokens",
    "resume": "checkpoint.resume",
    "mode": "rollout.mode",
    "eta": "rollout.max_staleness",
}


class ConfigError(ValueError):
    """A config problem, phrased for the person who wrote the config."""


class RunError(RuntimeError):
    """A run stopped by something outside the config (a full disk, say), phrased for the person running it:
    what happened, what is intact, what to do. The CLI prints the message alone, without a traceback."""


def default_config_path() -> Path:
    return Path(str(resources.files("rollwise") / "configs" / "default.yaml"))


def _section_keys(model_cls: type[BaseModel], path: list[str]) -> tuple[type[BaseModel] | None, list[str]]:
    """Walk a dotted path through the pydantic models; return the model owning the last key."""
    cls: type[BaseModel] | None = model_cls
    for depth, key in enumerate(path[:-1]):
        assert cls is not None
        fields = cls.model_fields
        if key not in fields:
            return cls, path[: depth + 1]
        annotation = fields[key].annotation
        cls = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if cls is None:  # a dict-valued field such as task.params: anything goes below it
            return None, []
    return cls, path


def _did_you_mean(key: str, allowed: list[str]) -> str:
    if COMMON_NAMES.get(key) in allowed:
        return f" Did you mean {COMMON_NAMES[key]!r}?"
    close = difflib.get_close_matches(key, allowed, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _check_override_key(dotted: str) -> None:
    path = dotted.split(".")
    cls, checked = _section_keys(RunConfig, path)
    if cls is None:
        return
    key = checked[-1]
    allowed = sorted(cls.model_fields)
    if key not in allowed:
        where = ".".join(checked[:-1]) or "top level"
        hint = _did_you_mean(key, allowed + list(ALIASES))
        raise ConfigError(f"unknown config key {dotted!r}: {where} allows {allowed}.{hint}")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings (values parsed as YAML: 1e-5, true, [1, 2], null)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. train.lr=1e-5)")
        key, value_text = item.split("=", 1)
        key = ALIASES.get(key.strip(), key.strip())
        _check_override_key(key)
        try:
            value = yaml.safe_load(value_text) if value_text != "" else ""
        except yaml.YAMLError:
            value = value_text  # not YAML (e.g. a prompt template with braces): take it as a string
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return raw


# Error types whose message reads better with the value that was given ("Input should be a finite number (got nan)").
_SHOW_INPUT = {"literal_error", "finite_number", "greater_than", "greater_than_equal", "less_than", "less_than_equal",
               "int_from_float", "int_parsing", "float_parsing", "int_type", "float_type", "string_type"}


def _format_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming its field; a single problem is a single line."""
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")  # our validators' messages name their fields themselves
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            cls, _ = _section_keys(RunConfig, [str(p) for p in err["loc"]])
            if cls is not None:
                allowed = sorted(cls.model_fields)
                msg += f"; allowed here: {allowed}." + _did_you_mean(str(err["loc"][-1]), allowed)
        elif err["type"] in _SHOW_INPUT:
            msg = f"{msg} (got {err.get('input')!r})"
        problems.append(f"{loc}: {msg}" if loc else msg)
    if len(problems) == 1:
        return f"invalid config: {problems[0]}"
    return "\n".join(["invalid config:", *(f"  {p}" for p in problems)])


def read_config_file(path: Path) -> dict[str, Any]:
    """The YAML mapping in `path`; a ConfigError naming the file when it is missing, a directory, unreadable,
    not UTF-8 text (binary, or UTF-16 as some Windows editors save), or not a YAML mapping."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(path)!r} is a directory: pass a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    head = data[:32]  # UTF-16 without a byte-order mark: ASCII text with every other byte NUL
    nul_halves = (not any(head[0::2]), not any(head[1::2]))
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or (len(head) >= 4 and nul_halves[0] != nul_halves[1]):
        raise ConfigError(f"config file {str(path)!r} is UTF-16 text: save it as UTF-8")
    try:
        text = data.decode("utf-8-sig")  # a UTF-8 byte-order mark is fine
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}; "
                          "a binary file?): pass a YAML file saved as UTF-8") from None
    if "\x00" in text:
        raise ConfigError(f"config file {str(path)!r} holds NUL bytes (a binary file?): pass a YAML file")
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())  # PyYAML's message spans lines: one line here
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {detail}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """The embedded default (or `path`), with dotted overrides applied, validated."""
    raw = apply_overrides(read_config_file(Path(path) if path is not None else default_config_path()), overrides or [])
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def dump_config(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain data that `load_config` accepts back (task fields of the other
    kind are left out: TaskConfig rejects them when set)."""
    data = cfg.model_dump(mode="json")
    data["task"] = cfg.task.model_dump(mode="json", exclude_defaults=True)
    data["task"]["kind"] = cfg.task.kind
    return data
