"""Prompt data: the synthetic task, reasoning-gym tasks, local JSONL/Parquet files and Hugging Face
datasets by name, mapped to (prompt, answer) pairs through ``data.prompt_field`` / ``data.answer_field``
and a template. A record repeated in a file is one example (DAPO-Math-17k ships each prompt ~100 times)."""

from __future__ import annotations

import json
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.data import procedural
from hpcrl.data.config import DataConfig, is_procedural, record_field
from hpcrl.data.synthetic import synthetic_split
from hpcrl.data.templates import render_prompt
from hpcrl.errors import ConfigError


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    images: tuple[bytes, ...] = ()
    """The prompt's images as encoded files (PNG, JPEG ...: what data sets store), in prompt order."""


IMAGE_MARKER = "<image>"
"""Where geo3k's problems say their image goes; the chat template places images itself."""


def records_to_examples(
    records: list[dict[str, Any]], cfg: DataConfig, source: str, *, validation: bool = False
) -> list[Example]:
    prompt_field = (cfg.val_prompt_field if validation else None) or cfg.prompt_field
    answer_field = (cfg.val_answer_field if validation else None) or cfg.answer_field
    out: dict[Example, None] = {}  # insertion-ordered set: a repeated record is one example
    imageless = 0
    for rec in records:
        problem = record_field(rec, prompt_field, source)
        if isinstance(problem, list):  # chat-style prompt: [{"role": "user", "content": ...}]
            problem = problem[-1]["content"] if problem and isinstance(problem[-1], dict) else str(problem)
        answer = str(record_field(rec, answer_field, source))
        if cfg.answer_after and cfg.answer_after in answer:
            answer = answer.rsplit(cfg.answer_after, 1)[1].strip()
        images: tuple[bytes, ...] = ()
        if cfg.image_field:
            images = image_files(record_field(rec, cfg.image_field, source), cfg.image_field, source)
            problem = str(problem).replace(IMAGE_MARKER, "").strip()
            if not images:  # a batch is all image rows or all text rows: a text row would stop a step
                imageless += 1
                continue
        out[Example(render_prompt(cfg.template, str(problem)), answer, images)] = None
    if imageless:
        warnings.warn(
            f"{source}: {imageless} records have no image in data.image_field={cfg.image_field}; left out",
            stacklevel=2,
        )
    return list(out)


def image_files(value: Any, key: str, source: str) -> tuple[bytes, ...]:
    """A record's images as encoded files: a list of them or one, each raw bytes or a Hugging Face
    ``Image`` cell ({bytes, path}: the bytes, else the file at path)."""
    out = [_image_bytes(item) for item in (value if isinstance(value, list) else [value])]
    for item, data in zip(value if isinstance(value, list) else [value], out, strict=True):
        if not isinstance(data, bytes):
            raise ConfigError(
                f"{source}: data.image_field={key} holds {type(item).__name__}, not image files (bytes or "
                "{bytes, path} cells); point data.image_field at the images column"
            )
    return tuple(out)


def _image_bytes(item: Any) -> Any:
    if isinstance(item, dict):
        return item.get("bytes") or (Path(item["path"]).read_bytes() if item.get("path") else None)
    return item


def read_records(
    source: str, split: str, hub: Path | None = None, fields: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """``hf:`` sources are read from the Hugging Face cache ``hub`` (offline: ``hpcrl fetch`` put them
    there; None: this process's ``HF_HOME``), the files of ``split`` as ``hpcrl/hub/files.py`` picks them.
    ``fields``: the (dotted) fields the run reads; a Parquet file's other columns are not loaded."""
    if source.startswith("hf:"):
        from hpcrl.hub.resolve import dataset_files

        if hub is None:
            from huggingface_hub import constants

            hub = Path(constants.HF_HUB_CACHE)
        return [rec for path in dataset_files(hub, source, split) for rec in read_file(path, fields)]
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"data.source file '{source}' does not exist")
    return read_file(path, fields)


def read_file(path: Path, fields: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        # DAPO-Math-17k's 1.79M rows as Python dicts of every column would take GBs and a minute
        names = set(pq.read_schema(path).names)
        columns = sorted({f.split(".")[0] for f in fields} & names) if fields else None
        return list(pq.read_table(path, columns=columns or None).to_pylist())
    if path.suffix == ".json":
        return list(json.loads(path.read_text()))
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def load_examples(cfg: DataConfig, seed: int, hub: Path | None = None) -> tuple[list[Example], list[Example]]:
    """Training and validation examples; validation is ``val_source`` or a held-out slice. ``hub``: the
    Hugging Face cache ``hf:`` sources are read from (``read_records``)."""
    if cfg.source == "synthetic":
        problems, held_out = synthetic_split(
            num_train=cfg.num_samples or 4096, num_val=cfg.max_val_samples, seed=seed
        )
        return (
            [Example(render_prompt(cfg.template, p.prompt), p.answer) for p in problems],
            [Example(render_prompt(cfg.template, p.prompt), p.answer) for p in held_out],
        )
    if is_procedural(cfg.source):
        train_pairs, val_pairs = procedural.generate(
            cfg.source, cfg.task_options, cfg.prompt_field, cfg.num_samples or 4096, cfg.max_val_samples, seed
        )
        return (
            [Example(render_prompt(cfg.template, q), a) for q, a in train_pairs],
            [Example(render_prompt(cfg.template, q), a) for q, a in val_pairs],
        )
    fields = (cfg.prompt_field, cfg.answer_field, *([cfg.image_field] if cfg.image_field else []))
    train = records_to_examples(read_records(cfg.source, cfg.split, hub, fields), cfg, cfg.source)
    if cfg.val_source:
        val_fields: tuple[str, ...] = (
            cfg.val_prompt_field or cfg.prompt_field,
            cfg.val_answer_field or cfg.answer_field,
        )
        val_fields += fields[2:]  # the images
        records = read_records(cfg.val_source, cfg.val_split, hub, val_fields)
        val = records_to_examples(records, cfg, cfg.val_source, validation=True)
    else:
        rng = random.Random(seed)
        train = train[:]
        rng.shuffle(train)
        cut = max(1, int(len(train) * cfg.val_fraction))
        train, val = train[cut:], train[:cut]
    return train, val[: cfg.max_val_samples]


class PromptStream:
    """Shuffled, epoch-based stream of training examples whose position survives a resume."""

    def __init__(self, examples: list[Example], seed: int) -> None:
        self.examples, self.seed = examples, seed
        self.epoch, self.offset = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Example]:
        out: list[Example] = []
        while len(out) < n:
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self.examples[self._order[self.offset]])
            self.offset += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]
        self._order = self._shuffle()
