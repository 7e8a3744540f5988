"""Environments on nodes of their own (``env.nodes``): an ``EnvPool`` in a Ray actor on each environment
node (placed by the ``hpcrl_env`` resource those nodes advertise), and ``RemotePool``, which speaks the
pool's interface to ``Episodes`` (start, reset, step; a session's ``error`` and ``close``) across Ray.

The episode processes are the actor's children, on its node: their CPU and memory are not the driver
node's. A session is an id on its actor (a process and a pipe do not travel); sessions are dealt to the
actors in turn, and each reset or step goes to all of them at once, one call per actor.
"""

from __future__ import annotations

import json
import os
import socket
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.envs.base import Step
from hpcrl.envs.config import ENV_RESOURCE, EnvConfig
from hpcrl.envs.pool import EnvPool, Session


class EnvActor:
    """One environment node's pool: its sessions by id, the episode processes its children."""

    def __init__(self, cfg: EnvConfig, verifier: str, private: tuple[str, ...], plugins: str) -> None:
        self.pool = EnvPool(cfg, verifier, private, plugins)
        self.sessions: dict[int, Session] = {}
        self.next_id = 0

    def where(self) -> dict[str, Any]:
        return {"role": "env", "host": socket.gethostname(), "pid": os.getpid()}

    def start(self, count: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        self.sessions.update(zip(ids, self.pool.start(count), strict=True))
        return ids

    def reset(self, ids: list[int], problems: list[tuple[str, str]]) -> tuple[list[Any], list[str]]:
        """Each session's first observation (None where it failed) and its error ("" while alive)."""
        out = self.pool.reset([self.sessions[i] for i in ids], problems)
        return out, [self.sessions[i].error for i in ids]

    def step(self, ids: list[int], turns: list[str]) -> tuple[list[Any], list[str]]:
        out = self.pool.step([self.sessions[i] for i in ids], turns)
        return out, [self.sessions[i].error for i in ids]

    def close(self, ids: list[int]) -> None:
        for i in ids:
            self.sessions.pop(i).close()


@dataclass
class RemoteSession:
    """A session on actor ``actor`` of ``owner``, as ``Episodes`` holds a ``Session``."""

    owner: RemotePool
    actor: int
    id: int
    error: str = ""
    """Why its environment failed (a timeout, a crash ...), as the actor's ``Session.error`` said."""
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.owner.actors[self.actor].close.remote([self.id])  # in order after its step: one caller


class RemotePool:
    """``EnvPool``'s interface over the environment nodes' actors."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self.dealt = 0

    def start(self, count: int) -> list[RemoteSession]:
        import ray

        owners = [(self.dealt + k) % len(self.actors) for k in range(count)]
        self.dealt += count
        refs = {a: self.actors[a].start.remote(n) for a, n in Counter(owners).items()}
        ids = {a: iter(ray.get(ref)) for a, ref in refs.items()}
        return [RemoteSession(self, a, next(ids[a])) for a in owners]

    def reset(self, sessions: list[RemoteSession], problems: list[tuple[str, str]]) -> list[str | None]:
        return self._call("reset", sessions, problems)

    def step(self, sessions: list[RemoteSession], turns: list[str]) -> list[Step | None]:
        return self._call("step", sessions, turns)

    def _call(self, method: str, sessions: list[RemoteSession], args: list[Any]) -> list[Any]:
        """``method`` on every actor at once, each with its sessions; the replies in ``sessions``' order."""
        import ray

        mine: dict[int, list[int]] = {}
        for k, s in enumerate(sessions):
            mine.setdefault(s.actor, []).append(k)
        refs = {
            a: getattr(self.actors[a], method).remote([sessions[k].id for k in ks], [args[k] for k in ks])
            for a, ks in mine.items()
        }
        out: list[Any] = [None] * len(sessions)
        for a, ks in mine.items():
            replies, errors = ray.get(refs[a])
            for k, reply, error in zip(ks, replies, errors, strict=True):
                out[k], sessions[k].error = reply, error
        return out

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


def remote_pool(
    cfg: EnvConfig, verifier: str, private: tuple[str, ...], run_dir: Path, say: Any
) -> RemotePool:
    """An ``EnvActor`` on each of the ``env.nodes`` environment nodes; where they run goes to env.json."""
    import ray

    actor_cls = ray.remote(num_cpus=0, resources={ENV_RESOURCE: 1})(EnvActor)
    plugins = os.environ.get("HPCRL_PLUGINS", "")
    actors = [actor_cls.remote(cfg, verifier, private, plugins) for _ in range(cfg.nodes)]
    where = ray.get([a.where.remote() for a in actors])
    (run_dir / "env.json").write_text(json.dumps({"name": cfg.name, "actors": where}, indent=1))
    say(f"environments ({cfg.name}) on {', '.join(w['host'] for w in where)}")
    return RemotePool(actors)
