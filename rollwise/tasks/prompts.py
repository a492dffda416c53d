"""Chat messages and prompt token ids for a problem.

The system prompt states the answer format that rollwise.reward enforces, with the tags taken from
the reward config (anything with `answer_format()`, e.g. rollwise.reward.RewardConfig), so the
instruction and the checker can never disagree. Placeholders are filled
with str.replace, not str.format, because questions and prompts may contain literal braces (JSON).
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import Field, field_validator

from rollwise.model.template_ids import flat_token_ids
from rollwise.tasks.answer_format import AnswerFormat, parse_response
from rollwise.types.task import Problem
from rollwise.types.config_section import ConfigSection

DEFAULT_SYSTEM_PROMPT = (
    "Solve the problem. You may reason first. Then write the final answer exactly once, inside "
    "{answer_open}{answer_close} tags, for example {answer_open}42{answer_close}, and write nothing after it."
)


class HasAnswerFormat(Protocol):
    """What the prompt needs of the reward config: its answer tags. A protocol, so tasks import
    nothing of rollwise.reward (reward imports tasks, one way)."""

    def answer_format(self) -> AnswerFormat: ...


class FewShotExample(ConfigSection):
    """One prior exchange shown before the real question: a user turn and an assistant turn."""

    question: str
    response: str


class PromptConfig(ConfigSection):  # no unknown keys, finite numbers (rollwise.types.config_section)

    # None sends no system message (some templates, e.g. SmolLM2's, then insert their own default).
    # {answer_open} / {answer_close} are replaced by the reward config's tags.
    system: str | None = DEFAULT_SYSTEM_PROMPT
    template: str = "{question}"  # the user message; must contain {question}
    few_shot: list[FewShotExample] = []
    # A format hint that is taken away: the fraction of *training* groups whose prompt shows the
    # few-shot examples goes linearly from few_shot_start to few_shot_end over few_shot_anneal_steps.
    # With a small model that never produces the answer format unprompted, early groups need the
    # examples to carry any reward signal; annealing them out teaches the format itself.
    few_shot_start: float = Field(1.0, ge=0.0, le=1.0)
    few_shot_end: float = Field(1.0, ge=0.0, le=1.0)
    few_shot_anneal_steps: int = Field(0, ge=0)
    few_shot_in_eval: bool = True  # held-out evaluation prompts show the examples too

    def few_shot_fraction(self, step: int) -> float:
        """Fraction of training groups at `step` (0-based) whose prompt includes the examples."""
        if not self.few_shot:
            return 0.0
        if self.few_shot_anneal_steps == 0:
            return self.few_shot_end
        progress = min(step / self.few_shot_anneal_steps, 1.0)
        return self.few_shot_start + (self.few_shot_end - self.few_shot_start) * progress

    @field_validator("template")
    @classmethod
    def _template_has_question(cls, value: str) -> str:
        if "{question}" not in value:
            raise ValueError(f"prompt template must contain '{{question}}', got {value!r}")
        return value


def _fill(text: str, fmt: AnswerFormat, question: str | None = None) -> str:
    text = text.replace("{answer_open}", fmt.open).replace("{answer_close}", fmt.close)
    if question is not None:
        # Last, so a question that happens to contain "{answer_open}" is left as written.
        text = text.replace("{question}", question)
    return text


def build_messages(
    problem: Problem,
    prompt_cfg: PromptConfig | None = None,
    reward_cfg: HasAnswerFormat | None = None,
    with_few_shot: bool = True,
) -> list[dict[str, str]]:
    """[system?] + few-shot (user, assistant) pairs + the problem as the final user turn.

    `reward_cfg`: the reward config whose answer tags the prompt states (None: the default tags)."""
    prompt_cfg = prompt_cfg or PromptConfig()
    fmt = reward_cfg.answer_format() if reward_cfg is not None else AnswerFormat()
    messages: list[dict[str, str]] = []
    if prompt_cfg.system is not None:
        messages.append({"role": "system", "content": _fill(prompt_cfg.system, fmt)})
    for i, example in enumerate(prompt_cfg.few_shot if with_few_shot else []):
        # A few-shot example in the wrong format would teach the policy to lose reward.
        parsed = parse_response(example.response, fmt)
        if parsed.status != "ok":
            raise ValueError(f"few_shot[{i}].response does not follow the answer format: {parsed.reason}")
        messages.append({"role": "user", "content": _fill(prompt_cfg.template, fmt, example.question)})
        messages.append({"role": "assistant", "content": example.response})
    messages.append({"role": "user", "content": _fill(prompt_cfg.template, fmt, problem.question)})
    return messages


def _check_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template; cannot build a chat prompt")


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt as text (for logs): chat template with the assistant generation prompt appended."""
    _check_chat_template(tokenizer)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Prompt token ids via the tokenizer's chat template, ending with the assistant generation prompt.
    `tools` (OpenAI function specs) go to the template, which renders them if it knows how."""
    _check_chat_template(tokenizer)
    return flat_token_ids(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True))


__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "FewShotExample",
    "PromptConfig",
    "build_messages",
    "encode_prompt",
    "render_prompt",
]
