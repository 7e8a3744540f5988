"""NeMo-Gym resource servers as environments: ``env.name=nemo_gym:http://host:port``.

A Gym resource server (``nemo_gym.base_resources_server.SimpleResourcesServer``) speaks HTTP+JSON:
``POST /seed_session`` starts a session (a cookie names it), ``POST /<tool>`` with the call's arguments
runs a tool and returns its result, ``POST /verify`` with the request and the model's response returns
``{"reward": ...}``. This adapter plays the agent's part of that protocol: each tool call in a model
turn (``env.tool_format``) goes to its endpoint, the results come back as the observation, and a turn
without a call is the answer, sent to ``/verify``. The problem's reference rides as
``expected_answer``, the field Gym's math and QA servers read.

Gym validates ``/verify``'s body with pydantic (``BaseVerifyRequest``): ``response`` must be a whole
OpenAI Responses object (id, created_at, model, object, tools, tool_choice, parallel_tool_calls;
messages with id, status and annotations), or the server answers 422. Its ``output`` is the episode
as a Gym agent would record it: each tool call as a ``function_call`` and its result as a
``function_call_output``, then the answer as the last message (the item Gym's verifiers read).
"""

from __future__ import annotations

import json
import time
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
        self.output: list[dict[str, Any]] = []  # the episode's Responses output items so far

    def reset(self, prompt: str, answer: str) -> str:
        self.prompt, self.answer, self.output = prompt, answer, []
        self._post("seed_session", {})
        return ""

    def step(self, turn: str) -> Step:
        calls = tool_calls(turn, self.fmt)
        if isinstance(calls, Step):
            return calls
        if calls:
            results = [self._call(c.name, c.arguments) for c in calls]
            info = {} if all(ran for ran, _ in results) else {"tool_error": True}
            return Step("\n".join(text for _, text in results), info=info)
        verdict = self._post("verify", self._verify_request(turn))
        return Step("", float(verdict["reward"]), True)

    def _call(self, name: str, arguments: dict[str, Any]) -> tuple[bool, str]:
        """(whether the tool ran, what the model reads). A 4xx (no such tool, arguments its schema
        rejects) is the model's mistake: the server's answer is an error turn, as Gym's own agent
        feeds it back; a 5xx or a dead server raises and ends the episode."""
        reply = self.http.post(f"{self.url}/{name}", json=arguments)
        if reply.is_client_error:
            result = f"error: tool {name} answered {reply.status_code}: {reply.text}"
        else:
            reply.raise_for_status()
            result = json.dumps(reply.json())
        call_id = f"call_{len(self.output) // 2}"
        self.output += [
            {"type": "function_call", "call_id": call_id, "name": name, "arguments": json.dumps(arguments)},
            {"type": "function_call_output", "call_id": call_id, "output": result},
        ]
        return not reply.is_client_error, result

    def _verify_request(self, turn: str) -> dict[str, Any]:
        text = {"type": "output_text", "text": turn, "annotations": []}
        answer = {
            "type": "message",
            "id": "msg_answer",
            "role": "assistant",
            "status": "completed",
            "content": [text],
        }
        response = {
            "id": "resp_hpcrl",
            "object": "response",
            "created_at": time.time(),
            "model": "policy",  # the trained model has no served name here; Gym's verifiers do not read it
            "output": [*self.output, answer],
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
        }
        return {
            "responses_create_params": {"input": [{"role": "user", "content": self.prompt}]},
            "response": response,
            "expected_answer": self.answer,
        }

    def _post(self, endpoint: str, body: dict[str, Any]) -> Any:
        reply = self.http.post(f"{self.url}/{endpoint}", json=body)
        reply.raise_for_status()  # a session or verdict that fails ends the episode as an error
        return reply.json()


@register_env("nemo_gym")
def gym_env(spec: EnvSpec) -> GymEnv:
    return GymEnv(spec)
