"""Bad input fails before anything is submitted: one line naming the key(s) and the fix, no traceback.

Each case goes through the real ``hpcrl`` entry point (``render``, which writes nothing on error).
"""

from __future__ import annotations

import pytest

from tests.conftest import SITE

GB200 = ["+experiment=dapo-nemotron-super-5n4g-megatron", *SITE]

CASES = {
    "degrees_do_not_divide_gpus": (
        [*GB200, "trainer.tp=3"],
        "trainer.tp=3 x trainer.pp=1 x trainer.cp=1 = 3 does not divide the 16 training GPUs",
    ),
    "ep_does_not_divide": (
        [*GB200, "trainer.ep=32"],
        "trainer.ep=32 x trainer.expert_tp=1 must divide the 16 GPUs",
    ),
    "rollout_tp_larger_than_node": ([*GB200, "rollout.tp=8"], "rollout.tp=8 is larger than a node (4 GPUs)"),
    "tp_does_not_divide_heads": (
        ["model=qwen2_1p5b", "cluster=h100", "trainer.tp=8", *SITE],
        "trainer.tp=8 does not divide qwen2_1p5b's 12 attention heads",
    ),
    "model_does_not_fit": (
        [*GB200, "layout.rollout_nodes=0", "layout.train_nodes=5", "trainer.ep=4"],
        # auto layout keeps the typed keys and finds nothing: the line says what is short
        "nemotron_super fits no layout on gb200 (4 x 189 GB per node, up to 128 node(s)) with "
        "trainer=megatron, keeping layout.rollout_nodes layout.train_nodes trainer.ep as typed: training needs",
    ),
    "quirk_forbidden_block_size": (
        ["+experiment=grpo-gemma3-1b-it-1n8g-fsdp2tp1", *SITE, "rollout.block_size=16"],
        "rollout.block_size=16 is not allowed for gemma3_1b",
    ),
    "segment_does_not_divide": (
        [*GB200, "cluster.slurm.segment=2"],
        "cluster.slurm.segment=2 does not divide the job's 5 nodes",
    ),
    "segment_larger_than_rack": (
        [*GB200, "layout.train_nodes=19", "cluster.slurm.segment=20"],
        "larger than one NVLink domain (18 nodes)",
    ),
    "unknown_key": (["trainer.learning_rate=1"], "unknown key 'trainer.learning_rate'"),
    "unknown_group_option": (["cluster=gb300"], "unknown config 'cluster/gb300'"),
    "missing_site_keys": (
        ["cluster=gb200", "model=qwen2_1p5b"],
        "cluster 'gb200' requires cluster.slurm.account, cluster.container.image",
    ),
    "negative_value": (["algo.num_generations=-4"], "algo.num_generations=-4 must be > 0"),
    "zero_value": (["trainer.micro_batch_size=0"], "trainer.micro_batch_size=0 must be > 0"),
    "wrong_type": (["algo.lr=fast"], "bad value in override 'algo.lr=fast'"),
    "bad_slurm_time": ([*GB200, "cluster.slurm.time=soon"], "cluster.slurm.time='soon' is not a Slurm time"),
    "fsdp_has_no_pp": (
        ["model=qwen3_8b", "cluster=h100", *SITE, "trainer.pp=2"],
        "the fsdp backend has no pipeline parallelism",
    ),
    "local_cluster_multi_node": (["layout.train_nodes=2"], "cluster=local runs on this machine only"),
    "local_cluster_multi_gpu": (
        ["cluster.gpus_per_node=2", "trainer.cp=2"],
        "cluster=local runs one trainer rank and one rollout engine, but cluster.gpus_per_node=2",
    ),
    "secret_in_env": (["+cluster.env.HF_TOKEN=abc"], "cluster.env.HF_TOKEN looks like a secret"),
    "overlong_buffer_too_long": (
        ["algo=dapo", "rollout.max_new_tokens=8"],
        "algo.overlong_buffer=512 must be smaller than rollout.max_new_tokens=8",
    ),
    "too_few_generations": (["algo.num_generations=1"], "a group-relative baseline needs at least 2 samples"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_clear_line(cli, tmp_path, case):
    overrides, expected = CASES[case]
    out = tmp_path / "run"
    result = cli("render", *overrides, "--out", str(out))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hpcrl: error: ")
    assert expected in lines[0]
    assert "Traceback" not in result.stderr
    assert not out.exists()  # nothing written before the error
