"""Tool calls read from model turns in each model's format; malformed ones are errors the environment
shows the model, and the built-in environments answer them."""

from __future__ import annotations

import pytest

from hpcrl.envs.base import EnvSpec
from hpcrl.envs.builtin import calculate, calculator_env
from hpcrl.envs.config import BUILT_IN_ENVS
from hpcrl.envs.toolcall import ToolCall, ToolCallError, format_tool_call, parse_tool_calls


def test_hermes_calls_are_read_in_order_with_text_around_them():
    text = (
        'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
        '\n<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>'
    )
    assert parse_tool_calls(text, "hermes") == [
        ToolCall("calculator", {"expression": "2+3"}),
        ToolCall("python", {"code": "print(1)"}),  # OpenAI-style arguments as a JSON string
    ]
    assert parse_tool_calls("The answer is 5.", "hermes") == []


def test_nemotron_calls_are_a_json_list_in_one_block():
    text = '<TOOLCALL>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</TOOLCALL>'
    assert parse_tool_calls(text, "nemotron") == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    # the other format's block is plain text to this one
    assert parse_tool_calls('<tool_call>{"name": "a"}</tool_call>', "nemotron") == []


@pytest.mark.parametrize(
    ("fmt", "text", "says"),
    [
        ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1}', "not closed"),
        ("hermes", "<tool_call>{name: a}</tool_call>", "not valid JSON"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '"name" string'),
        ("hermes", '<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "not a JSON object"),
        ("hermes", '<tool_call>{"name": "a", "arguments": "{oops"}</tool_call>', "not a JSON object"),
        ("nemotron", '<TOOLCALL>{"name": "a", "arguments": {}}</TOOLCALL>', "JSON list"),
    ],
)
def test_a_malformed_call_raises_what_the_model_reads_back(fmt, text, says):
    with pytest.raises(ToolCallError, match=says):
        parse_tool_calls(text, fmt)


@pytest.mark.parametrize("fmt", ["hermes", "nemotron"])
def test_written_calls_read_back(fmt):
    call = ToolCall("calculator", {"expression": "7 * 6"})
    assert parse_tool_calls(f"ok {format_tool_call(call, fmt)}", fmt) == [call]


def test_calculator_does_arithmetic_only():
    assert calculate("3 * (4 + 5) - 2 ** 3 / 4") == 25.0
    assert calculate("-7 // 2") == -4
    for bad in ("__import__('os')", "x + 1", "9 ** 9 ** 9", "1 +"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_calculator_episode_tool_turn_error_turn_and_graded_answer():
    env = calculator_env(EnvSpec("", "hermes", "exact"))
    assert env.reset("What is 6*7?", "42") == ""
    call = format_tool_call(ToolCall("calculator", {"expression": "6*7"}), "hermes")
    assert env.step(call).observation == "42" and not env.step(call).done
    bad = env.step("<tool_call>{not json}</tool_call>")
    assert bad.observation.startswith("error: the tool call is not valid JSON") and not bad.done
    unknown = env.step(format_tool_call(ToolCall("shell", {"cmd": "ls"}), "hermes"))
    assert unknown.observation == "error: no tool 'shell'; tools: calculator"
    wrong_args = env.step(format_tool_call(ToolCall("calculator", {"expr": "1"}), "hermes"))
    assert wrong_args.observation.startswith("error: calculator: KeyError")
    final = env.step("42")
    assert (final.done, final.reward, final.info["outcome"]) == (True, 1.0, "correct")
    assert env.step("41").reward == 0.0


def test_built_in_names_are_the_registered_ones():
    from hpcrl.envs.base import REGISTRY
    from hpcrl.envs.pool import make_env

    make_env("calculator", EnvSpec("", "hermes", "exact"))  # imports the built-in modules
    assert set(BUILT_IN_ENVS) <= set(REGISTRY)
    assert set(REGISTRY) - set(BUILT_IN_ENVS) <= {"test_scripted"}
