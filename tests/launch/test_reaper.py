"""The reaper stops its command's whole process group on signals and on the death of its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# A command whose group holds a grandchild, and which ignores SIGTERM so only SIGKILL ends it.
STUBBORN = "trap '' TERM; sleep 300 & echo $! ; wait"


def _start(cmd: str) -> tuple[subprocess.Popen[str], int]:
    reaper = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.launch.reaper", "--", "bash", "-c", cmd],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reaper.stdout is not None
    grandchild = int(reaper.stdout.readline())
    return reaper, grandchild


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie waiting for its parent to reap it is as good as gone
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                return True
        time.sleep(0.05)
    return False


def test_repeated_signals_stop_the_group_and_the_reaper():
    reaper, grandchild = _start(STUBBORN)
    time.sleep(0.5)  # let the reaper install its handlers and enter its loop
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGHUP, signal.SIGTERM):
        reaper.send_signal(sig)
        time.sleep(0.1)
    assert reaper.wait(timeout=15) == 128 + signal.SIGTERM
    assert _gone(grandchild, within_s=5)


def test_command_exit_is_passed_through_and_leftovers_are_stopped():
    reaper, grandchild = _start("sleep 300 & echo $!; exit 7")
    assert reaper.wait(timeout=15) == 7
    assert _gone(grandchild, within_s=5)


def test_parent_death_stops_the_group():
    # The reaper's parent is a shell that exits at once: the reaper must notice and clean up alone.
    shell = subprocess.Popen(
        [
            "bash",
            "-c",
            f"{sys.executable} -m hpcrl.launch.reaper -- bash -c 'sleep 300 & echo child $!; wait' & "
            "echo reaper $!; sleep 1",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert shell.stdout is not None
    pids = dict(shell.stdout.readline().split() for _ in range(2))
    reaper_pid, grandchild = int(pids["reaper"]), int(pids["child"])
    assert shell.wait(timeout=10) == 0
    assert _gone(reaper_pid, within_s=10)
    assert _gone(grandchild, within_s=5)


def test_slurms_warning_signal_leaves_the_reaper_and_its_group_running():
    """USR2 reaches every process of a Slurm step; Ray (the reaper's command) must survive it while
    the driver checkpoints. The grandchild is a Python process: it inherits the ignored signal."""
    reaper, grandchild = _start(f"{sys.executable} -c 'import time; time.sleep(300)' & echo $!; wait")
    time.sleep(0.5)
    for pid in (reaper.pid, grandchild):
        os.kill(pid, signal.SIGUSR2)
    time.sleep(0.5)
    assert reaper.poll() is None and not _gone(grandchild, within_s=0.2)
    reaper.send_signal(signal.SIGTERM)  # the normal stop still works
    assert reaper.wait(timeout=15) == 128 + signal.SIGTERM
    assert _gone(grandchild, within_s=5)


def test_a_watched_process_ending_stops_the_group_though_the_parent_lives():
    """``--watch PID`` (``hpcrl debug --here``): the user's shell leaving stops the command; the reaper's
    own parent (this test) lives on, and so would stop nothing."""
    shell = subprocess.Popen(["sleep", "300"])
    reaper = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpcrl.launch.reaper",
            "--watch",
            str(shell.pid),
            "--grace",
            "1",
            "--",
            "bash",
            "-c",
            STUBBORN,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reaper.stdout is not None
    grandchild = int(reaper.stdout.readline())
    time.sleep(0.5)
    assert reaper.poll() is None  # the watched shell is alive: the command runs
    shell.kill()  # left unreaped for a moment: a zombie has left too
    assert reaper.wait(timeout=15) == 128 + signal.SIGTERM
    assert _gone(grandchild, within_s=5)
    shell.wait()


def test_held_sigterm_leaves_ray_running_and_sigint_stops_it():
    """``--hold-term 1`` (a Slurm job's Ray): scancel's SIGTERM reaches every process of the step; the
    reaper and its command ride it out (the driver is saving), even a grandchild that installs its own
    SIGTERM handler as Ray's processes do; the node task's SIGINT then stops the whole group."""
    handler = "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))"
    cmd = f'{sys.executable} -c "import signal, sys, time; {handler}; time.sleep(300)" & echo $!; wait'
    reaper = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.launch.reaper", "--hold-term", "1", "--", "bash", "-c", cmd],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reaper.stdout is not None
    grandchild = int(reaper.stdout.readline())
    time.sleep(1.0)  # the grandchild's handler is in
    for _ in range(2):  # Slurm signals a cancelled step more than once
        for pid in (reaper.pid, grandchild):
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.3)
    assert reaper.poll() is None and not _gone(grandchild, within_s=0.5)
    reaper.send_signal(signal.SIGINT)
    assert reaper.wait(timeout=15) == 128 + signal.SIGINT
    assert _gone(grandchild, within_s=5)
