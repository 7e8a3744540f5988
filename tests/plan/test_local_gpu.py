"""cluster=local's ``gpu: auto``: this machine's GPU from nvidia-smi (faked on PATH here), or cpu."""

from __future__ import annotations

import os
import stat

import pytest

from hpcrl.config.compose import compose_config
from hpcrl.errors import ConfigError
from hpcrl.plan import local_gpu
from hpcrl.plan.local_gpu import LocalGpu, catalog_tflops, parse_smi
from hpcrl.plan.planner import make_plan


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """A fake nvidia-smi first on PATH that prints what the test sets and records its arguments."""
    out = tmp_path / "out.txt"
    calls = tmp_path / "calls.txt"
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {calls}\ncat {out}\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HPCRL_LOCAL_GPU", raising=False)
    local_gpu.probe.cache_clear()
    yield out, calls
    local_gpu.probe.cache_clear()


def test_parse_smi_names_the_gpu_without_the_vendor_in_gb():
    assert parse_smi("NVIDIA H200, 143771\nNVIDIA H200, 143771\n") == LocalGpu("H200", 150.8)
    assert parse_smi("NVIDIA H100 80GB HBM3, 81559\n") == LocalGpu("H100 80GB HBM3", 85.5)
    assert parse_smi("") is None
    assert parse_smi("No devices were found\n") is None


def test_catalog_tflops_reads_the_catalog_cluster_of_that_gpu():
    assert catalog_tflops("H200") == 989.0
    assert catalog_tflops("H100 80GB HBM3") == 989.0
    assert catalog_tflops("B200") == 2250.0
    assert catalog_tflops("RTX 4090") == 0.0


def test_local_plan_on_a_gpu_machine_is_a_gpu_plan(smi):
    out, calls = smi
    out.write_text("NVIDIA H200, 143771\n")
    p = make_plan(compose_config([]))
    cluster = p.cfg.cluster
    assert (cluster.gpu, cluster.gpu_memory_gb, cluster.gpu_bf16_tflops) == ("H200", 150.8, 989.0)
    assert p.cfg.rollout.sleep is True  # colocated on a GPU: the engine sleeps while the trainer trains
    assert p.cfg.rollout.block_size == 64
    assert "-i" not in calls.read_text()


def test_local_plan_follows_cuda_visible_devices(smi, monkeypatch):
    out, calls = smi
    out.write_text("NVIDIA H100 80GB HBM3, 81559\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert make_plan(compose_config([])).cfg.cluster.gpu == "H100 80GB HBM3"
    assert "-i 3" in calls.read_text()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for this shell: the CPU, nvidia-smi not asked
    p = make_plan(compose_config([]))
    assert (p.cfg.cluster.gpu, p.cfg.rollout.sleep) == ("cpu", False)
    assert calls.read_text().count("--query-gpu") == 1


def test_named_or_cpu_cluster_gpu_skips_the_probe(smi):
    out, calls = smi
    out.write_text("NVIDIA H200, 143771\n")
    assert make_plan(compose_config(["cluster.gpu=cpu"])).cfg.cluster.gpu == "cpu"
    assert make_plan(compose_config(["cluster.gpu=H100"])).cfg.cluster.gpu_memory_gb == 16
    assert not calls.exists()


def test_no_nvidia_smi_is_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HPCRL_LOCAL_GPU", raising=False)
    local_gpu.probe.cache_clear()
    try:
        assert make_plan(compose_config([])).cfg.cluster.gpu == "cpu"
    finally:
        local_gpu.probe.cache_clear()


def test_auto_on_a_slurm_cluster_is_refused():
    cfg = compose_config(["+experiment=grpo-tiny-2n1g-fsdp-split"])
    cfg.cluster.gpu = "auto"
    with pytest.raises(ConfigError) as err:
        make_plan(cfg)
    assert (
        str(err.value)
        == "cluster.gpu=auto is for cluster=local (this machine); cluster 'slurmtest' must name its GPU"
    )


def test_hpcrl_local_gpu_answers_for_the_probe(smi, monkeypatch):
    out, calls = smi
    out.write_text("NVIDIA H200, 143771\n")
    monkeypatch.setenv("HPCRL_LOCAL_GPU", "H100:80")
    assert (make_plan(compose_config([])).cfg.cluster.gpu_memory_gb, calls.exists()) == (80.0, False)
    monkeypatch.setenv("HPCRL_LOCAL_GPU", "cpu")
    assert make_plan(compose_config([])).cfg.cluster.gpu == "cpu"
    monkeypatch.setenv("HPCRL_LOCAL_GPU", "H200")
    with pytest.raises(ConfigError) as err:
        make_plan(compose_config([]))
    assert str(err.value) == "HPCRL_LOCAL_GPU=H200 must be NAME:GB (e.g. H200:141) or cpu"
