"""``hpcrl eval``: a real tiny model answered by the hf engine on CPU, scored by the real verifier pool.

The fast test evaluates an exported-style HF directory (the random tiny model) twice with one seed and
once with another; the slow one trains a few steps and checks that the eval of the run's starting model
and of its best checkpoint reproduce the training loop's own validation accuracy at those steps.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from hpcrl.algo.passk import maj_at_k, pass_at_k, vote_key
from hpcrl.cli import main
from tests.conftest import run_cli

SMALL = ["rollout=hf", "eval.max_problems=12", "eval.n=4", "eval.k=[1,2,4]", "rewards.processes=1"]


def _eval(tiny_dir, out, *extra):
    assert main(["eval", str(tiny_dir), *SMALL, *extra, "--out", str(out)]) == 0
    summary = json.loads((out / "eval.json").read_text())
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return summary, records


def test_eval_is_deterministic_for_a_seed_and_writes_every_verdict(tiny_dir, tmp_path, capsys):
    first, records = _eval(tiny_dir, tmp_path / "a")
    second, again = _eval(tiny_dir, tmp_path / "b")
    table = capsys.readouterr().out
    assert records == again  # the same completions, answers and verdicts
    assert first["metrics"] == second["metrics"]
    assert (first["problems"], first["n"], first["k"], first["rollout"]) == (12, 4, [1, 2, 4], "hf")
    assert len(records) == 12 and all(len(r["samples"]) == 4 for r in records)
    assert "pass@1 (greedy)" in table and "maj@4" in table and "parse failures" in table

    for r in records:  # each problem's scores follow from its own verdicts and answers
        done = [r["greedy"], *r["samples"]]
        assert all(d["answer"] == vote_key(d["text"]) for d in done)
        assert set(d["verdict"] for d in done) <= {"correct", "wrong", "parse_error", "timeout", "error"}
        correct = [s["verdict"] == "correct" for s in r["samples"]]
        assert r["scores"]["pass@1 (greedy)"] == float(r["greedy"]["verdict"] == "correct")
        assert r["scores"]["pass@2"] == pytest.approx(pass_at_k(4, sum(correct), 2))
        assert r["scores"]["maj@4"] == maj_at_k([s["answer"] for s in r["samples"]], correct, 4)
    for key, value in first["metrics"].items():  # the summary is the mean over problems
        assert value == pytest.approx(sum(r["scores"][key] for r in records) / 12)
    counts = first["samples"]
    verdicts = [s["verdict"] for r in records for s in r["samples"]]
    assert counts["completions"] == 48 and counts["parse_error"] == verdicts.count("parse_error")
    assert counts["timeout"] == verdicts.count("timeout") == 0

    _, other_seed = _eval(tiny_dir, tmp_path / "c", "run.seed=7")
    texts = [[s["text"] for s in r["samples"]] for r in records]
    assert texts != [[s["text"] for s in r["samples"]] for r in other_seed]  # the seed is honoured


def test_eval_refuses_bad_input_in_one_line(tiny_dir, tmp_path, capsys):
    assert main(["eval", str(tiny_dir), "eval.n=2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hpcrl: error: eval.k=[1, 4, 8]") and "eval.n=2" in err and "\n" not in err
    assert main(["eval", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory nor a catalog model" in capsys.readouterr().err
    assert main(["eval", str(tiny_dir), "eval.typo=1"]) == 2
    assert "eval.typo" in capsys.readouterr().err
    assert main(["eval", str(tiny_dir), "--compare", "base"]) == 2  # an HF dir has no starting model
    assert "--compare base needs a run" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing ran
    data = tmp_path / "problems.jsonl"  # MATH-500-style records, one far longer than the limit
    data.write_text(json.dumps({"problem": "What is $1+1$? " * 8, "answer": "2"}) + "\n")
    long = ["data=math500", f"data.source={data}", "data.max_prompt_tokens=32", "rollout=hf"]
    assert main(["eval", str(tiny_dir), *long, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "1 of 1 prompts are longer than data.max_prompt_tokens=32 (the longest: 1" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_eval_of_a_run_reproduces_its_validation_and_compares_with_the_base(tmp_path, model_cache):
    """Train 4 steps (hf engine); ``hpcrl eval RUN --compare base``: the base model's greedy pass@1 is the
    run's step-0 validation accuracy and the best checkpoint's is its step-4 one (same problems, same
    greedy decoding, another process), and the difference comes with its bootstrap interval."""
    os.environ["HPCRL_CACHE"] = str(model_cache)
    try:
        train = ["rollout=hf", "algo.max_steps=4", "algo.val_period=4", "checkpoint.period=4"]
        done = run_cli("submit", f"run.output_root={tmp_path}", *train, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        (run_dir,) = tmp_path.iterdir()
        assert f"hpcrl eval {run_dir} --compare base" in done.stdout
        result = run_cli("eval", str(run_dir), "rollout=hf", "eval.n=2", "eval.k=[1,2]", "--compare", "base")
    finally:
        os.environ.pop("HPCRL_CACHE")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    val = {
        r["step"]: r["val/accuracy"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "val/accuracy" in r
    }
    trained = json.loads((run_dir / "eval" / "step_000004" / "eval.json").read_text())
    base = json.loads((run_dir / "eval" / "base" / "eval.json").read_text())
    assert base["metrics"]["pass@1 (greedy)"] == pytest.approx(val[0])
    assert trained["metrics"]["pass@1 (greedy)"] == pytest.approx(val[4])
    diff = json.loads((run_dir / "eval" / "step_000004" / "compare.json").read_text())["differences"]
    greedy = diff["pass@1 (greedy)"]
    assert greedy["delta"] == pytest.approx(val[4] - val[0])
    assert greedy["low"] <= greedy["delta"] <= greedy["high"] and greedy["level"] == 0.95
    assert "base -> step_000004" in result.stdout and "pass@1 (greedy)" in result.stdout


def test_a_note_when_the_run_trained_on_other_data(tmp_path):
    from hpcrl.config.compose import compose_config
    from hpcrl.run.rundir import write_resolved_config
    from hpcrl.tools.evaluate import data_mismatch

    write_resolved_config(compose_config([]), tmp_path)
    assert data_mismatch(tmp_path, compose_config([])) == ""
    note = data_mismatch(tmp_path, compose_config(["data.max_val_samples=64"]))
    assert note.startswith("note: the run trained with data.max_val_samples=128;")


@pytest.mark.slow
def test_eval_as_a_slurm_job_returns_at_once_and_gives_the_local_results(slurm_cluster, tiny_dir, tmp_path):
    """``cluster=slurmtest``: queued as a one-node job (the command returns with its id), run there by
    the same code; the job's results equal this machine's for the same seed."""
    from hpcrl.launch import lifecycle

    # a cluster= override drops the embedded default's recipe: name what the eval reads on both sides
    same = ["rollout.max_new_tokens=8", "rollout.max_num_seqs=64", "data.max_prompt_tokens=16"]
    args = ["eval", str(tiny_dir), *SMALL, *same, f"run.output_root={tmp_path}"]
    queued = run_cli(*args, "cluster=slurmtest", "--out", str(tmp_path / "job"))
    assert queued.returncode == 0, queued.stdout + queued.stderr
    job_id = re.search(r"^job\s+(\d+)", queued.stdout, re.M).group(1)
    assert lifecycle.run_dir_of(job_id, tmp_path) == tmp_path / "job"  # `hpcrl logs/status` find it
    state = lifecycle.wait(job_id, tmp_path / "job", timeout_s=600)
    logs = "".join(p.read_text() for p in (tmp_path / "job" / "slurm").glob("*_log.*"))
    assert state == "COMPLETED", logs[-3000:]
    local = run_cli(*args, "--out", str(tmp_path / "here"))
    assert local.returncode == 0, local.stderr[-3000:]
    on_node = json.loads((tmp_path / "job" / "eval.json").read_text())
    assert on_node["metrics"] == json.loads((tmp_path / "here" / "eval.json").read_text())["metrics"]
    assert (tmp_path / "job" / "samples.jsonl").read_text() == (
        tmp_path / "here" / "samples.jsonl"
    ).read_text()
