"""Checkpoints: written atomically, kept by a validation metric, found again on resume.

A checkpoint is a directory ``step_NNNNNN`` holding ``state.pt`` and ``meta.json``. It is written
under a temporary name and renamed into place as the last act, so a kill mid-write leaves only a
``.tmp`` directory that resume ignores (and the next save removes).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    metric: float | None


class CheckpointManager:
    def __init__(self, root: Path, keep_top_k: int, metric: str, higher_is_better: bool) -> None:
        self.root, self.keep, self.metric, self.higher = root, keep_top_k, metric, higher_is_better
        root.mkdir(parents=True, exist_ok=True)

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, float]) -> Path:
        for stale in self.root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp"
        tmp.mkdir(parents=True)
        torch.save(state, tmp / "state.pt")
        meta = {
            "step": step,
            "metric_name": self.metric,
            "metric": metrics.get(self.metric),
            "metrics": metrics,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return final

    def list(self) -> list[CheckpointInfo]:
        out = []
        for path in sorted(self.root.glob("step_*")):
            if path.suffix == ".tmp" or not (path / "meta.json").exists():
                continue
            meta = json.loads((path / "meta.json").read_text())
            out.append(CheckpointInfo(path, int(meta["step"]), meta.get("metric")))
        return out

    def latest(self) -> CheckpointInfo | None:
        found = self.list()
        return max(found, key=lambda c: c.step) if found else None

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


def load_state(info: CheckpointInfo) -> dict[str, Any]:
    return dict(torch.load(info.path / "state.pt", weights_only=False))
