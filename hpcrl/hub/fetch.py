"""The downloads behind ``hpcrl fetch`` (``hpcrl/tools/fetch.py``) and a ``model.fetch=job`` run: what a
run needs, into the site's Hugging Face cache.

The model (safetensors shards and index, config, generation config, tokenizer and processor files) and
each ``hf:`` data set split the config names go into ``<HF_HOME>/hub`` through huggingface_hub, which
shows a progress bar, retries a broken transfer from where it stopped (in 10 MiB chunks) and keeps every
file it finished when the command is interrupted (a second run fetches only the rest; a half-written
file is never moved into the cache). ``HF_TOKEN`` (gated models) is read from the environment by
huggingface_hub and never written anywhere. The job then resolves the same commit offline
(``hpcrl/hub/resolve.py``).
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.errors import ConfigError, HpcrlError
from hpcrl.hub.files import model_files, split_files
from hpcrl.hub.resolve import cached_snapshot, parse_hf_source, write_ref

if TYPE_CHECKING:
    from hpcrl.config.schema import RunConfig


@dataclass(frozen=True)
class Fetched:
    what: str
    """'model org/name' or 'data hf:org/name (split train)'."""
    commit: str
    revision: str
    files: int
    nbytes: int
    fetched: int
    """Files downloaded by this call (0: everything was already there)."""
    path: Path

    def line(self) -> str:
        state = (
            f"fetched {self.fetched} of {self.files} files"
            if self.fetched
            else f"already there ({self.files} files)"
        )
        return f"{self.what}: {state}, {size_text(self.nbytes)}, revision {self.revision} = {self.commit[:12]}  {self.path}"


def size_text(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def wanted_sources(cfg: RunConfig) -> list[tuple[str, str, str]]:
    """(key, source, split) of each ``hf:`` data set split the run reads."""
    data = cfg.data
    out = [("data.source", data.source, data.split)]
    if data.val_source:
        out.append(("data.val_source", data.val_source, data.val_split))
    return [item for item in out if item[1].startswith("hf:")]


def fetch_model(
    hub: Path, repo: str, revision: str | None, say: Callable[[str], None], *, gguf: str | None = None
) -> Fetched:
    revision = revision or "main"
    if gguf:  # shipped in a package: converted here, no hub involved
        from hpcrl.hub.gguf import convert_gguf

        commit, path, converted = convert_gguf(hub, repo, revision, gguf, say)
        files = [p for p in path.iterdir() if p.is_file()]
        nbytes = sum(p.stat().st_size for p in files)
        return Fetched(
            f"model {repo} (from {gguf})", commit, revision, len(files), nbytes, len(files) * converted, path
        )
    api = _api()
    listing = _hub_call(lambda: _listing(api, repo, "model", revision), f"model.hf_id={repo}", revision)
    commit, sizes = listing
    shards = None
    if "model.safetensors.index.json" in sizes:  # fetched first: it says which shards are the model
        shards = _index_shards(hub, repo, commit)
    wanted = model_files(list(sizes), shards)
    if not any(name.endswith(".safetensors") for name in wanted):
        raise ConfigError(
            f"model.hf_id={repo} (revision {revision}) has no .safetensors weights at its top level; "
            "hpcrl loads safetensors only (convert the checkpoint, or point model.hf_id at a local directory)"
        )
    return _download(hub, repo, "model", revision, commit, wanted, sizes, f"model {repo}", say)


def fetch_split(hub: Path, source: str, split: str, key: str, say: Callable[[str], None]) -> Fetched:
    repo, subset = parse_hf_source(source)
    api = _api()
    commit, sizes = _hub_call(lambda: _listing(api, repo, "dataset", "main"), f"{key}={source}", "main")
    card = None
    if "README.md" in sizes:
        from huggingface_hub import hf_hub_download

        card_path = _hub_call(
            lambda: hf_hub_download(repo, "README.md", repo_type="dataset", revision=commit, cache_dir=hub),
            f"{key}={source}",
            "main",
        )
        card = Path(card_path).read_text()
    try:
        files = split_files(list(sizes), split, subset, card)
    except ConfigError as exc:
        raise ConfigError(f"{key}={source}: {exc}") from None
    if not files:
        raise ConfigError(f"{key}={source} has no .parquet/.jsonl/.json files for split '{split}' on the hub")
    wanted = files + (["README.md"] if card is not None else [])
    label = f"data {source} (split {split})"
    return _download(hub, repo, "dataset", "main", commit, wanted, sizes, label, say)


def _download(
    hub: Path,
    repo: str,
    kind: str,
    revision: str,
    commit: str,
    wanted: list[str],
    sizes: dict[str, int],
    label: str,
    say: Callable[[str], None],
) -> Fetched:
    from huggingface_hub import snapshot_download

    nbytes = sum(sizes.get(name, 0) for name in wanted)
    before = cached_snapshot(hub, repo, kind, commit)
    todo = before.missing(wanted) if before else wanted
    if todo:
        say(f"{label}: fetching {len(todo)} of {len(wanted)} files ({size_text(nbytes)} in all)")
        started = time.perf_counter()
        # by commit: huggingface_hub then leaves refs/ alone; the ref is written below, once complete
        _hub_call(
            lambda: snapshot_download(
                repo, repo_type=kind, revision=commit, cache_dir=hub, allow_patterns=wanted, max_workers=8
            ),
            label,
            revision,
        )
        say(f"{label}: done in {time.perf_counter() - started:.0f}s")
    after = cached_snapshot(hub, repo, kind, commit)
    if after is None or after.missing(wanted):
        raise HpcrlError(
            f"{label}: the cache at {hub} is still incomplete after fetching; run `hpcrl fetch` again"
        )
    try:  # the job resolves the revision through refs/
        write_ref(hub, repo, kind, revision, commit)
    except OSError as exc:
        raise ConfigError(
            f"{label}: cannot write to the cache {hub} ({exc.strerror}); check cluster.env.HF_HOME"
        ) from None
    return Fetched(label, commit, revision, len(wanted), nbytes, len(todo), after.path)


def _index_shards(hub: Path, repo: str, commit: str) -> list[str]:
    from huggingface_hub import hf_hub_download

    index = _hub_call(
        lambda: hf_hub_download(repo, "model.safetensors.index.json", revision=commit, cache_dir=hub),
        f"model.hf_id={repo}",
        commit,
    )
    return sorted(set(json.loads(Path(index).read_text()).get("weight_map", {}).values()))


def _api() -> Any:
    from huggingface_hub import HfApi

    return HfApi()


def _listing(api: Any, repo: str, kind: str, revision: str) -> tuple[str, dict[str, int]]:
    """The commit ``revision`` names on the hub and the repository's files with their sizes."""
    from huggingface_hub.hf_api import RepoFile

    info = api.repo_info(repo, repo_type=kind, revision=revision)
    tree = api.list_repo_tree(repo, repo_type=kind, revision=info.sha, recursive=True)
    return str(info.sha), {f.path: int(f.size) for f in tree if isinstance(f, RepoFile)}


def _hub_call(call: Callable[[], Any], what: str, revision: str) -> Any:
    """``call()``, with the hub's errors as one line naming ``what`` and the fix."""
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return call()
    except GatedRepoError:
        raise ConfigError(
            f"{what} is gated: accept its terms on the hub with your account, then `export HF_TOKEN=...` in "
            "this shell (hpcrl never writes it to a file)"
        ) from None
    except RepositoryNotFoundError:
        token = " (or private: export HF_TOKEN)" if not os.environ.get("HF_TOKEN") else ""
        raise ConfigError(
            f"{what}: no such repository on {constants.ENDPOINT}{token}; check the id"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(f"{what}: the hub has no revision '{revision}' (model.revision)") from None
    except HfHubHTTPError as exc:
        raise HpcrlError(
            f"{what}: the hub answered {exc.response.status_code} ({constants.ENDPOINT})"
        ) from None
    except OSError as exc:
        if exc.errno in _LOCAL_ERRNOS:  # the cache's filesystem, not the network
            raise ConfigError(
                f"{what}: cannot write to the cache ({exc.strerror}: {exc.filename or ''}); check "
                "cluster.env.HF_HOME: a shared directory you can write, with space for the model"
            ) from None
        raise _unreachable(what, exc, constants.ENDPOINT) from None
    except (httpx2.TransportError, LocalEntryNotFoundError) as exc:
        raise _unreachable(what, exc, constants.ENDPOINT) from None


_LOCAL_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def _unreachable(what: str, exc: Exception, endpoint: str) -> HpcrlError:
    return HpcrlError(
        f"{what}: cannot reach {endpoint} ({type(exc).__name__}: {str(exc)[:160]}); "
        "hpcrl fetch runs where the hub is reachable (a login node); what finished is kept, run it again"
    )
