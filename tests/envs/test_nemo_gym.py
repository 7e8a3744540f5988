"""The NeMo-Gym adapter against a loopback stand-in of a resource server (tests/harness/gym_standin.py):
a session per episode, tool calls to their endpoints, the answer to /verify; a server-side failure
ends the episode as an error in its own process."""

from __future__ import annotations

import pytest

from hpcrl.envs.base import EnvSpec
from hpcrl.envs.config import EnvConfig
from hpcrl.envs.nemo_gym import GymEnv
from hpcrl.envs.pool import EnvPool
from hpcrl.envs.toolcall import ToolCall, format_tool_call
from tests.harness.gym_standin import GymStandIn


@pytest.fixture
def gym():
    server = GymStandIn()
    yield server
    server.close()


def test_an_episode_is_a_session_of_tool_calls_then_a_verified_answer(gym):
    env = GymEnv(EnvSpec(gym.url, "hermes", "exact"))
    assert env.reset("What is 2 + 40?", "42") == ""
    step = env.step(format_tool_call(ToolCall("add", {"a": 2, "b": 40}), "hermes"))
    assert (step.observation, step.done) == ('{"sum": 42}', False)
    assert env.step("<tool_call>{oops</tool_call>").observation.startswith(
        "error: the tool call is not valid"
    )
    final = env.step("42")
    assert (final.done, final.reward) == (True, 1.0)
    sent = gym.verified[0]
    assert sent["expected_answer"] == "42"
    assert sent["responses_create_params"]["input"] == [{"role": "user", "content": "What is 2 + 40?"}]
    assert gym.sessions == {"0": 1}  # one session, its one tool call counted under its cookie


def test_episodes_in_processes_each_hold_their_own_session_and_a_404_tool_is_that_episodes_error(gym):
    pool = EnvPool(EnvConfig(f"nemo_gym:{gym.url}", step_timeout_s=20), "exact")
    sessions = pool.start(2)
    assert pool.reset(sessions, [("q", "5"), ("q", "5")]) == ["", ""]
    steps = pool.step(
        sessions,
        [
            format_tool_call(ToolCall("add", {"a": 2, "b": 3}), "hermes"),
            format_tool_call(ToolCall("no_such_tool", {}), "hermes"),
        ],
    )
    assert steps[0] is not None and steps[0].observation == '{"sum": 5}'
    assert steps[1] is None and "404" in sessions[1].error and not sessions[1].alive
    (last,) = pool.step(sessions[:1], ["5"])
    assert last is not None and (last.reward, last.done) == (1.0, True)
    assert sorted(gym.sessions.values()) == [0, 1]
    sessions[0].close()


def test_the_url_is_required():
    with pytest.raises(ValueError, match=r"nemo_gym:<url> needs the resource server's URL"):
        GymEnv(EnvSpec("", "hermes", "exact"))
