"""Tool calls read from a model turn, in the model's own format (``env.tool_format``).

``hermes`` (Qwen 2.5/3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one
block per call. ``nemotron`` (Llama-Nemotron, Nemotron Nano 2): ``<TOOLCALL>[{"name": ..., "arguments":
{...}}, ...]</TOOLCALL>``, a JSON list in one block. A turn without a block has no call (its text is
the model's answer); a block that does not parse raises ``ToolCallError``, which the environment turns
into an error observation: a malformed call costs the model a turn, never the run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


class ToolCallError(ValueError):
    """A tool-call block that does not parse; the message is what the model reads back."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


_BLOCKS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "nemotron": ("<TOOLCALL>", "</TOOLCALL>"),
}


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
    """The calls in ``text`` ([] when it has none), in order."""
    opening, closing = _BLOCKS[fmt]
    bodies = re.findall(re.escape(opening) + r"(.*?)" + re.escape(closing), text, re.DOTALL)
    if text.count(opening) != len(bodies):
        raise ToolCallError(f"a {opening} block is not closed with {closing}")
    calls: list[ToolCall] = []
    for body in bodies:
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            raise ToolCallError(
                f"the tool call is not valid JSON: {exc.msg} (at character {exc.pos})"
            ) from None
        if fmt == "nemotron":
            if not isinstance(value, list):
                raise ToolCallError(f"{opening} holds a JSON list of calls, not {type(value).__name__}")
            calls += [_call(v) for v in value]
        else:
            calls.append(_call(value))
    return calls


def _call(value: Any) -> ToolCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ToolCallError('a tool call is a JSON object with a "name" string and an "arguments" object')
    args = value.get("arguments", {})
    if isinstance(args, str):  # OpenAI-style: the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ToolCallError(f'the "arguments" of {value["name"]!r} are not a JSON object') from None
    if not isinstance(args, dict):
        raise ToolCallError(f'the "arguments" of {value["name"]!r} are not a JSON object')
    return ToolCall(value["name"], args)


def format_tool_call(call: ToolCall, fmt: str) -> str:
    """How a model in ``fmt`` writes ``call`` (tests and prompts that show the model an example)."""
    payload = {"name": call.name, "arguments": call.arguments}
    opening, closing = _BLOCKS[fmt]
    body = json.dumps([payload] if fmt == "nemotron" else payload)
    return f"{opening}{body}{closing}"
