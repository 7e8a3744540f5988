"""Checkpoints: every trainer rank writes its own shards; the driver writes the loop state and commits
the directory once every rank has finished. No model or optimizer tensor passes through the driver.

    checkpoints/step_000010.tmp/   being written: resume never reads it, the next save removes it
    checkpoints/step_000010/       committed (renamed into place as the last act):
        trainer/      torch.distributed.checkpoint shards: one __<rank>_0.distcp a trainer rank,
                      and .metadata (where each chunk of each tensor lies)
        loop.pt       the driver's loop state: step, prompt-stream position, RNG states
        model.json    the model, backend and layout that wrote it (resume and export check it)
        hf/           the model's config, generation config and tokenizer (export copies them)
        manifest.json every other file's size and CRC-32 (each rank sums its own shards as it writes them)
        meta.json     step and metrics (with the rename, the commit marker)

A resume takes the newest checkpoint that verifies against its manifest (sizes of every file, checksums
of all but the shards, whose full check is ``hpcrl export``'s), saying which it skipped and why.

Saves may be async (``checkpoint.async_save``): the ranks copy their state to host memory and write
it in the background while the next step runs; ``settle`` waits for them and commits.

A save that fails for space or permission (``DISK_FAULTS``, on any rank) removes its ``.tmp`` and keeps
the previous checkpoints: an async save says so in one line and the run goes on (the next period saves
again; ``faults/save_failures`` counts them); a sync save (the last, or a stop's) ends the run in one line.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from hpcrl.core.files import crc32_of
from hpcrl.errors import HpcrlError

HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
)
"""What a Hugging Face directory holds besides weights: copied into ``hf/`` of every checkpoint."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    metric: float | None
    higher_is_better: bool = True
    """How ``metric`` ranks (meta.json; checkpoints written before it was recorded: higher)."""

    @property
    def score(self) -> float:
        """Larger is better, whichever way the metric ranks; no metric ranks last."""
        value = float(self.metric) if self.metric is not None else float("-inf")
        return value if self.higher_is_better else -value

    def about(self) -> dict[str, Any]:
        """model.json: what wrote it (empty for a checkpoint without one)."""
        path = self.path / "model.json"
        return dict(json.loads(path.read_text())) if path.exists() else {}


class Shards(Protocol):
    """What a checkpoint asks of the trainer ranks (``Fleet``; a recording fake in the tests)."""

    def save_checkpoint(self, path: str, async_save: bool) -> float: ...
    def finish_checkpoint(self) -> float: ...


class CheckpointManager:
    def __init__(
        self,
        root: Path,
        keep_top_k: int,
        metric: str,
        higher_is_better: bool,
        about: dict[str, Any] | None = None,
        model_dir: Path | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        """``about``: written as model.json; ``model_dir``: the model whose HF_FILES go into hf/;
        ``say``: where a failed async save's line goes."""
        self.root, self.keep, self.metric, self.higher = root, keep_top_k, metric, higher_is_better
        self.about, self.model_dir, self.say = about or {}, model_dir, say
        self.pending: tuple[int, Path, dict[str, float], bool] | None = None
        self.failures = 0
        """Saves lost to a full or unwritable disk (``faults/save_failures``)."""
        root.mkdir(parents=True, exist_ok=True)

    def save(
        self,
        step: int,
        shards: Shards,
        loop_state: dict[str, Any],
        metrics: dict[str, float],
        async_save: bool,
    ) -> float:
        """Start checkpoint ``step``: the ranks write their shards (async: in the background) and the
        driver its loop state; committed now (sync) or by ``settle``. Seconds the caller was blocked."""
        blocked = self.settle(shards)
        tmp = self._fresh_tmp(step)
        try:
            tmp.mkdir(parents=True)
            blocked += shards.save_checkpoint(str(tmp / "trainer"), async_save)
            torch.save(loop_state, tmp / "loop.pt")
            (tmp / "model.json").write_text(json.dumps(self.about, indent=1))
            self._copy_hf_files(tmp / "hf")
        except Exception as exc:
            self._failed(step, tmp, exc, async_save)
            return blocked
        self.pending = (step, tmp, metrics, async_save)
        return blocked + (0.0 if async_save else self.settle(shards))

    def _fresh_tmp(self, step: int) -> Path:
        """Where checkpoint ``step`` is written: earlier partial directories removed first; one that
        cannot be (a read-only file in it) is left aside under another name rather than block the save."""
        for stale in self.root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f"step_{step:06d}.tmp"
        return tmp if not tmp.exists() else self.root / f"step_{step:06d}.{os.getpid()}.tmp"

    def _failed(self, step: int, tmp: Path, exc: Exception, async_save: bool) -> None:
        """A save of ``step`` failed: its partial directory goes; a full or unwritable disk is one
        line (async: said, and the run goes on; sync: raised); anything else is raised as it came."""
        partial = tree_bytes(tmp)
        fault = disk_fault(exc) or self._full(tmp, partial)
        shutil.rmtree(tmp, ignore_errors=True)
        if fault is None:
            raise exc
        line = no_room_line(tmp, step, fault, self._needed(partial))
        if not async_save:
            self.say(f"{line}: the run stops here; {DISK_FIX}")  # a line of its own in the driver log
            raise HpcrlError(f"{line}: the run stops here; {DISK_FIX}") from None
        self.failures += 1
        self.say(f"{line}: the run goes on and saves again at the next period; {DISK_FIX}")

    def _full(self, tmp: Path, partial: int) -> OSError | None:
        """A full disk whose error lost its errno on the way (DCP's zip writer raises "unexpected
        pos"): the filesystem itself says, with less free than the rest of a checkpoint needs."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return None
        latest = self.latest()
        rest = (tree_bytes(latest.path) if latest is not None else 0) - partial
        if free >= max(rest, 1 << 20):
            return None
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    def _needed(self, partial: int) -> str:
        """Bytes one checkpoint takes: the last committed one's, else at least what was written."""
        latest = self.latest()
        if latest is not None:
            return f"{tree_bytes(latest.path):,} bytes needed"
        return f"at least {partial:,} bytes needed"

    def settle(self, shards: Shards) -> float:
        """Wait for the checkpoint in flight (if any) and commit it; the seconds waited."""
        if self.pending is None:
            return 0.0
        step, tmp, metrics, async_save = self.pending
        self.pending = None
        try:
            return self._commit(shards, step, tmp, metrics)
        except Exception as exc:
            self._failed(step, tmp, exc, async_save)
            return 0.0

    def _commit(self, shards: Shards, step: int, tmp: Path, metrics: dict[str, float]) -> float:
        waited = shards.finish_checkpoint()  # raises if a rank failed (``_failed`` takes it)
        meta = {
            "step": step,
            "metric_name": self.metric,
            "metric": metrics.get(self.metric),
            "metrics": metrics,
        }
        write_manifest(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        final = self.root / f"step_{step:06d}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return waited

    def _copy_hf_files(self, out: Path) -> None:
        out.mkdir()
        for name in HF_FILES:
            if self.model_dir is not None and (self.model_dir / name).exists():
                shutil.copy2(self.model_dir / name, out / name)

    def list(self) -> list[CheckpointInfo]:
        return committed(self.root)

    def latest(self) -> CheckpointInfo | None:
        found = self.list()
        return max(found, key=lambda c: c.step) if found else None

    def resumable(
        self, say: Callable[[str], None], skip: frozenset[Path] = frozenset()
    ) -> CheckpointInfo | None:
        """The newest committed checkpoint that verifies (``verify``) and is not in ``skip``; each
        newer one passed over gets one line saying why."""
        for info in sorted(self.list(), key=lambda c: c.step, reverse=True):
            problem = "it failed to load" if info.path in skip else verify(info.path)
            if not problem:
                return info
            say(f"checkpoint {info.path.name} skipped: {problem}")
        return None

    def _score(self, c: CheckpointInfo) -> float:
        value = float(c.metric) if c.metric is not None else float("-inf")
        return value if self.higher else -value

    def best(self) -> CheckpointInfo | None:
        scored = [c for c in self.list() if c.metric is not None]
        return max(scored, key=self._score) if scored else None

    def _prune(self) -> None:
        found = self.list()
        if len(found) <= self.keep:
            return
        latest = max(found, key=lambda c: c.step)
        scored = sorted((c for c in found if c.metric is not None), key=self._score, reverse=True)
        keep = {c.path for c in scored[: self.keep]} | {latest.path}  # the latest always stays, for resume
        for c in found:
            if c.path not in keep:
                shutil.rmtree(c.path, ignore_errors=True)


def committed(root: Path) -> list[CheckpointInfo]:
    """The committed checkpoints under ``root`` (meta.json present, not .tmp), in step order."""
    out = []
    for path in sorted(root.glob("step_*")):
        if path.suffix == ".tmp" or not (path / "meta.json").exists():
            continue
        try:
            meta = json.loads((path / "meta.json").read_text())
        except ValueError:
            continue  # not committed whole (meta.json is written before the rename): never resumed
        higher = bool(meta.get("higher_is_better", True))
        out.append(CheckpointInfo(path, int(meta["step"]), meta.get("metric"), higher))
    return out


def best_or_latest(root: Path) -> CheckpointInfo | None:
    """The best committed checkpoint by its recorded metric and direction, else the latest."""
    found = committed(root)
    scored = [c for c in found if c.metric is not None]
    if scored:
        return max(
            scored, key=lambda c: float(c.metric or 0) if c.higher_is_better else -float(c.metric or 0)
        )
    return found[-1] if found else None


def load_loop_state(info: CheckpointInfo) -> dict[str, Any]:
    return dict(torch.load(info.path / "loop.pt", weights_only=False))


def check_resumable(info: CheckpointInfo, now: dict[str, Any], weights_only: bool = False) -> str:
    """'' when this run can resume ``info`` as it was written, else a line saying how the layout
    changes (the shards are resharded on load). Raises with one line naming both sides when the
    checkpoint is of another model or backend (no format maps those), or holds another optimizer's
    state than ``weights_only`` lets this run start afresh."""
    if not (info.path / "model.json").exists():
        raise HpcrlError(
            f"checkpoint {info.path} was written by an older hpcrl (one gathered state.pt, no per-rank "
            "shards) and cannot be resumed: point checkpoint.dir or run.dir elsewhere to start fresh"
        )
    was = info.about()
    for key in ("model", "backend"):
        if was.get(key) != now.get(key):
            raise HpcrlError(
                f"checkpoint {info.path} was written for model={was.get('model')} trainer={was.get('backend')}; "
                f"this run is model={now.get('model')} trainer={now.get('backend')}: point checkpoint.dir "
                "elsewhere (or run.dir to a new run directory) to start fresh"
            )
    # (checkpoints from before trainer.optimizer existed hold AdamW's)
    was_opt, now_opt = was.get("optimizer", "adamw"), now.get("optimizer", "adamw")
    if was_opt != now_opt and not weights_only:
        raise HpcrlError(
            f"checkpoint {info.path} holds trainer.optimizer={was_opt} state; this run is "
            f"trainer.optimizer={now_opt}: set checkpoint.resume_weights_only=true to start its state "
            f"afresh, or trainer.optimizer={was_opt}"
        )
    if was.get("layout") != now.get("layout"):
        return f"resharding {info.path.name}: written by {was.get('layout')}, loaded as {now.get('layout')}"
    return ""


DISK_FAULTS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})
"""A save's failures that are the filesystem's (space, quota, permission), not the run's."""
DISK_FIX = (
    "free space there, lower checkpoint.keep_top_k, or set checkpoint.dir to a larger, writable filesystem"
)


def disk_fault(exc: BaseException) -> OSError | None:
    """The space or permission error behind ``exc``, if any: raised here, or on a rank and carried
    by Ray (``cause``) or torch.distributed.checkpoint (``failures``: each rank's)."""
    todo: list[Any] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FAULTS:
            return e
        todo += [getattr(e, "cause", None), getattr(e, "__cause__", None), getattr(e, "__context__", None)]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [getattr(f, "exc", f) for f in failures.values()]
    return None


def no_room_line(tmp: Path, step: int, fault: OSError, needed: str) -> str:
    """One line: which save failed, where (the file, else the checkpoint being written), why, the bytes
    it needs and those free."""
    where = Path(fault.filename) if fault.filename else tmp
    try:
        free = f"{shutil.disk_usage(tmp.parent).free:,} free"
    except OSError:
        free = "free space unknown"
    why = os.strerror(fault.errno) if fault.errno is not None else str(fault)
    return f"checkpoint step_{step:06d} not saved: {why} at {where} ({needed}, {free})"


def tree_bytes(path: Path) -> int:
    """The bytes of every file under ``path`` (0 when it is gone)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


MANIFEST = "manifest.json"
SIDECAR = ".crc_*.json"
"""A rank's record of the shards it wrote (``trainer/shards.py``), merged into the manifest at commit."""


def write_manifest(tmp: Path) -> None:
    """Every file of the checkpoint being committed with its size and CRC-32: the shards' from their
    ranks' records (no shard is read again here), the rest summed now (small files)."""
    files: dict[str, dict[str, int]] = {}
    for sidecar in sorted((tmp / "trainer").glob(SIDECAR)):
        for name, entry in json.loads(sidecar.read_text()).items():
            files[f"trainer/{name}"] = entry
        sidecar.unlink()
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        rel = path.relative_to(tmp).as_posix()
        if rel not in files:
            files[rel] = {"size": path.stat().st_size, "crc32": crc32_of(path)}
    (tmp / MANIFEST).write_text(json.dumps(files, indent=0))


def verify(path: Path, deep: bool = False) -> str:
    """'' when the checkpoint at ``path`` is whole, else what is wrong, in a few words: every file of
    its manifest present at its recorded size, the checksums of all but the shards (``deep``: of the
    shards too, a read of the whole checkpoint). One written before manifests: its key files present."""
    manifest = path / MANIFEST
    if not manifest.exists():
        missing = [f for f in ("loop.pt", "trainer/.metadata") if not (path / f).exists()]
        return f"{missing[0]} is missing" if missing else ""
    try:
        files = json.loads(manifest.read_text())
    except ValueError:
        return f"{MANIFEST} is unreadable"
    for rel, entry in files.items():
        file = path / rel
        if not file.exists():
            return f"{rel} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{rel} is {size:,} bytes, {entry['size']:,} when committed"
        if (deep or not rel.endswith(".distcp")) and crc32_of(file) != entry["crc32"]:
            return f"{rel} does not match its checksum (changed since it was committed)"
    return ""
