"""Slurm's time syntax (``cluster.slurm.time``, ``cluster.rollout_node.time``)."""

from __future__ import annotations

import re

from hpcrl.errors import ConfigError

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_slurm_time(text: str, key: str = "cluster.slurm.time") -> int:
    """Slurm time string to whole minutes (rounded up); raises ConfigError naming ``key`` on anything else."""
    match = _TIME.match(text.strip())
    if not match:
        raise ConfigError(f"{key}='{text}' is not a Slurm time; use MM, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = match.groups()
    if days is not None or c is not None:  # D-HH[:MM[:SS]] or HH:MM:SS
        hours, minutes, seconds = int(a), int(b or 0), int(c or 0)
    elif b is not None:  # MM:SS
        hours, minutes, seconds = 0, int(a), int(b)
    else:  # MM
        hours, minutes, seconds = 0, int(a), 0
    total = int(days or 0) * 1440 + hours * 60 + minutes + (1 if seconds else 0)
    if total <= 0:
        raise ConfigError(f"{key}='{text}' must be longer than zero")
    return total
