"""Reward schema (``rewards.*``): how the verifier processes run. Which verifier runs is the data set's
choice (``data.verifier``): its answers need that checker."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hpcrl.config.checks import positive
from hpcrl.errors import ConfigError

CPUS_PER_PROCESS = 8
"""One reward process per this many CPUs of the driver's node: the trainer ranks, the engines and Ray
share the node, and scoring a step's samples is a small part of the step."""
MIN_PROCESSES = 2
"""At least two, so that a sample that hangs until its time limit does not stop the others."""
MAX_PROCESSES = 16
"""Each process imports SymPy and math-verify (~0.2 GB, seconds of start-up); more than 16 only add that."""


def available_cpus() -> int:
    """CPUs this process may run on (its affinity: under Slurm, the task's allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        return os.cpu_count() or 1


def default_processes(cpus: int) -> int:
    """Reward processes for a node with ``cpus`` CPUs: one per CPUS_PER_PROCESS, within
    [MIN_PROCESSES, MAX_PROCESSES] (2 on a laptop or the test cluster, 16 on a 192-CPU GPU node)."""
    return max(MIN_PROCESSES, min(MAX_PROCESSES, cpus // CPUS_PER_PROCESS))


@dataclass
class RewardsConfig:
    processes: int | None = None
    """Verifier processes in the reward pool (``hpcrl/rewards/pool.py``) on the driver's node. None:
    derived when the run starts from the CPUs the driver may use (``default_processes``)."""
    timeout_s: float = 5.0
    """Per-sample time limit: a verifier still busy after this long is killed, its process replaced and
    the sample scored as a timeout (counted in ``train/verifier_timeouts``)."""
    start_timeout_s: float = 300.0
    """A reward process that has not started (imported its verifier and built its parsers) by then is
    broken, not slow: the run stops with an error that names the verifier."""

    def process_count(self) -> int:
        """``processes``, or the default for this node's CPUs."""
        return self.processes if self.processes is not None else default_processes(available_cpus())

    def check(self) -> None:
        if self.processes is not None and self.processes < 1:
            raise ConfigError(
                f"rewards.processes={self.processes} must be >= 1 (or null: derived from the node's CPUs)"
            )
        positive("rewards.timeout_s", self.timeout_s)
        positive("rewards.start_timeout_s", self.start_timeout_s)
