"""Built-in tool environments: the model may call a tool any number of turns, then answers; the answer
(a turn without a tool call) ends the episode and ``data.verifier`` grades it against the problem's
reference, as a single-turn completion would be graded.

``python``: ``{"name": "python", "arguments": {"code": "..."}}`` runs the code in the sandbox
(``envs/sandbox.py``) and shows its output. ``calculator``: ``{"name": "calculator", "arguments":
{"expression": "3 * (4 + 5)"}}`` evaluates arithmetic (numbers, + - * / // % **, parentheses).
"""

from __future__ import annotations

import ast
import operator
import os
from collections.abc import Callable
from typing import Any

from hpcrl.envs.base import EnvSpec, Step, register_env, tool_calls
from hpcrl.envs.sandbox import Limits, require_sandbox, run_python
from hpcrl.envs.toolcall import ToolCall

Tool = Callable[[dict[str, Any]], str]


class ToolEnv:
    """An environment of named tools, graded by a verifier when the model answers."""

    def __init__(self, spec: EnvSpec, tools: dict[str, Tool]) -> None:
        from hpcrl.rewards.verifiers import get_verifier

        self.fmt, self.tools = spec.tool_format, tools
        self.verify = get_verifier(spec.verifier)
        self.prompt = self.answer = ""

    def reset(self, prompt: str, answer: str) -> str:
        self.prompt, self.answer = prompt, answer
        return ""

    def step(self, turn: str) -> Step:
        calls = tool_calls(turn, self.fmt)
        if isinstance(calls, Step):
            return calls
        if not calls:
            verdict = self.verify(turn, self.answer, self.prompt)
            return Step("", verdict.reward, True, {"outcome": verdict.outcome.value})
        return Step("\n".join(self._call(c) for c in calls))

    def _call(self, call: ToolCall) -> str:
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: no tool {call.name!r}; tools: {', '.join(sorted(self.tools))}"
        try:
            return tool(call.arguments)
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            return f"error: {call.name}: {type(exc).__name__}: {exc}"


PRIVATE_ENV = "HPCRL_ENV_PRIVATE"
"""Paths (os.pathsep-separated) a sandboxed tool must not read: the pool sets it to the run directory,
the driver's working directory and the home directory (``envs/pool.py``)."""


@register_env("python")
def python_env(spec: EnvSpec) -> ToolEnv:
    require_sandbox()  # refuse here, in one line, rather than run model code unsandboxed
    private = tuple(filter(None, os.environ.get(PRIVATE_ENV, "").split(os.pathsep)))
    limits = Limits()

    def python(args: dict[str, Any]) -> str:
        result = run_python(str(args["code"]), limits, private)
        if result.timed_out:
            return f"error: the code ran past {limits.wall_s:.0f} s and was stopped"
        return result.output if result.exit_code == 0 else f"exit code {result.exit_code}\n{result.output}"

    return ToolEnv(spec, {"python": python})


_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPONENT = 100
"""``9 ** 9 ** 9`` would keep the environment busy for minutes: larger exponents are refused."""


def calculate(expression: str) -> float | int:
    """Arithmetic only: anything else in the expression (names, calls, attributes) is a ValueError."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None
    return ev(tree.body)


@register_env("calculator")
def calculator_env(spec: EnvSpec) -> ToolEnv:
    return ToolEnv(spec, {"calculator": lambda args: str(calculate(str(args["expression"])))})
