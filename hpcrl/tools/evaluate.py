"""``hpcrl eval MODEL [overrides]``: pass@1 (greedy), pass@k and maj@k of a model on a data set.

MODEL is a run directory (its best checkpoint), a checkpoint directory (``step_NNNNNN/``), an exported
Hugging Face directory or a catalog model name (``conf/model/<name>.yaml``). A checkpoint is exported
first (``hpcrl export``, into ``<run>/eval/<step>/hf``). Generation uses the run's rollout engine
(``rollout=vllm|hf``, one engine in this process) and scoring the same verifier pool as training
(``data.verifier``, ``rewards.*``); ``eval.*`` (``config/eval.py``) sets the samples and the k.

The problems: ``data.val_source`` if set, else every record of ``data.source`` (the synthetic task:
its held-out problems, which training never sees), the first ``eval.max_problems`` of them.
Written to the eval directory: ``eval.json`` (the summary) and ``samples.jsonl`` (per problem: prompt,
reference, completions, parsed answers, verdicts and the problem's scores).

``--compare base`` (or another MODEL) evaluates the other model on the same problems and reports each
metric's difference with a paired-bootstrap interval (``hpcrl/algo/passk.py``).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.algo.passk import Difference, maj_at_k, paired_bootstrap, pass_at_k, vote_key
from hpcrl.config.schema import RunConfig
from hpcrl.data.loader import Example
from hpcrl.errors import HpcrlError
from hpcrl.tools.eval_target import Target, base_target, model_dir_of, resolve_target

Log = Callable[[str], None]


def say(msg: str) -> None:
    print(f"[hpcrl eval {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def eval_examples(cfg: RunConfig) -> list[Example]:
    from hpcrl.data.config import is_procedural
    from hpcrl.data.loader import load_examples, read_records, records_to_examples
    from hpcrl.hub.cache import hub_dir

    data, hub = cfg.data, hub_dir(cfg.cluster)
    if data.source == "synthetic" or is_procedural(data.source):  # generated: the validation problems
        examples = load_examples(data, cfg.run.seed)[1]
    elif data.val_source:
        records = read_records(data.val_source, data.val_split, hub)
        examples = records_to_examples(records, data, data.val_source, validation=True)
    else:
        examples = records_to_examples(read_records(data.source, data.split, hub), data, data.source)
    return examples[: cfg.eval.max_problems or None]


# -- generation and scoring -------------------------------------------------------------------------
@dataclass
class Answered:
    """One completion as the eval reports it."""

    text: str
    answer: str | None
    verdict: str
    tokens: int
    truncated: bool


@dataclass
class Problem:
    prompt: str
    reference: str
    greedy: Answered
    samples: list[Answered] = field(default_factory=list)

    def scores(self, ks: list[int]) -> dict[str, float]:
        """This problem's score under each metric (their means over problems are the results)."""
        out = {"pass@1 (greedy)": float(self.greedy.verdict == "correct")}
        correct = [s.verdict == "correct" for s in self.samples]
        answers = [s.answer for s in self.samples]
        for k in ks:
            out[f"pass@{k}"] = pass_at_k(len(correct), sum(correct), k)
        for k in ks:
            if k > 1:  # maj@1 is pass@1
                out[f"maj@{k}"] = maj_at_k(answers, correct, k)
        return out


def make_engine(cfg: RunConfig, model_dir: Path, scratch: Path) -> Any:
    """One rollout engine in this process: the run's backend and settings."""
    import torch

    from hpcrl.rollout.backends import rollout_spec
    from hpcrl.rollout.build import build_engine

    on_cpu = not torch.cuda.is_available()
    kv_gb = _cpu_kv_gb(cfg) if on_cpu and rollout_spec(cfg.rollout).cpu_kv_budget else None
    return build_engine(
        model_dir,
        cfg.rollout,
        seed=cfg.run.seed,
        max_model_len=cfg.max_seq_len,
        on_cpu=on_cpu,
        scratch=scratch,
        kv_cache_gb=kv_gb,
    )


def _cpu_kv_gb(cfg: RunConfig) -> float:
    """vLLM on CPU needs an explicit KV budget: the plan's, for the engine's max_num_seqs (evaluation
    sends every problem's samples at once)."""
    from hpcrl.plan.planner import make_plan

    return make_plan(cfg).memory.rollout.cpu_kv_gb(cfg.rollout.max_num_seqs)


def answer_all(cfg: RunConfig, model_dir: Path, examples: list[Example], log: Log) -> list[Problem]:
    """Greedy and ``eval.n`` sampled completions of every problem, scored by the verifier pool."""
    from hpcrl.rewards.pool import RewardPool, Task
    from hpcrl.rollout.base import SamplingSettings
    from hpcrl.run.driver import make_encoder
    from hpcrl.run.vision import prompt_encoder

    e, r = cfg.eval, cfg.rollout
    encode, _pad = prompt_encoder(model_dir, cfg.data, make_encoder)
    encoded = [encode(x) for x in examples]
    prompts = [p.engine for p in encoded]
    limit = cfg.data.max_prompt_tokens
    if too_long := [len(p.ids) for p in encoded if len(p.ids) > limit]:
        # the engine's context is sized from it (max_seq_len): cutting a problem short would change it
        raise HpcrlError(
            f"{len(too_long)} of {len(prompts)} prompts are longer than data.max_prompt_tokens={limit} "
            f"(the longest: {max(too_long)} tokens); raise data.max_prompt_tokens"
        )
    with tempfile.TemporaryDirectory(prefix="hpcrl-eval-") as scratch:
        engine = make_engine(cfg, model_dir, Path(scratch))
        started = time.perf_counter()
        greedy = engine.generate(prompts, SamplingSettings(1, 0.0, 1.0, r.max_new_tokens, cfg.run.seed))
        sampled = (
            engine.generate(
                prompts, SamplingSettings(e.n, e.temperature, e.top_p, r.max_new_tokens, cfg.run.seed)
            )
            if e.n
            else [[] for _ in prompts]
        )
        log(f"generated {len(prompts) * (1 + e.n)} completions in {time.perf_counter() - started:.1f}s")
    groups = [g + s for g, s in zip(greedy, sampled, strict=True)]  # greedy first, then the samples
    tasks = [
        Task(i * (1 + e.n) + j, c.text, x.answer, x.prompt)
        for i, (x, g) in enumerate(zip(examples, groups, strict=True))
        for j, c in enumerate(g)
    ]
    with RewardPool(cfg.data.verifier, cfg.rewards, cfg.data.percent) as pool:
        verdicts = [o.value for o in pool.score(tasks)]
    problems = []
    for i, (x, g) in enumerate(zip(examples, groups, strict=True)):
        done = [
            Answered(c.text, vote_key(c.text), verdicts[i * (1 + e.n) + j], len(c.token_ids), c.truncated)
            for j, c in enumerate(g)
        ]
        problems.append(Problem(x.prompt, x.answer, done[0], done[1:]))
    return problems


# -- the summary -------------------------------------------------------------------------------------
def summarize(problems: list[Problem], ks: list[int]) -> dict[str, Any]:
    """Each metric's mean over problems, the verdict counts, lengths and truncation."""
    n = max(1, len(problems))
    per = [p.scores(ks) for p in problems]
    metrics = {key: sum(s[key] for s in per) / n for key in (per[0] if per else {})}
    greedy = [p.greedy for p in problems]
    samples = [s for p in problems for s in p.samples]
    return {
        "metrics": metrics,
        "greedy": _counts(greedy),
        "samples": _counts(samples),
    }


def _counts(done: list[Answered]) -> dict[str, float]:
    m = max(1, len(done))
    counts = {
        v: sum(a.verdict == v for a in done) for v in ("correct", "wrong", "parse_error", "timeout", "error")
    }
    return {
        "completions": len(done),
        **counts,
        "mean_gen_tokens": sum(a.tokens for a in done) / m,
        "truncated": sum(a.truncated for a in done),
    }


def write_results(out: Path, about: dict[str, Any], problems: list[Problem], ks: list[int]) -> dict[str, Any]:
    from hpcrl.run.rundir import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    summary = {**about, "problems": len(problems), **summarize(problems, ks)}
    lines = []
    for i, p in enumerate(problems):
        record = {
            "index": i,
            "prompt": p.prompt,
            "reference": p.reference,
            "greedy": vars(p.greedy),
            "samples": [vars(s) for s in p.samples],
            "scores": p.scores(ks),
        }
        lines.append(json.dumps(record))
    atomic_write_text(out / "samples.jsonl", "".join(line + "\n" for line in lines))
    atomic_write_text(out / "eval.json", json.dumps(summary, indent=1) + "\n")
    return summary


def evaluate(cfg: RunConfig, target: Target, log: Log = say) -> tuple[dict[str, Any], list[Problem]]:
    """Evaluate one model: its summary (also in ``target.out``/eval.json) and its problems."""
    started = time.perf_counter()
    model_dir = model_dir_of(target, cfg, log)
    examples = eval_examples(cfg)
    if not examples:
        raise HpcrlError(
            f"data '{cfg.data.name}' gave no problems to evaluate (data.source={cfg.data.source})"
        )
    log(
        f"{target.label}: {len(examples)} problems from {cfg.data.name}, 1 greedy + {cfg.eval.n} samples each"
    )
    problems = answer_all(cfg, model_dir, examples, log)
    about = {
        "model": target.label,
        "model_dir": str(model_dir),
        "data": cfg.data.name,
        "verifier": cfg.data.verifier,
        "rollout": cfg.rollout.backend,
        "seed": cfg.run.seed,
        "n": cfg.eval.n,
        "k": list(cfg.eval.k),
        "temperature": cfg.eval.temperature,
        "top_p": cfg.eval.top_p,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "seconds": round(time.perf_counter() - started, 1),
    }
    summary = write_results(target.out, about, problems, list(cfg.eval.k))
    log(f"{target.label}: results in {target.out}")
    return summary, problems


def compare(cfg: RunConfig, before: list[Problem], after: list[Problem]) -> dict[str, Difference]:
    """Every metric's after - before over the same problems, with a paired-bootstrap interval."""
    if [p.prompt for p in before] != [p.prompt for p in after]:
        raise HpcrlError("the two evaluations answered different problems; they cannot be compared")
    ks = list(cfg.eval.k)
    b, a = [p.scores(ks) for p in before], [p.scores(ks) for p in after]
    return {
        key: paired_bootstrap(
            [s[key] for s in b],
            [s[key] for s in a],
            resamples=cfg.eval.bootstrap_resamples,
            level=cfg.eval.confidence,
            seed=cfg.run.seed,
        )
        for key in (b[0] if b else {})
    }


# -- printing -----------------------------------------------------------------------------------------
def table(summary: dict[str, Any]) -> str:
    """The summary as a few aligned lines."""
    rows = [
        f"{summary['model']}  ({summary['problems']} problems, {summary['data']}, seed {summary['seed']})"
    ]
    for key, value in summary["metrics"].items():
        rows.append(f"  {key:<18} {value:7.3f}")
    for part in ("greedy", "samples"):
        c = summary[part]
        if c["completions"]:
            rows.append(
                f"  {part:<18} {c['completions']} completions: {c['parse_error']} parse failures, "
                f"{c['timeout']} timeouts, {c['error']} verifier errors, {c['truncated']} truncated, "
                f"{c['mean_gen_tokens']:.1f} tokens on average"
            )
    return "\n".join(rows)


def compare_table(diffs: dict[str, Difference], before: str, after: str) -> str:
    if not diffs:
        return ""
    level = next(iter(diffs.values())).level
    rows = [f"{before} -> {after}  (paired bootstrap over problems, {level:.0%} interval)"]
    for key, d in diffs.items():
        rows.append(
            f"  {key:<18} {d.before:.3f} -> {d.after:.3f}  {d.delta:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"
            f"  ({d.improved} up, {d.worsened} down)"
        )
    return "\n".join(rows)


def run_eval(
    overrides: list[str], spec: str, out: Path | None, against: str | None, *, here: bool = False
) -> int:
    """``hpcrl eval``: evaluate MODEL (and ``--compare``'s model), print the tables. A Slurm cluster
    queues the same command as a one-node job (``eval_job.py``), which runs it ``here``."""
    from dataclasses import asdict

    from hpcrl.config.compose import compose_config

    root = Path(compose_config(list(overrides)).run.output_root)
    target = resolve_target(spec, out, root)
    cfg = _config_for(target, overrides)
    other = None
    if against is not None:  # checked before anything is queued
        other = base_target(target) if against == "base" else resolve_target(against, None, target.out.parent)
    if cfg.cluster.scheduler.value != "local" and not here:
        from hpcrl.tools.eval_job import submit_eval

        done = submit_eval(run_eval, cfg, target.out, overrides, spec, against)
        print(f"job     {done.job_id}  (eval on 1 node of {cfg.cluster.name})")
        print(f"eval    {done.run_dir}")
        for path in done.logs:
            print(f"log     {path}")
        return 0
    if target.run_dir is not None and (note := data_mismatch(target.run_dir, cfg)):
        say(note)
    summary, problems = evaluate(cfg, target)
    print(table(summary))
    if other is None:
        return 0
    other_summary, other_problems = evaluate(cfg, other)
    print(table(other_summary))
    diffs = compare(cfg, other_problems, problems)
    print(compare_table(diffs, other.label, target.label))
    from hpcrl.run.rundir import atomic_write_text

    record = {"before": other_summary["model_dir"], "after": summary["model_dir"]}
    record |= {"differences": {k: asdict(d) for k, d in diffs.items()}}
    atomic_write_text(target.out / "compare.json", json.dumps(record, indent=1) + "\n")
    return 0


def data_mismatch(run_dir: Path, cfg: RunConfig) -> str:
    """A note when the run trained on other data than this eval reads: eval composes its config from
    the command line (as ``submit`` does), not from the run's config.yaml."""
    from dataclasses import asdict

    import yaml

    path = run_dir / "config.yaml"
    if not path.exists():
        return ""
    trained = (yaml.safe_load(path.read_text()) or {}).get("data", {})
    now = asdict(cfg.data)
    differ = sorted(k for k in set(trained) | set(now) if trained.get(k) != now.get(k))
    if not differ:
        return ""
    shown = " ".join(f"data.{k}={trained.get(k)}" for k in differ[:4])
    return (
        f"note: the run trained with {shown}; this eval reads data '{cfg.data.name}' (pass data=... to match)"
    )


def _config_for(target: Target, overrides: list[str]) -> RunConfig:
    """The config composed from the overrides, as ``hpcrl submit`` would; when that names another
    catalog model than the one the target is, ``model=<it>`` goes first (its catalog entry and quirks)."""
    from hpcrl.config.compose import compose_config
    from hpcrl.plan.planner import make_plan

    cfg = compose_config(list(overrides))
    chosen = any(o.lstrip("+").split("=", 1)[0] == "model" for o in overrides)
    if target.catalog and cfg.model.name != target.catalog and not chosen:
        cfg = compose_config([f"model={target.catalog}", *overrides])
    return make_plan(cfg).cfg  # with the model's quirks applied, as a training run has them
