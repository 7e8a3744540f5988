"""``cluster=local`` on whatever this machine is: ``cluster.gpu: auto`` becomes the GPU this machine
shows (its name, memory and, from the catalog, its bf16 peak), or ``cpu`` where it shows none.

The same recipe then runs on a laptop's CPU and on a workstation's GPU without a cluster key typed: the
planner turns engine sleep, the KV block size and the memory check to the GPU's figures, and the run's
actors ask Ray for the GPU (``run/fleet.py``). A local run places one trainer rank and one engine
(``cluster.gpus_per_node`` stays 1), on the first GPU ``CUDA_VISIBLE_DEVICES`` shows.

``nvidia-smi`` is asked, not torch: planning stays torch-free and fast (a machine without the tool
costs one ``PATH`` lookup). ``CUDA_VISIBLE_DEVICES=`` (empty) keeps a GPU machine on its CPU;
``cluster.gpu=cpu`` or a named GPU on the command line skips the probe. ``HPCRL_LOCAL_GPU=H200:141``
(name:GB, or ``cpu``) answers for the probe: plan a one-GPU recipe from a laptop for the workstation it
will run on (the tests plan such shipped recipes so on a CPU-only CI machine).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from hpcrl.config.cluster import ClusterConfig, Scheduler
from hpcrl.errors import ConfigError

AUTO = "auto"
OVERRIDE = "HPCRL_LOCAL_GPU"
PROBE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class LocalGpu:
    name: str
    """As nvidia-smi names it, less the vendor ("H200")."""
    memory_gb: float
    """Total memory in GB (1e9 bytes)."""


def resolve_local_gpu(cluster: ClusterConfig, conf: Path | None = None) -> None:
    """In place: ``cluster.gpu == "auto"`` becomes this machine's GPU (``gpu``, ``gpu_memory_gb``,
    ``gpu_bf16_tflops`` from the catalog cluster of that GPU, if any) or ``cpu``. Anything else is left
    alone, so calling it twice is harmless."""
    if cluster.gpu.strip().lower() != AUTO:
        return
    if cluster.scheduler is not Scheduler.local:
        raise ConfigError(
            f"cluster.gpu=auto is for cluster=local (this machine); cluster '{cluster.name}' must name its GPU"
        )
    told = os.environ.get(OVERRIDE)
    gpu = stated(told) if told else probe(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if gpu is None:
        cluster.gpu = "cpu"
        return
    cluster.gpu = gpu.name
    cluster.gpu_memory_gb = gpu.memory_gb
    if not cluster.gpu_bf16_tflops:
        cluster.gpu_bf16_tflops = catalog_tflops(gpu.name, conf)


def stated(value: str) -> LocalGpu | None:
    """``HPCRL_LOCAL_GPU``: ``NAME:GB`` (``H200:141``) or ``cpu``."""
    if value.strip().lower() == "cpu":
        return None
    name, _, gb = value.rpartition(":")
    try:
        memory_gb = float(gb)
    except ValueError:
        memory_gb = 0.0
    if not name.strip() or memory_gb <= 0:
        raise ConfigError(f"{OVERRIDE}={value} must be NAME:GB (e.g. H200:141) or cpu")
    return LocalGpu(name.strip(), memory_gb)


@cache
def probe(visible: str | None) -> LocalGpu | None:
    """The first GPU ``visible`` (``CUDA_VISIBLE_DEVICES``; None: all) lets a process see, from
    nvidia-smi; None without the tool, without a GPU, or with ``visible`` empty."""
    if (visible is not None and not visible.strip()) or visible in ("-1", "none", "NoDevFiles"):
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    cmd = [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    if visible is not None:
        cmd += ["-i", visible.split(",")[0].strip()]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_smi(out)


def parse_smi(out: str) -> LocalGpu | None:
    """nvidia-smi's first ``name, memory.total`` line (MiB) -> LocalGpu."""
    for line in out.splitlines():
        name, _, mib = line.rpartition(",")
        try:
            memory_gb = round(float(mib) * 2**20 / 1e9, 1)
        except ValueError:
            continue
        return LocalGpu(re.sub(r"^NVIDIA\s+", "", name.strip()), memory_gb)
    return None


def catalog_tflops(name: str, conf: Path | None = None) -> float:
    """The bf16 peak of the catalog cluster whose GPU this is (its ``gpu:`` a word of ``name``: "H200"
    in "H200", "H100" in "H100 80GB HBM3"); 0 where none is (MFU figures then read 0)."""
    if conf is None:
        from hpcrl.config.paths import conf_dir

        conf = conf_dir()
    words = set(re.split(r"[\s-]+", name.upper()))
    for path in sorted((conf / "cluster").glob("*.yaml")):
        text = path.read_text()
        gpu = re.search(r"^gpu:\s*(\S+)", text, re.M)
        peak = re.search(r"^gpu_bf16_tflops:\s*([\d.]+)", text, re.M)
        if gpu and peak and gpu.group(1).upper() in words:
            return float(peak.group(1))
    return 0.0
