"""``Fleet.sleep_engines`` on local Ray with engines that never go to sleep (``rollout.sleep``; vLLM's
CPU build has none, so tests/run/test_engine_kill.py's runs cannot carry it); tests/run/test_engine_faults.py
reads what it prints.

    python tests/harness/sleep_hang.py

``Sleeper`` is a stand-in for the rollout engine actor (``run/actors.py``'s ``RolloutActor``), named as
such: real Ray actors in their own processes, whose ``sleep`` blocks for ever from its ``hang_from``-th
call on; the other calls a refit makes of an engine return at once. The refit's weight transfer is a
stand-in too (``NoWeights``): the engines hold none. What is real is the fleet's side: the bounded wait,
the kill, the rebuild before the refit, the count and the bound. One JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

from hpcrl.run.engine_faults import EngineFailed, EngineFaults
from hpcrl.run.fleet import Fleet
from hpcrl.run.refit import Refit

LIMIT_S = 1.0
"""``rollout.hang_timeout_s`` here: the test waits about this long for each hung engine."""


class Sleeper:
    """Stand-in for a rollout engine actor: its ``hang_from``-th ``sleep`` (0: none) never returns."""

    def __init__(self, hang_from: int) -> None:
        self.hang_from, self.sleeps = hang_from, 0

    def where(self) -> dict[str, Any]:
        return {"role": "rollout", "host": "localhost", "pid": os.getpid()}

    def sleep(self) -> None:
        self.sleeps += 1
        while self.sleeps == self.hang_from:
            time.sleep(60)

    def slept(self) -> int:
        return self.sleeps

    def pause_generation(self) -> None: ...
    def wake_up(self, tags: list[str]) -> None: ...
    def resume_generation(self, version: int) -> None: ...


class NoWeights(Refit):
    """Stand-in for the weight transfer: the sleepers hold no weights."""

    def run(self, trainers: list[Any], engines: list[Any]) -> dict[str, float]:
        self.last = {"engines": float(len(engines))}
        return self.last


def main() -> None:
    import ray

    scratch = tempfile.mkdtemp(prefix="hpcrl-")  # short: Ray's socket names have a length limit
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        _temp_dir=scratch,
        _node_ip_address="127.0.0.1",
    )
    actor = ray.remote(num_cpus=0)(Sleeper)
    # engine 0 hangs going to sleep; rebuilt, it goes to sleep (the rebuild puts it to sleep as the
    # others are), and hangs the next time
    spawned = [actor.remote(1), actor.remote(0)]

    def spawn(i: int) -> Any:
        spawned.append(actor.remote(2))
        return spawned[-1]

    fleet = Fleet([], spawned[:2], placement=ray.get([a.where.remote() for a in spawned[:2]]))
    fleet.refit, fleet.sleep, fleet.spawn = NoWeights("object_store", "gloo", 1), True, spawn
    fleet.faults = EngineFaults(max_restarts=1, hang_timeout_s=LIMIT_S)
    out: dict[str, Any] = {}
    start = time.monotonic()
    fleet.sleep_engines()
    out["first_s"] = time.monotonic() - start
    out["down"] = dict(fleet.faults.down)
    out["asleep"] = fleet.asleep
    try:
        ray.get(spawned[0].where.remote(), timeout=30)
        out["hung_killed"] = False
    except ray.exceptions.RayActorError:
        out["hung_killed"] = True
    out["refit"] = fleet.sync_weights(1)  # the lost engine rebuilt first, then the refit
    out["rebuilt"] = fleet.engines[0] is spawned[2] and not fleet.faults.down
    out["after_refit"] = {"asleep": fleet.asleep, "version": fleet.version}
    out["rebuilt_slept"] = ray.get(fleet.engines[0].slept.remote())  # put to sleep, then woken
    start = time.monotonic()
    try:
        fleet.sleep_engines()  # the rebuilt engine 0 hangs too: one failure past the bound
    except EngineFailed as exc:
        out["stopped"] = str(exc)
    out["second_s"] = time.monotonic() - start
    print(json.dumps(out))
    ray.shutdown()
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
