"""The multi-token-prediction settings at plan time: ``trainer.mtp_loss_scale`` and
``rollout.speculative`` need a model with MTP layers, a backend that carries them, and each other;
each refusal is one line naming the key and the fix."""

from __future__ import annotations

import pytest

from hpcrl.errors import ConfigError
from tests.conftest import SITE, plan

NH = "+experiment=grpo-tinynemotronh-1n1g-fsdp"
WITH_MTP = (NH, "model.mtp_layers=1", "model.hybrid.mtp_pattern=*E")


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        plan(*overrides)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_mtp_plans_with_the_fsdp_backend_and_the_vllm_engine():
    p = plan(
        *WITH_MTP,
        "trainer.mtp_loss_scale=0.3",
        "rollout=vllm",
        "rollout.speculative=mtp",
        "rollout.num_speculative_tokens=3",
    )
    assert p.cfg.trainer.mtp_loss_scale == 0.3
    assert (p.cfg.rollout.speculative, p.cfg.rollout.num_speculative_tokens) == ("mtp", 3)
    assert plan(*WITH_MTP).cfg.trainer.mtp_loss_scale is None  # off unless asked: the recipes' default


def test_each_mtp_refusal_names_the_key_and_the_fix():
    assert "tiny_nemotronh has no MTP layers (model.mtp_layers=0); drop trainer.mtp_loss_scale" in refusal(
        NH, "trainer.mtp_loss_scale=0.3"
    )
    megatron = (*WITH_MTP, "trainer=megatron", "trainer.mtp_loss_scale=0.3")
    assert plan(*megatron).cfg.trainer.mtp_loss_scale == 0.3
    # the MTP layers shard as the decoder's under TP (SP), EP and CP, sit on the last stage under PP
    # (8 layers: 2 stages), and read either log-prob head
    gpus = ("cluster=h100", *SITE)
    eight = ("model.num_layers=8", "model.hybrid.pattern=MEM*EMEM", "model.hybrid.mamba=4")
    for layout, (tp, pp, ep, cp) in (
        ("trainer.tp=2", (2, 1, 1, 1)),
        ("trainer.ep=2", (1, 1, 2, 1)),
        ("trainer.tp=2 trainer.ep=2", (2, 1, 2, 1)),
        ("trainer.cp=2", (1, 1, 1, 2)),
        ("trainer.tp=2 trainer.cp=2 trainer.packing=true", (2, 1, 1, 2)),
        ("trainer.pp=2", (1, 2, 1, 1)),
        ("trainer.tp=2 trainer.pp=2 trainer.ep=2", (2, 2, 2, 1)),
    ):
        p = plan(*megatron, *eight, *layout.split(), *gpus)
        assert p.cfg.trainer.mtp_loss_scale == 0.3
        train = p.topology.train
        assert (train.tp, train.pp, train.ep, train.cp) == (tp, pp, ep, cp)
    assert plan(*megatron, "trainer.fused_logprob=false").cfg.trainer.mtp_loss_scale == 0.3
    assert plan(*megatron, "trainer.packing=true").cfg.trainer.packing  # each depth inside its sequence
    # the decoder's routers replay, the MTP layers' route freely (trainer/router_replay.py); the hf
    # engine returns no routes
    assert plan(*megatron, "trainer.router_replay=true", "rollout=vllm").cfg.trainer.router_replay
    # a tied head would be a second copy of the embedding on the last stage: not carried under PP yet
    tied = refusal(*megatron, *eight, "trainer.pp=2", "model.tie_embeddings=true", *gpus)
    assert (
        "trainer.mtp_loss_scale=0.3: trainer=megatron does not carry the MTP layers of a model with tied "
        "embeddings (model.tie_embeddings=true) under trainer.pp=2 yet: set trainer.pp=1, or use trainer=fsdp"
    ) in tied
    assert plan(*megatron, *eight, "model.tie_embeddings=true", *gpus).cfg.trainer.mtp_loss_scale == 0.3
    assert "has none (model.mtp_layers=0): set rollout.speculative=null" in refusal(
        NH, "rollout=vllm", "rollout.speculative=mtp"
    )
    assert "no refit would reach them: set trainer.mtp_loss_scale" in refusal(
        *WITH_MTP, "rollout=vllm", "rollout.speculative=mtp"
    )
    assert "rollout.speculative='eagle' must be one of mtp" in refusal(
        *WITH_MTP, "rollout=vllm", "rollout.speculative=eagle"
    )
    assert "does nothing without rollout.speculative" in refusal(
        *WITH_MTP, "rollout=vllm", "rollout.num_speculative_tokens=2"
    )
    assert "trainer.mtp_loss_scale" in refusal(*WITH_MTP, "trainer.mtp_loss_scale=-1")
    assert "trainer.mtp_detach=false does nothing without trainer.mtp_loss_scale" in refusal(
        *WITH_MTP, "trainer.mtp_detach=false"
    )


def test_the_memory_estimate_counts_the_mtp_block_where_it_is_held():
    """Nemotron 3 Super's one MTP block (2.9B parameters): in the trainer's share with
    trainer.mtp_loss_scale, in the engine's weights with rollout.speculative."""
    super_ = ("+experiment=dapo-nemotron-super-3n8g-megatron", *SITE, "trainer=fsdp", "trainer.ep=1")
    counts = plan(*super_).cfg.model.param_counts()
    assert counts.with_mtp().total - counts.total == counts.mtp > 2.9e9
    base = plan(*super_, "trainer.tp=1", "trainer.cp=1").memory
    held = plan(*super_, "trainer.tp=1", "trainer.cp=1", "trainer.mtp_loss_scale=0.3",
                "rollout.speculative=mtp").memory  # fmt: skip
    assert held.train.weights > base.train.weights and held.train.grads > base.train.grads
    assert held.rollout.weights - base.rollout.weights == pytest.approx(
        2 * counts.mtp / plan(*super_).topology.rollout.tp / 1e9, rel=1e-6
    )
