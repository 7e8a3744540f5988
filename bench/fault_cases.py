"""bench/fault_suite.py's cases for issue 37 items 1, 3 and 5 beyond its first eight: an engine killed
inside a refit, a half-written ``.tmp`` checkpoint, ``hpcrl export``/``hpcrl eval`` of a damaged
checkpoint, a reward plugin that cannot start, a step whose rewards are all errors and environment
plugins that raise, hang or crash. The same real parts and the tests' own harnesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.errors import HpcrlError
from hpcrl.rewards.config import RewardsConfig
from hpcrl.rewards.pool import RewardPool, Task
from tests.run.test_engine_kill import killed_run

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    fault: str
    detected: str
    recovered: str
    lost: str
    completed: str
    seconds: float = 0.0


def _steps(rows: list[dict]) -> str:
    return ",".join(str(r["step"]) for r in rows)


def _one_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.startswith("hpcrl: error:")]
    return lines[0] if len(lines) == 1 else f"({len(lines)} error lines)"


def engine_refit_killed(work: Path, cache: Path) -> Row:
    """The lone engine SIGKILLed inside the refit to version 3 (engines paused, before the weights
    go out; on-policy): tests/harness/engine_kill.py's ``f3``."""
    result, calls, rows = killed_run(work, cache, 1, "f3")
    refits = json.loads((work / "refits.json").read_text())
    killed = [r for r in refits if r["killed"]]
    versions_ok = all({tuple(v) for v in c["versions"]} == {(c["version"],) * 2} for c in calls)
    restarts = sum(r.get("faults/engine_restarts", 0) for r in rows)
    return Row(
        "rollout engine SIGKILLed inside a refit (weights not yet sent)",
        "the refit: the lost engine's call fails at once (not left to the broadcast's timeout)",
        f"engine rebuilt, refit run again: {killed[0]['seconds']:.1f} s for that refit; "
        f"{restarts:.0f} restart counted; batch after it at version "
        f"{calls[-1]['version'] if calls else '?'}" + ("" if versions_ok else " (VERSIONS WRONG)")
        if killed
        else "(NOT KILLED)",
        "0",
        f"{'yes' if result.returncode == 0 else 'NO'} (steps {_steps(rows)})",
    )


def plant_partial(ckpts: Path) -> Path:
    """What a kill or a full disk inside the save of step 6 leaves: its half-written ``.tmp``."""
    tmp = ckpts / "step_000006.tmp"
    (tmp / "trainer").mkdir(parents=True, exist_ok=True)
    (tmp / "trainer" / "__0_0.distcp").write_bytes(b"half")
    return tmp


def partial_tmp(work: Path, _cache: Path) -> Row:
    """Reads what damaged_shard's resume (which ran with ``step_000006.tmp`` planted) left."""
    ckpts = work / "run" / "checkpoints"
    from hpcrl.run.checkpoint import verify

    said = (work / "resume.out").read_text()
    metrics = (work / "run" / "metrics.jsonl").read_text().splitlines()
    last = json.loads(metrics[-1])["step"] if metrics else None
    left = sorted(p.name for p in ckpts.glob("*.tmp"))
    six = ckpts / "step_000006"
    whole = six.is_dir() and verify(six, deep=True) == ""
    return Row(
        "half-written step_000006.tmp beside the checkpoints (a kill or full disk mid-save)",
        "resume lists committed directories only" + (" (NAMED IN RESUME)" if ".tmp" in said else ""),
        f"ignored by the resume; the save of step 6 replaced it ({'step_000006 verifies' if whole else 'NOT WHOLE'}; "
        f".tmp left: {left or 'none'})",
        "0",
        f"{'yes' if last == 7 else 'NO'} (damaged_shard's resume, to step {last})",
    )


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )


def damaged_export(work: Path, _cache: Path) -> Row:
    """``hpcrl export`` and ``hpcrl eval`` of the checkpoint damaged_shard truncated."""
    ckpt = work / "run" / "checkpoints" / "step_000005"
    started = time.perf_counter()
    export = _cli("export", str(ckpt), "--out", str(work / "exported"))
    evaluated = _cli("eval", str(ckpt), "--out", str(work / "eval"))
    lines = [_one_line(export.stderr), _one_line(evaluated.stderr)]
    ok = [
        r.returncode != 0 and "is damaged" in line for r, line in zip((export, evaluated), lines, strict=True)
    ]
    return Row(
        "`hpcrl export` / `hpcrl eval` of the truncated checkpoint",
        "the deep check (sizes and CRC32 of every file) before anything loads",
        f"refused in one line each (export: {'yes' if ok[0] else 'NO'}, eval: {'yes' if ok[1] else 'NO'}): "
        f"`… is damaged: {lines[0].split(' is damaged: ')[-1]}`",
        "none written (no model directory, no eval.json)"
        if not (work / "exported").exists() and not (work / "eval" / "eval.json").exists()
        else "SOMETHING WRITTEN",
        f"exit {export.returncode} / {evaluated.returncode} (the intact checkpoints named)",
        time.perf_counter() - started,
    )


def _plugins(name: str) -> str:
    old = os.environ.get("HPCRL_PLUGINS", "")
    os.environ["HPCRL_PLUGINS"] = name
    return old


def plugin_no_start(_work: Path, _cache: Path) -> Row:
    """A plugin the driver imports but a reward process cannot (tests/harness/verifier_plugin_no_start)."""
    old = _plugins("tests.harness.verifier_plugin_no_start")
    started = time.perf_counter()
    try:
        with RewardPool("test_no_start", RewardsConfig(processes=2)) as pool:
            pool.score([Task(0, "x", "x", "")])
        line = "(NO ERROR)"
    except HpcrlError as exc:
        line = str(exc)
    finally:
        os.environ["HPCRL_PLUGINS"] = old
    seconds = time.perf_counter() - started
    return Row(
        "reward plugin that fails to start in its process",
        f"the first reward process's start ({seconds:.1f} s; not a restart loop to rewards.start_timeout_s)",
        f"stops in one line{'' if chr(10) not in line else ' (MULTI-LINE)'}: `{line[:120]}…`",
        "the step (nothing scored)",
        "no: stops before the first step is scored (by design)",
        seconds,
    )


def all_errors(_work: Path, _cache: Path) -> Row:
    """Every sample of a batch raises in the verifier (tests/harness/verifier_plugins)."""
    old = _plugins("tests.harness.verifier_plugins")
    started = time.perf_counter()
    try:
        with RewardPool("test_adversarial", RewardsConfig(processes=2), warn=lambda _: None) as pool:
            pool.score([Task(i, "raise", "ok", "") for i in range(16)])
        line = "(NO ERROR)"
    except HpcrlError as exc:
        line = str(exc)
    finally:
        os.environ["HPCRL_PLUGINS"] = old
    return Row(
        "a step whose rewards are all errors (verifier raises on each of 16)",
        "the reward pool, at the end of the batch",
        f"stops in one line{'' if chr(10) not in line else ' (MULTI-LINE)'}: `{line[:110]}…`",
        "the step (no update from all-zero rewards)",
        "no: stops rather than train on nothing (by design)",
        time.perf_counter() - started,
    )


def env_broken(_work: Path, cache: Path) -> Row:
    """tests/envs/test_episodes.py's episodes: the hf engine on the tiny model, environment processes
    that raise, hang (env.step_timeout_s=3) or crash on their second step, beside good ones."""
    from transformers import AutoTokenizer

    from hpcrl.envs.config import EnvConfig
    from hpcrl.envs.episodes import EpisodePrompt, Episodes, observation_renderer
    from hpcrl.envs.pool import EnvPool
    from hpcrl.rollout.base import SamplingSettings
    from hpcrl.rollout.hf_engine import HFEngine
    from hpcrl.run.tiny_model import ensure_tiny_model
    from tests.conftest import compose

    modes = ["ok", "ok", "raise", "hang", "crash"]
    tiny = ensure_tiny_model(compose("model=tiny").model, cache, sft_steps=0, seed=0, log=lambda _: None)
    old = _plugins("tests.harness.env_plugins")
    try:
        cfg = EnvConfig(
            "test_scripted", max_turns=3, max_tokens=60, processes=4, step_timeout_s=3, memory_mb=512
        )
        engine = HFEngine(tiny, compose("model=tiny", "rollout=hf").rollout, device="cpu")
        observe = observation_renderer(AutoTokenizer.from_pretrained(tiny))
        tok = AutoTokenizer.from_pretrained(tiny)
        prompts = [EpisodePrompt(tok.encode(f"1 + {i} ="), f"1 + {i} =", m) for i, m in enumerate(modes)]
        started = time.perf_counter()
        settings = SamplingSettings(n=2, temperature=1.0, top_p=1.0, max_tokens=5, seed=3)
        groups = {
            i: g
            for part in Episodes(engine, cfg, EnvPool(cfg, "exact"), observe).generate_stream(
                prompts, settings
            )
            for i, g in part
        }
        seconds = time.perf_counter() - started
    finally:
        os.environ["HPCRL_PLUGINS"] = old
    errors = {modes[i]: sum(c.verdict == ("error", 0.0) for c in g) for i, g in groups.items()}
    good = sum(c.verdict != ("error", 0.0) for i, g in groups.items() if modes[i] == "ok" for c in g)
    return Row(
        "environment plugin that raises / hangs / crashes on its 2nd step",
        f"its episode process ({seconds:.1f} s for the 10 episodes; env.step_timeout_s 3 for the hang)",
        f"that episode ends, graded error (0); {good} of 4 good episodes unaffected",
        f"{sum(v for m, v in errors.items() if m != 'ok')} of 10 episodes (the broken ones)",
        f"yes (all {len(groups)} groups back)",
        seconds,
    )
