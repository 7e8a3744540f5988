"""Issue 37's faults, one after another, as one table: fault | detected in | recovered how | samples
lost | run completed (issue 37 item 9).

The real parts throughout: local Ray, the vLLM CPU build, the FSDP2 trainer on the tiny model and
math-verify reward processes, driven by the tests' own harnesses (tests/harness/engine_kill.py for
engines and trainer ranks, tests/harness/verifier_plugins.py for plugins, the tests' pathological
answers). The tests stay the assertions: the cases with no figure of their own here (full disk,
signals) run their test and report it passed, and how long it took. bench/fault_cases.py holds the
cases added in session 25 (engine killed inside a refit, partial ``.tmp``, export/eval of a damaged
checkpoint, plugins that cannot start, all-error rewards, broken environments). damaged_shard,
partial_tmp and damaged_export work on trainer_killed's run directory: run them after it.

    PYTHONPATH=. .venv/bin/python bench/fault_suite.py [--only engine_killed,...] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import fault_cases  # noqa: E402
from bench.fault_cases import Row, _steps  # noqa: E402
from hpcrl.rewards.config import RewardsConfig  # noqa: E402
from hpcrl.rewards.pool import RewardPool, Task  # noqa: E402
from hpcrl.rewards.verifiers import Outcome  # noqa: E402
from tests.data.test_rewards import PATHOLOGICAL  # noqa: E402
from tests.run.test_engine_kill import killed_run  # noqa: E402

# keep_top_k: damaged_shard needs an older checkpoint beside the newest
LAGGED = [
    "algo.max_staleness=1",
    "algo.is_correction=tis",
    "checkpoint.period=2",
    "checkpoint.keep_top_k=5",
    "algo.max_steps=5",
]


def engine_killed(work: Path, cache: Path) -> Row:
    """The lone engine SIGKILLed while it generates step 2's batch (on-policy)."""
    result, calls, rows = killed_run(work, cache, 1, "2")
    lost = sum(r.get("faults/lost_groups", 0) for r in rows)
    versions_ok = all({tuple(v) for v in c["versions"]} == {(c["version"],) * 2} for c in calls)
    return Row(
        "rollout engine SIGKILLed mid-generation",
        "the same generate call (Ray: actor died)",
        f"rebuilt with the trainers' weights; {lost:.0f} unfinished groups generated again"
        + ("" if versions_ok else " (VERSIONS WRONG)"),
        "0",
        f"{'yes' if result.returncode == 0 else 'NO'} (steps {_steps(rows)})",
    )


def engine_hung(work: Path, cache: Path) -> Row:
    """The lone engine SIGSTOPped while it generates step 2's batch: hung, no progress."""
    limit = 10
    result, _calls, rows = killed_run(work, cache, 1, "s2", f"rollout.hang_timeout_s={limit}")
    others = [r["time/rollout"] for r in rows if r["step"] != 2]
    extra = rows[1]["time/rollout"] - sorted(others)[len(others) // 2] if len(rows) > 1 else float("nan")
    lost = sum(r.get("faults/lost_groups", 0) for r in rows)
    return Row(
        "rollout engine hung (SIGSTOP) mid-generation",
        f"{extra:.1f} s added to its step (rollout.hang_timeout_s={limit}, then the rebuild)",
        f"killed and rebuilt; {lost:.0f} unfinished groups generated again",
        "0",
        f"{'yes' if result.returncode == 0 else 'NO'} (steps {_steps(rows)})",
    )


def trainer_killed(work: Path, cache: Path) -> Row:
    """Trainer rank 0 SIGKILLed as step 4 begins (step 2's async checkpoint committed as step 3 ended),
    generation one step ahead; then the resume."""
    result, _calls, rows = killed_run(work, cache, 1, "r4", *LAGGED)
    redone = len(rows) - 2
    line = next((x for x in result.stderr.splitlines() if x.startswith("hpcrl: error:")), "(no line)")
    resumed, _calls, rows = killed_run(work, cache, 1, "-", *LAGGED)
    again = json.loads((work / "calls-resumed.json").read_text())
    kept = "1 generated batches" in resumed.stdout
    stale = [r["async/staleness"] for r in rows]
    return Row(
        "trainer rank SIGKILLed (max_staleness 1) + resume",
        "the train step's call; the run stops in one line"
        + ("" if "trainer rank 0" in line else " (NO LINE)"),
        f"resume from step_000002 with its kept batch ({'trained' if kept else 'LOST'} at staleness "
        f"{stale[2] if len(stale) > 2 else '?'}); {len(again)} batches generated after",
        f"0 ({redone} step trained again; batches made after the checkpoint: made again)",
        f"{'yes' if resumed.returncode == 0 else 'NO'} (steps {_steps(rows)})",
    )


def damaged_shard(work: Path, cache: Path) -> Row:
    """The newest checkpoint of ``trainer_killed``'s run with its shard cut to 5%, then a resume (with
    a half-written ``step_000006.tmp`` planted beside it: partial_tmp's row)."""
    ckpts = sorted((work / "run" / "checkpoints").glob("step_*"))
    newest = ckpts[-1]
    shard = next((newest / "trainer").glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 20])
    fault_cases.plant_partial(newest.parent)
    more = [*LAGGED[:-1], "algo.max_steps=7"]
    (work / "calls-resumed.json").unlink()
    result, _calls, rows = killed_run(work, cache, 1, "-", *more)
    (work / "resume.out").write_text(result.stdout + result.stderr)
    skipped = next((x for x in result.stdout.splitlines() if newest.name in x and "resumed" not in x), "")
    resumed = next(
        (x.split("resumed from ")[1] for x in result.stdout.splitlines() if "resumed from" in x), "?"
    )
    return Row(
        "checkpoint shard truncated to 5%",
        "resume's check (sizes recorded at commit)" + ("" if skipped else " (NOT SAID)"),
        f"skipped {newest.name}; resumed from {Path(resumed.split()[0]).name}",
        f"0 (steps after the older checkpoint trained again: {len(ckpts) and newest.name})",
        f"{'yes' if result.returncode == 0 else 'NO'} (steps {_steps(rows)})",
    )


def _pytest(*node_ids: str) -> tuple[bool, float]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *node_ids],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if done.returncode != 0:
        print(done.stdout[-3000:], file=sys.stderr)
    return done.returncode == 0, time.perf_counter() - started


def full_disk(_work: Path, _cache: Path) -> Row:
    ok, seconds = _pytest("tests/run/test_disk.py")
    return Row(
        "full disk / read-only path on save (tmpfs)",
        "the save (one line: path, bytes needed)",
        "async: previous checkpoint kept, next period retried; sync: stops in one line",
        "0 (the previous checkpoint)",
        f"async yes, sync stops cleanly (tests/run/test_disk.py {'passed' if ok else 'FAILED'})",
        seconds,
    )


def signals(_work: Path, _cache: Path) -> Row:
    """Real signals to a driver's handlers (the whole run under them, Ray and all, is
    tests/run/test_embedded.py's; the Slurm job's, USR2 then SIGTERM, tests/launch/test_slurm.py's:
    minutes each, left to the tests)."""
    ok, seconds = _pytest("tests/run/test_signals.py")
    return Row(
        "SIGINT / SIGTERM / USR2 (local driver; in a Slurm job: test_slurm.py)",
        "the signal handler; saved after the step in flight",
        "exit 130 / 143 / 75 in one line (USR2: requeued); the resume equals an unbroken run",
        "0",
        f"on resume (tests/run/test_signals.py {'passed' if ok else 'FAILED'})",
        seconds,
    )


def reward_plugins(_work: Path, _cache: Path) -> Row:
    os.environ["HPCRL_PLUGINS"] = "tests.harness.verifier_plugins"
    said: list[str] = []
    kinds = ["ok"] * 9 + ["hang", "crash", "raise", "eat"]
    with RewardPool(
        "test_adversarial", RewardsConfig(processes=2, timeout_s=2.0, memory_mb=300), warn=said.append
    ) as pool:
        started = time.perf_counter()
        out = pool.score([Task(i, k, "ok", "") for i, k in enumerate(kinds)])
        seconds = time.perf_counter() - started
        restarts = pool.restarts
    failed = sum(o in (Outcome.timeout, Outcome.error) for o in out)
    return Row(
        "reward plugin that hangs / crashes / raises / eats memory",
        f"its sample: {seconds:.1f} s for the batch (timeout_s 2, memory_mb 300); warned once: {len(said) == 1}",
        f"scored 0; {restarts} reward processes replaced",
        f"{failed} of {len(kinds)} samples (the faulty ones)",
        "yes (the batch scored)",
        seconds,
    )


def adversarial(_work: Path, _cache: Path) -> Row:
    clean = [Task(i, f"\\boxed{{{i % 97}}}", str(i % 97), "") for i in range(1024)]
    bad = [
        Task(t.index, PATHOLOGICAL[i % len(PATHOLOGICAL)], t.answer, "") if i % 20 == 0 else t
        for i, t in enumerate(clean)
    ]
    with RewardPool("math", RewardsConfig(processes=2)) as pool:
        pool.score(clean[:8])  # warm: parsers built
        t0 = time.perf_counter()
        pool.score(clean)
        t1 = time.perf_counter()
        out = pool.score(bad)
        t2 = time.perf_counter()
        restarts = pool.restarts
    n_bad = sum(i % 20 == 0 for i in range(len(bad)))
    wrong = sum(out[i] != Outcome.correct for i in range(0, len(bad), 20))
    added = (t2 - t1) - (t1 - t0)
    return Row(
        "5% pathological answers in 1,024 (towers, huge sums, factorials)",
        f"the screen, before SymPy: {added:+.2f} s for the batch against clean answers",
        f"each scored wrong ({wrong} of {n_bad}); {restarts} process restarts",
        f"0 (the {n_bad} answers are wrong, not lost)",
        "yes",
        t2 - t1,
    )


def _line(r: Row) -> str:
    return f"| {r.fault} | {r.detected} | {r.recovered} | {r.lost} | {r.completed} | {r.seconds:.0f} |"


CASES: dict[str, Callable[[Path, Path], Row]] = {
    "engine_killed": engine_killed,
    "engine_hung": engine_hung,
    "engine_refit_killed": fault_cases.engine_refit_killed,
    "trainer_killed": trainer_killed,
    "damaged_shard": damaged_shard,  # after trainer_killed: its run's checkpoints
    "partial_tmp": fault_cases.partial_tmp,  # after damaged_shard: what its resume did
    "damaged_export": fault_cases.damaged_export,  # after damaged_shard: its damaged checkpoint
    "full_disk": full_disk,
    "signals": signals,
    "reward_plugins": reward_plugins,
    "plugin_no_start": fault_cases.plugin_no_start,
    "all_errors": fault_cases.all_errors,
    "env_broken": fault_cases.env_broken,
    "adversarial": adversarial,
}
AFTER = {"damaged_shard", "partial_tmp", "damaged_export"}
"""Cases that read or change ``trainer_killed``'s run directory (run them after it)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument(
        "--work", type=Path, default=None, help="kept after the run (default: a temp dir, removed)"
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="hpcrl-faults-"))
    cache = work / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["HPCRL_CACHE"] = str(cache)
    rows: list[Row] = []
    started = time.perf_counter()
    for name in args.only.split(","):
        t0 = time.perf_counter()
        case = work / ("trainer_killed" if name in AFTER else name)
        case.mkdir(exist_ok=True)
        row = CASES[name](case, cache)
        row.seconds = row.seconds or time.perf_counter() - t0
        rows.append(row)
        print(f"[fault suite] {name}: {time.perf_counter() - t0:.0f}s: {_line(row)}", flush=True)
    print("\n| fault | detected in | recovered how | samples lost | run completed | case s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(_line(r))
    print(f"\n{len(rows)} cases in {time.perf_counter() - started:.0f} s")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
