"""Environment processes: each episode's environment in a process of its own, under limits.

A process per episode (forked from a server that has imported the environments already, so starting
one costs milliseconds) keeps episodes apart: an environment that hangs past ``env.step_timeout_s``, or
crashes, or allocates past ``env.memory_mb`` loses its own episode (an error, reward 0) and nothing
else. The parent talks to many at once: ``exchange`` sends each live episode its message and collects
the replies, killing those past the time limit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import resource
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from hpcrl.envs import nemo_gym, verifiers_env  # noqa: F401  (register their environments on import)
from hpcrl.envs.base import REGISTRY, Environment, EnvSpec, Step
from hpcrl.envs.builtin import PRIVATE_ENV
from hpcrl.envs.config import EnvConfig
from hpcrl.rewards.config import load_plugins

PRELOAD = [m for m in ("math_verify", "reasoning_gym") if importlib.util.find_spec(m) is not None]
"""Imported once by the server the episode processes fork from: the graders' imports take ~2 s, which
would otherwise count against each episode's first step (``env.step_timeout_s``)."""


def make_env(name: str, spec: EnvSpec) -> Environment:
    """A fresh environment of ``env.name`` (``name`` before its colon)."""
    if name not in REGISTRY:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name](spec)


def _serve(kind: str, spec: EnvSpec, plugins: str, private: str, memory_mb: int, conn: Connection) -> None:
    """One episode's process: build the environment, then answer reset/step messages until told to stop."""
    import logging

    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeouts are off
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # Slurm's warning is the driver's to handle
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.environ[PRIVATE_ENV] = private
    try:
        load_plugins(plugins)
        env = make_env(kind, spec)
    except Exception as exc:
        env, failure = None, f"{type(exc).__name__}: {exc}"
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        if env is None:
            conn.send(("error", failure))
            continue
        try:
            if msg[0] == "reset":
                conn.send(("ok", env.reset(msg[1], msg[2])))
            else:
                s = env.step(msg[1])
                conn.send(("ok", (s.observation, float(s.reward), bool(s.done), dict(s.info))))
        except Exception as exc:  # the environment's own bug: its episode's error
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


@dataclass
class Session:
    """One episode's environment process."""

    proc: Any
    conn: Connection
    alive: bool = True
    error: str = ""
    """Why it died (a timeout, a crash, the environment's exception); "" while alive."""

    def close(self) -> None:
        if self.alive:
            with contextlib.suppress(OSError):
                self.conn.send(None)
        self.proc.join(timeout=1)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        self.alive = False


@dataclass
class EnvPool:
    """Starts episode processes for ``env.name`` and exchanges messages with them under the limits."""

    cfg: EnvConfig
    verifier: str
    private: tuple[str, ...] = ()
    """Paths the environment's tools must not read (``envs/builtin.py``'s PRIVATE_ENV)."""
    plugins: str = field(default_factory=lambda: os.environ.get("HPCRL_PLUGINS", ""))

    def __post_init__(self) -> None:
        load_plugins(self.plugins)
        argument = self.cfg.name.partition(":")[2]
        self.spec = EnvSpec(argument, self.cfg.tool_format, self.verifier)
        make_env(self.cfg.kind(), self.spec)  # here, in the caller: a refusal (no sandbox) is one line
        self.ctx = mp.get_context("forkserver")  # no fork of the driver, which holds Ray and torch threads
        # verifiers' import takes seconds: once in the server, not in each episode's first reset
        heavy = ["verifiers.v1"] if self.cfg.kind() == "verifiers" else []
        self.ctx.set_forkserver_preload(["hpcrl.envs.pool", *PRELOAD, *heavy])

    def start(self, count: int) -> list[Session]:
        sessions = []
        private = os.pathsep.join(self.private)
        for _ in range(count):
            parent, child = self.ctx.Pipe()
            args = (self.cfg.kind(), self.spec, self.plugins, private, self.cfg.memory_mb, child)
            proc = self.ctx.Process(target=_serve, args=args, daemon=True)
            proc.start()
            child.close()
            sessions.append(Session(proc, parent))
        return sessions

    def reset(self, sessions: list[Session], problems: list[tuple[str, str]]) -> list[str | None]:
        """Each session's first observation (None where it failed: ``Session.error`` says why)."""
        return self._exchange(sessions, [("reset", p, a) for p, a in problems])

    def step(self, sessions: list[Session], turns: list[str]) -> list[Step | None]:
        """Each session's step (None where it failed)."""
        out = self._exchange(sessions, [("step", t) for t in turns])
        return [None if r is None else Step(*r) for r in out]

    def _exchange(self, sessions: list[Session], messages: list[Any]) -> list[Any]:
        replies: list[Any] = [None] * len(sessions)
        waiting: dict[Connection, int] = {}
        for i, (s, msg) in enumerate(zip(sessions, messages, strict=True)):
            try:
                s.conn.send(msg)
                waiting[s.conn] = i
            except OSError:
                self._fail(s, "the environment process died")
        deadline = time.monotonic() + self.cfg.step_timeout_s
        while waiting and (left := deadline - time.monotonic()) > 0:
            for ready in wait(list(waiting), timeout=left):
                conn = cast(Connection, ready)
                i = waiting.pop(conn)
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    self._fail(sessions[i], "the environment process died (crash or memory limit)")
                    continue
                if status == "ok":
                    replies[i] = payload
                else:
                    self._fail(sessions[i], str(payload))
        for i in waiting.values():
            self._fail(
                sessions[i], f"the environment took longer than env.step_timeout_s={self.cfg.step_timeout_s}"
            )
        return replies

    @staticmethod
    def _fail(session: Session, why: str) -> None:
        session.error = why
        session.proc.kill()
        session.alive = False
        session.close()
