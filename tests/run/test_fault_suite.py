"""bench/fault_suite.py through its entry point, with its two cheapest cases (real reward processes,
seconds): the table it prints has their rows, each saying the run stops in one line. The other cases
are the slow tests' own runs (tests/run, tests/data, tests/envs), which the suite reuses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_the_suite_prints_a_row_for_each_case_it_runs(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/fault_suite.py", "--only", "plugin_no_start,all_errors"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HPCRL_CACHE": str(tmp_path)},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = done.stdout.split("| fault |", 1)[1].splitlines()
    rows = [line for line in table if line.startswith("| ") and not line.startswith("|---")]
    assert len(rows) == 2, table
    start, errors = rows
    assert "fails to start" in start and "stops in one line: `reward process for verifier" in start
    assert "'sympy_extras'" in start and "(MULTI-LINE)" not in start
    assert "failed on all 16 samples of a batch, the first with ValueError" in errors
    assert "2 cases in" in done.stdout
