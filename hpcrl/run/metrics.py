"""Metric sinks: a live console line per step, metrics.jsonl, TensorBoard, and wandb (offline by default)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

from hpcrl.config.schema import LoggerConfig
from hpcrl.run.rundir import atomic_write_text


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: LoggerConfig, run_name: str, config: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.jsonl = (run_dir / "metrics.jsonl").open("a")
        self.tb: Any = None
        self.wandb: Any = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if cfg.wandb and cfg.wandb_mode != "disabled":
            try:
                import wandb
            except ImportError:
                print("hpcrl: logger.wandb=true but wandb is not installed; skipping wandb", file=sys.stderr)
            else:
                os.environ.setdefault("WANDB_DIR", str(run_dir))
                self.wandb = wandb.init(
                    project=cfg.wandb_project, name=run_name, mode=cast(Any, cfg.wandb_mode), config=config
                )

    def resume(self, step: int) -> None:
        """The run goes on after ``step`` (0: from the start): rows a killed attempt logged after it
        (and a line it left half-written) go, so that the steps it repeats are not logged twice. Each
        file is rewritten whole and renamed into place: a kill now leaves the old one or the new."""
        self.jsonl.close()
        for name in ("metrics.jsonl", "samples.jsonl"):
            kept = [r for r in read_rows(self.run_dir / name) if step and r.get("step", 0) <= step]
            if (self.run_dir / name).exists():
                atomic_write_text(self.run_dir / name, "".join(json.dumps(r) + "\n" for r in kept))
        self.jsonl = (self.run_dir / "metrics.jsonl").open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A validation's example completions: ``samples.jsonl`` (one line each) and TensorBoard text."""
        if not rows:
            return
        with (self.run_dir / "samples.jsonl").open("a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        if self.tb is not None:
            self.tb.add_text("val/samples", samples_markdown(rows), step)
            self.tb.flush()

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def sample_rows(scored: Any, k: int) -> list[dict[str, Any]]:
    """The first ``k`` problems of a validation's ``Scored`` (the same ones every time: the set is
    fixed) with their greedy completion and outcome."""
    rows = zip(scored.examples, scored.groups, scored.outcomes, strict=True)
    return [
        {"prompt": e.prompt, "completion": g[0].text, "answer": e.answer, "outcome": str(o[0])}
        for e, g, o in list(rows)[:k]
    ]


def samples_markdown(rows: list[dict[str, Any]]) -> str:
    """TensorBoard's text tab renders markdown: one block per problem."""
    return "\n\n".join(
        f"**{r['outcome']}** (answer: `{r['answer']}`)\n\n    " + r["completion"].replace("\n", "\n    ")
        for r in rows
    )


def console_line(step: int, total: int, m: dict[str, float]) -> str:
    parts = [f"step {step:>3}/{total}"]
    for key, fmt in (
        ("train/reward", "reward {:.3f}"),
        ("train/accuracy", "acc {:.3f}"),
        ("val/accuracy", "val {:.3f}"),
        ("train/kl", "kl {:.4f}"),
        ("train/entropy", "ent {:.3f}"),
        ("train/gen_kl_error", "gen_kl {:.1e}"),
        ("train/mean_gen_tokens", "len {:.1f}"),
        ("perf/gen_tokens_per_s", "{:.0f} tok/s"),
        ("time/step", "{:.1f}s"),
        ("time/environment", "env {:.1f}s"),
    ):
        if key in m:
            parts.append(fmt.format(m[key]))
    if m.get("faults/engine_restarts"):  # only when an engine failed (run/engine_faults.py)
        parts.append(
            f"engine restarts {m['faults/engine_restarts']:.0f}, lost groups {m['faults/lost_groups']:.0f}"
        )
    return " | ".join(parts)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows, one a step, in order; none when the run has not logged yet. A step
    logged again (a resumed attempt's file from before ``MetricsLogger.resume``) supersedes the rows
    from it on."""
    rows: list[dict[str, Any]] = []
    for row in read_rows(run_dir / "metrics.jsonl"):
        while rows and rows[-1].get("step", 0) >= row.get("step", 0):
            rows.pop()
        rows.append(row)
    return rows


def read_rows(file: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's rows. A run still writing (or killed mid-line) can end in a partial line:
    it is left out."""
    rows = []
    for line in file.read_text().splitlines() if file.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # blank, or the line being written
    return rows
