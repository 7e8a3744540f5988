"""Reward worker pool: verifiers run in separate processes with a hard per-sample time limit.

An adversarial completion that makes SymPy spin, or a verifier that crashes its process, costs
that one sample (scored as timeout/error, counted apart) and a worker restart, never the run.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass
from typing import Any

from hpcrl.rewards.verifiers import Outcome, Verdict, get_verifier


@dataclass(frozen=True)
class Task:
    index: int
    completion: str
    answer: str
    prompt: str


def _worker(verifier_name: str, plugins: str, tasks: Any, results: Any, worker_id: int) -> None:
    import logging

    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeouts are off
    for module in filter(None, plugins.split(",")):
        importlib.import_module(module)
    verify = get_verifier(verifier_name)
    while True:
        task = tasks.get()
        if task is None:
            return
        results.put(("start", worker_id, task.index, time.monotonic()))
        try:
            verdict = verify(task.completion, task.answer, task.prompt)
        except Exception:
            verdict = Verdict(Outcome.error)
        results.put(("done", worker_id, task.index, verdict.outcome.value))


class RewardPool:
    def __init__(self, verifier: str, workers: int = 2, timeout_s: float = 5.0) -> None:
        get_verifier(verifier)  # fail here, in the caller, on an unknown name
        self.verifier, self.size, self.timeout_s = verifier, workers, timeout_s
        self.plugins = os.environ.get("HPCRL_PLUGINS", "")
        self.ctx = mp.get_context("spawn")  # no fork of a process that holds torch/Ray threads
        self.tasks: Any = self.ctx.Queue()
        self.results: Any = self.ctx.Queue()
        self.procs: dict[int, Any] = {}
        self.next_id = 0
        self.restarts = 0
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        wid = self.next_id
        self.next_id += 1
        proc = self.ctx.Process(
            target=_worker, args=(self.verifier, self.plugins, self.tasks, self.results, wid), daemon=True
        )
        proc.start()
        self.procs[wid] = proc

    def score(self, tasks: list[Task]) -> list[Outcome]:
        outcomes: dict[int, Outcome] = {}
        running: dict[int, tuple[int, float]] = {}  # worker -> (task index, started)
        for task in tasks:
            self.tasks.put(task)
        while len(outcomes) < len(tasks):
            try:
                kind, wid, index, value = self.results.get(timeout=0.2)
                if kind == "start":
                    running[wid] = (index, value)
                elif index not in outcomes:
                    outcomes[index] = Outcome(value)
                    running.pop(wid, None)
            except queue.Empty:
                pass
            now = time.monotonic()
            for wid, (index, started) in list(running.items()):
                dead = not self.procs[wid].is_alive()
                if now - started > self.timeout_s or dead:
                    self.procs.pop(wid).kill()
                    running.pop(wid)
                    outcomes.setdefault(index, Outcome.error if dead else Outcome.timeout)
                    self.restarts += 1
                    self._spawn()
        return [outcomes[t.index] for t in tasks]

    def close(self) -> None:
        for _ in self.procs:
            self.tasks.put(None)
        for proc in self.procs.values():
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
        self.procs.clear()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
