"""A driver in the user's shell and the signals that stop it (``run/preempt.py``): real signals sent to
this process. The whole run under them, Ray and all: tests/run/test_embedded.py."""

from __future__ import annotations

import os
import signal

import pytest

from hpcrl.cli import _stoppable
from hpcrl.run.preempt import REQUEST, Preempted, saving_on_signals


@pytest.fixture(autouse=True)
def fresh_request():
    REQUEST.reset()
    yield
    REQUEST.reset()


@pytest.mark.parametrize(
    ("sig", "code", "why"),
    [
        (signal.SIGUSR2, 75, "the scheduler's warning signal"),
        (signal.SIGTERM, 143, "SIGTERM (scancel or kill)"),
        (signal.SIGINT, 130, "SIGINT (Ctrl-C)"),
    ],
)
def test_each_stop_signal_asks_for_a_save_and_names_itself(sig, code, why, capsys):
    before = signal.getsignal(sig)
    with saving_on_signals():
        os.kill(os.getpid(), sig)
        assert REQUEST.asked and REQUEST.signum == sig
        os.kill(os.getpid(), signal.SIGUSR2)  # a later signal does not change what the stop says
        assert REQUEST.signum == sig
    assert signal.getsignal(sig) is before  # put back when the driver ends
    stop = Preempted(7, REQUEST.signum)
    assert (str(stop), stop.exit_code) == (f"stopped after step 7 on {why}; its checkpoint is saved", code)
    assert capsys.readouterr().err.startswith(f"hpcrl: {why}: saving after the current step")


def test_a_second_ctrl_c_stops_at_once():
    with saving_on_signals():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_the_cli_ends_a_stop_in_one_line_with_its_code(capsys):
    def saved() -> int:
        stop = Preempted(3, signal.SIGTERM)
        stop.resume = "run.dir=/runs/x"
        raise stop

    def interrupted() -> int:
        raise KeyboardInterrupt

    assert _stoppable(saved) == 143
    assert capsys.readouterr().err == (
        "hpcrl: stopped after step 3 on SIGTERM (scancel or kill); its checkpoint is saved; "
        "to resume, run again with run.dir=/runs/x\n"
    )
    assert _stoppable(interrupted) == 130
    assert capsys.readouterr().err == (
        "hpcrl: stopped by a second Ctrl-C, without saving the step in progress\n"
    )
    assert _stoppable(lambda: 0) == 0
