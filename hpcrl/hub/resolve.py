"""Offline resolution: a hub id and revision to the snapshot directory ``hpcrl fetch`` left in the cache,
and a data set split to its files there. No network and no huggingface_hub import: the checks before
submit run it on the login node in milliseconds, and the job runs it with ``HF_HUB_OFFLINE=1``.

The cache is huggingface_hub's: ``<hub>/<models|datasets>--org--name/refs/<revision>`` holds the commit,
``snapshots/<commit>/`` the files, ``trees/<commit>.json`` the repository's whole file list at that
commit (written by huggingface_hub when it fetched), which says what a complete snapshot holds.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hpcrl.errors import ConfigError
from hpcrl.hub.files import index_shards, missing_shards, model_files, split_files

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
FETCH_HINT = "run `hpcrl fetch` with this command's overrides on a login node (it fills the cache)"


@dataclass(frozen=True)
class Snapshot:
    repo: str
    kind: str
    """'model' or 'dataset'."""
    revision: str
    commit: str
    path: Path
    listing: list[str]
    """The repository's files at ``commit`` (the cached tree; the files present when there is none)."""

    def missing(self, wanted: list[str]) -> list[str]:
        return [name for name in wanted if not (self.path / name).is_file()]


def repo_folder(hub: Path, repo: str, kind: str) -> Path:
    return hub / f"{kind}s--{repo.replace('/', '--')}"


def write_ref(hub: Path, repo: str, kind: str, revision: str, commit: str) -> None:
    """Point ``refs/<revision>`` at ``commit``, atomically (a job reading it never sees half a ref); only
    once the snapshot is complete, so a ref never names a partial one."""
    if revision == commit:
        return
    ref = repo_folder(hub, repo, kind) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)


def cached_snapshot(hub: Path, repo: str, kind: str, revision: str | None) -> Snapshot | None:
    """The cached snapshot of ``repo`` at ``revision`` (None: main), or None when the cache has none."""
    revision = revision or "main"
    folder = repo_folder(hub, repo, kind)
    commit = revision if _COMMIT.match(revision) else _read(folder / "refs" / revision)
    if not commit or not (folder / "snapshots" / commit).is_dir():
        return None
    path = folder / "snapshots" / commit
    tree = folder / "trees" / f"{commit}.json"
    try:
        listing = sorted(json.loads(tree.read_text())["files"])
    except (OSError, ValueError, KeyError):
        listing = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    return Snapshot(repo, kind, revision, commit, path, listing)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def model_snapshot(hub: Path, repo: str, revision: str | None) -> Path:
    """The directory of a fetched, complete model; a ConfigError naming what is missing otherwise."""
    snap = cached_snapshot(hub, repo, "model", revision)
    where = f"model.hf_id={repo} (revision {revision or 'main'})"
    if snap is None:
        raise ConfigError(f"{where} is not in the Hugging Face cache {hub}: {FETCH_HINT}")
    missing = snap.missing(model_files(snap.listing, index_shards(snap.path))) or missing_shards(snap.path)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ConfigError(
            f"{where} is incomplete in the cache {hub} (commit {snap.commit[:12]}: {shown} missing): {FETCH_HINT}"
        )
    if not (snap.path / "config.json").is_file():
        raise ConfigError(
            f"{where} at commit {snap.commit[:12]} has no config.json: it is not a model repository"
        )
    return snap.path


def parse_hf_source(source: str) -> tuple[str, str | None]:
    """``hf:org/name`` or ``hf:org/name:subset`` -> (repo id, subset)."""
    body = source.removeprefix("hf:")
    repo, _, subset = body.partition(":")
    return repo, subset or None


def dataset_files(hub: Path, source: str, split: str, key: str = "data.source") -> list[Path]:
    """The cached files of one split of an ``hf:`` data set; a ConfigError naming ``key`` otherwise."""
    repo, subset = parse_hf_source(source)
    snap = cached_snapshot(hub, repo, "dataset", None)
    if snap is None:
        raise ConfigError(f"{key}={source} is not in the Hugging Face cache {hub}: {FETCH_HINT}")
    wanted = split_for(snap, split, subset, source, key)
    missing = snap.missing(wanted)
    if missing:
        raise ConfigError(
            f"{key}={source} split '{split}' is incomplete in the cache {hub} ({', '.join(missing[:3])} "
            f"missing): {FETCH_HINT}"
        )
    return [snap.path / name for name in wanted]


def split_for(snap: Snapshot, split: str, subset: str | None, source: str, key: str) -> list[str]:
    """The files of ``split`` in a snapshot's listing (the card, README.md, read from the snapshot)."""
    card = _read(snap.path / "README.md") if "README.md" in snap.listing else None
    try:
        files = split_files(snap.listing, split, subset, card)
    except ConfigError as exc:
        raise ConfigError(f"{key}={source}: {exc}") from None
    if not files:
        raise ConfigError(
            f"{key}={source} has no data files for split '{split}' (.parquet/.jsonl/.json); "
            f"files: {', '.join(snap.listing[:8])}{' ...' if len(snap.listing) > 8 else ''}"
        )
    return files
