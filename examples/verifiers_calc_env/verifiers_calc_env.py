"""A classic-verifiers environment written the way environments for prime-rl / tinker-cookbook are: it knows
nothing of rollwise. Two-digit multiplication with a `calculator` tool (vf.ToolEnv, multi-turn); offline
synthetic data; the rubric pays 1.0 for the right number inside <answer></answer> in the last reply.

    vf.load_environment("verifiers-calc-env", num_train=400, num_eval=50, seed=0)
"""

from __future__ import annotations

import ast
import operator
import random
import re

import verifiers as vf
from datasets import Dataset

SYSTEM = ("You have a calculator tool. Call it with <tool_call>{\"name\": \"calculator\", \"arguments\": "
          "{\"expression\": \"...\"}}</tool_call>, read its result, then give the final answer inside "
          "<answer></answer> tags.")

# A worked episode before each question: a small base model never calls a tool unprompted.
DEMO = [
    {"role": "user", "content": "Calculate 12 * 34."},
    {"role": "assistant", "content": "<tool_call>{\"name\": \"calculator\", \"arguments\": "
                                     "{\"expression\": \"12 * 34\"}}</tool_call>"},
    {"role": "tool", "tool_call_id": "call_demo", "content": "408"},
    {"role": "assistant", "content": "12 * 34 = 408. <answer>408</answer>"},
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("only numbers and + - * / are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: the expression, e.g. "12 * 34"
    """
    try:
        value = _eval(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _rows(n: int, rng: random.Random, digits: int, op: str, question: str) -> list[dict]:
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    rows = []
    for _ in range(n):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        rows.append({"question": question.format(a=a, b=b, op=op), "answer": calculator(f"{a} {op} {b}")})
    return rows


def correct_answer(completion, answer, **kwargs) -> float:
    """1.0 when the last assistant reply has exactly the right number inside <answer></answer>."""
    replies = [m for m in completion if getattr(m, "role", None) == "assistant" or
               (isinstance(m, dict) and m.get("role") == "assistant")]
    if not replies:
        return 0.0
    last = replies[-1]
    text = last.get("content") if isinstance(last, dict) else last.content
    found = re.findall(r"<answer>\s*(-?[\d,]+)\s*</answer>", text or "")
    return 1.0 if len(found) == 1 and found[0].replace(",", "") == str(answer) else 0.0


def load_environment(num_train: int = 400, num_eval: int = 50, seed: int = 0, digits: int = 2, op: str = "*",
                     question: str = "Calculate {a} {op} {b}.", system_prompt: str = SYSTEM, max_turns: int = 3,
                     demo: bool = True) -> vf.Environment:
    rng = random.Random(seed)
    train = _rows(num_train, rng, digits, op, question)
    held_out = _rows(num_eval, rng, digits, op, question)
    return vf.ToolEnv(
        dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(held_out),
        system_prompt=system_prompt, few_shot=DEMO if demo else None, tools=[calculator], max_turns=max_turns,
        rubric=vf.Rubric(funcs=[correct_answer], weights=[1.0]),
    )
