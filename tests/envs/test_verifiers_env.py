"""The verifiers (0.4.0) adapter on a real verifiers environment (``tests/harness/vf_taskset.py``: a
``vf.Taskset``, a ``vf.Toolset`` with a plain and a coroutine tool, a rubric of two weighted
``@vf.reward`` methods, a ``@vf.stop`` on the trace): its data file, its tools as observations, its
rubric as the reward after every turn, its stop, and a malformed call as an error turn. Through the
episode processes (``EnvPool``) as the run uses it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.envs.base import EnvSpec
from hpcrl.envs.config import EnvConfig
from hpcrl.envs.pool import EnvPool
from hpcrl.envs.toolcall import ToolCall, format_tool_call
from hpcrl.envs.verifiers_env import VerifiersEnv, export_tasks, load_taskset

FACTORY = "tests.harness.vf_taskset:load"


def call(name: str, **args: int) -> str:
    return format_tool_call(ToolCall(name, args), "hermes")


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict[str, str]]:
    path = tmp_path_factory.mktemp("vf") / "tasks.jsonl"
    assert export_tasks(load_taskset(FACTORY), path, limit=4) == 4
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_data_file_holds_each_task_s_prompt_and_data(rows):
    assert [r["prompt"] for r in rows] == ["10 + 10 =", "11 + 12 =", "12 + 14 =", "13 + 16 ="]
    assert json.loads(rows[1]["answer"])["a"] == 11 and json.loads(rows[1]["answer"])["b"] == 12


def test_tools_answer_and_the_rubric_grades_every_turn(rows):
    env = VerifiersEnv(EnvSpec(FACTORY, "hermes", "exact"))
    assert env.reset(rows[1]["prompt"], rows[1]["answer"]) == ""
    s = env.step(call("add", a=11, b=12))
    assert (s.observation, s.done) == ("23", False)
    assert s.reward == 0.25 and s.info["rewards"] == {"correct": 0.0, "used_tool": 1.0}
    s = env.step(call("negate", x=4) + call("nope"))  # a coroutine tool, and one the env does not have
    assert s.observation == "-4\nerror: no tool 'nope'; tools: add, calculator, negate"
    assert s.done  # the task's @vf.stop: three tool results
    roles = [(n.message.role, n.sampled) for n in env.trace.nodes]
    assert (
        roles
        == [("user", False), ("assistant", True), ("tool", False), ("assistant", True)]
        + [("tool", False)] * 2
    )


def test_a_malformed_call_is_an_error_turn_then_the_answer_ends_it(rows):
    env = VerifiersEnv(EnvSpec(FACTORY, "hermes", "exact"))
    env.reset(rows[2]["prompt"], rows[2]["answer"])
    s = env.step('<tool_call>{"name": "add"')
    assert s.observation.startswith("error: a <tool_call> block is not closed") and not s.done
    s = env.step("26")
    assert (s.reward, s.done) == (0.75, True)  # right, without the tool: 0.75 x 1 + 0.25 x 0


def test_a_factory_that_is_not_a_taskset_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"module>:<factory> names a function"):
        load_taskset("tests.harness.vf_taskset")
    with pytest.raises(ValueError, match="returned a OrderedDict, not a verifiers Taskset"):
        load_taskset("collections:OrderedDict")


def test_episode_processes_run_the_adapter(rows, tmp_path: Path):
    cfg = EnvConfig(f"verifiers:{FACTORY}", max_turns=3, processes=2)
    pool = EnvPool(cfg, "exact")
    sessions = pool.start(2)
    try:
        assert pool.reset(sessions, [(r["prompt"], r["answer"]) for r in rows[:2]]) == ["", ""]
        first, second = pool.step(sessions, ["20", call("add", a=11, b=12)])
        assert first is not None and (first.reward, first.done) == (0.75, True)
        assert second is not None and (second.observation, second.reward) == ("23", 0.25)
    finally:
        for s in sessions:
            s.close()
