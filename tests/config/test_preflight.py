"""Mistakes that used to plan and then fail inside the job: each is one line from `hpcrl plan` now,
naming the key and the fix, through the real command line."""

from __future__ import annotations

import os

import pytest

from tests.conftest import JOB_FETCH, ROOT, SITE, run_cli

GEMMA_MEGATRON = ["+experiment=grpo-gemma3-1b-it-1n8g-fsdp2tp1", "trainer=megatron", *JOB_FETCH]


def refused(*overrides: str) -> str:
    result = run_cli("plan", *overrides)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # one line
    return result.stderr


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["data.template=cott"], "data.template=cott is not a prompt template; use one of: plain, cot, dapo"),
        (
            ["data.verifier=mathh"],
            "data.verifier=mathh is not a verifier (no HPCRL_PLUGINS module registers it); use one of: exact, math",
        ),
        (
            [*GEMMA_MEGATRON, "trainer.pp=4"],
            "trainer.pp=4 does not divide gemma3_1b's 26 layers (model.num_layers): pipeline stages hold equal numbers of layers; use trainer.pp in 1, 2, 13, 26",
        ),
        (
            ["data.source=no/such/train.jsonl"],
            "data.source=no/such/train.jsonl does not exist on this machine",
        ),
        (["data.val_source=no/such/val.parquet"], "data.val_source=no/such/val.parquet does not exist"),
        (["model.name=gemma3_1b"], "model.name=gemma3_1b contradicts the model group's choice 'tiny'"),
        (
            ["+cluster=h100", "cluster.name=gb200", *SITE],
            "cluster.name=gb200 contradicts the cluster group's choice 'h100'",
        ),
    ],
)
def test_plan_refuses_what_the_job_would_fail_on(overrides, fragment):
    assert f"hpcrl: error: {fragment}" in refused(*overrides)


def test_missing_source_names_the_flag_for_paths_only_the_nodes_see():
    stderr = refused("data.source=/lustre/only-on-nodes/train.jsonl")
    assert "set data.check_source=false if it is visible only on the compute nodes" in stderr
    result = run_cli("plan", "data.source=/lustre/only-on-nodes/train.jsonl", "data.check_source=false")
    assert result.returncode == 0, result.stderr


def test_an_existing_source_is_checked_relative_to_the_submit_directory(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    result = run_cli("plan", "data.source=train.jsonl", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    result = run_cli("plan", "data.source=train.jsonl")  # the repository has no such file
    assert result.returncode == 2 and f"({ROOT / 'train.jsonl'})" in result.stderr


def test_a_source_deleted_after_a_cached_plan_is_still_refused(tmp_path):
    """The compose cache keeps config checks, not the filesystem's answer."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    assert run_cli("plan", f"data.source={data}").returncode == 0
    data.unlink()
    assert "does not exist" in refused(f"data.source={data}")


def test_pp_that_divides_the_layers_plans():
    result = run_cli("plan", *GEMMA_MEGATRON, "trainer.pp=2")
    assert result.returncode == 0 and "fits" in result.stdout, result.stderr


def test_a_plugin_verifier_is_accepted_and_a_broken_plugin_named(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "from hpcrl.rewards.verifiers import Outcome, Verdict, register\n"
        "@register('yes')\n"
        "def yes(completion, answer, prompt=''):\n"
        "    return Verdict(Outcome.correct)\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("HPCRL_PLUGINS", "my_rewards")
    assert run_cli("plan", "data.verifier=yes").returncode == 0
    monkeypatch.setenv("HPCRL_PLUGINS", "my_rewardz")
    stderr = refused("data.verifier=yes")
    assert "data.verifier=yes: HPCRL_PLUGINS=my_rewardz does not import here (ModuleNotFoundError" in stderr


def test_a_data_file_without_the_fields_the_run_reads_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "q.jsonl").write_text('\n{"question": "1+1", "answer": "2"}\n')
    stderr = refused(f"data.source={tmp_path / 'q.jsonl'}")
    assert (
        f"data.source={tmp_path / 'q.jsonl'}: records have no field 'problem' (set data.prompt_field"
        in stderr
    )
    assert (
        run_cli("plan", f"data.source={tmp_path / 'q.jsonl'}", "data.prompt_field=question").returncode == 0
    )
    rows = [{"prompt": [{"role": "user", "content": "2*3"}], "reward_model": {"ground_truth": "6"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert (
        run_cli(
            "plan", "data=dapo_math_17k", f"data.source={tmp_path / 'd.parquet'}", "data.val_source=null"
        ).returncode
        == 0
    )
    stderr = refused(
        "data=dapo_math_17k", f"data.source={tmp_path / 'd.parquet'}", "data.answer_field=reward_model.truth"
    )
    assert "records have no field 'reward_model.truth'" in stderr
