"""`hpcrl init`: sinfo/scontrol parsing on captured output of the project's Slurm test cluster, the
catalog match, the written file (which must compose), and the command on the real test cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpcrl.config import compose
from hpcrl.config.slurminfo import (
    Partition,
    arch_by_partition,
    gpu_partitions,
    parse_gres,
    parse_scontrol,
    parse_sinfo,
)
from hpcrl.errors import HpcrlError
from hpcrl.tools.siteinit import Answers, catalog, choose, fill, match_clusters, render, run_init, template
from tests.conftest import JOB_DOWNLOADS, run_cli

CAPTURED = Path(__file__).resolve().parents[1] / "harness" / "slurm_output"
"""``sinfo -h -e -o SINFO_FORMAT``, ``scontrol show node -o`` and ``scontrol show partition -o`` as the
test cluster (tools/slurm-cluster up 3, Slurm 22.05.8) printed them."""


def captured_partitions() -> list[Partition]:
    nodes = parse_scontrol((CAPTURED / "testcluster-show-node.txt").read_text())
    return gpu_partitions(
        parse_sinfo((CAPTURED / "testcluster-sinfo.txt").read_text()), arch_by_partition(nodes)
    )


def gpu_partition(gres: str, arch: str, cpus: int, name: str = "gpu", limit: str | None = None) -> Partition:
    line = f"{name}*|up|18|{cpus}|880000|{gres}|gb-[001-018]|{limit or 'infinite'}"
    (part,) = parse_sinfo(line)
    return Partition(**{**part.__dict__, "arch": arch})


def test_sinfo_lines_of_the_test_cluster():
    lines = parse_sinfo((CAPTURED / "testcluster-sinfo.txt").read_text())
    assert [(p.name, p.default, p.up, p.nodes, p.cpus, p.memory_mb) for p in lines] == [
        ("debug", True, True, 3, 2, 2000),
        ("urgent", False, True, 3, 2, 2000),
    ]
    assert {(p.gpus, p.gpu_type, p.node_names, p.time_limit) for p in lines} == {
        (1, "", "hpcrl-node[1-3]", None)
    }


def test_scontrol_records_keep_values_with_spaces():
    nodes = parse_scontrol((CAPTURED / "testcluster-show-node.txt").read_text())
    assert [n["NodeName"] for n in nodes] == ["hpcrl-node1", "hpcrl-node2", "hpcrl-node3"]
    assert nodes[0]["Arch"] == "x86_64" and nodes[0]["Gres"] == "gpu:1" and nodes[0]["CPUTot"] == "2"
    assert nodes[0]["OS"].startswith("Linux ") and " SMP " in nodes[0]["OS"]  # spaces inside a value
    assert nodes[0]["Partitions"] == "debug,urgent" and nodes[0]["AllocTRES"] == ""
    parts = parse_scontrol((CAPTURED / "testcluster-show-partition.txt").read_text())
    assert [(p["PartitionName"], p["Default"], p["Nodes"]) for p in parts] == [
        ("debug", "YES", "hpcrl-node[1-3]"),
        ("urgent", "NO", "hpcrl-node[1-3]"),
    ]


@pytest.mark.parametrize(
    ("gres", "expected"),
    [
        ("gpu:1", (1, "")),
        ("gpu:h100:8(S:0-1)", (8, "h100")),
        ("gpu:nvidia_gb200:4(S:0-1),nvme:1", (4, "nvidia_gb200")),
        ("craynetwork:4,gpu:a100:4", (4, "a100")),
        ("(null)", (0, "")),
        ("gpu:a100:4,gpu:v100:2", (4, "a100")),
    ],
)
def test_gres_gives_gpus_per_node_and_model(gres, expected):
    assert parse_gres(gres) == expected


def test_the_test_cluster_is_proposed_as_slurmtest():
    parts = captured_partitions()
    assert [p.name for p in parts] == ["debug", "urgent"] and parts[0].arch == "x86_64"
    assert [m.cluster for m in match_clusters(parts[0], catalog())] == ["slurmtest"]


@pytest.mark.parametrize(
    ("gres", "arch", "cpus", "expected"),
    [
        ("gpu:4", "aarch64", 144, ["gb200"]),
        ("gpu:gb200:4(S:0-1)", "aarch64", 144, ["gb200"]),
        ("gpu:h100:8(S:0-1)", "x86_64", 192, ["h100"]),
        ("gpu:nvidia_h200:8", "x86_64", 192, ["h200"]),
        ("gpu:8", "x86_64", 192, ["h100", "h200", "b200"]),  # no model named: 8 GPUs, 192 CPUs first
        ("gpu:a100:8", "x86_64", 128, []),
        ("gpu:4", "x86_64", 64, []),
    ],
)
def test_catalog_match_by_gpus_arch_and_model(gres, arch, cpus, expected):
    assert [m.cluster for m in match_clusters(gpu_partition(gres, arch, cpus), catalog())] == expected


def test_proposal_can_be_changed_when_asked_and_unmatched_nodes_need_a_cluster():
    parts = captured_partitions()
    answers_given = iter(["h100", "lab-acc", "", "~/hf"])
    asked: list[str] = []

    def ask(question: str, default: str) -> str:
        asked.append(f"{question} [{default}]")
        return next(answers_given) or default

    part, name = choose(parts, catalog(), Answers(), ask)
    assert (part.name, name) == ("debug", "h100") and asked == ["catalog cluster for these nodes [slurmtest]"]
    filled = fill(catalog()["h100"], Answers(), ask)
    assert (filled.account, filled.image) == ("lab-acc", None)  # h100 requires an image: asked, left empty
    assert filled.hf_home == str(Path.home() / "hf")  # made absolute: the container mounts it as is
    assert asked[-1].startswith("Hugging Face cache on shared storage, HF_HOME")
    with pytest.raises(
        HpcrlError, match=r"no catalog cluster has gpu's nodes \(4 GPUs, x86_64\); pass --cluster"
    ):
        choose([gpu_partition("gpu:4", "x86_64", 64)], catalog(), Answers(), None)
    with pytest.raises(
        HpcrlError, match="--partition nope is not a GPU partition here; GPU partitions: debug, urgent"
    ):
        choose(parts, catalog(), Answers(partition="nope"), None)


def test_rendered_file_composes_and_carries_the_partition_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCRL_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRL_COMPOSE_CACHE", "0")
    part = gpu_partition("gpu:4", "aarch64", 144, name="gb200nvl72", limit="4:00:00")
    text = render("gb200", catalog()["gb200"], part, Answers(account="my-acc", image="/img/hpcrl.sqsh"))
    (tmp_path / "site.yaml").write_text(text)
    cfg = compose.compose_config(["+cluster=gb200"])
    assert (cfg.cluster.slurm.account, cfg.cluster.container.image) == ("my-acc", "/img/hpcrl.sqsh")
    assert (cfg.cluster.slurm.partition, cfg.cluster.slurm.time, cfg.cluster.max_nodes) == (
        "gb200nvl72",
        "4:00:00",
        18,
    )
    assert "time limit 4:00:00" in text  # the header says what was read


def test_rendered_file_without_answers_loads_and_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCRL_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRL_COMPOSE_CACHE", "0")
    (tmp_path / "site.yaml").write_text(render("gb200", catalog()["gb200"], None, Answers()))
    assert "account: <your Slurm account>  # required by this cluster" in (tmp_path / "site.yaml").read_text()
    with pytest.raises(
        HpcrlError, match=r"cluster 'gb200' requires cluster\.slurm\.account, cluster\.container\.image"
    ):
        compose.compose_config(["+cluster=gb200"])
    (tmp_path / "site.yaml").write_text(template(catalog()))
    assert yaml.safe_load((tmp_path / "site.yaml").read_text()) is None  # every line a comment
    assert compose.compose_config(["+cluster=h100", "cluster.slurm.account=a", "cluster.container.image=i"])


def no_slurm_env(tmp_path: Path) -> dict[str, str]:
    """A PATH with the venv but no sinfo/scontrol: a laptop."""
    return {"HPCRL_CONFIG_DIR": str(tmp_path / "cfg"), "PATH": str(Path(sys.executable).parent)}


def test_init_without_slurm_writes_a_template_or_the_named_cluster(tmp_path, monkeypatch):
    for key, value in no_slurm_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    site = tmp_path / "cfg" / "site.yaml"
    result = run_cli("init")
    assert result.returncode == 0, result.stderr
    assert (
        "a commented template: no sinfo/scontrol" in result.stdout
        and "#     slurm: {account:" in site.read_text()
    )
    result = run_cli("init", "--cluster", "gb200", "--account", "my-acc", "--image", "/img/hpcrl.sqsh")
    assert result.returncode == 2 and f"{site} exists; edit it, or run `hpcrl init --force`" in result.stderr
    result = run_cli(
        "init", "--cluster", "gb200", "--account", "my-acc", "--image", "/img/hpcrl.sqsh", "--force"
    )
    assert result.returncode == 0, result.stderr
    plan = run_cli("plan", "+experiment=dapo-nemotron-super-5n4g-megatron", *JOB_DOWNLOADS)
    assert plan.returncode == 0, plan.stderr
    assert "my-acc" in plan.stdout and "/img/hpcrl.sqsh" in plan.stdout


@pytest.mark.slow
def test_init_on_the_slurm_test_cluster(slurm_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("HPCRL_CONFIG_DIR", str(tmp_path))
    assert os.environ["SLURM_CONF"] == slurm_cluster
    result = run_cli("init", "--account", "acct")  # stdin is not a terminal: no question asked
    assert result.returncode == 0, result.stderr
    assert "found   partition debug (default): 3 x86_64 nodes hpcrl-node[1-3], 1 GPU, 2 CPUs" in result.stdout
    written = yaml.safe_load((tmp_path / "site.yaml").read_text())
    assert written == {
        "clusters": {"slurmtest": {"max_nodes": 3, "slurm": {"partition": "debug", "account": "acct"}}}
    }
    assert "already" not in result.stdout and run_cli("init").returncode == 2  # never overwritten silently
    result = run_cli("init", "--partition", "urgent", "--force")
    assert result.returncode == 0, result.stderr
    show = run_cli("show", "+cluster=slurmtest")
    assert yaml.safe_load(show.stdout)["cluster"]["slurm"]["partition"] == "urgent"
    assert f"# cluster.slurm.partition: {tmp_path / 'site.yaml'}:" in show.stdout


@pytest.mark.slow
def test_init_asks_on_a_terminal(slurm_cluster, tmp_path, monkeypatch):
    """stdin a terminal: the proposal is confirmed with Enter, the account typed in."""

    monkeypatch.setenv("HPCRL_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "shell-hf"))  # proposed; the answer typed wins
    done = init_on_a_terminal(f"\nlab-acc\n{tmp_path / 'hf'}\n")
    assert done.returncode == 0, done.stderr
    assert (
        "catalog cluster for these nodes [slurmtest]: Slurm account (empty: none) []: Hugging Face cache on "
        f"shared storage, HF_HOME (`hpcrl fetch` fills it; empty: none) [{tmp_path / 'shell-hf'}]: wrote"
    ) in done.stdout
    written = yaml.safe_load((tmp_path / "site.yaml").read_text())
    assert written["clusters"]["slurmtest"]["slurm"] == {"partition": "debug", "account": "lab-acc"}
    assert written["clusters"]["slurmtest"]["env"] == {"HF_HOME": str(tmp_path / "hf")}


def init_on_a_terminal(answers: str) -> subprocess.CompletedProcess[str]:
    """`hpcrl init` with stdin a terminal (a pty) that has ``answers`` typed in already."""
    import pty

    master, terminal = pty.openpty()
    try:
        os.write(master, answers.encode())
        exe = Path(sys.executable).with_name("hpcrl")
        return subprocess.run([str(exe), "init"], stdin=terminal, capture_output=True, text=True, timeout=120)
    finally:
        os.close(terminal)
        os.close(master)


def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sinfo``/``scontrol`` that print an 8-GPU partition (GRES names no model), first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    outputs = {
        "sinfo": "cpu*|up|64|128|512000|(null)|cn[001-064]|2-00:00:00\ngpu|up|32|192|2000000|gpu:8|dgx[01-32]|2:00:00\n",
        "scontrol": "NodeName=dgx01 Arch=x86_64 CPUTot=192 Gres=gpu:8 OS=Linux 6.1 #1 SMP Partitions=gpu RealMemory=2000000\n",
    }
    for name, text in outputs.items():
        (bin_dir / f"{name}.txt").write_text(text)
        (bin_dir / name).write_text(f"#!/bin/sh\ncat {bin_dir / name}.txt\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin")
    monkeypatch.setenv("HPCRL_CONFIG_DIR", str(tmp_path / "cfg"))


def test_init_asks_for_the_hf_cache_on_a_terminal(tmp_path, monkeypatch):
    """stdin a terminal: Enter takes the proposed cluster, then account, image and HF cache are typed."""

    fake_slurm(tmp_path, monkeypatch)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "shell-hf"))  # proposed; the answer typed wins
    done = init_on_a_terminal(f"\nlab\n/img/rl.sqsh\n{tmp_path / 'hf'}\n")
    assert done.returncode == 0, done.stderr
    assert f"HF_HOME (`hpcrl fetch` fills it; empty: none) [{tmp_path / 'shell-hf'}]: wrote" in done.stdout
    written = yaml.safe_load((tmp_path / "cfg" / "site.yaml").read_text())["clusters"]["h100"]
    assert written["env"] == {"HF_HOME": str(tmp_path / "hf")} and written["slurm"]["account"] == "lab"
    assert f"note    HF_HOME {tmp_path / 'hf'} does not exist yet" in done.stdout


def test_init_with_sinfo_and_scontrol_faked_at_the_edge(tmp_path, monkeypatch):
    """An 8-GPU partition whose GRES names no model matches three catalog clusters: init proposes one
    (same CPU count first), names the others, and writes the partition's shorter time limit."""
    fake_slurm(tmp_path, monkeypatch)
    result = run_cli("init", "--account", "lab", "--image", "/img/rl.sqsh")
    assert result.returncode == 0, result.stderr
    assert "found   partition gpu: 32 x86_64 nodes dgx[01-32], 8 GPUs, 192 CPUs" in result.stdout
    assert "also    h200, b200 match these nodes (--cluster chooses)" in result.stdout
    written = yaml.safe_load((tmp_path / "cfg" / "site.yaml").read_text())["clusters"]
    assert written == {
        "h100": {
            "max_nodes": 32,
            "slurm": {"partition": "gpu", "account": "lab", "time": "2:00:00"},
            "container": {"image": "/img/rl.sqsh"},
        }
    }


def test_init_writes_the_hf_cache_as_env_hf_home(tmp_path, monkeypatch):
    """Non-interactive (flags only): HF_HOME from the answer, written as env: {HF_HOME: ...}, read back
    by the composer; without an answer the entry stays commented and init says what to fill in."""
    for key, value in no_slurm_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HPCRL_COMPOSE_CACHE", "0")
    said: list[str] = []
    answers = Answers(cluster="gb200", account="acc", image="/img/hpcrl.sqsh", hf_home=str(tmp_path / "hf/"))
    path = run_init(answers, False, None, said.append)
    written = yaml.safe_load(path.read_text())["clusters"]["gb200"]
    assert written["env"] == {"HF_HOME": str(tmp_path / "hf")}  # normalized: no trailing slash
    assert f"note    HF_HOME {tmp_path / 'hf'} does not exist yet: `hpcrl fetch` creates it" in said
    assert compose.compose_config(["+cluster=gb200"]).cluster.env["HF_HOME"] == str(tmp_path / "hf")

    said.clear()
    path = run_init(Answers(cluster="gb200", account="acc", image="/img/i.sqsh"), True, None, said.append)
    assert "env" not in yaml.safe_load(path.read_text())["clusters"]["gb200"]
    assert any(line.startswith("todo    set env.HF_HOME there") for line in said)
    with pytest.raises(HpcrlError, match="HF_HOME 'hf-cache' is not an absolute path; give the cache's"):
        run_init(Answers(cluster="gb200", hf_home="hf-cache"), True, None, said.append)


def test_the_commented_optional_keys_compose_when_uncommented(tmp_path, monkeypatch):
    """The starter file's commented setup, extra_sbatch and HF_HOME lines are valid site keys as written."""
    monkeypatch.setenv("HPCRL_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRL_COMPOSE_CACHE", "0")
    text = render("gb200", catalog()["gb200"], None, Answers(account="acc", image="/img/i.sqsh"))
    uncommented = "\n".join(
        line.replace("# ", "", 1) if re.match(r"^ +# +(env|setup|HF_HOME|- |extra_sbatch)", line) else line
        for line in text.splitlines()
    )
    (tmp_path / "site.yaml").write_text(uncommented)
    cluster = compose.compose_config(["+cluster=gb200"]).cluster
    assert cluster.setup == ["module load cuda/12.8", "source /shared/nccl/nccl_env.sh"]
    assert cluster.slurm.extra_sbatch == {"mail_type": "END", "mail_user": "you@example.org"}
    assert cluster.env["HF_HOME"] == "/shared/hf-cache"
