"""Tools an agent can call: a calculator, and python/bash in the rollout's sandbox.

A tool is a name, a description, a JSON schema for its arguments and `run(arguments) -> str`.
`ToolRegistry.execute` never raises for what the model did: an unknown tool, arguments that do not
fit the schema, or a tool that fails become an error text returned to the model as the tool result.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Any

from rollwise.agent.toolcalls import ToolCall, ToolCallError
from rollwise.sandbox.types import Sandbox

MAX_RESULT_CHARS = 4_000  # tool output shown to the model (its context is the scarce resource)


class ToolError(Exception):
    """Raised by a tool for a bad request from the model; its message goes back as the tool result."""


class Tool:
    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def run(self, arguments: dict[str, Any]) -> str:
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        """The OpenAI function spec (what `tools=` carries)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolResult:
    call_id: str
    name: str | None
    content: str
    error: bool

    def message(self) -> dict[str, Any]:
        """The tool message that carries this result back to the model."""
        msg: dict[str, Any] = {"role": "tool", "content": self.content, "tool_call_id": self.call_id}
        if self.name:
            msg["name"] = self.name
        return msg


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """A small JSON-schema check (required, unknown keys, top-level types); the problem, or None."""
    props: dict[str, Any] = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    unknown = [k for k in arguments if k not in props]
    if unknown and schema.get("additionalProperties", False) is False:
        return f"unknown argument(s) {unknown}; allowed: {sorted(props)}"
    for key, value in arguments.items():
        kind = props.get(key, {}).get("type")
        expected = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if expected and (not isinstance(value, expected) or (kind != "boolean" and isinstance(value, bool))):
            return f"argument {key!r} must be of type {kind}, got {type(value).__name__}"
    return None


class ToolRegistry:
    def __init__(self, tools: list[Tool] | None = None) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools or []:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        if not tool.name:
            raise ValueError(f"{type(tool).__name__} has no name")
        if tool.name in self.tools:
            raise ValueError(f"two tools are named {tool.name!r}")
        self.tools[tool.name] = tool

    def specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self.tools.values()]

    def execute(self, call: ToolCall | ToolCallError) -> ToolResult:
        if isinstance(call, ToolCallError):
            return ToolResult(call.id, call.name, call.message, error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call.id, call.name, f"error: unknown tool {call.name!r}; available tools: "
                              f"{sorted(self.tools)}", error=True)
        problem = check_arguments(tool.parameters, call.arguments)
        if problem:
            return ToolResult(call.id, call.name, f"error: {call.name}: {problem}", error=True)
        try:
            out = tool.run(call.arguments)
        except ToolError as exc:
            return ToolResult(call.id, call.name, f"error: {exc}", error=True)
        except Exception as exc:  # noqa: BLE001 - a failing tool is the model's observation, not a crash
            return ToolResult(call.id, call.name, f"error: {call.name} failed: {type(exc).__name__}: {exc}"[:1000],
                              error=True)
        if len(out) > MAX_RESULT_CHARS:
            out = out[:MAX_RESULT_CHARS] + f"\n[... {len(out) - MAX_RESULT_CHARS} more characters cut]"
        return ToolResult(call.id, call.name, out, error=False)


# ---------------------------------------------------------------------------------------- calculator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_arithmetic(expression: str) -> int | float:
    """+ - * / // % ** and parentheses on numbers; anything else (names, calls) is refused."""
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    tree = ast.parse(expression.strip(), mode="eval")

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > 1e6):
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")

    value = ev(tree)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    return value


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. '(2 + 3) * 4'."
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}

    def run(self, arguments: dict[str, Any]) -> str:
        try:
            value = evaluate_arithmetic(arguments["expression"])
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except SyntaxError as exc:
            raise ToolError(f"not an arithmetic expression ({exc.msg})") from None
        except (ValueError, TypeError) as exc:
            raise ToolError(str(exc)) from None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(value)


# ---------------------------------------------------------------------------------------- sandbox tools


def _format_run(result: Any) -> str:
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.killed or result.exit_code not in (0, None):
        parts.append(f"[exit code {result.exit_code}" + (f"; {result.reason}" if result.reason else "") + "]")
    return "\n".join(parts) or "(no output)"


class PythonTool(Tool):
    """Runs Python in the rollout's sandbox; files persist across the episode's turns."""

    name = "python"
    description = "Run a Python program in your workspace and return its output (print what you need)."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(self, sandbox: Sandbox, interpreter: str = "python3", timeout_s: float | None = None) -> None:
        self.sandbox, self.interpreter, self.timeout_s = sandbox, interpreter, timeout_s
        self._n = 0

    def run(self, arguments: dict[str, Any]) -> str:
        self._n += 1
        path = f".tool_python_{self._n}.py"
        self.sandbox.write_file(path, arguments["code"])
        return _format_run(self.sandbox.run(f"{self.interpreter} -E -s {path}", self.timeout_s))


class BashTool(Tool):
    name = "bash"
    description = "Run a shell command in your workspace and return its output."
    parameters = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}

    def __init__(self, sandbox: Sandbox, timeout_s: float | None = None) -> None:
        self.sandbox, self.timeout_s = sandbox, timeout_s

    def run(self, arguments: dict[str, Any]) -> str:
        return _format_run(self.sandbox.run(arguments["command"], self.timeout_s))
