"""The reward pool against real worker processes and real misbehaving reward code."""

from __future__ import annotations

import asyncio
import textwrap
import time

import pytest

from rollwise.reward.code_exec import (
    DEFAULT_LIMITS,
    extract_program,
    python_tests,
    run_python_tests,
)
from rollwise.reward.pool import (
    RewardFnError,
    RewardPool,
    load_reward_fn,
    score_samples_in_pool,
)
from rollwise.types.sample import Sample
from rollwise.sandbox.local import LocalSandbox
from rollwise.types.task import Problem

pytestmark = pytest.mark.timeout(120)

REWARDS = textwrap.dedent('''
    import os, time
    from rollwise.reward.scoring import RewardResult

    def exact(problem, response, finish_reason):
        return 1.0 if response.strip() == problem.answer else 0.0

    def detailed(problem, response, finish_reason):
        return RewardResult(reward=0.5, outcome="formatted_wrong", extracted=response, strict_correct=False,
                            lenient_correct=False)

    def raises(problem, response, finish_reason):
        raise RuntimeError("verifier bug")

    def hangs(problem, response, finish_reason):
        while True:
            time.sleep(0.1)

    def crashes(problem, response, finish_reason):
        os._exit(3)

    def segfaults(problem, response, finish_reason):
        import ctypes
        return ctypes.string_at(0)

    def garbage(problem, response, finish_reason):
        return "definitely correct"

    def nan(problem, response, finish_reason):
        return float("nan")

    def hog(problem, response, finish_reason):
        return len(bytearray(8 * 1024**3))

    def exits(problem, response, finish_reason):
        raise SystemExit(0)

    not_a_function = 3
''')

PROBLEM = Problem(id="p1", question="2+2?", answer="4")


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARDS)
    broken = path.parent / "broken_rewards.py"
    broken.write_text("import module_that_does_not_exist\n\ndef f(p, r, f):\n    return 1.0\n")
    return path


@pytest.fixture(scope="module")
def pool():
    with RewardPool(workers=2, timeout_s=2.0, memory_bytes=1024**3) as p:
        yield p


def test_good_rewards_by_import_path(pool, rewards_file):
    fn = f"{rewards_file}:exact"
    results = pool.score(fn, [(PROBLEM, "4", "stop"), (PROBLEM, " 5", "stop")], keys=["a", "b"])
    assert [(r.key, r.reward, r.ok) for r in results] == [("a", 1.0, True), ("b", 0.0, True)]
    detailed = pool.submit(f"{rewards_file}:detailed", PROBLEM, "x").result()
    assert detailed.ok and detailed.reward == 0.5 and detailed.result.outcome == "formatted_wrong"
    # A module on sys.path works the same way (the built-in code-execution reward is one).
    assert load_reward_fn("rollwise.reward.code_exec:python_tests") is python_tests


def test_misbehaving_reward_code_gives_clear_results_and_the_pool_survives(pool, rewards_file):
    cases = {
        "raises": ("exception", "raised RuntimeError: verifier bug"),
        "hangs": ("timeout", "did not return within 2 s; worker killed and replaced"),
        "crashes": ("crash", "worker exited with code 3"),
        "segfaults": ("crash", "SIGSEGV"),
        "garbage": ("bad_return", "returned 'definitely correct' (str); it must return a float"),
        "nan": ("bad_return", "must be a finite number"),
        "hog": ("exception", "MemoryError"),
        "exits": ("exception", "SystemExit"),
        "not_a_function": ("import", "is a int, not a function"),
        "missing": ("import", "has no attribute 'missing'"),
    }
    replaced = pool.stats.workers_replaced
    start = time.monotonic()
    futures = {name: pool.submit(f"{rewards_file}:{name}", PROBLEM, "4", key=name) for name in cases}
    for name, (kind, text) in cases.items():
        r = futures[name].result(timeout=60)
        assert not r.ok and r.reward == 0.0 and r.key == name
        assert r.error_kind == kind, (name, r)
        assert text in r.error and f"{rewards_file}:{name}" in r.error, (name, r.error)
    assert time.monotonic() - start < 30
    assert pool.stats.workers_replaced - replaced == 3  # hangs, crashes, segfaults
    # Still serving, on replacement workers.
    assert pool.submit(f"{rewards_file}:exact", PROBLEM, "4").result().reward == 1.0


def test_bad_reward_paths_name_the_function(pool, rewards_file):
    with pytest.raises(RewardFnError, match="'package.module:function'"):
        pool.submit("no_colon_here", PROBLEM, "4")
    with pytest.raises(RewardFnError, match="need a module and a function name"):
        pool.submit("module:", PROBLEM, "4")
    broken = f"{rewards_file.parent / 'broken_rewards.py'}:f"
    r = pool.submit(broken, PROBLEM, "4").result()
    assert r.error_kind == "import" and "ModuleNotFoundError" in r.error and broken in r.error
    assert "No module named 'not_a_real_pkg'" in pool.check("not_a_real_pkg.rewards:score")
    assert "no such file" in pool.check("/nonexistent/rewards.py:score")
    assert pool.check(f"{rewards_file}:exact") is None


def test_async_and_samples(pool, rewards_file):
    fn = f"{rewards_file}:exact"

    async def both():
        return await asyncio.gather(pool.ascore(fn, PROBLEM, "4", key="x"), pool.ascore(fn, PROBLEM, "3"))

    good, bad = asyncio.run(both())
    assert good.reward == 1.0 and good.key == "x" and bad.reward == 0.0

    def sample(i, text):
        return Sample(sample_id=f"r/{i}", group_id="r", problem_id="p1", prompt_ids=[1], response_ids=[2],
                      behaviour_logprobs=[-0.1], versions=[0], finish_reason="stop", response_text=text)

    samples = [sample(0, "4"), sample(1, "5")]
    score_samples_in_pool(pool, fn, samples, {"p1": PROBLEM})
    assert [(s.reward, s.outcome, s.strict_correct) for s in samples] == [
        (1.0, "correct", True), (0.0, "formatted_wrong", False)]
    crashed = [sample(2, "4")]
    score_samples_in_pool(pool, f"{rewards_file}:raises", crashed, {"p1": PROBLEM})
    assert crashed[0].outcome == "unparseable" and "verifier bug" in crashed[0].extra["reward_error"]


def test_closing_resolves_every_pending_call(rewards_file):
    pool = RewardPool(workers=1, timeout_s=1.0)
    futures = [pool.submit(f"{rewards_file}:hangs", PROBLEM, "4", key=str(i)) for i in range(3)]
    time.sleep(0.2)
    pool.close()
    results = [f.result(timeout=10) for f in futures]
    assert all(not r.ok for r in results)
    assert {r.error_kind for r in results} <= {"timeout", "pool_closed"} and results[-1].error_kind == "pool_closed"
    late = pool.submit(f"{rewards_file}:exact", PROBLEM, "4").result(timeout=1)
    assert late.error_kind == "pool_closed"


def test_code_execution_reward_runs_the_program_in_a_sandbox(pool):
    with LocalSandbox() as sb:
        if not sb.run("command -v python3").ok:
            pytest.skip("no python3 inside the sandbox (Debian's python3 is what the sandbox sees)")
    problem = Problem(id="add", question="Write add(a, b).", answer="",
                      metadata={"tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0"})
    good = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    fn = "rollwise.reward.code_exec:python_tests"
    r_good, r_wrong, r_none = pool.score(fn, [(problem, good, "stop"), (problem, wrong, "stop"),
                                              (problem, "no code", "stop")])
    assert r_good.ok and r_good.reward == 1.0 and r_good.result.outcome == "correct", r_good
    assert r_wrong.ok and r_wrong.result.outcome == "formatted_wrong" and "AssertionError" in r_wrong.result.parse_reason
    assert r_none.result.outcome == "unparseable"
    no_tests = pool.submit(fn, Problem(id="x", question="q", answer=""), good).result()
    assert no_tests.error_kind == "exception" and "no 'tests'" in no_tests.error

    assert extract_program("```\nprint(1)\n```\ntext\n```py\nprint(2)\n```") == "print(2)\n"
    # The program is untrusted: an infinite loop or a network call stays in its sandbox.
    tight = DEFAULT_LIMITS.model_copy(update={"timeout_s": 1.0})
    looping = run_python_tests("while True:\n    pass\n", "", limits=tight)
    assert looping.killed and looping.limit in ("timeout", "cpu_time")
    net = run_python_tests("import socket\nsocket.create_connection(('1.1.1.1', 443), timeout=2)\n", "")
    assert not net.ok
