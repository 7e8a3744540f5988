"""Run model-written Python in a sandbox: no network, bounded CPU, memory, output and time, a scratch
working directory, no environment variables of the run, and the run directory and home hidden.

The sandbox is a fresh network and mount namespace (``unshare --net --mount``; as a user without root,
also a user namespace that maps it to root inside): only a loopback that is down, so nothing is
reachable; each private path has an empty read-only tmpfs mounted over it, so the run's checkpoints,
logs and the home's credentials read as an empty directory. ``setrlimit`` bounds the code's CPU
seconds, address space, file sizes (its output goes to a file under the limit, so a print loop cannot
fill the caller's memory) and open files; a wall-clock limit kills its whole process group. Where a
namespace cannot be made (no ``unshare``, user namespaces off), the tool refuses to start
(``SandboxUnavailable``) rather than run code unsandboxed.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from hpcrl.errors import HpcrlError


class SandboxUnavailable(HpcrlError):
    """This machine cannot make the sandbox's namespaces."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    """Killed (the whole process group) after this long."""
    cpu_s: int = 5
    """``RLIMIT_CPU``: the kernel kills a busy loop after this many CPU seconds."""
    memory_mb: int = 512
    """``RLIMIT_AS``: an allocation past it fails (``MemoryError``)."""
    output_bytes: int = 4096
    """What the model reads back of the output: its last bytes (the rest is cut)."""
    file_mb: int = 16
    """``RLIMIT_FSIZE``: no file (the output file included) grows past it."""


@dataclass(frozen=True)
class RunResult:
    output: str
    """stdout and stderr together, the last ``Limits.output_bytes`` of them."""
    exit_code: int
    timed_out: bool


_PYTHON = os.path.realpath(sys.executable)
"""The interpreter itself, not a virtual environment's link to it: the code needs only the standard
library, and the environment's packages stay out of its reach."""


def _unshare_args() -> list[str]:
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", "--net", "--mount", *user]


@cache
def sandbox_problem() -> str | None:
    """Why the sandbox cannot run here (one line), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"the Python tool's sandbox needs Linux namespaces; this is {sys.platform}"
    if shutil.which("unshare") is None:
        return "the Python tool's sandbox needs `unshare` (util-linux) on PATH; install it on the nodes"
    probe = subprocess.run([*_unshare_args(), "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        why = probe.stderr.strip().splitlines()[-1:] or ["no message"]
        return (
            f"the Python tool's sandbox cannot make a network namespace ({why[0]}); run as root or "
            "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)"
        )
    return None


def require_sandbox() -> None:
    if (problem := sandbox_problem()) is not None:
        raise SandboxUnavailable(problem)


_HIDE = (
    'py="$1"; shift; for d in "$@"; do '
    'if [ -d "$d" ]; then mount -t tmpfs -o ro,size=4k,mode=0555 hidden "$d" || exit 97; '
    'elif [ -e "$d" ]; then mount --bind /dev/null "$d" || exit 97; fi; done; '
    'exec "$py" -I -B code.py'
)
"""Inside the namespaces: an empty directory over each private directory, /dev/null over each private
file, then the code (``-I``: no PYTHON* variables, no user site; ``-B``: no bytecode files)."""


def hidden_paths(private: tuple[str, ...], keep: str) -> list[str]:
    """What to cover so that ``private`` cannot be read, except the way down to ``keep`` (the Python
    installation the code runs on, often under the home directory): a private directory above ``keep``
    is not covered itself, its other entries are, level by level."""
    out: list[str] = []
    keep_path = Path(keep).resolve()
    for p in (Path(x).resolve() for x in private):
        if not p.exists():
            continue
        if p != keep_path and p in keep_path.parents:
            entries = tuple(str(c) for c in sorted(p.iterdir()) if c != keep_path)
            out += hidden_paths(entries, keep) if entries else []
        elif p != keep_path and keep_path not in p.parents:
            out.append(str(p))
    return out


def run_python(code: str, limits: Limits, private: tuple[str, ...] = ()) -> RunResult:
    """Run ``code`` in the sandbox with ``private`` directories hidden; its output and exit code."""
    require_sandbox()
    scratch = Path(tempfile.mkdtemp(prefix="hpcrl-tool-"))
    try:
        (scratch / "code.py").write_text(code)
        out_path = scratch / "output"
        with out_path.open("wb") as out:
            proc = subprocess.Popen(
                [
                    *_unshare_args(),
                    "/bin/sh",
                    "-c",
                    _HIDE,
                    "sh",
                    _PYTHON,
                    *hidden_paths(private, sys.base_prefix),
                ],
                cwd=scratch,
                env={"PATH": "/usr/bin:/bin", "HOME": str(scratch), "LANG": "C.UTF-8"},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a timeout kills what it forked too
                preexec_fn=lambda: _limit(limits),
            )
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc)
        with out_path.open("rb") as f:  # the end: where a traceback says what went wrong
            f.seek(max(0, out_path.stat().st_size - limits.output_bytes))
            output = f.read().decode("utf-8", errors="replace")
        return RunResult(output, proc.returncode, timed_out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _limit(limits: Limits) -> None:
    """In the child before exec: the kernel's limits (inherited by the shell and the code)."""
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
