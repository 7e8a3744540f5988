"""run/engine_faults.py's scheduling without Ray: engines as threads that hand over groups, die
after their first, or hang until killed. Each completion names the engine and the weights version
that made it, so a test sees where every prompt went and that nothing of a lost engine's unfinished
prompts survives. The real engines on Ray: tests/run/test_engine_kill.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from hpcrl.rollout.base import Completion
from hpcrl.run import engine_faults
from hpcrl.run.engine_faults import EngineFailed, EngineFaults, dispatch


class Engines:
    """``behaviour[e]``: "ok", "dies" (after its first group), "hangs" (after its first group, until
    killed). A revived engine is "ok" and holds ``version`` + 1."""

    def __init__(self, *behaviour: str) -> None:
        self.behaviour = list(behaviour)
        self.version = [0] * len(behaviour)
        self.killed: list[int] = []
        self.revived: list[int] = []
        self.causes: list[str] = []
        self.released = threading.Event()

    def start(self, e: int, idx: list[int], call: int) -> Iterator[list[tuple[int, list[Completion]]]]:
        for j, p in enumerate(idx):
            if j == 1 and self.behaviour[e] == "dies":
                raise RuntimeError("The actor died unexpectedly before finishing this task.\nActorDiedError")
            if j == 1 and self.behaviour[e] == "hangs":
                self.released.wait()
                return
            v = self.version[e]
            yield [(j, [Completion([p], [0.0], f"engine{e}", False, (v, v))])]

    def kill(self, e: int) -> str:
        self.killed.append(e)
        self.released.set()  # a killed engine's stream ends (its late parts must be ignored)
        return f"node{e}"

    def revive(self, faults: EngineFaults) -> list[int]:
        down = sorted(faults.down)
        for e in down:
            self.causes.append(faults.down.pop(e))
            self.behaviour[e], self.version[e] = "ok", self.version[e] + 1
        self.revived += down
        return down


def run(engines: Engines, n: int, faults: EngineFaults) -> dict[int, Completion]:
    got: dict[int, Completion] = {}
    live = [e for e in range(len(engines.behaviour)) if e not in faults.down]
    for part in dispatch(n, live, engines.start, engines.kill, lambda: engines.revive(faults), faults):
        for i, group in part:
            assert i not in got, f"prompt {i} handed over twice"
            got[i] = group[0]
    assert sorted(got) == list(range(n))
    assert all(c.token_ids == [i] for i, c in got.items())
    return got


@pytest.fixture(autouse=True)
def quick_poll(monkeypatch):
    monkeypatch.setattr(engine_faults, "POLL_S", 0.05)


def test_without_faults_each_engine_takes_its_share_and_nothing_is_counted():
    faults = EngineFaults(max_restarts=0, hang_timeout_s=60)
    got = run(Engines("ok", "ok"), 6, faults)
    assert {i: c.text for i, c in got.items()} == {i: f"engine{i % 2}" for i in range(6)}
    assert faults.metrics() == {"faults/engine_restarts": 0.0, "faults/lost_groups": 0.0}


def test_a_dead_engines_unfinished_prompts_go_to_the_survivor_which_it_leaves_down_until_the_refit():
    engines, faults = Engines("ok", "dies"), EngineFaults(max_restarts=1, hang_timeout_s=60)
    got = run(engines, 8, faults)
    # engine 1 had 1, 3, 5, 7 and finished 1: the other three come from engine 0, at the same version
    assert [i for i, c in got.items() if c.text == "engine1"] == [1]
    assert {c.versions for c in got.values()} == {(0, 0)}
    assert engines.killed == [1] and engines.revived == []  # rebuilt at the refit, not mid-batch
    assert faults.down.keys() == {1} and "ActorDiedError" in faults.down[1]
    assert faults.metrics() == {"faults/engine_restarts": 1.0, "faults/lost_groups": 3.0}
    assert faults.metrics()["faults/engine_restarts"] == 0.0  # counted once


def test_a_hung_engine_is_killed_and_a_lone_engine_comes_back_at_once_with_the_version_it_got():
    engines, faults = Engines("hangs"), EngineFaults(max_restarts=1, hang_timeout_s=0.2)
    got = run(engines, 4, faults)
    assert engines.killed == [0] and engines.revived == [0]
    assert got[0].versions == (0, 0) and {got[i].versions for i in (1, 2, 3)} == {(1, 1)}
    assert engines.causes == ["no group finished for rollout.hang_timeout_s=0.2 s"] and not faults.down
    assert faults.metrics()["faults/lost_groups"] == 3.0


def test_past_the_bound_the_error_names_the_node_and_the_cause():
    engines, faults = Engines("ok", "dies"), EngineFaults(max_restarts=0, hang_timeout_s=60)
    with pytest.raises(EngineFailed) as err:
        run(engines, 4, faults)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("rollout engine 1 on node1 failed (RuntimeError: ActorDiedError)")
    assert "rollout.max_engine_restarts=0" in line


def test_when_every_engine_is_lost_all_come_back_at_once_and_share_what_is_left():
    engines, faults = Engines("dies", "dies"), EngineFaults(max_restarts=2, hang_timeout_s=60)
    got = run(engines, 8, faults)
    assert sorted(engines.killed) == [0, 1] and engines.revived == [0, 1]
    assert {got[i].text for i in (0, 1)} == {"engine0", "engine1"} and got[0].versions == (0, 0)
    # the six unfinished prompts, spread over both rebuilt engines at their new version
    assert {got[i].text for i in range(2, 8)} == {"engine0", "engine1"}
    assert {got[i].versions for i in range(2, 8)} == {(1, 1)}
    assert faults.metrics() == {"faults/engine_restarts": 2.0, "faults/lost_groups": 6.0}


@pytest.mark.slow  # a local Ray (10-20 s)
def test_an_engine_that_never_goes_to_sleep_is_lost_rebuilt_before_the_refit_and_bounded():
    """``Fleet.sleep_engines`` on local Ray (tests/harness/sleep_hang.py: real actors, a stand-in for the
    engine whose ``sleep`` never returns): the wait is bounded by ``rollout.hang_timeout_s`` (1 s), the
    hung engine is marked lost and killed, the next refit rebuilds it (asleep, as the others) and
    counts the restart; when it hangs again, one past ``rollout.max_engine_restarts=1``, the fleet
    raises ``EngineFailed`` (the driver saves and stops) after the same bound."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/harness/sleep_hang.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    cause = "hung going to sleep: no answer to its sleep in rollout.hang_timeout_s=1 s"
    assert out["down"] == {"0": cause}
    assert out["asleep"]
    assert out["hung_killed"]
    assert out["first_s"] >= 1.0  # waited the bound; not for ever: the harness' own timeout (120 s)
    assert out["refit"]["faults/engine_restarts"] == 1.0
    assert out["rebuilt"]
    assert out["rebuilt_slept"] == 1
    assert out["after_refit"] == {"asleep": False, "version": 1}
    assert out["stopped"] == (
        f"rollout engine 0 on localhost failed ({cause}): 2 engine failures in this run, more than "
        "rollout.max_engine_restarts=1"
    )
    assert out["second_s"] >= 1.0
