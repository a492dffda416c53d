"""Built-in verifiers: math-verify equivalence, reasoning-gym's own scorer, both through the reward pool."""

import json

from rollwise.reward.pool import RewardPool
from rollwise.reward.verifiers import math_verify_reward
from rollwise.tasks import make_task
from rollwise.types.task import Problem
from rollwise.tasks.math_equal import math_equal


def test_math_equal_knows_equivalent_forms():
    assert math_equal("0.5", "1/2") and math_equal("\\frac{1}{2}", "0.5")
    assert math_equal("x + 1", "1 + x")
    assert math_equal("\\boxed{12}", "12")
    assert not math_equal("0.51", "1/2") and not math_equal("3", "4")
    assert not math_equal("no answer here", "4")


def test_math_verify_reward_checks_format_then_equivalence():
    problem = Problem(id="p", question="half?", answer="1/2")
    assert math_verify_reward(problem, "It is <answer>0.5</answer>", "stop").outcome == "correct"
    assert math_verify_reward(problem, "<answer>0.4</answer>", "stop").outcome == "formatted_wrong"
    assert math_verify_reward(problem, "0.5", "stop").outcome == "unparseable"


def test_jsonl_task_with_math_verify(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "3/4"}) + "\n" for i in range(10)))
    task = make_task({"kind": "jsonl", "path": str(path), "verifier": "math_verify", "eval_fraction": 0.2})
    problem = task.problems("train")[0]
    assert task.score_answer(problem, "0.75") == 1.0 and task.score_answer(problem, "0.7") == 0.0
    exact = make_task({"kind": "jsonl", "path": str(path)})
    assert exact.score_answer(problem, "0.75") == 0.0  # the default stays a normalized exact match


def test_built_in_verifiers_run_in_the_reward_pool():
    rg = make_task({"kind": "reasoning_gym", "name": "basic_arithmetic", "train_size": 2, "eval_size": 0})
    rg_problem = rg.problems("train")[0]
    with RewardPool(workers=1, timeout_s=60) as pool:
        math = pool.score("rollwise.reward.verifiers:math_verify_reward",
                          [(Problem(id="m", question="q", answer="2/4"), "<answer>0.5</answer>", "stop")])
        rg_results = pool.score("rollwise.reward.verifiers:reasoning_gym_reward",
                                [(rg_problem, f"<answer>{rg_problem.answer}</answer>", "stop"),
                                 (rg_problem, "<answer>not a number</answer>", "stop")])
    assert math[0].ok and math[0].reward == 1.0
    assert [r.ok for r in rg_results] == [True, True]
    assert [r.reward for r in rg_results] == [1.0, 0.1]  # correct, formatted but wrong
