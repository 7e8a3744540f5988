"""NeMo-Gym resource servers as environments: ``env.name=nemo_gym:http://host:port``.

A Gym resource server (``nemo_gym.base_resources_server.SimpleResourcesServer``) speaks HTTP+JSON:
``POST /seed_session`` starts a session (a cookie names it), ``POST /<tool>`` with the call's arguments
runs a tool and returns its result, ``POST /verify`` with the request and the model's response returns
``{"reward": ...}``. This adapter plays the agent's part of that protocol: each tool call in a model
turn (``env.tool_format``) goes to its endpoint, the results come back as the observation, and a turn
without a call is the answer, sent to ``/verify``. The problem's reference rides as
``expected_answer``, the field Gym's math and QA servers read.
"""

from __future__ import annotations

import json
from typing import Any

from hpcrl.envs.base import EnvSpec, Step, register_env, tool_calls


class GymEnv:
    def __init__(self, spec: EnvSpec, timeout_s: float = 60.0) -> None:
        import httpx

        if not spec.argument.startswith(("http://", "https://")):
            raise ValueError(
                f"env.name=nemo_gym:<url> needs the resource server's URL, got {spec.argument!r}"
            )
        self.url, self.fmt = spec.argument.rstrip("/"), spec.tool_format
        self.http = httpx.Client(timeout=timeout_s)  # keeps the session cookie /seed_session sets
        self.prompt = self.answer = ""

    def reset(self, prompt: str, answer: str) -> str:
        self.prompt, self.answer = prompt, answer
        self._post("seed_session", {})
        return ""

    def step(self, turn: str) -> Step:
        calls = tool_calls(turn, self.fmt)
        if isinstance(calls, Step):
            return calls
        if calls:
            results = [json.dumps(self._post(c.name, c.arguments)) for c in calls]
            return Step("\n".join(results))
        verdict = self._post("verify", self._verify_request(turn))
        return Step("", float(verdict["reward"]), True)

    def _verify_request(self, turn: str) -> dict[str, Any]:
        message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": turn}]}
        return {
            "responses_create_params": {"input": [{"role": "user", "content": self.prompt}]},
            "response": {"output": [message]},
            "expected_answer": self.answer,
        }

    def _post(self, endpoint: str, body: dict[str, Any]) -> Any:
        reply = self.http.post(f"{self.url}/{endpoint}", json=body)
        reply.raise_for_status()  # a tool that fails server-side ends the episode as an error
        return reply.json()


@register_env("nemo_gym")
def gym_env(spec: EnvSpec) -> GymEnv:
    return GymEnv(spec)
