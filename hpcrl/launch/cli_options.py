"""The command line's options, per command (``hpcrl/cli.py`` holds the commands and their tables)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def add_root_of_debug_job(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        help="run.output_root of the debug job (default: from the overrides)",
    )


def add_show(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", action="store_true", help="list the options of every config group")


def add_render(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", type=Path, default=None, help="directory to write into (default: the run directory)"
    )
    p.add_argument(
        "-m",
        "--multirun",
        action="store_true",
        help="every point of a sweep: its verdict, config and sbatch file",
    )


def add_submit(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hold",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="Slurm: keep the job's Ray cluster up this long after the driver (debugging)",
    )
    p.add_argument(
        "-m",
        "--multirun",
        action="store_true",
        help="Slurm: Hydra sweep syntax (algo.lr=1e-6,3e-6 ...): one job per point, returns at once",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="with -m: plan every point and write its files, submit nothing (as render -m)",
    )
    p.add_argument(
        "--into",
        type=Path,
        default=None,
        metavar="SWEEP_DIR",
        help="with -m: resume a sweep that stopped half-way (submits the points its sweep.json lacks)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="Slurm: only bring up Ray and place one actor per node by role (checks an allocation; no training)",
    )


def add_doctor(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", default=None, help="check every node of this job (default: $SLURM_JOB_ID)")
    p.add_argument("--here", action="store_true", help="check only the machine this runs on")
    p.add_argument("--expect", default=None, help=argparse.SUPPRESS)  # a node of a --job fan-out


def add_debug(p: argparse.ArgumentParser) -> None:
    add_root_of_debug_job(p)
    p.add_argument("--no-wait", action="store_true", help="return once submitted, without waiting for Ray")
    p.add_argument(
        "--here",
        action="store_true",
        help="no new job: Ray on the allocation this shell is in (salloc, srun --pty), until you leave it",
    )


def add_run(p: argparse.ArgumentParser) -> None:
    add_root_of_debug_job(p)
    p.add_argument(
        "--job", default=None, help="the debug job (default: $SLURM_JOB_ID, i.e. the allocation you are in)"
    )
    p.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # on the head node already


def add_attach(p: argparse.ArgumentParser) -> None:
    p.add_argument("job")
    p.add_argument("node", nargs="?", default=None, help="host name or node index (default: the head)")
    p.epilog = "hpcrl attach JOB [NODE] -- COMMAND...  runs COMMAND there instead of a shell"


def add_job(optional: bool) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("job", nargs="?" if optional else None)

    return add


def add_logs(p: argparse.ArgumentParser) -> None:
    p.add_argument("job")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")


def add_ls(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", type=Path, default=None, metavar="DIR", help="the points of one sweep")
    p.add_argument("--plot", action="store_true", help="with --sweep: also write the sweep's curves.png/html")


def add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="a step_NNNNNN/ directory, or a run (its best checkpoint)")
    p.add_argument("--out", type=Path, required=True, help="the Hugging Face model directory to write")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights' dtype (default bf16)")


def add_init(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster", default=None, help="catalog cluster to write (default: the one matching sinfo)"
    )
    p.add_argument("--partition", default=None, help="Slurm partition (default: the default GPU partition)")
    p.add_argument("--account", default=None, help="Slurm account (asked when stdin is a terminal)")
    p.add_argument("--image", default=None, help="container image (asked where the cluster requires one)")
    p.add_argument(
        "--hf-home",
        default=None,
        help="the site's shared Hugging Face cache, HF_HOME (asked when stdin is a terminal; hpcrl fetch fills it)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing site.yaml")


def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", help="a run or checkpoint directory, a Hugging Face model directory or a catalog model"
    )
    p.add_argument(
        "overrides", nargs="*", help="Hydra overrides: data=..., eval.n=16, rollout.max_new_tokens=..."
    )
    p.add_argument("--out", type=Path, default=None, help="directory for eval.json and samples.jsonl")
    p.add_argument(
        "--compare",
        default=None,
        metavar="base|MODEL",
        help="also evaluate the run's starting model (base) or another MODEL; print the differences",
    )


def add_plot(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", type=Path, help="run directories (a sweep directory: all its points)")
    p.add_argument("--out", type=Path, default=None, help="where curves.png/html go (default: the first run)")
