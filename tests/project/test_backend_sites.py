"""A backend is one folder plus one table entry: outside a backend's own modules, no code asks which
backend it has.

The scan (AST, every module of hpcrl/) counts, outside ``BACKEND_HOMES``:
- ``isinstance`` / ``issubclass`` against a backend's schema or class (``VLLMRolloutConfig``, ``FSDPTrainer``),
  and ``match`` class patterns of them;
- comparisons of a ``backend`` (or ``engine``) attribute or name with a backend's name (``"megatron"``)
  or with another such attribute;
- ``getattr`` / ``hasattr`` probes of a rollout, trainer or engine object, or of a setting only one
  backend's schema has (``inflight_update``, ``expert_tp`` ...) or of an engine method.
Callers ask the specs instead (``trainer/backends.py``, ``rollout/backends.py``). The issue that asked for
this (34) counted 42 such sites in 12 modules; ``KNOWN`` holds the ones that remain, with why.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from hpcrl.config.schema import GROUP_SCHEMAS
from hpcrl.rollout.backends import CAPABILITY_VIEWS, ROLLOUTS
from hpcrl.rollout.base import RolloutEngine
from hpcrl.rollout.config import RolloutConfig
from hpcrl.trainer.backends import TRAINERS, ExpertTP
from hpcrl.trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hpcrl"

BACKEND_HOMES = (
    "hpcrl/trainer/fsdp/",
    "hpcrl/trainer/megatron/",
    "hpcrl/trainer/backends.py",
    "hpcrl/rollout/vllm_engine.py",
    "hpcrl/rollout/vllm_compat.py",
    "hpcrl/rollout/hf_engine.py",
    "hpcrl/rollout/backends.py",
)
"""Each backend's own modules, and the tables that declare them."""

KNOWN: dict[str, str] = {}
"""``path:line`` of a site that remains -> why. Empty: none remains."""

CLASSES = {
    "FSDPTrainerConfig",
    "MegatronTrainerConfig",
    "VLLMRolloutConfig",
    "HFRolloutConfig",
    "FSDPTrainer",
    "MegatronTrainer",
    "VLLMEngine",
    "HFEngine",
}
NAMES = set(TRAINERS) | set(ROLLOUTS)
SUBJECTS = ("rollout", "trainer", "engine")


def _own_fields() -> set[str]:
    """Settings only some backend's schema has (a subclass's fields beyond its base's)."""
    own = set()
    for schema in GROUP_SCHEMAS.values():
        base = TrainerConfig if issubclass(schema, TrainerConfig) else RolloutConfig
        own |= {f.name for f in dataclasses.fields(schema)} - {f.name for f in dataclasses.fields(base)}
    return own


PROBED = _own_fields() | {n for n in dir(RolloutEngine) if not n.startswith("_")}


def _is_backend_word(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in ("backend", "engine")
    return isinstance(node, ast.Name) and node.id in ("backend", "engine")


def _is_backend_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def sites(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every place in ``tree`` that tests which backend it has."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name in ("isinstance", "issubclass") and len(node.args) == 2:
                if any(n.id in CLASSES for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)):
                    found.append((node.lineno, ast.unparse(node)))
            elif name in ("getattr", "hasattr") and len(node.args) >= 2:
                subject, key = ast.unparse(node.args[0]), node.args[1]
                probed = isinstance(key, ast.Constant) and key.value in PROBED
                if probed or any(s in subject for s in SUBJECTS):
                    found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            words, names = sum(map(_is_backend_word, sides)), sum(map(_is_backend_name, sides))
            if words and (names or words > 1):  # not ``backend == "nccl"`` (a collective's backend)
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.MatchClass) and ast.unparse(node.cls).split(".")[-1] in CLASSES:
            found.append((node.lineno, ast.unparse(node)))
    return found


def backend_sites() -> dict[str, str]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(BACKEND_HOMES):
            continue
        for line, what in sites(ast.parse(path.read_text(), rel)):
            out[f"{rel}:{line}"] = what
    return out


def test_no_code_outside_a_backend_asks_which_backend_it_has() -> None:
    found = backend_sites()
    new = {where: what for where, what in found.items() if where not in KNOWN}
    assert not new, (
        "code outside a backend's own modules tests which backend it has; ask its spec instead "
        "(trainer/backends.py, rollout/backends.py):\n" + "\n".join(f"  {w}: {s}" for w, s in new.items())
    )
    gone = set(KNOWN) - set(found)
    assert not gone, f"KNOWN sites that no longer exist (drop them): {sorted(gone)}"


def test_the_scan_finds_each_kind_of_site() -> None:
    """The scanner itself: each kind of type test it must catch, and what it must leave alone."""
    caught = """
isinstance(cfg.rollout, VLLMRolloutConfig)
isinstance(t, (FSDPTrainerConfig, int))
cfg.trainer.backend == "megatron"
backend != "fsdp"
rollout.engine == "hf"
getattr(cfg.rollout, "sleep", False)
hasattr(self.engine, "generate_stream")
getattr(x, "inflight_update", None)
match cfg.trainer:
    case MegatronTrainerConfig(): pass
"""
    assert len(sites(ast.parse(caught))) == 9
    left = """
isinstance(x, dict)
getattr(model.config, "tie_word_embeddings", False)
name == "model"
backend == "nccl"
target.kind == "hf"
spec.sleep and x
"""
    assert sites(ast.parse(left)) == []


def test_each_capability_matches_its_schema() -> None:
    """A capability a spec declares is backed by its schema's fields (the views read them), and a
    schema with those fields declares it; each spec names a schema the groups register."""
    schemas = {schema.backend: schema for schema in GROUP_SCHEMAS.values()}  # type: ignore[attr-defined]
    assert set(schemas) == set(TRAINERS) | set(ROLLOUTS)
    for name, spec in ROLLOUTS.items():
        fields = {f.name for f in dataclasses.fields(schemas[name])}
        for capability, view in CAPABILITY_VIEWS.items():
            has = set(view.__annotations__) <= fields
            assert getattr(spec, capability) == has, (name, capability, sorted(view.__annotations__))
    for name, trainer in TRAINERS.items():
        fields = {f.name for f in dataclasses.fields(schemas[name])}
        assert trainer.expert_tp == (set(ExpertTP.__annotations__) <= fields), name


def test_every_spec_builds_a_class_of_its_backend() -> None:
    """The lazy build paths name real classes (import only the module's source: no torch here)."""
    for spec in (*TRAINERS.values(), *ROLLOUTS.values()):
        for path in (spec.build, getattr(spec, "export_names", None)):
            if path is None:
                continue
            module, _, name = path.partition(":")
            parts = module.split(".")
            source = ROOT.joinpath(*parts).with_suffix(".py")
            if not source.exists():
                source = ROOT.joinpath(*parts, "__init__.py")
            tree = ast.parse(source.read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef)}
            imported = {
                a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
            }
            assert name in defined | imported, f"{path}: no {name} in {source}"
