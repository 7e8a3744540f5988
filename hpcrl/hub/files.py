"""Which files of a hub repository a run needs: a model's weights, config and tokenizer; a data set
split's data files. Pure functions of the repository's file list, so the login node (listing the hub)
and the job (listing the cache, offline) choose the same files."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from hpcrl.errors import ConfigError

MODEL_FILES = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.model",
    "chat_template*",
    "preprocessor_config.json",
    "processor_config.json",
    "*.py",
]
"""What a model needs, top level only: safetensors shards and their index, config, generation config,
tokenizer and processor files (``*.py``: models whose code ships with them). Not ``.bin``/``.pth``
duplicates of the weights, nor ``original/`` (the publisher's own format), nor anything in folders."""

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
"""Data files hpcrl reads (``hpcrl/data/loader.py``)."""

SPLIT_NAMES = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
"""Split keywords of file names, as the ``datasets`` library infers splits without a card's ``configs``."""


def model_files(paths: list[str], shards: list[str] | None = None) -> list[str]:
    """The model files among a repository's ``paths``; with the safetensors index's ``shards``, only the
    shards it names (a publisher's ``consolidated.safetensors`` beside them is another copy)."""
    files = [p for p in paths if "/" not in p and any(_glob(g).match(p) for g in MODEL_FILES)]
    if shards is not None:
        files = [p for p in files if not p.endswith(".safetensors") or p in shards]
    return sorted(files)


def index_shards(snapshot: Path) -> list[str] | None:
    """The shards the snapshot's safetensors index names (None: no index there)."""
    index = snapshot / "model.safetensors.index.json"
    if not index.is_file():
        return None
    return sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))


def missing_shards(snapshot: Path) -> list[str]:
    """Shards named by the safetensors index that are not in ``snapshot`` (a half-fetched model)."""
    index = snapshot / "model.safetensors.index.json"
    if not index.is_file():
        return [] if any(snapshot.glob("*.safetensors")) else ["*.safetensors"]
    names = set(json.loads(index.read_text()).get("weight_map", {}).values())
    return sorted(n for n in names if not (snapshot / n).is_file())


def split_files(paths: list[str], split: str, subset: str | None, card: str | None) -> list[str]:
    """The data files of ``split`` (of config ``subset``) among a data set repository's ``paths``: from
    the card's ``configs`` when it has them (what ``datasets`` reads), else by file and folder names."""
    configs = card_configs(card) if card else []
    if configs:
        return _from_configs(paths, split, subset, configs)
    data = [p for p in paths if p.endswith(DATA_SUFFIXES) and not p.startswith(".")]
    if subset:
        data = [p for p in data if subset in p.split("/")[:-1]]
    by_split = {name: [p for p in data if _names_split(p, words)] for name, words in SPLIT_NAMES.items()}
    if not any(by_split.values()):  # no split in any name: it is all one train split
        by_split["train"] = data
    chosen = by_split.get(split) or [p for p in data if _names_split(p, (split,))]
    return sorted(chosen)


def card_configs(card: str) -> list[dict[str, Any]]:
    """The ``configs`` list of a data set card's YAML header (empty when it has none)."""
    import yaml

    m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", card, re.DOTALL)
    if not m:
        return []
    try:
        meta = yaml.safe_load(m.group(1)) or {}
    except yaml.YAMLError:
        return []
    configs = meta.get("configs") if isinstance(meta, dict) else None
    return [c for c in configs or [] if isinstance(c, dict)]


def _from_configs(
    paths: list[str], split: str, subset: str | None, configs: list[dict[str, Any]]
) -> list[str]:
    names = [str(c.get("config_name", "default")) for c in configs]
    if subset:
        chosen = next((c for c in configs if c.get("config_name") == subset), None)
        if chosen is None:
            raise ConfigError(f"the data set has no subset '{subset}'; its card names: {', '.join(names)}")
    else:
        chosen = next((c for c in configs if c.get("default")), None)
        chosen = chosen or next((c for c in configs if c.get("config_name", "default") == "default"), None)
        if chosen is None and len(configs) == 1:
            chosen = configs[0]
        if chosen is None:
            raise ConfigError(
                f"the data set has subsets {', '.join(names)}: name one as hf:<repo>:<subset> in data.source"
            )
    files = chosen.get("data_files", [])
    if isinstance(files, (str, list)) and not (
        isinstance(files, list) and files and isinstance(files[0], dict)
    ):
        patterns = {"train": [files] if isinstance(files, str) else list(files)}
    else:
        patterns = {}
        for entry in files:
            path = entry.get("path", [])
            patterns[str(entry.get("split", "train"))] = [path] if isinstance(path, str) else list(path)
    if split not in patterns:
        raise ConfigError(
            f"the data set has no split '{split}'; its card names: {', '.join(sorted(patterns))}"
        )
    found = [p for p in paths if any(_glob(g).match(p) for g in patterns[split])]
    unreadable = [p for p in found if not p.endswith(DATA_SUFFIXES)]
    if unreadable:
        raise ConfigError(
            f"split '{split}' is in files hpcrl does not read ({', '.join(unreadable[:2])}); "
            "it reads .parquet, .jsonl and .json"
        )
    return sorted(found)


def _names_split(path: str, words: tuple[str, ...]) -> bool:
    """A folder or file name of ``path`` is, or starts with, one of ``words`` followed by a separator
    (``train-00000-of-00001.parquet``, ``data/test.jsonl``, ``validation/part-0.parquet``)."""
    parts = path.lower().split("/")
    alternatives = "|".join(re.escape(w.lower()) for w in words)
    return any(re.match(rf"^({alternatives})([-._ 0-9]|$)", part) for part in parts)


@cache
def _glob(pattern: str) -> re.Pattern[str]:
    """A card's glob as a regex: ``*`` within one folder, ``**`` across folders."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")
