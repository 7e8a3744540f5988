"""The NeMo-Gym adapter against a loopback stand-in of a resource server (tests/harness/gym_standin.py
says why not nemo-gym itself): a session per episode, tool calls to their endpoints, a tool's 4xx as an
error turn the model reads, the episode as a whole Responses object to /verify; a server-side failure
ends the episode as an error in its own process."""

from __future__ import annotations

import httpx
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


def call(name: str, **arguments: object) -> str:
    return format_tool_call(ToolCall(name, dict(arguments)), "hermes")


def test_an_episode_is_a_session_of_tool_calls_then_a_verified_answer(gym):
    env = GymEnv(EnvSpec(gym.url, "hermes", "exact"))
    assert env.reset("What is 2 + 40?", "42") == ""
    step = env.step(call("add", a=2, b=40))
    assert (step.observation, step.done, step.info) == ('{"sum": 42}', False, {})
    assert env.step("<tool_call>{oops</tool_call>").observation.startswith(
        "error: the tool call is not valid"
    )
    bad_args, no_tool = env.step(call("add", a=2)), env.step(call("no_such_tool"))
    assert bad_args.observation.startswith("error: tool add answered 422") and not bad_args.done
    assert (
        no_tool.observation.startswith("error: tool no_such_tool answered 404") and no_tool.info["tool_error"]
    )
    final = env.step("42")
    assert (final.done, final.reward) == (True, 1.0)  # the stand-in answers 422 to a body Gym would reject
    sent = gym.verified[0]
    assert sent["expected_answer"] == "42"
    assert sent["responses_create_params"]["input"] == [{"role": "user", "content": "What is 2 + 40?"}]
    items = sent["response"]["output"]
    assert [i["type"] for i in items] == ["function_call", "function_call_output"] * 3 + ["message"]
    assert (items[0]["name"], items[0]["arguments"], items[1]["output"]) == (
        "add",
        '{"a": 2, "b": 40}',
        '{"sum": 42}',
    )
    assert gym.sessions == {"0": 1}  # one session, its one good tool call counted under its cookie
    env.reset("What is 2 + 2?", "4")
    assert env.step("5").reward == 0.0 and gym.verified[1]["response"]["output"][0]["type"] == "message"


def test_the_standin_rejects_a_verify_body_gym_would(gym):
    http = httpx.Client()
    http.post(f"{gym.url}/seed_session", json={})
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]}
    body = {
        "responses_create_params": {"input": []},
        "response": {"output": [message]},
        "expected_answer": "4",
    }
    reply = http.post(f"{gym.url}/verify", json=body)
    assert reply.status_code == 422 and "response.id" in reply.json()["detail"]
    assert "response.output.0.content.annotations" in reply.json()["detail"]


def test_episodes_in_processes_each_hold_their_own_session_and_a_500_tool_is_that_episodes_error(gym):
    pool = EnvPool(EnvConfig(f"nemo_gym:{gym.url}", step_timeout_s=20), "exact")
    sessions = pool.start(2)
    assert pool.reset(sessions, [("q", "5"), ("q", "5")]) == ["", ""]
    steps = pool.step(sessions, [call("add", a=2, b=3), call("crash")])
    assert steps[0] is not None and steps[0].observation == '{"sum": 5}'
    assert steps[1] is None and "500" in sessions[1].error and not sessions[1].alive
    (last,) = pool.step(sessions[:1], ["5"])
    assert last is not None and (last.reward, last.done) == (1.0, True)
    assert sorted(gym.sessions.values()) == [0, 1]
    sessions[0].close()


def test_the_url_is_required():
    with pytest.raises(ValueError, match=r"nemo_gym:<url> needs the resource server's URL"):
        GymEnv(EnvSpec("", "hermes", "exact"))
