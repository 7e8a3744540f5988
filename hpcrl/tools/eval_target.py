"""Which model ``hpcrl eval`` evaluates and where its results go: a run (its best checkpoint), a
checkpoint directory (exported first), a Hugging Face directory or a catalog model."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.config.schema import RunConfig
from hpcrl.errors import HpcrlError

Log = Callable[[str], None]


# -- which model, where its results go ----------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """A model to evaluate: how MODEL was given, and where its results go."""

    label: str
    kind: str
    """'checkpoint' (exported before use), 'hf' (a model directory) or 'catalog'."""
    path: Path | None
    """The checkpoint or HF directory; None for a catalog model (``prepare_model`` finds it)."""
    out: Path
    run_dir: Path | None = None
    catalog: str | None = None
    """The catalog model the run trained (model.json), or the one named."""


def resolve_target(spec: str, out: Path | None, output_root: Path) -> Target:
    """MODEL as given on the command line; ``out``: ``--out`` (None: the default place)."""
    path = Path(spec)
    if path.is_dir():
        if (path / "meta.json").exists() or (path / "checkpoints").is_dir():
            return _checkpoint_target(path, out)
        if (path / "config.json").exists():
            return Target(path.name, "hf", path, out or _stamped(output_root, path.name))
        raise HpcrlError(
            f"{spec}: neither a run directory (checkpoints/), a checkpoint (meta.json) nor a Hugging Face "
            "model directory (config.json)"
        )
    from hpcrl.config.compose import conf_dir

    if (conf_dir() / "model" / f"{spec}.yaml").exists():
        return Target(spec, "catalog", None, out or _stamped(output_root, spec), catalog=spec)
    names = ", ".join(sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml")))
    raise HpcrlError(f"MODEL '{spec}' is not a directory nor a catalog model (one of: {names})")


def _checkpoint_target(path: Path, out: Path | None) -> Target:
    from hpcrl.tools.export import resolve

    ckpt = resolve(path)
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    about = _about(ckpt)
    default = (run_dir / "eval" if run_dir else ckpt / "eval") / ckpt.name
    return Target(ckpt.name, "checkpoint", ckpt, out or default, run_dir, about.get("model"))


def _about(ckpt: Path) -> dict[str, Any]:
    if not (ckpt / "model.json").exists():
        raise HpcrlError(f"{ckpt} has no model.json: it predates sharded checkpoints and cannot be exported")
    return dict(json.loads((ckpt / "model.json").read_text()))


def base_target(trained: Target) -> Target:
    """The model a run started from (its checkpoints' model.json ``source``)."""
    if trained.kind != "checkpoint" or trained.path is None:
        raise HpcrlError("--compare base needs a run or checkpoint directory as MODEL (its starting model)")
    source = Path(_about(trained.path).get("source", ""))
    if not (source / "config.json").exists():
        raise HpcrlError(
            f"{trained.path}/model.json names the starting model {source}, which is not a model directory "
            "here: pass it as --compare DIR"
        )
    return Target("base", "hf", source, trained.out.parent / "base", trained.run_dir, trained.catalog)


def _stamped(root: Path, label: str) -> Path:
    return root / f"eval-{label}-{time.strftime('%Y%m%d-%H%M%S')}"


def model_dir_of(target: Target, cfg: RunConfig, log: Log) -> Path:
    """The Hugging Face directory to serve: exported first for a checkpoint (reused if already there)."""
    if target.kind == "hf" and target.path is not None:
        return target.path
    if target.kind == "catalog":
        from hpcrl.plan.planner import make_plan
        from hpcrl.run.driver import prepare_model

        return prepare_model(make_plan(cfg))
    assert target.path is not None
    hf = target.out / "hf"
    if not (hf / "config.json").exists():
        import torch

        from hpcrl.tools.export import export

        # fp32 on CPU: the CPU engines compute in fp32, and a bf16 round trip would move the answers
        export(target.path, hf, "bf16" if torch.cuda.is_available() else "fp32", log)
    return hf


# -- the problems -----------------------------------------------------------------------------------
