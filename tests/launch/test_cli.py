"""The CLI through its real entry point."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import JOB_FETCH, ROOT, SITE, compose, run_cli
from tests.harness.hub_standin import HubStandIn, publish_for


def test_plan_default_prints_tables_and_fits(cli):
    result = cli("plan")
    assert result.returncode == 0, result.stderr
    for title in ("Nodes: 1 x 1 GPUs, colocated", "Parallelism", "Memory per GPU", "fits"):
        assert title in result.stdout


def test_documented_form_plans_the_seed_recipe_and_lists_the_other_layout(cli):
    """Issue 32: the headline command plans the model's default recipe for the cluster (the seed's
    DAPO + Megatron job, exit 0), says so, and lists the other shipped layout beside it."""
    result = cli("plan", "+cluster=gb200", "+model=nemotron_super", *JOB_FETCH)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("DAPO · megatron · data dapo_math_17k")
    assert "recipe dapo-nemotron-super-5n4g-megatron: the default for nemotron_super on" in result.stdout
    assert "auto layout" not in result.stdout and "Nodes: 5 x 4 GPUs, split" in result.stdout
    assert "+experiment=dapo-nemotron-super-5n4g-megatron-tp4cp4ep4etp4" in result.stdout


def test_plan_shows_quirks_and_sbatch(cli):
    result = cli("plan", "+experiment=grpo-gemma3-1b-it-1n8g-fsdp2tp1", *JOB_FETCH)
    assert result.returncode == 0, result.stderr
    assert "rollout.block_size=32" in result.stdout and "rollout.load_format=auto" in result.stdout
    assert "acct" in result.stdout and "img.sqsh" in result.stdout


def test_render_writes_script_and_resolved_config(cli, tmp_path):
    out = tmp_path / "run"
    result = cli("render", "+experiment=dapo-nemotron-super-5n4g-megatron", *JOB_FETCH, "--out", str(out))
    assert result.returncode == 0, result.stderr
    script = (out / "sbatch.sh").read_text()
    assert script.startswith("#!/bin/bash") and "#SBATCH --nodes=5" in script
    assert f"{out.resolve()}/slurm/%j_0_log.out" in script
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["trainer"]["ep"] == 16
    assert resolved["trainer"]["router_dtype"] == "fp32"  # quirks are in the resolved config


def test_render_local_writes_config_only(cli, tmp_path):
    result = cli("render", "--out", str(tmp_path / "r"))
    assert result.returncode == 0
    assert (tmp_path / "r" / "config.yaml").exists() and not (tmp_path / "r" / "sbatch.sh").exists()


def test_show_groups_lists_catalog(cli):
    result = cli("show", "--groups")
    assert "nemotron_super" in result.stdout and "gb200" in result.stdout
    assert "dapo-gemma4-26ba4b-it-4n8g-fsdp2ep16cp2" in result.stdout


def test_show_prints_yaml(cli):
    result = cli("show", "model=gemma3_1b")
    assert yaml.safe_load(result.stdout)["model"]["head_dim"] == 256


def test_plan_and_render_do_not_import_heavy_frameworks(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from hpcrl.cli import main\n"
        f"main(['render', '+experiment=dapo-nemotron-super-5n4g-megatron', *{SITE!r}, '--out', {str(tmp_path)!r}])\n"
        "main(['plan'])\n"
        "heavy = sorted(m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "HEAVY=\n" in result.stdout, result.stdout[-500:] + result.stderr[-500:]


def test_fsdp_context_parallel_plans_and_what_fsdp_cannot_split_is_refused_before_submit(tmp_path):
    """fsdp splits sequences over attention (trainer.cp) and experts over trainer.ep: the CP2 and
    EP16 x CP2 recipes plan and may be submitted.
    Tensor parallel and CP over Mamba layers are not run as something else (plain data parallel, with
    more memory per GPU than the plan says), nor an expert degree over experts fsdp cannot split
    (Nemotron-H's are not gated): refused before anything is written."""
    site = JOB_FETCH
    recipe = "+experiment=dapo-gemma4-e2b-it-1n8g-fsdp2cp2"
    plan = run_cli("plan", recipe, *site)
    assert plan.returncode == 0 and "cannot submit yet" not in plan.stdout, plan.stdout + plan.stderr
    # the seed's EP16 x CP2 layout plans as named (EP 16 of 32 GPUs: expert DP 2)
    moe = run_cli("plan", "+experiment=dapo-gemma4-26ba4b-it-4n8g-fsdp2ep16cp2", *site)
    assert moe.returncode == 0 and "cannot submit yet" not in moe.stdout, moe.stdout + moe.stderr
    assert re.search(r"train\s*│\s*32\s*│\s*1\s*│\s*1\s*│\s*2\s*│\s*16\s*│.*expert DP 2", moe.stdout)
    refused = [
        (
            (recipe, "trainer.tp=2"),
            "trainer=fsdp has no tensor parallelism yet (trainer.tp=2): set trainer.tp=1",
        ),
        (
            (recipe, "model=tiny_nemotronh"),
            "trainer=fsdp splits sequences over attention only, and tiny_nemotronh has Mamba layers: "
            "set trainer.cp=1",
        ),
        (
            (recipe, "model=tiny_nemotronh", "trainer.cp=1", "trainer.ep=2"),
            "trainer=fsdp splits the experts of qwen3_moe, gemma4 over trainer.ep, not tiny_nemotronh's",
        ),
    ]
    for overrides, why in refused:
        for command in ("submit", "render", "plan"):  # plan and render refuse what submit refuses
            done = run_cli(command, *overrides, f"run.output_root={tmp_path}", *site)
            assert done.returncode == 2 and why in " ".join(done.stderr.split()), (command, done.stderr)
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing submitted


def test_plan_shows_both_gb200_layouts_with_their_peaks(cli):
    result = cli("plan", "+experiment=dapo-nemotron-super-5n4g-megatron", *JOB_FETCH)
    assert result.returncode == 0, result.stderr
    assert "Shipped layouts for nemotron_super on gb200" in result.stdout
    rows = [line for line in result.stdout.splitlines() if "+experiment=dapo-nemotron-super-5n4g" in line]
    assert len(rows) == 2 and all("fits" in row and "/ 189" in row for row in rows), rows
    assert any("(this plan)" in row and "2 x 1 x 1 x 16 x 1 (8)" in row for row in rows)
    assert any("-tp4cp4ep4etp4" in row and "4 x 4 x 1 x 4 x 4 (1)" in row for row in rows)
    assert "checkpoint 123.61B with MTP" in result.stdout  # 120.67B trained, MTP in the checkpoint only


@pytest.mark.parametrize(
    "recipe",
    [
        "dapo-nemotron-super-5n4g-megatron",
        "dapo-nemotron-super-5n4g-megatron-tp4cp4ep4etp4",
        "dapo-nemotron-super-3n8g-megatron",
    ],
)
def test_super_recipes_are_accepted_by_submit(recipe, tmp_path):
    """`hpcrl submit` takes each Super recipe to sbatch: the Slurm binaries are faked at the edge (a
    `sbatch` that keeps the script and answers with a job id, an `srun` that submitit looks for); the
    script it is handed is the golden one but for the run directory."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        f'#!/bin/sh\ncp "$1" {tmp_path}/submitted.sh\necho "Submitted batch job 4242"\n'
    )
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = tmp_path / "runs"
    hf_home = tmp_path / "hf"
    # the goldens' placeholders; the model and data sets fetched into a cache first, from a stand-in hub
    site = [
        "cluster.slurm.account=ACCOUNT",
        "cluster.container.image=IMAGE",
        f"+cluster.env.HF_HOME={hf_home}",
    ]
    exe = Path(sys.executable).with_name("hpcrl")
    cfg = compose(f"+experiment={recipe}", *site)
    data = cfg.data
    sources = [
        (data.source, data.split, (data.prompt_field, data.answer_field)),
        (
            data.val_source,
            data.val_split,
            (data.val_prompt_field or data.prompt_field, data.val_answer_field or data.answer_field),
        ),
    ]
    with HubStandIn(publish_for(cfg.model.hf_id, sources)) as hub:
        fetched = subprocess.run(
            [str(exe), "fetch", f"+experiment={recipe}", *site],
            capture_output=True,
            text=True,
            env={**env, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
            timeout=120,
            cwd=ROOT,
        )
    assert fetched.returncode == 0, fetched.stderr
    assert fetched.stdout.count("fetched") == 3, fetched.stdout  # the model, the training and validation sets
    result = subprocess.run(
        [str(exe), "submit", f"+experiment={recipe}", f"run.output_root={out}", *site],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "job     4242" in result.stdout
    run_dir = Path(re.search(r"^run dir (.+)$", result.stdout, re.M).group(1))
    golden = (ROOT / "sbatch" / f"{recipe}.sbatch").read_text()
    expected = golden.replace(f"/RUN_DIR/{recipe}", str(run_dir)).replace("/HF_HOME", str(hf_home))
    assert (tmp_path / "submitted.sh").read_text() == expected


def test_plan_and_render_refuse_what_submit_refuses_with_its_line_and_write_nothing(cli, tmp_path):
    """A cache the job's container would mount but that does not exist: submit refuses it, and so do
    render (no script), plan (after its tables), debug and run, with submit's line and exit code."""
    missing = tmp_path / "no-cache"
    out = tmp_path / "run"
    args = ["+experiment=dapo-nemotron-super-5n4g-megatron", *SITE, "model.fetch=job"]
    args += [f"+cluster.env.HF_HOME={missing}", f"run.output_root={tmp_path / 'runs'}"]
    line = f"hpcrl: error: cluster.env.HF_HOME={missing} does not exist"
    rendered = cli("render", *args, "--out", str(out))
    assert rendered.returncode == 2 and rendered.stderr.startswith(line), rendered.stderr
    assert not out.exists()
    planned = cli("plan", *args)
    assert planned.returncode == 2 and planned.stderr.startswith(line), planned.stderr
    assert "Memory per GPU" in planned.stdout  # the tables it could compute come first
    submitted = cli("submit", *args)
    assert submitted.returncode == 2 and submitted.stderr == rendered.stderr == planned.stderr
    # a debug session and a driver run in one (issue 37 item 8) ask the same gate before anything else
    for command in (["debug"], ["run", "--job", "4242"]):
        refused = cli(*command, *args)
        assert refused.returncode == 2 and refused.stderr == submitted.stderr, (command, refused.stderr)
    assert not (tmp_path / "runs").exists()


def test_a_debug_session_refuses_what_submit_refuses_before_any_job(cli, tmp_path):
    """Issue 37 item 8: `hpcrl debug` asks the gate submit asks (here its context check, which the
    session's submit did not make), so no job is held for a run every `hpcrl run` would refuse."""
    args = [
        "+experiment=grpo-tiny-2n1g-fsdp-split",
        "rollout.max_new_tokens=4096",
        f"run.output_root={tmp_path}",
    ]
    submitted = cli("submit", *args)
    assert submitted.returncode == 2 and "exceed the 64 positions of tiny" in submitted.stderr, (
        submitted.stderr
    )
    debug = cli("debug", *args)
    assert debug.returncode == 2 and debug.stderr == submitted.stderr, debug.stderr
    assert not any(tmp_path.iterdir())  # no run directory: nothing was submitted
