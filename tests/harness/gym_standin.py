"""A loopback stand-in for a NeMo-Gym resource server (not NeMo-Gym itself, which the tests do not
install): the endpoints of its documented protocol, enough to drive ``envs/nemo_gym.py``.

``POST /seed_session`` sets a session cookie; ``POST /add`` (a tool) adds ``a`` and ``b`` and counts
the calls of the cookie's session; ``POST /verify`` grades the assistant's last output text against
``expected_answer`` (reward 1 or 0) and reports the session's tool calls; any other path is a 404.
"""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


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
                    standin.sessions[session] += 1
                    return self._reply({"sum": body["a"] + body["b"]})
                if self.path == "/verify":
                    standin.verified.append(body)
                    text = body["response"]["output"][-1]["content"][0]["text"]
                    reward = 1.0 if text.strip() == body["expected_answer"] else 0.0
                    return self._reply({"reward": reward, "tool_calls": standin.sessions[session]})
                return self._reply({"detail": "not found"}, status=404)

            def _reply(self, payload: dict[str, Any], status: int = 200, cookie: str = "") -> None:
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
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
