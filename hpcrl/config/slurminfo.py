"""What a Slurm cluster says about its partitions, read on the login node for ``hpcrl init``.

Two commands, both readable by any user: ``sinfo -e`` (one line per partition and kind of node:
node count, CPUs, memory, GRES, the node name pattern, the time limit) and ``scontrol show node -o``
(the CPU architecture, which sinfo does not print). The parsers are pure functions of that text;
``read_partitions`` runs the commands.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, replace

SINFO_FORMAT = "%P|%a|%D|%c|%m|%G|%N|%l"
"""partition (``*`` marks the default) | availability | nodes | CPUs | memory MB | GRES | node names | time limit"""


@dataclass(frozen=True)
class Partition:
    """One partition as its most numerous kind of GPU node describes it."""

    name: str
    default: bool
    up: bool
    nodes: int
    """Nodes of this kind in the partition."""
    node_names: str
    """Slurm's compressed pattern, e.g. ``gpu-[001-128]``."""
    cpus: int
    memory_mb: int
    gpus: int
    gpu_type: str
    """GRES type (``h100`` of ``gpu:h100:8``); "" when the site names none."""
    time_limit: str | None
    """Slurm time string; None: no limit."""
    arch: str = ""
    kinds: int = 1
    """Kinds of node in the partition (sinfo lines); the others are left out here."""


def parse_gres(text: str) -> tuple[int, str]:
    """(GPUs, type) of a GRES string: ``gpu:4``, ``gpu:h100:8(S:0-1)``, ``gpu:a100:4,gpu:v100:2``
    (the first type), ``(null)``."""
    for item in text.split(","):
        parts = re.sub(r"\(.*?\)", "", item).strip().split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        count = parts[-1]
        if count.isdigit():
            return int(count), parts[1] if len(parts) == 3 else ""
    return 0, ""


def _number(text: str) -> int:
    """sinfo's ``2000`` or ``250+`` (the smallest of several: ``-e`` avoids them, older sites print them)."""
    digits = text.strip().rstrip("+")
    return int(digits) if digits.isdigit() else 0


def parse_sinfo(text: str) -> list[Partition]:
    """Every line of ``sinfo -h -e -o SINFO_FORMAT``; a partition may have several (kinds of node)."""
    out = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 8:
            continue
        name, avail, nodes, cpus, memory, gres, node_names, limit = fields
        gpus, gpu_type = parse_gres(gres)
        out.append(
            Partition(
                name=name.rstrip("*"),
                default=name.endswith("*"),
                up=avail == "up",
                nodes=_number(nodes),
                node_names=node_names,
                cpus=_number(cpus),
                memory_mb=_number(memory),
                gpus=gpus,
                gpu_type=gpu_type,
                time_limit=None if limit in ("infinite", "UNLIMITED", "n/a") else limit,
            )
        )
    return out


def parse_scontrol(text: str) -> list[dict[str, str]]:
    """Records of ``scontrol show ... -o`` (one a line): ``Key=value`` pairs, where a value may hold
    spaces (``OS=Linux 6.1.0 #1 SMP``) up to the next `` Key=``."""
    records = []
    for line in text.splitlines():
        starts = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.]*)=", line))
        record = {}
        for here, nxt in zip(starts, [*starts[1:], None], strict=True):
            end = nxt.start() if nxt else len(line)
            record[here.group(1)] = line[here.end() : end].strip()
        if record:
            records.append(record)
    return records


def arch_by_partition(nodes: list[dict[str, str]]) -> dict[str, str]:
    """The most common ``Arch`` of each partition's nodes (``scontrol show node -o``)."""
    seen: dict[str, Counter[str]] = {}
    for node in nodes:
        for part in filter(None, node.get("Partitions", "").split(",")):
            seen.setdefault(part, Counter())[node.get("Arch", "")] += 1
    return {part: counts.most_common(1)[0][0] for part, counts in seen.items()}


def gpu_partitions(lines: list[Partition], arch: dict[str, str]) -> list[Partition]:
    """One Partition per partition with GPU nodes: its most numerous kind of GPU node, with its
    architecture and how many kinds it has; the default partition first, then by size."""
    by_name: dict[str, list[Partition]] = {}
    for line in lines:
        by_name.setdefault(line.name, []).append(line)
    out = []
    for name, kinds in by_name.items():
        gpu_kinds = [k for k in kinds if k.gpus]
        if not gpu_kinds:
            continue
        main = max(gpu_kinds, key=lambda k: k.nodes)
        out.append(replace(main, arch=arch.get(name, ""), kinds=len(kinds), default=kinds[0].default))
    return sorted(out, key=lambda p: (not p.default, -p.nodes, p.name))


def have_slurm() -> bool:
    return shutil.which("sinfo") is not None and shutil.which("scontrol") is not None


def read_partitions() -> list[Partition]:
    """The GPU partitions of the cluster this machine submits to (runs sinfo and scontrol)."""
    sinfo = run_slurm(["sinfo", "-h", "-e", "-o", SINFO_FORMAT])
    nodes = run_slurm(["scontrol", "show", "node", "-o"])
    return gpu_partitions(parse_sinfo(sinfo), arch_by_partition(parse_scontrol(nodes)))


def run_slurm(argv: list[str]) -> str:
    """A Slurm command's output; a missing binary, a timeout or a failure is one line."""
    from hpcrl.errors import HpcrlError

    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HpcrlError(f"`{' '.join(argv)}` failed: {exc}") from None
    if done.returncode:
        last = ([line for line in done.stderr.splitlines() if line.strip()] or [f"exit {done.returncode}"])[
            -1
        ]
        raise HpcrlError(f"`{' '.join(argv)}` failed ({last.strip()})")
    return done.stdout
