"""Tasks (reasoning-gym, JSONL), the strict answer format, reward scoring and prompt encoding."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from rollwise.model.tiny import tiny_tokenizer
from rollwise.reward.scoring import RewardConfig, score
from rollwise.tasks import make_task, TaskConfig
from rollwise.types.task import Problem, Task
from rollwise.tasks.jsonl_task import JsonlTask
from rollwise.tasks.reasoning_gym_task import ReasoningGymTask
from rollwise.tasks.answer_format import AnswerFormat, answers_match, last_number, parse_number, parse_response
from rollwise.tasks.prompts import PromptConfig, build_messages, encode_prompt, render_prompt
from rollwise.tasks.reasoning_gym_task import strip_answer_instructions

RG_CFG = {
    "kind": "reasoning_gym",
    "name": "basic_arithmetic",
    "params": {"min_terms": 2, "max_terms": 3, "max_digits": 2},
    "train_size": 200,
    "eval_size": 50,
    "seed": 7,
}


@pytest.fixture(scope="module")
def rg_task() -> Task:
    return make_task(RG_CFG)


# --- reasoning-gym -------------------------------------------------------------------------------


def test_reasoning_gym_loads_by_name_and_params(rg_task: Task) -> None:
    assert isinstance(rg_task, ReasoningGymTask)
    train, eval_ = rg_task.problems("train"), rg_task.problems("eval")
    assert len(train) == 200 and len(eval_) == 50
    p = train[0]
    assert p.question.startswith("Calculate ") and p.answer.lstrip("-").isdigit()
    # The params reached the generator: at most 3 terms of at most 2 digits.
    for q in train:
        assert 2 <= q.metadata["rg_metadata"]["num_terms"] <= 3
        assert q.metadata["rg_metadata"]["num_digits"] <= 2


def test_reasoning_gym_splits_disjoint_and_deterministic(rg_task: Task) -> None:
    train, eval_ = rg_task.problems("train"), rg_task.problems("eval")
    assert not {p.question for p in train} & {p.question for p in eval_}
    assert len({p.question for p in eval_}) == len(eval_)  # eval has no repeats either
    assert len({p.id for p in train + eval_}) == len(train) + len(eval_)  # ids are unique

    again = make_task(RG_CFG)
    assert [(p.id, p.question, p.answer) for p in again.problems("train")] == [
        (p.id, p.question, p.answer) for p in train
    ]
    assert [p.id for p in again.problems("eval")] == [p.id for p in eval_]
    other_seed = make_task({**RG_CFG, "seed": 8})
    assert [p.question for p in other_seed.problems("train")] != [p.question for p in train]
    with pytest.raises(ValueError, match="split"):
        rg_task.problems("test")  # type: ignore[arg-type]


def test_reasoning_gym_verifier(rg_task: Task) -> None:
    p = rg_task.problems("train")[0]
    assert rg_task.score_answer(p, p.answer) == 1.0
    assert rg_task.score_answer(p, str(int(p.answer) + 1)) < 1.0
    # Works on an eval problem too (scored from the Problem alone).
    e = rg_task.problems("eval")[0]
    assert rg_task.score_answer(e, e.answer) == 1.0


def test_reasoning_gym_unknown_name_is_clear() -> None:
    with pytest.raises(ValueError) as info:
        ReasoningGymTask("basic_arithmatic", train_size=2, eval_size=1)
    msg = str(info.value)
    assert "basic_arithmatic" in msg and "basic_arithmetic" in msg and "reasoning_gym.factory.DATASETS" in msg


def test_reasoning_gym_bad_params_are_clear() -> None:
    with pytest.raises(ValueError, match=r"'max_term'.*Did you mean: max_terms"):
        ReasoningGymTask("basic_arithmetic", {"max_term": 3}, train_size=2, eval_size=1)
    with pytest.raises(ValueError, match="min_terms must be positive"):  # a bad value, from the dataset's validate()
        ReasoningGymTask("basic_arithmetic", {"min_terms": 0}, train_size=2, eval_size=1)
    with pytest.raises(ValueError, match="'seed' is set by rollwise"):
        ReasoningGymTask("basic_arithmetic", {"seed": 1}, train_size=2, eval_size=1)


def test_reasoning_gym_impossible_eval_size_is_clear() -> None:
    # 1-digit a+b: far fewer than 500 distinct questions exist outside a 150-item train split.
    params = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"], "allow_parentheses": False}
    task = ReasoningGymTask("basic_arithmetic", params, train_size=150, eval_size=500)
    with pytest.raises(ValueError, match="distinct eval questions"):
        task.problems("eval")


def test_strip_answer_instructions() -> None:
    q = "Solve the following multiplication: 12 * 3. Give only the result as your final answer."
    assert strip_answer_instructions(q) == "Solve the following multiplication: 12 * 3."
    keep = "How many eggs? Give the result as your final answer. Do not include units."
    assert strip_answer_instructions(keep) == "How many eggs? Do not include units."
    only = "Give only the result as your final answer."
    assert strip_answer_instructions(only) == only  # never strips a question to nothing


def test_task_config_errors() -> None:
    with pytest.raises(ValidationError, match="trian_size"):
        TaskConfig.model_validate({**RG_CFG, "trian_size": 3})
    with pytest.raises(ValidationError, match="needs `name`"):
        TaskConfig(kind="reasoning_gym")
    with pytest.raises(ValidationError, match="needs `path`"):
        TaskConfig(kind="jsonl")
    with pytest.raises(ValidationError, match="`path` only applies to kind 'jsonl'"):
        TaskConfig(kind="reasoning_gym", name="basic_arithmetic", path="x.jsonl")
    with pytest.raises(ValidationError):
        TaskConfig(kind="huggingface", name="x")  # type: ignore[arg-type]


# --- JSONL ---------------------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_task_load_split_and_verify(tmp_path: Path) -> None:
    rows = [{"prompt": f"What is {i} + 1?", "answer": i + 1, "level": i % 3} for i in range(20)]
    rows.append({"prompt": "What is 0 + 1?", "answer": 1})  # duplicate question: must not leak across splits
    rows.append({"prompt": "Capital of France?", "answer": "Paris"})
    path = _write_jsonl(tmp_path / "qa.jsonl", rows)

    task = make_task({"kind": "jsonl", "path": str(path), "eval_fraction": 0.25, "seed": 3})
    assert task.name == "qa"
    train, eval_ = task.problems("train"), task.problems("eval")
    assert len(train) + len(eval_) == 21 and len(eval_) == math.ceil(21 * 0.25)
    assert not {p.question for p in train} & {p.question for p in eval_}
    same = make_task({"kind": "jsonl", "path": str(path), "eval_fraction": 0.25, "seed": 3})
    assert [p.id for p in same.problems("eval")] == [p.id for p in eval_]

    by_q = {p.question: p for p in train + eval_}
    p = by_q["What is 4 + 1?"]
    assert p.answer == "5" and p.metadata["level"] == 1 and p.metadata["line"] == 5
    assert task.score_answer(p, "5") == 1.0
    assert task.score_answer(p, " 5.0 ") == 1.0  # numeric comparison
    assert task.score_answer(p, "6") == 0.0
    paris = by_q["Capital of France?"]
    assert task.score_answer(paris, "  paris ") == 1.0 and task.score_answer(paris, "Lyon") == 0.0


def test_jsonl_eval_path_and_custom_keys(tmp_path: Path) -> None:
    train = _write_jsonl(tmp_path / "train.jsonl", [{"q": "a?", "a": "1"}, {"q": "b?", "a": "2"}])
    ev = _write_jsonl(tmp_path / "eval.jsonl", [{"q": "b?", "a": "2"}, {"q": "c?", "a": "3"}])
    task = JsonlTask(train, prompt_key="q", answer_key="a", eval_path=ev)
    assert [p.question for p in task.problems("train")] == ["a?", "b?"]
    assert [p.question for p in task.problems("eval")] == ["c?"]  # "b?" is in train, so dropped


def test_jsonl_bad_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "x", "answer": "1"}\n\n{"prompt": "y"}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: missing key 'answer'"):
        JsonlTask(path)
    path.write_text('{"prompt": "x", "answer": "1"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=rf"{path}:2: invalid JSON"):
        JsonlTask(path)
    with pytest.raises(ValueError, match="not found"):
        JsonlTask(tmp_path / "missing.jsonl")


# --- answer format -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, finish_reason, status, answer",
    [
        ("Let me think. 2+3=5.\n<answer>5</answer>", "stop", "ok", "5"),
        ("<answer> -12 </answer>\n  ", "stop", "ok", "-12"),  # whitespace after the tag is fine
        ("<ANSWER>7</ANSWER>", None, "ok", "7"),
        ("The answer is 5.", "stop", "unparseable", None),  # no tags
        ("<answer>5</answer> <answer>6</answer>", "stop", "unparseable", None),  # two answers
        ("<answer>5</answer>" * 40, "stop", "unparseable", None),  # degenerate repetition
        ("<answer>5</answer><answer>5</answer><answer>5", "length", "unparseable", None),  # same, truncated
        ("<answer>5</answer><ANSWER>5</ANSWER>", "stop", "unparseable", None),  # case variants count too
        ("<answer>5</answer> so the answer is 5", "stop", "unparseable", None),  # trailing text
        ("<answer>   </answer>", "stop", "unparseable", None),  # empty
        ("<answer><answer>5</answer>", "stop", "unparseable", None),  # nested/unclosed
        ("<answer>5", "stop", "unparseable", None),  # never closed
        ("5</answer>", "stop", "unparseable", None),  # never opened
        ("</answer>5<answer>", "stop", "unparseable", None),  # reversed
        ("Thinking... <answer>5</answer>", "length", "unparseable", None),  # truncated at the token limit
        ("Thinking... <answer>5</answer>", "abort", "unparseable", None),
    ],
)
def test_parse_response(text: str, finish_reason: str | None, status: str, answer: str | None) -> None:
    parsed = parse_response(text, AnswerFormat(), finish_reason=finish_reason)
    assert (parsed.status, parsed.answer) == (status, answer)
    assert (parsed.reason is None) == (status == "ok")


def test_custom_answer_tags() -> None:
    fmt = AnswerFormat(open="\\boxed{", close="}")
    assert parse_response("so \\boxed{42}", fmt).answer == "42"
    assert parse_response("<answer>42</answer>", fmt).status == "unparseable"
    with pytest.raises(ValueError):
        AnswerFormat(open="<a>", close="<a>")


def test_last_number_and_matching() -> None:
    assert last_number("5 - 3 = 2, so the result is -4.") == "-4"
    assert last_number("It costs $1,234.50 in total") == "1234.50"
    assert last_number("x=5-3") == "3"  # "-" between digits is an operator, not a sign
    assert last_number("no digits here") is None
    assert parse_number("5.0") == parse_number("5") and parse_number("1/2") is None
    assert answers_match("5", "5.0") and answers_match("1,000", "1000") and not answers_match("2/4", "1/2")
    assert answers_match("Hello  World", "hello world") and not answers_match("5", "five")


# --- scoring -------------------------------------------------------------------------------------


class _ExactTask(Task):
    name = "exact"

    def problems(self, split):  # pragma: no cover - unused
        return []

    def score_answer(self, problem: Problem, extracted_answer: str) -> float:
        return 1.0 if extracted_answer == problem.answer else 0.0


class _BrokenTask(_ExactTask):
    def score_answer(self, problem: Problem, extracted_answer: str) -> float:
        raise KeyError("metadata missing")


class _NanTask(_ExactTask):
    def score_answer(self, problem: Problem, extracted_answer: str) -> float:
        return float("nan")


PROBLEM = Problem(id="p0", question="What is 2 + 3?", answer="5")


def test_reward_per_outcome() -> None:
    cfg = RewardConfig(correct=2.0, formatted_wrong=0.25, unparseable=-0.5)
    task = _ExactTask()
    right = score(PROBLEM, task, "2 + 3 = 5 <answer>5</answer>", "stop", cfg)
    assert (right.reward, right.outcome, right.extracted, right.strict_correct) == (2.0, "correct", "5", True)
    assert right.lenient_correct and right.error is None

    wrong = score(PROBLEM, task, "<answer>6</answer>", "stop", cfg)
    assert (wrong.reward, wrong.outcome, wrong.extracted, wrong.strict_correct) == (0.25, "formatted_wrong", "6", False)
    assert not wrong.lenient_correct

    # Right number, wrong format: no reward, but the lenient diagnostic sees it.
    loose = score(PROBLEM, task, "The answer is 5", "stop", cfg)
    assert (loose.reward, loose.outcome, loose.extracted) == (-0.5, "unparseable", None)
    assert loose.lenient_correct and not loose.strict_correct

    degenerate = score(PROBLEM, task, "<answer>5</answer>" * 30, "length", cfg)
    assert (degenerate.reward, degenerate.outcome) == (-0.5, "unparseable")

    default = score(PROBLEM, task, "<answer>6</answer>", "stop")
    assert default.reward == pytest.approx(0.1)


def test_reasoning_gym_partial_credit_is_not_correct(rg_task: Task) -> None:
    p = next(q for q in rg_task.problems("train") if not q.answer.startswith("-"))
    # reasoning-gym's default verifier gives partial credit when the answer is a substring.
    result = score(p, rg_task, f"<answer>-{p.answer}</answer>", "stop")
    assert 0 < result.verifier_score < 1 and result.outcome == "formatted_wrong" and result.reward == 0.1
    result = score(p, rg_task, f"<answer>{p.answer}</answer>", "stop")
    assert result.outcome == "correct" and result.reward == 1.0


def test_verifier_exception_does_not_crash() -> None:
    for task, text in [(_BrokenTask(), "KeyError"), (_NanTask(), "nan")]:
        result = score(PROBLEM, task, "<answer>5</answer>", "stop")
        assert result.reward == 0.0 and result.outcome == "unparseable" and not result.strict_correct
        assert result.error is not None and text in result.error
        assert result.extracted == "5"


def test_reward_config_validation() -> None:
    with pytest.raises(ValidationError, match="corect"):
        RewardConfig.model_validate({"corect": 1.0})
    with pytest.raises(ValidationError, match="correct > formatted_wrong"):
        RewardConfig(correct=0.1, formatted_wrong=0.5)


# --- prompts -------------------------------------------------------------------------------------


def test_prompt_encoding_ends_with_generation_prompt() -> None:
    tok = tiny_tokenizer()
    messages = build_messages(PROBLEM, PromptConfig(), RewardConfig())
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "<answer></answer>" in messages[0]["content"] and messages[1]["content"] == PROBLEM.question

    ids = encode_prompt(tok, messages)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    tail = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(tail) :] == tail
    assert tok.decode(ids) == render_prompt(tok, messages)
    assert render_prompt(tok, messages).endswith("What is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_config_template_few_shot_and_tags() -> None:
    reward_cfg = RewardConfig(answer_open="[[", answer_close="]]")
    cfg = PromptConfig(
        system=None,
        template="Q: {question}\nAnswer in {answer_open}{answer_close}.",
        few_shot=[{"question": "1+1?", "response": "1+1=2 [[2]]"}],
    )
    messages = build_messages(PROBLEM, cfg, reward_cfg)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"] == "Q: 1+1?\nAnswer in [[]]."
    assert messages[1]["content"] == "1+1=2 [[2]]"
    assert messages[2]["content"] == "Q: What is 2 + 3?\nAnswer in [[]]."
    # A question with literal braces is inserted verbatim (no str.format).
    braces = Problem(id="b", question='Parse {"a": 1}', answer="1")
    assert build_messages(braces, PromptConfig(system=None))[0]["content"] == 'Parse {"a": 1}'

    with pytest.raises(ValidationError, match=r"\{question\}"):
        PromptConfig(template="no placeholder")
    with pytest.raises(ValidationError, match="sytem"):
        PromptConfig.model_validate({"sytem": "hi"})
    with pytest.raises(ValueError, match=r"few_shot\[0\]"):
        build_messages(PROBLEM, PromptConfig(few_shot=[{"question": "1+1?", "response": "2"}]))
