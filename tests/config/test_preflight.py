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
    assert "HPCRL_PLUGINS=my_rewardz: no module my_rewardz here (the job's reward processes import" in stderr
    (tmp_path / "broken_rewards.py").write_text("import no_such_dependency\n")  # registers nothing it shows
    monkeypatch.setenv("HPCRL_PLUGINS", "broken_rewards")
    stderr = refused("data.verifier=yes")
    assert (
        "data.verifier=yes: HPCRL_PLUGINS=broken_rewards does not import here (ModuleNotFoundError" in stderr
    )


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


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            ["checkpoint.metric=val/acc"],
            "checkpoint.metric=val/acc is not a metric the run logs, so no checkpoint would rank; use one "
            "of: val/accuracy, val/parse_error_rate",
        ),
        (
            ["checkpoint.metric=val/parse_error_rate"],
            "checkpoint.higher_is_better=true keeps the worst checkpoints by "
            "checkpoint.metric=val/parse_error_rate: set checkpoint.higher_is_better=false",
        ),
        (
            ["rollout.max_new_tokens=49"],
            "data.max_prompt_tokens=16 + rollout.max_new_tokens=49 = 65 tokens exceed the 64 positions of "
            "tiny (model.max_position_embeddings): its engines refuse a longer context; lower it, e.g. "
            "rollout.max_new_tokens=48",
        ),
        (["trainer.max_seq_len=128"], "trainer.max_seq_len=128 exceed the 64 positions of tiny"),
    ],
)
def test_plan_refuses_what_the_run_cannot_hold_or_rank(overrides, fragment, tmp_path):
    """A metric the run never logs (or ranked the wrong way), a context past the model's positions;
    render refuses the same, writing nothing."""
    assert f"hpcrl: error: {fragment}" in refused(*overrides)
    rendered = run_cli("render", *overrides, "--out", str(tmp_path / "r"))
    assert rendered.returncode == 2 and fragment in rendered.stderr and not (tmp_path / "r").exists()


def test_the_context_the_model_holds_plans():
    assert run_cli("plan", "rollout.max_new_tokens=48").returncode == 0  # 16 + 48 = the 64 positions


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("a.jsonl", '\n{"problem": "1+1", "answer": 2\n', "line 2 is not JSON (Expecting ',' delimiter"),
        ("a.jsonl", '["1+1", "2"]\n', "the first record is a JSON list, not an object with fields"),
        ("a.jsonl", "\n\n", "holds no record; point it at the data set's file"),
        ("a.parquet", "not parquet", "is not a readable parquet file ("),
    ],
)
def test_a_data_file_that_does_not_parse_is_refused(tmp_path, name, text, fragment):
    (tmp_path / name).write_text(text)
    stderr = refused(f"data.source={tmp_path / name}")
    assert stderr.startswith(f"hpcrl: error: data.source={tmp_path / name}") and fragment in stderr


def test_an_image_field_the_records_lack_is_refused(tmp_path):
    (tmp_path / "v.jsonl").write_text('{"problem": "area?", "answer": "2"}\n')
    stderr = refused(
        "+experiment=vlm_grpo-gemma4-e4b-it-1n8g-fsdp2", *JOB_FETCH, f"data.source={tmp_path / 'v.jsonl'}"
    )
    assert (
        f"data.source={tmp_path / 'v.jsonl'}: records have no field 'images' (data.image_field); name the "
        "field that holds the images" in stderr
    )


def test_plugins_are_found_not_imported_and_a_missing_one_is_named(tmp_path, monkeypatch):
    """A plugin that cannot be imported here (it would need the job's GPU stack) still plans when its
    source registers the verifier: the planner finds it without importing it. A module not found is
    refused even when data.verifier is built in: the job's reward processes import every one."""
    (tmp_path / "gpu_rewards.py").write_text(
        "raise RuntimeError('imported on the planner side')\n"
        "from hpcrl.rewards.verifiers import register\n"
        "@register('judge')\n"
        "def judge(completion, answer, prompt=''):\n"
        "    pass\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("HPCRL_PLUGINS", "gpu_rewards")
    planned = run_cli("plan", "data.verifier=judge")
    assert planned.returncode == 0, planned.stderr
    monkeypatch.setenv("HPCRL_PLUGINS", "gpu_rewards,no_such_rewards")
    stderr = refused()  # data.verifier=math, built in
    assert "HPCRL_PLUGINS=gpu_rewards,no_such_rewards: no module no_such_rewards here" in stderr


def test_wandb_online_needs_a_key_where_the_job_starts_and_wandb_on(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no `wandb login` either
    online = ["logger.wandb=true", "logger.wandb_mode=online"]
    assert "hpcrl: error: logger.wandb_mode=online needs a wandb key: export WANDB_API_KEY" in refused(
        *online
    )
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert run_cli("plan", *online).returncode == 0  # logged in
    stderr = refused("logger.wandb_mode=online")
    assert "logger.wandb_mode=online does nothing with logger.wandb=false: set logger.wandb=true" in stderr
