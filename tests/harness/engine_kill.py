"""The real loop (local Ray, vLLM CPU engines, the FSDP2 trainer, math-verify workers) with rollout
engines SIGKILLed mid-generation; tests/run/test_engine_kill.py reads what it writes.

    python tests/harness/engine_kill.py OUT_DIR ENGINES KILLS [override ...]

ENGINES engines (a local run has one: the others start beside it, in the first one's slot, with as many
rollout units for Ray). KILLS (e.g. ``2,t3,4``): in those training generate calls, the engine that
handed over the first group is killed right after it (``rollout.max_num_seqs`` = the group size: its
other prompts are still to come); ``sN``: that engine is stopped instead (SIGSTOP: it hangs);
``tN``: engine 0 is killed as train step N begins; ``rN``: trainer rank 0 is (the run stops; run the
harness again on OUT_DIR, with ``-`` for KILLS, to resume); ``fN``: engine 0 is killed inside the
refit to version N, after the engines paused and before the weights go out; ``hN``: stopped there
(SIGSTOP: it hangs in the refit). OUT_DIR/calls.json: per
training call, the trainers' version when it began and every completion's stamped versions;
OUT_DIR/refits.json: per weight sync, its version and wall seconds; OUT_DIR/run: the run directory.
Exits 2 with the one line on stderr where the run stops on an ``HpcrlError``, as the CLI does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpcrl.config.compose import compose_config
from hpcrl.errors import HpcrlError
from hpcrl.plan.planner import make_plan
from hpcrl.run import fleet as fleet_module
from hpcrl.run.actors import ROLLOUT_RESOURCE, TRAIN_RESOURCE
from hpcrl.run.driver import run_loop
from hpcrl.run.fleet import Fleet
from hpcrl.run.slots import Slots, plan_slots


def connect(engines: int) -> Any:
    def start(scratch: Path) -> None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import ray

        ray.init(
            num_cpus=os.cpu_count() or 1,
            num_gpus=0,
            resources={TRAIN_RESOURCE: 1, ROLLOUT_RESOURCE: engines},
            include_dashboard=False,
            _temp_dir=str(scratch / "ray"),
            _node_ip_address="127.0.0.1",
            configure_logging=False,
        )

    return start


def watched(fleet: Fleet, kills: dict[int, int], calls: list[dict[str, Any]]) -> Any:
    """``fleet.generate_stream``, recording versions and killing an engine in the ``kills`` calls."""
    generate = fleet.generate_stream

    def generate_stream(prompts: list[Any], settings: Any) -> Any:
        if settings.temperature == 0.0:  # validation
            yield from generate(prompts, settings)
            return
        call = {"version": fleet.version, "versions": [], "killed": None}
        calls.append(call)
        for part in generate(prompts, settings):
            if len(calls) in kills and call["killed"] is None:
                engine = part[0][0] % len(fleet.engines)  # all engines are up when a call begins: i::k
                kill(fleet, engine, kills[len(calls)])
                call["killed"] = engine
            call["versions"] += [list(c.versions) for _, group in part for c in group]
            yield part

    return generate_stream


def kill(fleet: Fleet, engine: int, sig: int = signal.SIGKILL) -> None:
    os.kill([w for w in fleet.placement if w["role"] == "rollout"][engine]["pid"], sig)


def killing_trains(fleet: Fleet, steps: set[int], rank_steps: set[int]) -> Any:
    """``fleet.train_step``, killing engine 0 as the ``steps``-th train steps begin (trainer rank 0
    as the ``rank_steps``-th do)."""
    train_step, taken = fleet.train_step, [0]

    def train(batch: Any, lr: float | None = None) -> dict[str, float]:
        taken[0] += 1
        if taken[0] in steps:
            kill(fleet, 0)
        if taken[0] in rank_steps:
            os.kill(next(w for w in fleet.placement if w["role"] == "train")["pid"], signal.SIGKILL)
        return train_step(batch, lr)

    return train


def killing_refits(fleet: Fleet, versions: dict[int, int], refits: list[dict[str, Any]]) -> Any:
    """``fleet.sync_weights``, timed; in the refits to ``versions`` engine 0 is sent that signal (once
    each) when the refit itself begins (engines paused; in the first try, before the weights go out)."""
    sync, run = fleet.sync_weights, fleet.refit.run

    def refit_run(trainers: Any, engines: Any) -> Any:
        if refits and refits[-1]["version"] in versions and not refits[-1]["killed"]:
            refits[-1]["killed"] = True
            kill(fleet, 0, versions[refits[-1]["version"]])
            time.sleep(0.5)  # gone (its sockets closed) before the first bucket goes out
        return run(trainers, engines)

    def sync_weights(version: int) -> dict[str, float]:
        refits.append({"version": version, "killed": False})
        start = time.perf_counter()
        out = sync(version)
        refits[-1]["seconds"] = time.perf_counter() - start
        return out

    fleet.refit.run = refit_run  # type: ignore[method-assign]
    return sync_weights


def main() -> int:
    out, engines = Path(sys.argv[1]), int(sys.argv[2])
    kills = {
        int(k.lstrip("s")): signal.SIGSTOP if k[0] == "s" else signal.SIGKILL
        for k in sys.argv[3].split(",")
        if k[0] not in "trfh-"
    }
    train_kills = {int(k[1:]) for k in sys.argv[3].split(",") if k.startswith("t")}
    rank_kills = {int(k[1:]) for k in sys.argv[3].split(",") if k.startswith("r")}
    refit_kills = {
        int(k[1:]): signal.SIGSTOP if k[0] == "h" else signal.SIGKILL
        for k in sys.argv[3].split(",")
        if k[0] in "fh"
    }
    plan = make_plan(compose_config(sys.argv[4:]))
    (out / "run").mkdir(parents=True, exist_ok=True)
    calls: list[dict[str, Any]] = []  # a resume's calls go to calls-resumed.json
    refits: list[dict[str, Any]] = []
    start = Fleet.start.__func__  # type: ignore[attr-defined]

    def more_slots(*args: Any, **kwargs: Any) -> Slots:
        """The one local slot's engine ``engines`` times, in one wave: they start together."""
        slots = plan_slots(*args, **kwargs)
        return replace(slots, engines=slots.engines * engines, waves=[list(range(engines))])

    def start_more(cls: type[Fleet], *args: Any, **kwargs: Any) -> Fleet:
        fleet = start(cls, *args, **kwargs)
        fleet.generate_stream = watched(fleet, kills, calls)  # type: ignore[method-assign]
        fleet.train_step = killing_trains(fleet, train_kills, rank_kills)  # type: ignore[method-assign]
        fleet.sync_weights = killing_refits(fleet, refit_kills, refits)  # type: ignore[method-assign]
        return fleet

    fleet_module.plan_slots = more_slots
    Fleet.start = classmethod(start_more)  # type: ignore[method-assign, assignment]
    try:
        run_loop(plan, out / "run", connect(engines), slurm=False)
    except HpcrlError as exc:
        print(f"hpcrl: error: {exc}", file=sys.stderr)
        return 2
    finally:
        resumed = "-resumed" if (out / "calls.json").exists() else ""
        (out / f"calls{resumed}.json").write_text(json.dumps(calls))
        (out / f"refits{resumed}.json").write_text(json.dumps(refits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
