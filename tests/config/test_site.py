"""Site configuration ($HPCRL_CONFIG_DIR): site.yaml keys per cluster and the site's own conf/ groups,
on both composers, below the command line, checked with file and line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from hpcrl.config import compose
from hpcrl.config.cluster import ContainerConfig
from hpcrl.errors import ConfigError
from tests.conftest import JOB_DOWNLOADS, ROOT, SITE, run_cli

SITE_YAML = """\
clusters:
  gb200:
    slurm: {account: my-acc, partition: gb200nvl72, qos: normal}
    container: {image: /shared/images/hpcrl.sqsh, mounts: ["/lustre:/lustre"]}
    env: {HF_HOME: /lustre/hf}
  h100:
    slurm:
      account: other-acc
"""

MY_CLUSTER = """\
# A site's own cluster: 4 x H100 PCIe per node.
name: mycluster
gpu: H100
gpus_per_node: 4
gpu_memory_gb: 80
cpus_per_node: 64
slurm:
  partition: gpu
"""

MY_RECIPE = """\
# @package _global_
defaults:
  - override /cluster: mycluster
  - override /model: qwen2_1p5b
  - _self_
run:
  name: my-qwen
layout:
  train_nodes: 2
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """An empty site directory as $HPCRL_CONFIG_DIR; write files into it."""
    monkeypatch.setenv("HPCRL_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRL_COMPOSE_CACHE", "0")

    def write(relative: str, text: str) -> Path:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return write


def both(*overrides: str):
    """The config from the Hydra-free composer and from Hydra, which must agree."""
    fast = compose._compose_fast(list(overrides))
    assert fast is not None, "a site file must not push plain overrides onto the slow path"
    hydra = compose._compose_hydra(list(overrides))
    assert fast == hydra
    return fast


def test_site_keys_apply_to_their_cluster_only(site):
    site("site.yaml", SITE_YAML)
    cfg = both("+cluster=gb200", "+model=nemotron_super")
    assert (cfg.cluster.slurm.account, cfg.cluster.slurm.qos) == ("my-acc", "normal")
    assert cfg.cluster.container == ContainerConfig(
        image="/shared/images/hpcrl.sqsh", mounts=["/lustre:/lustre"]
    )
    assert cfg.cluster.env["HF_HOME"] == "/lustre/hf"
    assert cfg.cluster.env["NCCL_MNNVL_ENABLE"] == "1"  # the catalog's entries stay
    cfg.check()  # the required account and image now come from the site file
    h100 = both("+cluster=h100")
    assert h100.cluster.slurm.account == "other-acc" and h100.cluster.container.image is None
    assert "HF_HOME" not in h100.cluster.env


def test_command_line_wins_over_the_site_file(site):
    site("site.yaml", SITE_YAML)
    cfg = both("+cluster=gb200", "cluster.slurm.account=cli-acc", "+cluster.env.HF_HOME=/scratch/hf")
    assert cfg.cluster.slurm.account == "cli-acc" and cfg.cluster.slurm.qos == "normal"
    assert cfg.cluster.env["HF_HOME"] == "/scratch/hf"
    cfg = compose.compose_config(["+cluster=gb200", "cluster.container.mounts=[]"])  # list syntax: Hydra
    assert cfg.cluster.container.mounts == [] and cfg.cluster.container.image == "/shared/images/hpcrl.sqsh"


def test_site_keys_win_over_a_recipe(site):
    site(
        "site.yaml",
        "clusters:\n  gb200:\n    slurm: {time: '02:00:00', account: a}\n    container: {image: i}\n",
    )
    cfg = both("+experiment=dapo-nemotron-super-5n4g-megatron")
    assert cfg.cluster.slurm.time == "02:00:00" and cfg.layout.rollout_nodes == 1


def test_site_conf_adds_a_cluster_and_a_recipe(site):
    site("conf/cluster/mycluster.yaml", MY_CLUSTER)
    site("conf/experiment/my-qwen.yaml", MY_RECIPE)
    site("site.yaml", "clusters:\n  mycluster:\n    slurm: {account: lab}\n")
    cfg = both("+experiment=my-qwen")
    assert (cfg.cluster.name, cfg.cluster.gpus_per_node, cfg.cluster.slurm.partition) == (
        "mycluster",
        4,
        "gpu",
    )
    assert (cfg.cluster.slurm.account, cfg.model.name, cfg.layout.train_nodes) == ("lab", "qwen2_1p5b", 2)
    result = run_cli("show", "--groups")
    assert re.search(r"^cluster: .*\bmycluster\b", result.stdout, re.M), result.stdout


def test_site_file_may_not_shadow_a_shipped_option(site):
    path = site("conf/cluster/gb200.yaml", MY_CLUSTER)
    with pytest.raises(
        ConfigError, match=f"{re.escape(str(path.resolve()))} shadows hpcrl's own conf/cluster/gb200.yaml"
    ):
        compose.compose_config(["+cluster=h100"])


def test_a_group_file_named_otherwise_than_its_option_is_refused(site):
    path = site("conf/cluster/mycluster.yaml", MY_CLUSTER.replace("name: mycluster", "name: theirs"))
    with pytest.raises(ConfigError, match=f"{re.escape(str(path.resolve()))}: name: theirs contradicts"):
        compose.compose_config(["+cluster=mycluster"])


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        (
            "clusters:\n  gb200:\n    slurm:\n      acount: x\n",
            4,
            "unknown key 'clusters.gb200.slurm.acount'; known here: partition, account",
        ),
        (
            "clusters:\n  gb200:\n    gpus_per_node: 8\n",
            3,
            "clusters.gb200.gpus_per_node describes the hardware, not the site",
        ),
        (
            "clusters:\n  gb20:\n    slurm: {account: x}\n",
            2,
            "clusters.gb20 names no cluster; available: b200, gb200",
        ),
        ("cluster:\n  gb200: {}\n", 1, "unknown key 'cluster'; site.yaml holds only clusters"),
        (
            "clusters:\n  gb200:\n    env:\n      HF_TOKEN: hf_abc\n",
            4,
            "clusters.gb200.env.HF_TOKEN looks like a secret",
        ),
        (
            "clusters:\n  gb200:\n    slurm: {time: 8:00:00}\n",
            3,
            "clusters.gb200.slurm.time=28800 is not a str; quote it",
        ),
        (
            "clusters:\n  gb200:\n    container: {mounts: /lustre:/lustre}\n",
            3,
            "container.mounts='/lustre:/lustre' is not a list[str]",
        ),
        ("clusters:\n  gb200:\n    slurm: [account]\n", 3, "clusters.gb200.slurm must be a mapping"),
        (
            "clusters:\n  gb200:\n    setup:\n      - module load cuda\n      - export HF_TOKEN=hf_live_value\n",
            5,
            "clusters.gb200.setup line looks like it carries a secret (HF_TOKEN=...); remove it and export",
        ),
        (
            "clusters:\n  gb200:\n    setup: [huggingface-cli login --token abc123]\n",
            3,
            "clusters.gb200.setup line looks like it carries a secret (--token ...)",
        ),
        (
            "clusters:\n  gb200:\n    slurm:\n      account: a\n      extra_sbatch:\n        nodelist: n1\n"
            "        nodez: n2\n",
            7,
            "clusters.gb200.slurm.extra_sbatch.nodez: not an sbatch option hpcrl passes through; use one of: "
            "acctg_freq, begin,",
        ),
        (
            "clusters:\n  gb200:\n    slurm:\n      extra_sbatch: {time: '10:00'}\n",
            4,
            "clusters.gb200.slurm.extra_sbatch.time: hpcrl sets --time itself; use cluster.slurm.time",
        ),
        (
            "clusters:\n  gb200:\n    slurm:\n      extra_sbatch:\n        gpus-per-node: '4'\n",
            5,
            "extra_sbatch.gpus-per-node: hpcrl sets --gpus-per-node itself; use cluster.gpus_per_node",
        ),
        (
            "clusters:\n  gb200:\n    slurm:\n      extra_sbatch:\n        nice: 10\n",
            5,
            'clusters.gb200.slurm.extra_sbatch.nice must be a string; quote it (nice: "10")',
        ),
    ],
)
def test_bad_site_file_fails_with_file_and_line(site, text, line, fragment):
    path = site("site.yaml", text)
    with pytest.raises(ConfigError) as info:
        compose.compose_config(["+cluster=h100"])
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: ") and fragment in message and "\n" not in message
    assert "hf_live_value" not in message and "abc123" not in message  # a secret is named, never shown


SETUP_SITE = """\
clusters:
  gb200:
    slurm:
      account: my-acc
      extra_sbatch: {nodelist: "gb-[001-005]", mail-type: END}
    container: {image: /shared/images/hpcrl.sqsh, mounts: ["/lustre:/lustre"]}
    setup:
      - module load cuda/12.8
      - source /lustre/nccl/nccl_env.sh
"""


def test_setup_and_extra_sbatch_are_site_keys(site):
    path = site("site.yaml", SETUP_SITE)
    cfg = both("+cluster=gb200")
    assert cfg.cluster.setup == ["module load cuda/12.8", "source /lustre/nccl/nccl_env.sh"]
    assert cfg.cluster.slurm.extra_sbatch == {"nodelist": "gb-[001-005]", "mail-type": "END"}
    assert both("+cluster=h100").cluster.setup == []  # gb200's lines stay with gb200
    cfg = compose.compose_config(["+cluster=gb200", "cluster.setup=[module load cuda/13.0]"])  # list: Hydra
    assert (
        cfg.cluster.setup == ["module load cuda/13.0"]
        and cfg.cluster.slurm.extra_sbatch["mail-type"] == "END"
    )
    result = run_cli("show", "+cluster=gb200")
    assert f"# cluster.setup: {path}:7" in result.stdout
    assert f"# cluster.slurm.extra_sbatch: {path}:5" in result.stdout


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        (
            "cluster.setup=['export WANDB_API_KEY=abc123']",
            "cluster.setup[0] looks like it carries a secret (WANDB_API_KEY=...); remove it and export",
        ),
        ("cluster.setup=[echo hf_abcdefghijklmnopqrstuvwxyz]", "a string shaped like an access token"),
    ],
)
def test_a_secret_in_a_setup_line_on_the_command_line_is_refused(site, override, fragment):
    with pytest.raises(ConfigError) as info:
        compose.compose_config(["+cluster=h100", override])
    assert fragment in str(info.value) and "abc123" not in str(info.value) and "hf_abc" not in str(info.value)


def test_a_setup_line_may_export_a_secret_by_reference(site):
    lines = [
        'export HF_TOKEN="$HF_TOKEN"',
        "export HF_TOKEN=$(cat ~/.hf_token)",
        "export TOKENIZERS_PARALLELISM=0",
    ]
    site("site.yaml", "clusters:\n  h100:\n    setup:\n" + "".join(f"      - '{line}'\n" for line in lines))
    site_keys = ["cluster.slurm.account=a", "cluster.container.image=i"]
    assert compose.compose_config(["+cluster=h100", *site_keys]).cluster.setup == lines


def test_bad_site_file_through_the_cli(site):
    path = site("site.yaml", "clusters:\n  gb200:\n    slurm: {partitoin: x}\n")
    result = run_cli("plan", "+cluster=gb200")
    assert result.returncode == 2
    assert result.stderr.startswith(f"hpcrl: error: {path}:3: unknown key 'clusters.gb200.slurm.partitoin'")


def test_missing_site_keys_name_the_file_and_the_lines_to_add(site, tmp_path):
    """The error's lines, with the placeholders filled in, are a working site file."""
    result = run_cli("plan", "+experiment=dapo-nemotron-super-5n4g-megatron")
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()  # one line, the entry to paste at its end
    assert "cluster 'gb200' requires cluster.slurm.account, cluster.container.image" in line
    _, entry = line.split(f"add to {tmp_path / 'site.yaml'}: ")
    snippet = entry.replace("<account>", "my-acc").replace("<image>", "/img/hpcrl.sqsh")
    assert yaml.safe_load(snippet) == {
        "clusters": {"gb200": {"slurm": {"account": "my-acc"}, "container": {"image": "/img/hpcrl.sqsh"}}}
    }
    site("site.yaml", snippet + "\n")
    result = run_cli("plan", "+experiment=dapo-nemotron-super-5n4g-megatron", *JOB_DOWNLOADS)
    assert result.returncode == 0, result.stderr
    assert "my-acc" in result.stdout and "/img/hpcrl.sqsh" in result.stdout


def test_show_names_the_file_and_line_of_each_site_key(site):
    path = site("site.yaml", SITE_YAML)
    result = run_cli("show", "+cluster=gb200", "cluster.slurm.qos=high")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)["cluster"]
    assert shown["slurm"]["account"] == "my-acc" and shown["slurm"]["qos"] == "high"
    assert f"# cluster.slurm.account: {path}:3" in result.stdout
    assert f"# cluster.env.HF_HOME: {path}:5" in result.stdout
    assert f"# cluster.slurm.qos: the command line (over {path}:3)" in result.stdout
    assert "other-acc" not in result.stdout  # h100's keys stay with h100


def test_an_edited_site_file_is_not_served_from_the_compose_cache(site, tmp_path, monkeypatch):
    monkeypatch.setenv("HPCRL_COMPOSE_CACHE", "1")
    monkeypatch.setenv("HPCRL_CACHE", str(tmp_path / "cache"))
    site("site.yaml", "clusters:\n  h100:\n    slurm: {account: first}\n    container: {image: i}\n")
    assert compose.compose_config(["+cluster=h100"]).cluster.slurm.account == "first"
    assert list((tmp_path / "cache" / "compose").glob("*.pkl"))  # the cache is in use
    site(
        "site.yaml",
        "clusters:\n  h100:\n    slurm: {account: second, qos: long}\n    container: {image: i}\n",
    )
    assert compose.compose_config(["+cluster=h100"]).cluster.slurm.account == "second"


def test_the_default_config_dir_is_under_the_home(monkeypatch, tmp_path):
    from hpcrl.config.paths import site_file

    monkeypatch.delenv("HPCRL_CONFIG_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert site_file() == tmp_path / ".config" / "hpcrl" / "site.yaml"


def test_no_site_file_changes_nothing(site):
    cfg = both("+cluster=gb200")
    assert cfg.cluster.slurm.account is None and "HF_HOME" not in cfg.cluster.env


def test_the_readme_site_file_composes_as_written(site):
    readme = (ROOT / "README.md").read_text()
    block = readme.split("### Site file", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    site("site.yaml", block)
    cfg = both("+cluster=gb200")
    assert (cfg.cluster.slurm.partition, cfg.cluster.env["HF_HOME"]) == ("gb200nvl72", "/lustre/hf")


def test_a_site_variable_is_overridden_like_a_new_entry(site):
    site("site.yaml", SITE_YAML)
    with pytest.raises(
        ConfigError, match=r"'cluster\.env\.HF_HOME' is a new entry .*: add it with \+cluster\.env\.HF_HOME="
    ):
        compose.compose_config(["+cluster=gb200", "cluster.env.HF_HOME=/x"])
    assert both("+cluster=gb200", "+cluster.env.HF_HOME=/x").cluster.env["HF_HOME"] == "/x"


def test_a_bad_value_in_a_site_group_file_names_file_and_line(site):
    path = site("conf/cluster/mycluster.yaml", MY_CLUSTER.replace("gpus_per_node: 4", "gpus_per_node: four"))
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path.resolve()))}:4: cluster\.gpus_per_node: Value 'four'"
    ):
        compose.compose_config(["+cluster=mycluster"])


def test_an_unknown_key_in_a_site_group_file_names_file_and_line(site):
    path = site("conf/cluster/mycluster.yaml", MY_CLUSTER.replace("  partition: gpu", "  partitoin: gpu"))
    with pytest.raises(ConfigError) as info:
        compose.compose_config(["+cluster=mycluster"])
    assert (
        str(info.value)
        == f"{path.resolve()}:8: unknown key 'partitoin' (SlurmSite has no such field); check the spelling"
    )


def test_a_site_recipe_builds_on_a_shipped_one(site):
    site(
        "conf/experiment/my-nemotron.yaml",
        "# @package _global_\ndefaults:\n  - dapo-nemotron-super-5n4g-megatron\n  - _self_\n"
        "run:\n  name: my-nemotron\nalgo:\n  max_steps: 7\n",
    )
    site("site.yaml", SITE_YAML)
    cfg = both("+experiment=my-nemotron")
    assert (cfg.run.name, cfg.algo.max_steps, cfg.layout.rollout_nodes) == ("my-nemotron", 7, 1)
    assert cfg.cluster.slurm.account == "my-acc" and cfg.trainer.ep == 16


@pytest.mark.parametrize(
    "name",
    ["AWS_ACCESS_KEY_ID", "SSH_PRIVATE_KEY", "DB_PASSWD", "GITLAB_PAT", "NGC_AUTH", "DEPLOY_KEY", "HF_TOKEN"],
)
def test_secret_looking_env_names_are_refused_on_the_command_line(site, name):
    """cluster.env entries are written into sbatch.sh and config.yaml: a secret's name is refused there."""
    with pytest.raises(
        ConfigError, match=rf"cluster.env.{name} looks like a secret; export it in your shell"
    ):
        compose.compose_config(["+cluster=h100", f"+cluster.env.{name}=x"]).cluster.check()


def test_ordinary_env_names_pass(site):
    names = [
        "TOKENIZERS_PARALLELISM",
        "MAX_TOKENS",
        "LD_LIBRARY_PATH",
        "NCCL_IB_PKEY",
        "KEYBOARD_LAYOUT",
        "GIT_AUTHOR_NAME",
    ]
    cfg = compose.compose_config(["+cluster=h100", *(f"+cluster.env.{n}=1" for n in names), *SITE])
    assert set(names) <= set(cfg.cluster.env)
