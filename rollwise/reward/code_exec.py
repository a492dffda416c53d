"""A code-execution reward: run the model's program against the problem's tests in a sandbox.

The program is model output, i.e. untrusted code; it runs in a LocalSandbox (bubblewrap: no
network, its own filesystem view, rlimits, a timeout), never in the reward worker itself.

Example task row (JSONL; extra fields become `problem.metadata`):

    {"prompt": "Write a function add(a, b) that returns the sum of a and b.",
     "answer": "",
     "tests": "assert add(2, 3) == 5\\nassert add(-1, 1) == 0"}

and the reward, by import path, in a RewardPool:

    pool.score("rollwise.reward.code_exec:python_tests", [(problem, response, "stop")])

The response's last fenced code block (```python ... ```, or a bare ``` block) is the program.
Outcomes follow rollwise.reward.scoring: no code block -> "unparseable"; the tests fail ->
"formatted_wrong"; all tests pass -> "correct"; rewards from RewardConfig's defaults.
"""

from __future__ import annotations

import re

from rollwise.reward.scoring import RewardConfig, RewardResult
from rollwise.sandbox.local import LocalSandbox
from rollwise.sandbox.types import RunResult, SandboxLimits
from rollwise.types.task import Problem

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Model programs are small; a test run that needs more than this is wrong, not slow.
DEFAULT_LIMITS = SandboxLimits(timeout_s=10, cpu_s=5, memory_bytes=512 * 1024**2, max_processes=16,
                               max_file_bytes=8 * 1024**2, max_output_bytes=8 * 1024)


def extract_program(response: str) -> str | None:
    """The last fenced code block of the response, or None."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks and blocks[-1].strip() else None


def run_python_tests(program: str, tests: str, limits: SandboxLimits = DEFAULT_LIMITS,
                     interpreter: str = "python3") -> RunResult:
    """Run `program` followed by `tests` (plain asserts) in a fresh sandbox; exit code 0 = passed."""
    with LocalSandbox(limits) as sb:
        sb.write_file("solution.py", program)
        sb.write_file("test_solution.py", "from solution import *  # noqa\n\n" + tests + "\n")
        # -E -s: ignore PYTHON* variables and the user site; the script's own dir stays importable.
        return sb.run(f"{interpreter} -E -s test_solution.py")


def python_tests(problem: Problem, response: str, finish_reason: str | None) -> RewardResult:
    """Reward function: 1.0 if the response's program passes `problem.metadata["tests"]`."""
    cfg = RewardConfig()
    tests = problem.metadata.get("tests")
    if not isinstance(tests, str) or not tests.strip():
        # The task's fault, not the model's: raise so the pool reports it as a reward error.
        raise ValueError(f"problem {problem.id} has no 'tests' string in its metadata")
    program = extract_program(response)
    if program is None:
        return RewardResult(reward=cfg.unparseable, outcome="unparseable", extracted=None, strict_correct=False,
                            lenient_correct=False, parse_reason="no fenced code block in the response")
    run = run_python_tests(program, tests)
    passed = run.ok
    detail = None if passed else (run.reason or (run.stderr.strip().splitlines() or ["tests failed"])[-1])[:500]
    return RewardResult(
        reward=cfg.correct if passed else cfg.formatted_wrong,
        outcome="correct" if passed else "formatted_wrong",
        extracted=program,
        strict_correct=passed,
        lenient_correct=passed,
        parse_reason=detail,  # why the tests failed: the failing assert, or the limit hit
        verifier_score=1.0 if passed else 0.0,
    )
