"""The job's container: the mounts the sbatch asks for (run dir, HF cache, IMEX directory), the check before
submit that every path the job opens is under them, and the site's setup lines and extra sbatch options
in the rendered script. Real configs, plans and renderings; no Slurm needed."""

from __future__ import annotations

import copy
import re

import pytest

from hpcrl.errors import ConfigError
from hpcrl.launch.mounts import IMEX_DIR, Mount, auto_mounts, check_mounts, job_mounts, seen_through, visible
from hpcrl.launch.sbatch import container_args, render_sbatch
from hpcrl.launch.submit import submit
from hpcrl.plan.planner import make_plan
from tests.conftest import compose, run_cli

SPLIT = "+experiment=grpo-tiny-2n1g-fsdp-split"  # two Slurm nodes, tiny local model, synthetic data


@pytest.fixture(scope="module")
def base_cfg():
    return compose(SPLIT, "cluster.container.image=/img/hpcrl.sqsh")


@pytest.fixture
def cfg(base_cfg, tmp_path):
    """A fresh copy with the HF cache in a directory of its own that exists."""
    cfg = copy.deepcopy(base_cfg)
    (tmp_path / "hf").mkdir()
    cfg.cluster.env["HF_HOME"] = str(tmp_path / "hf")
    return cfg


def mounts(*entries: str) -> list[Mount]:
    return [Mount.parse(e) for e in entries]


# ---- what the container sees -------------------------------------------------------------------------


def test_an_identity_mount_shows_the_host_path_as_itself():
    site = mounts("/lustre:/lustre")
    assert visible("/lustre/u/run", site) and visible("/lustre", site)
    assert not visible("/lustre2/u", site)  # a prefix of the name is not a parent directory
    assert not visible("/home/u/run", site)


def test_a_moved_mount_does_not_show_the_host_path():
    """/lustre/proj:/data shows /lustre/proj/x at /data/x: the host path hpcrl hands the job is wrong."""
    site = mounts("/lustre/proj:/data")
    assert not visible("/lustre/proj/x", site) and seen_through("/lustre/proj/x", site) is None
    assert seen_through("/data/x", site) == site[0]  # the container's /data/x is not the host's


def test_nested_mounts_the_deepest_destination_wins():
    # a moved mount elsewhere does not hide the identity mount's files
    assert visible("/lustre/proj/x", mounts("/lustre:/lustre", "/lustre/proj:/data"))
    # a mount onto a directory inside an identity mount hides the host's files there
    shadow = mounts("/lustre:/lustre", "/scratch:/lustre/scratch")
    assert visible("/lustre/u", shadow) and not visible("/lustre/scratch/u", shadow)
    assert seen_through("/lustre/scratch/u", shadow) == shadow[1]
    # an identity mount deeper than a moved one shows its own directory again
    assert visible("/data/keep/x", mounts("/other:/data", "/data/keep:/data/keep"))
    # two mounts on one destination: pyxis mounts them in order, the last is on top
    assert visible("/d/x", mounts("/a:/d", "/d:/d")) and not visible("/d/x", mounts("/d:/d", "/a:/d"))
    # flags after the destination do not change the paths
    assert visible("/lustre/x", mounts("/lustre:/lustre:ro"))


# ---- automatic mounts ----------------------------------------------------------------------------------


def test_the_run_dir_and_cache_are_mounted_when_no_site_mount_shows_them(cfg, tmp_path):
    cluster, run_dir, hf = cfg.cluster, tmp_path / "runs" / "r1", str(tmp_path / "hf")
    assert auto_mounts(cluster, run_dir) == [f"{run_dir}:{run_dir}", f"{hf}:{hf}"]
    cluster.container.mounts = [f"{tmp_path}:{tmp_path}"]  # both lie under it
    assert auto_mounts(cluster, run_dir) == []
    cluster.container.mounts = [f"{tmp_path}:/scratch"]  # moved: the host paths would be wrong inside
    assert auto_mounts(cluster, run_dir) == [f"{run_dir}:{run_dir}", f"{hf}:{hf}"]
    cluster.container.mounts = [f"{tmp_path}:{tmp_path}", f"/elsewhere:{tmp_path / 'runs'}"]  # shadowed
    assert auto_mounts(cluster, run_dir) == [f"{run_dir}:{run_dir}"]
    assert job_mounts(cluster, None) == cluster.container.mounts  # no run dir, cache already shown


def test_the_cache_mounted_is_the_one_the_job_uses(cfg, tmp_path, monkeypatch):
    """cluster.env.HF_HOME, else the submitting shell's HF_HOME (sbatch exports it), else the default."""
    cluster = cfg.cluster
    del cluster.env["HF_HOME"]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "shell-hf"))
    assert auto_mounts(cluster, None) == [f"{tmp_path / 'shell-hf'}:{tmp_path / 'shell-hf'}"]
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert auto_mounts(cluster, None) == [f"{tmp_path / 'xdg/huggingface'}:{tmp_path / 'xdg/huggingface'}"]


def test_imex_directory_reaches_the_container_with_or_without_a_channel(cfg):
    cluster = cfg.cluster
    assert IMEX_DIR not in ",".join(job_mounts(cluster, None))
    cluster.imex.enabled = True  # channel None: Slurm's switch/nvidia_imex assigns one at run time
    assert job_mounts(cluster, None)[-1] == f"{IMEX_DIR}:{IMEX_DIR}"
    cluster.imex.channel = 3
    assert job_mounts(cluster, None)[-1] == f"{IMEX_DIR}:{IMEX_DIR}"


def test_the_rendered_script_and_a_later_srun_mount_the_same(cfg, tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    text = render_sbatch(make_plan(cfg), run_dir)
    hf = tmp_path / "hf"
    expected = f"--container-mounts={run_dir}:{run_dir},{hf}:{hf}"
    assert f" {expected} --no-container-mount-home " in text
    args = container_args(cfg.cluster, run_dir)  # job.json's: `hpcrl attach`, `hpcrl run`
    assert args == ["--container-image=/img/hpcrl.sqsh", expected, "--no-container-mount-home"]
    assert " ".join(args) in text


def test_no_container_no_mounts(cfg, tmp_path):
    cfg.cluster.container.image = None
    text = render_sbatch(make_plan(cfg), tmp_path / "r")
    assert "--container" not in text
    cfg.checkpoint.dir = "/nowhere/ckpt"
    check_mounts(make_plan(cfg), tmp_path / "r")  # bare nodes: nothing to check


# ---- checked before submit --------------------------------------------------------------------------


def test_a_checkpoint_dir_outside_the_mounts_is_refused(cfg, tmp_path):
    (tmp_path / "shared" / "ckpt").mkdir(parents=True)
    cfg.checkpoint.dir = str(tmp_path / "shared" / "ckpt" / "new")
    with pytest.raises(ConfigError) as info:
        check_mounts(make_plan(cfg), tmp_path / "runs" / "r")
    ckpt = tmp_path / "shared" / "ckpt"
    assert str(info.value) == (
        f"checkpoint.dir={ckpt / 'new'} is not under cluster.container.mounts; add '{ckpt}:{ckpt}' (or a "
        "directory above it: your shared filesystem) to cluster.container.mounts"
    )
    cfg.cluster.container.mounts = [f"{tmp_path / 'shared'}:{tmp_path / 'shared'}"]
    check_mounts(make_plan(cfg), tmp_path / "runs" / "r")
    cfg.checkpoint.enabled = False
    cfg.cluster.container.mounts = []
    check_mounts(make_plan(cfg), tmp_path / "runs" / "r")  # no checkpoints, no path


def test_a_path_in_the_run_dir_or_cache_counts_as_mounted(cfg, tmp_path):
    cfg.checkpoint.dir = str(tmp_path / "runs" / "r" / "ckpt")  # the run dir is mounted automatically
    check_mounts(make_plan(cfg), tmp_path / "runs" / "r")
    model = tmp_path / "hf" / "local-model"  # a model directory inside the (auto-mounted) cache
    model.mkdir()
    cfg.model.hf_id = str(model)
    check_mounts(make_plan(cfg), tmp_path / "runs" / "r")


def test_data_files_outside_the_mounts_are_refused(cfg, tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    cfg.data.source = str(data / "train.jsonl")
    with pytest.raises(
        ConfigError, match=rf"^data\.source={re.escape(str(data))}/train\.jsonl is not under "
    ):
        check_mounts(make_plan(cfg), tmp_path / "runs" / "r")
    cfg.data.source, cfg.data.val_source = "hf:org/set", "val.jsonl"  # relative: from this directory
    monkeypatch.chdir(data)
    with pytest.raises(ConfigError, match=rf"^data\.val_source={re.escape(str(data))}/val\.jsonl is not "):
        check_mounts(make_plan(cfg), tmp_path / "runs" / "r")
    cfg.data.check_source = False  # a path only the compute nodes (or the image) have: not checked
    check_mounts(make_plan(cfg), tmp_path / "runs" / "r")


def test_a_model_dir_seen_only_through_a_moved_mount_is_refused(cfg, tmp_path):
    model = tmp_path / "proj" / "model"
    model.mkdir(parents=True)
    cfg.model.hf_id = str(model)
    cfg.cluster.container.mounts = [f"{tmp_path / 'proj'}:/data"]
    with pytest.raises(ConfigError) as info:
        check_mounts(make_plan(cfg), tmp_path / "runs" / "r")
    assert str(info.value) == (
        f"model.hf_id={model} is not under cluster.container.mounts as itself: '{tmp_path / 'proj'}:/data' "
        f"shows it at /data/model inside the container, and hpcrl hands the job host paths; add "
        f"'{model}:{model}' (or a directory above it: your shared filesystem) to cluster.container.mounts"
    )


def test_a_path_hidden_by_a_nested_mount_is_refused(cfg, tmp_path):
    ckpt = tmp_path / "scratch" / "ckpt"
    ckpt.mkdir(parents=True)
    cfg.checkpoint.dir = str(ckpt)
    cfg.cluster.container.mounts = [f"{tmp_path}:{tmp_path}", f"/other:{tmp_path / 'scratch'}"]
    with pytest.raises(ConfigError) as info:
        check_mounts(make_plan(cfg), tmp_path / "runs" / "r")
    assert str(info.value).startswith(
        f"checkpoint.dir={ckpt} is not under cluster.container.mounts as itself: '/other:{tmp_path / 'scratch'}' "
        "puts the host's /other/ckpt at that path inside the container"
    )


def test_a_missing_cache_the_container_would_mount_is_refused(cfg, tmp_path):
    cfg.cluster.env["HF_HOME"] = str(tmp_path / "no-hf")
    with pytest.raises(ConfigError) as info:
        check_mounts(make_plan(cfg), tmp_path / "runs" / "r")
    assert str(info.value).startswith(
        f"cluster.env.HF_HOME={tmp_path / 'no-hf'} does not exist, and the job's container mounts it; create it"
    )
    cfg.cluster.container.mounts = [f"{tmp_path}:{tmp_path}"]  # under a site mount: the job may create it
    check_mounts(make_plan(cfg), tmp_path / "runs" / "r")


def test_submit_refuses_before_writing_anything(cfg, tmp_path):
    cfg.run.output_root = str(tmp_path / "runs")
    cfg.checkpoint.dir = "/not/mounted/ckpt"
    with pytest.raises(
        ConfigError, match=r"^checkpoint\.dir=/not/mounted/ckpt is not under cluster\.container"
    ):
        submit(make_plan(cfg))
    assert not (tmp_path / "runs").exists()  # no run dir, no .jobs index


# ---- the site's lines and options in the script ------------------------------------------------------


def test_setup_lines_run_first_and_extra_sbatch_options_pass_through(cfg, tmp_path):
    cfg.cluster.setup = ["module load cuda/12.8", "source /shared/nccl/nccl_env.sh"]
    cfg.cluster.slurm.extra_sbatch = {
        "nodelist": "gb-[001-002]",
        "mail-type": "END",
        "dependency": "afterok:7",
    }
    cfg.check()
    text = render_sbatch(make_plan(cfg), tmp_path / "r")
    setup = text.split("# setup\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert setup[:5] == [
        "set -eo pipefail",
        "# cluster.setup",
        "module load cuda/12.8",
        "source /shared/nccl/nccl_env.sh",
        "set -u",
    ]
    assert setup[5].startswith("ulimit ")  # hpcrl's own lines after the site's
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    for line in ("--nodelist='gb-[001-002]'", "--mail-type=END", "--dependency=afterok:7"):
        assert f"#SBATCH {line}" in sbatch
    assert sum(line.startswith("#SBATCH --nodes=") for line in sbatch) == 1


@pytest.mark.parametrize(
    ("option", "fragment"),
    [
        ("nodes", "cluster.slurm.extra_sbatch.nodes: hpcrl sets --nodes itself; use layout.train_nodes"),
        ("gres", "cluster.slurm.extra_sbatch.gres: hpcrl sets --gres itself; use cluster.gpus_per_node"),
        ("output", "hpcrl sets --output itself; use run.dir (logs go to <run dir>/slurm)"),
        (
            "mail_typ",
            "cluster.slurm.extra_sbatch.mail_typ: not an sbatch option hpcrl passes through; use one",
        ),
    ],
)
def test_extra_sbatch_options_hpcrl_sets_or_does_not_know_are_refused(cfg, option, fragment):
    cfg.cluster.slurm.extra_sbatch = {option: "x"}
    with pytest.raises(ConfigError) as info:
        cfg.check()
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_jobs_run_offline_unless_the_job_fetches(cfg, tmp_path):
    assert "export HF_HUB_OFFLINE=1" in render_sbatch(make_plan(cfg), tmp_path / "r")
    cfg.model.fetch = "job"
    assert "HF_HUB_OFFLINE" not in render_sbatch(make_plan(cfg), tmp_path / "r")


def test_secrets_never_reach_the_script(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secretvalue0123456789abcdef")
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value")
    cfg.cluster.setup = ['export HF_TOKEN="$HF_TOKEN"']  # by reference: allowed, no value written
    cfg.check()
    text = render_sbatch(make_plan(cfg), tmp_path / "r")
    assert "hf_secretvalue" not in text and "wandb-secret-value" not in text and "WANDB_API_KEY" not in text
    cfg.cluster.setup = ["export HF_TOKEN=hf_secretvalue0123456789abcdef"]
    with pytest.raises(
        ConfigError, match=r"cluster\.setup\[0\] looks like it carries a secret \(HF_TOKEN=\.\.\.\)"
    ):
        cfg.check()


def test_render_through_the_cli_mounts_its_run_dir(tmp_path):
    """`hpcrl render` writes the script `submit` would submit: the container mounts the run dir it wrote."""
    hf = tmp_path / "hf"
    hf.mkdir()  # the cache the container mounts exists (else render refuses, as submit does)
    out = tmp_path / "render"
    result = run_cli(
        "render",
        SPLIT,
        "cluster.container.image=/img/i.sqsh",
        f"+cluster.env.HF_HOME={hf}",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    script = (out / "sbatch.sh").read_text()
    assert f"--container-mounts={out}:{out},{hf}:{hf} " in script
    assert f"export HF_HOME={hf}\n" in script
