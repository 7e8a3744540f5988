"""Issue 39: a pod's preStop hook and the driver's side of it (hpcrl/launch/kube_prestop.py), both real, in
threads of this process (no Ray: the slow run in test_kube_driver.py has the driver save and exit 75 on
the hook's request)."""

from __future__ import annotations

import json
import threading
import time

from hpcrl.launch.kube_prestop import EXITED, REQUEST, STOP_DIR, answering_prestop, ask_and_wait, main


def test_no_driver_no_wait(tmp_path, capsys):
    """A debug RayCluster without a driver, or a finished run: the hook returns at once."""
    start = time.monotonic()
    assert main([str(tmp_path), "--wait", "30"]) == 0
    assert capsys.readouterr().out == f"hpcrl preStop: no driver runs in {tmp_path}: nothing to save\n"
    with answering_prestop(tmp_path, lambda pod: None) as exited:
        exited(0, None)
    assert ask_and_wait(tmp_path, 30) == (0, f"no driver runs in {tmp_path}: nothing to save")
    assert time.monotonic() - start < 5
    assert not (tmp_path / STOP_DIR / REQUEST).exists()  # nothing left to stop the next attempt


def test_the_hook_asks_and_returns_once_the_driver_has_saved(tmp_path):
    asked: list[str] = []
    request_seen = threading.Event()

    def ask(pod: str) -> None:
        asked.append(pod)
        request_seen.set()

    def driver() -> None:
        with answering_prestop(tmp_path, ask, poll_s=0.05) as exited:
            assert request_seen.wait(10)
            time.sleep(0.3)  # the step in flight ends, the save is written
            exited(75, 3)

    thread = threading.Thread(target=driver)
    thread.start()
    while not (tmp_path / STOP_DIR / "driver.json").exists():
        time.sleep(0.01)
    code, line = ask_and_wait(tmp_path, 10, poll_s=0.05)
    thread.join()
    assert len(set(asked)) == 1 and line == f"driver exited 75 (saved step 3) after pod {asked[0]}'s request"
    assert code == 0 and json.loads((tmp_path / STOP_DIR / EXITED).read_text()) == {"code": 75, "step": 3}


def test_a_driver_that_never_answers_is_waited_for_no_longer_than_the_bound(tmp_path):
    with answering_prestop(tmp_path, lambda pod: None, poll_s=0.05):
        start = time.monotonic()
        code, line = ask_and_wait(tmp_path, 0.5, poll_s=0.05)
        assert 0.5 <= time.monotonic() - start < 3
    assert code == 1 and line.startswith("the driver did not exit within 0.5 s of pod ")
    # a driver that died in an exception still says so: later hooks do not wait for it
    assert json.loads((tmp_path / STOP_DIR / EXITED).read_text()) == {"code": 1, "step": None}


def test_a_request_of_an_earlier_attempt_does_not_stop_the_next(tmp_path):
    """KubeRay's retry runs the entrypoint again with the same run directory: the old request is gone."""
    stop = tmp_path / STOP_DIR
    stop.mkdir()
    (stop / REQUEST).write_text(json.dumps({"pod": "old-worker", "at": 0}))
    (stop / EXITED).write_text(json.dumps({"code": 75, "step": 2}))
    asked: list[str] = []
    with answering_prestop(tmp_path, asked.append, poll_s=0.05):
        time.sleep(0.3)
        assert not (stop / EXITED).exists()  # a driver runs again: a hook now waits for it
    assert asked == []
