"""``hpcrl export CHECKPOINT --out DIR [--dtype bf16|fp32]``: a Hugging Face model directory from a
training checkpoint (run/checkpoint.py's layout), for either backend.

It streams: the DCP shards are read one layer at a time (no process group, no GPU: a login node
will do), turned into the checkpoint names the model was loaded from, cast, and written into
safetensors files of at most 5 GB with ``model.safetensors.index.json``. Weights the trainer did
not hold (a vision tower and projector the megatron backend leaves frozen in the engines, a
multi-token-prediction block) are copied unchanged from the source model directory named in
model.json, so the export is the whole model. config.json, generation_config.json and the
tokenizer come from the checkpoint's ``hf/``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from hpcrl.errors import HpcrlError

SHARD_BYTES = 5 * 10**9
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LAYER = re.compile(r"layers\.(\d+)\.")


def resolve(path: Path) -> Path:
    """A step directory as given; a run directory or its checkpoints/ directory: its best checkpoint
    (by the run's metric and direction), else its latest."""
    from hpcrl.run.checkpoint import best_or_latest

    if (path / "meta.json").exists():
        return whole(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = best_or_latest(root)
    if found is None:
        raise HpcrlError(f"{path}: no committed checkpoint there (a step_NNNNNN/ directory with meta.json)")
    return whole(found.path)


def whole(ckpt: Path) -> Path:
    """``ckpt`` once every file of it matches its manifest, shards summed too (they are read next
    anyway); else one line naming the file and the intact checkpoints beside it."""
    from hpcrl.run.checkpoint import committed, verify

    problem = verify(ckpt, deep=True)
    if not problem:
        return ckpt
    others = [c.path.name for c in committed(ckpt.parent) if c.path != ckpt and not verify(c.path)]
    hint = f"; intact beside it: {', '.join(others)}" if others else ""
    raise HpcrlError(f"checkpoint {ckpt} is damaged: {problem}{hint}")


def export(checkpoint: Path, out: Path, dtype: str = "bf16", log: Callable[[str], None] = print) -> Path:
    ckpt = resolve(Path(checkpoint))
    if not (ckpt / "model.json").exists():
        raise HpcrlError(f"{ckpt} has no model.json: it predates sharded checkpoints and cannot be exported")
    about = json.loads((ckpt / "model.json").read_text())
    log(f"exporting {ckpt} ({about['backend']}, {about['model']}) to {out} in {dtype}")
    try:
        files = write_export(ckpt / "trainer", about, ckpt / "hf", out, dtype, log)
    except (EOFError, RuntimeError, OSError) as exc:  # damage in a checkpoint older than its manifest
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise HpcrlError(f"checkpoint {ckpt} could not be read ({type(exc).__name__}: {first})") from exc
    log(f"wrote {files} safetensors file(s), the config and the tokenizer to {out}")
    return out


def write_export(
    trainer_dir: Path, about: dict[str, Any], hf_dir: Path, out: Path, dtype: str, log: Callable[[str], None]
) -> int:
    """The export of one checkpoint's shards; ``hf_dir`` holds the model's config and tokenizer
    (model.json's ``source``: its weights, for those the trainer did not hold)."""
    from hpcrl.run.checkpoint import HF_FILES

    source = Path(about.get("source", ""))
    tensors = hf_tensors(trainer_dir, about["backend"], hf_dir, source)
    files = write_sharded(with_untrained(tensors, source, hf_dir, log), out, DTYPES[dtype])
    for name in HF_FILES:
        if (hf_dir / name).exists():
            shutil.copy2(hf_dir / name, out / name)
    _set_dtype(out / "config.json", dtype)
    return files


def hf_tensors(
    trainer_dir: Path, backend: str, hf_dir: Path, source: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """The trained weights under the source checkpoint's names, one layer at a time."""
    from hpcrl.trainer.backends import TRAINERS

    spec = TRAINERS[backend]
    convert = spec.hf_names(hf_dir, source)
    reader, prefix = DCPReader(trainer_dir), spec.checkpoint_prefix
    for group in reader.groups(prefix):
        yield from convert(reader.read(group, prefix)).items()


class DCPReader:
    """A DCP checkpoint's tensors read whole, a few at a time, without a process group."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.path = path
        self.meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata

    def groups(self, prefix: str) -> list[list[str]]:
        """Keys under ``prefix`` by decoder layer, in layer order; the rest (embeddings, norms, head)
        last. Padding rows (``#pad/``) left out: they are not part of the model."""
        by_layer: dict[int, list[str]] = {}
        for key in self.meta:
            if key.startswith(prefix) and "#pad/" not in key and hasattr(self.meta[key], "size"):
                m = LAYER.search(key)
                by_layer.setdefault(int(m.group(1)) if m else 1 << 30, []).append(key)
        return [by_layer[i] for i in sorted(by_layer)]

    def read(self, keys: list[str], prefix: str) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        state = {k: torch.empty(self.meta[k].size, dtype=self.meta[k].properties.dtype) for k in keys}
        dcp.load(state, checkpoint_id=str(self.path), no_dist=True)
        return {k.removeprefix(prefix): v for k, v in state.items()}


def with_untrained(
    tensors: Iterator[tuple[str, torch.Tensor]], source: Path, hf_dir: Path, log: Callable[[str], None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors``, then every tensor of the source model the trainer did not hold (read one at a
    time from its safetensors)."""
    from hpcrl.trainer.hf_checkpoint import HFCheckpoint

    seen = set()
    for name, t in tensors:
        seen.add(name)
        yield name, t
    if not list(source.glob("*.safetensors")):
        log(f"source model {source} not found: weights the trainer did not hold are not in the export")
        return
    tied = _tied(hf_dir)
    with HFCheckpoint(source) as src:
        left = [n for n in src.names() if n not in seen and not (tied and n.endswith("lm_head.weight"))]
        if left:
            log(f"copying {len(left)} weights the trainer did not train from {source} (e.g. {left[0]})")
        for name in left:
            yield name, src.get(name)


def _tied(hf_dir: Path) -> bool:
    config = json.loads((hf_dir / "config.json").read_text())
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def write_sharded(
    tensors: Iterator[tuple[str, torch.Tensor]], out: Path, dtype: torch.dtype, limit: int = SHARD_BYTES
) -> int:
    """Safetensors files of at most ``limit`` bytes (a bigger single tensor gets a file of its own)
    and the index; holds one file's worth at a time. Returns the number of files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = []
    batch: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal batch, size
        if batch:
            save_file(batch, str(out / f".part-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            shards.append(list(batch))
            batch, size = {}, 0

    for name, t in tensors:
        t = (t.to(dtype) if t.is_floating_point() else t).contiguous()
        if size and size + t.nbytes > limit:
            flush()
        batch[name], size, total = t, size + t.nbytes, total + t.nbytes
    flush()
    return _name_shards(out, shards, total)


def _name_shards(out: Path, shards: list[list[str]], total: int) -> int:
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (out / f".part-{i:05d}.safetensors").replace(out / final)
        weight_map |= dict.fromkeys(names, final)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return n


def _set_dtype(config_path: Path, dtype: str) -> None:
    config = json.loads(config_path.read_text())
    name = "bfloat16" if dtype == "bf16" else "float32"
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = name
    config_path.write_text(json.dumps(config, indent=2))
