"""Mathematical answer equivalence: the JSONL task's `verifier: math_verify` (a task decides
correctness, rollwise.types.task), also used by the reward pool's `math_verify_reward`
(rollwise.reward.verifiers)."""

from __future__ import annotations

from typing import Any


def math_equal(answer: str, reference: str, timeout_s: int = 5) -> bool:
    """Mathematical equivalence with Hugging Face's math-verify: "1/2" == "0.5" == "\\frac{1}{2}",
    "x+1" == "1+x", sets and intervals compared as such. A bare number or expression is read both as
    LaTeX and as plain math. math-verify's own per-call timeout (signal based) bounds pathological input."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]

    def parsed(text: str) -> Any:
        text = text.strip()
        # math-verify extracts LaTeX from $...$ / \boxed{}; a bare answer is wrapped so it is found.
        return parse(text if "$" in text or "\\boxed" in text else f"${text}$", extraction_config=configs,
                     parsing_timeout=timeout_s)

    gold, guess = parsed(reference), parsed(answer)
    if not gold or not guess:
        return False
    return bool(verify(gold, guess, timeout_seconds=timeout_s))
