"""What the job's container sees of the host's files: the mounts the sbatch asks pyxis for, and the check
before submit that every path hpcrl hands the job is among them.

hpcrl hands the job absolute host paths (the run directory, ``HF_HOME``, data files, checkpoints), so a
path works in the container only where it appears at the same path. Inside the container a path resolves
through the mount with the longest destination above it (of two equal destinations, the one listed last:
pyxis mounts them in order); the path is right only when that mount's source is its destination:

- ``/lustre:/lustre``: ``/lustre/a/b`` is ``/lustre/a/b`` inside: under the mount;
- ``/lustre/proj:/data``: ``/lustre/proj/x`` is ``/data/x`` inside, and ``/lustre/proj/x`` is nothing:
  not under a mount (the job would look for the host path);
- ``/lustre:/lustre`` and ``/scratch:/lustre/scratch``: ``/lustre/scratch/x`` is the host's
  ``/scratch/x`` inside: not under a mount, though ``/lustre`` is mounted.

The run directory and the Hugging Face cache are mounted automatically (``src:src``) when they are not
under a site mount; with IMEX (GB200) the channel directory is mounted too, so a channel Slurm assigns
at run time reaches the container.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config.cluster import ClusterConfig
from hpcrl.data.config import is_template_file
from hpcrl.errors import ConfigError
from hpcrl.plan.planner import Plan

IMEX_DIR = "/dev/nvidia-caps-imex-channels"
"""Where the IMEX channels (``channelN``) of a GB200 node live; Slurm's switch/nvidia_imex makes one per job."""

_SCHEME = re.compile(r"^[A-Za-z_][\w-]*:")
"""``hf:...``, ``reasoning_gym:...``: a data source that is not a file path."""


@dataclass(frozen=True)
class Mount:
    """One ``src:dst[:flags]`` entry of ``--container-mounts``, paths normalized."""

    src: str
    dst: str
    entry: str

    @classmethod
    def parse(cls, entry: str) -> Mount:
        src, dst = entry.split(":")[:2]
        return cls(os.path.normpath(src), os.path.normpath(dst), entry)

    @property
    def identity(self) -> bool:
        return self.src == self.dst


def host_path(path: str | Path) -> str:
    """``path`` as the job receives it: absolute (from this directory), ``~`` expanded, symlinks kept
    (the job opens the path as written, so a link that leaves the mounts is not followed here either)."""
    return os.path.normpath(os.path.abspath(os.path.expanduser(str(path))))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def seen_through(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount through which the container sees ``path`` (None: the image's own files)."""
    found = None
    for mount in mounts:
        if _under(path, mount.dst) and (found is None or len(mount.dst) >= len(found.dst)):
            found = mount
    return found


def visible(path: str, mounts: list[Mount]) -> bool:
    """Whether the container sees host ``path`` at the same path."""
    mount = seen_through(path, mounts)
    return mount is not None and mount.identity


def job_mounts(cluster: ClusterConfig, run_dir: Path | None) -> list[str]:
    """``--container-mounts`` entries: the site's, the automatic ones, the IMEX channel directory."""
    entries = [*cluster.container.mounts, *auto_mounts(cluster, run_dir)]
    if cluster.imex.enabled:  # with or without a fixed channel: Slurm may assign one at run time
        entries.append(f"{IMEX_DIR}:{IMEX_DIR}")
    return entries


def auto_mounts(cluster: ClusterConfig, run_dir: Path | None) -> list[str]:
    """``src:src`` for the run directory and the Hugging Face cache, each where the site's mounts do
    not show it as itself. ``run_dir`` None: a command with no run directory of its own."""
    from hpcrl.hub.cache import hf_home

    entries: list[str] = []
    wanted = [host_path(run_dir)] if run_dir is not None else []
    for path in [*wanted, host_path(hf_home(cluster))]:
        if not visible(path, [Mount.parse(e) for e in [*cluster.container.mounts, *entries]]):
            entries.append(f"{path}:{path}")
    return entries


def check_mounts(plan: Plan, run_dir: Path) -> None:
    """With a container image, every path the job opens must be under ``--container-mounts`` (the site's
    and the automatic ones): a ConfigError naming the first that is not, the key that set it and the mount
    to add. Nothing is written; ``run_dir`` need not exist yet."""
    from hpcrl.hub.cache import hf_home

    cluster = plan.cfg.cluster
    if not cluster.container.image:
        return
    mounts = [Mount.parse(e) for e in job_mounts(cluster, run_dir)]
    for key, path in job_paths(plan):
        _check_one(key, host_path(path), mounts)
    home = host_path(hf_home(cluster))
    if f"{home}:{home}" in auto_mounts(cluster, run_dir) and not Path(home).is_dir():
        # pyxis cannot start a container whose mount source is missing: the job would die at once
        where = (
            "cluster.env.HF_HOME" if cluster.env.get("HF_HOME") else "HF_HOME (this shell's, or the default)"
        )
        raise ConfigError(
            f"{where}={home} does not exist, and the job's container mounts it; create it on shared storage "
            f"(mkdir -p {home}) or `hpcrl fetch` into it, or set cluster.env.HF_HOME to your shared cache"
        )


def job_paths(plan: Plan) -> list[tuple[str, str]]:
    """(key, path) of each host path the job opens besides the run directory and the cache."""
    cfg = plan.cfg
    paths = []
    if cfg.checkpoint.enabled and cfg.checkpoint.dir:
        paths.append(("checkpoint.dir", cfg.checkpoint.dir))
    if cfg.data.check_source:  # false: a path only the compute nodes see (the image's own, maybe)
        for key, source in (("data.source", cfg.data.source), ("data.val_source", cfg.data.val_source)):
            if source and source != "synthetic" and not _SCHEME.match(source):
                paths.append((key, source))
        if is_template_file(cfg.data.template):
            paths.append(("data.template", cfg.data.template))
    if Path(cfg.model.hf_id).expanduser().is_dir():
        paths.append(("model.hf_id", cfg.model.hf_id))
    return paths


def _check_one(key: str, path: str, mounts: list[Mount]) -> None:
    mount = seen_through(path, mounts)
    if mount is not None and mount.identity:
        return
    top = _existing_dir(path)
    fix = f"add '{top}:{top}' (or a directory above it: your shared filesystem) to cluster.container.mounts"
    if mount is None:  # not below any destination; below a source, maybe, shown elsewhere
        mount = next((m for m in mounts if _under(path, m.src)), None)
        if mount is None:
            raise ConfigError(f"{key}={path} is not under cluster.container.mounts; {fix}")
        shown = f"shows it at {_rebase(path, mount.src, mount.dst)} inside the container"
    else:
        shown = f"puts the host's {_rebase(path, mount.dst, mount.src)} at that path inside the container"
    raise ConfigError(
        f"{key}={path} is not under cluster.container.mounts as itself: '{mount.entry}' {shown}, and hpcrl "
        f"hands the job host paths; {fix}"
    )


def _rebase(path: str, old: str, new: str) -> str:
    return os.path.normpath(new + "/" + path[len(old.rstrip("/")) :])


def _existing_dir(path: str) -> str:
    """The deepest existing directory at or above ``path`` (a file: its directory), what can be mounted
    now (pyxis refuses a missing mount source); the path itself when nothing below ``/`` exists."""
    p = Path(path)
    while not p.is_dir() and p.parent != p.parent.parent:
        p = p.parent
    return str(p) if p.is_dir() else path
