"""Megatron-core backend, a Qwen3-MoE under torchrun with gloo on CPU: EP, EP x PP, TP, TP x EP, CP,
EP x CP and expert TP give the one-rank step (and it fsdp's); the grouped experts equal Megatron's
loop; MoE layouts plan."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import JOB_DOWNLOADS, ROOT, run_cli
from tests.harness.megatron_parity import parity_batch
from tests.harness.zygote import torchrun
from tests.megatron.common import (
    _assert_same_step,
    _torchrun,
    assert_exports_to,
)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """A small random Qwen3-MoE (4 experts, top-2, renormalised top-k weights) as a HF checkpoint."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("qwen3_moe")
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.slow
def test_qwen3_moe_matches_fsdp_and_expert_parallel_matches_one_rank(qwen3_moe_dir, tmp_path):
    """Router and experts mapped from the checkpoint; EP=2 (tokens exchanged by all-to-all over gloo)
    and EP=2 x PP=2 give the one-rank step. The load-balancing loss is off: the HF model (fsdp) adds
    it only when asked for router logits, so the two backends would differ by it."""
    mask = parity_batch().loss_mask.bool()
    aux_off = ("trainer.moe_aux_loss_coeff=0",)
    base = _torchrun(qwen3_moe_dir, tmp_path / "ep1.pt", 1, 1, port=29741, extra=aux_off)
    assert base["layout"]["experts"] == ["GroupedExperts"]  # grouped GEMMs (experts.py), not Megatron's loop
    fsdp = _torchrun(qwen3_moe_dir, tmp_path / "fsdp.pt", 1, 1, backend="fsdp", port=29742)
    assert torch.allclose(base["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    assert base["metrics"]["grad_norm"] == pytest.approx(fsdp["metrics"]["grad_norm"], rel=1e-5)
    # fsdp's gradients are named as transformers holds them (experts fused): in checkpoint names
    from transformers import AutoModelForCausalLM

    from hpcrl.trainer.fsdp import checkpoint_names

    assert_exports_to(fsdp["weights"], tmp_path / "fsdp.ckpt", qwen3_moe_dir, backend="fsdp")
    hf_grads = checkpoint_names(AutoModelForCausalLM.from_pretrained(qwen3_moe_dir), fsdp["grads"])
    assert hf_grads.keys() == base["grads"].keys()
    for name, grad in hf_grads.items():
        assert torch.allclose(base["grads"][name], grad, atol=1e-5), name
    # EP is carved out of the data-parallel ranks, or (tensor parallel) out of the TP ranks: TP=2 x EP=1
    # keeps every expert on both TP ranks, each routing its own slice of the tokens (sequence parallel),
    # so expert and router gradients are partial per rank and summed
    # (TP=2 x DP=2 with EP=2: each expert on one TP rank of each data-parallel pair). Under context
    # parallel each rank's loss comes multiplied by cp: CP=2 (experts replicated over the CP pair, whose
    # gradients are summed) and EP=2 x CP=2 (the all-to-all already summed both halves) must scale by it.
    # Expert tensor parallel (ETP) splits each expert's fc1/fc2 over its own group, which Megatron
    # carves out of the TP x DP ranks like EP: TP=2 x ETP=2, DP=2 x ETP=2 (one expert split across two
    # data-parallel ranks, each gathering the other's routed tokens), TP=2 x EP=2 x ETP=2 x DP=2.
    layouts = (
        (1, 2, 1, 2, 1, 1),
        (1, 2, 2, 2, 1, 1),
        (2, 1, 1, 1, 1, 1),
        (2, 2, 1, 1, 1, 1),
        (2, 2, 1, 2, 1, 1),
        (1, 1, 1, 1, 2, 1),
        (1, 2, 1, 1, 2, 1),
        (2, 2, 1, 1, 2, 1),
        (2, 1, 1, 1, 1, 2),
        (1, 1, 1, 2, 1, 2),
        (2, 2, 1, 2, 1, 2),
    )
    for i, (tp, ep, pp, dp, cp, etp) in enumerate(layouts):
        where = f"TP={tp} EP={ep} PP={pp} DP={dp} CP={cp} ETP={etp}"
        run = _torchrun(
            qwen3_moe_dir,
            tmp_path / f"tp{tp}ep{ep}pp{pp}dp{dp}cp{cp}etp{etp}.pt",
            tp,
            pp,
            dp=dp,
            cp=cp,
            port=29771 + i,
            extra=(*aux_off, f"trainer.ep={ep}", f"trainer.expert_tp={etp}"),
        )
        assert run["layout"]["sequence_parallel"] == (tp > 1) and run["layout"]["cp"] == cp, where
        assert run["layout"]["expert_tp"] == etp and run["layout"]["expert_fc1_rows"] == [(64 // etp, 64)], (
            where
        )
        _assert_same_step(run, base, mask, where)
        assert all(run["state_restored"]), where
        if (tp, ep, etp, dp) == (2, 2, 2, 2):  # this layout's checkpoint exports to the trained weights
            assert_exports_to(
                run["weights"], tmp_path / f"tp{tp}ep{ep}pp{pp}dp{dp}cp{cp}etp{etp}.ckpt", qwen3_moe_dir
            )
        if tp == 1:  # Adam's state split, never repeated: dense over DP x CP, experts by EP, ETP, expert DP
            assert sum(run["optimizer_numel"]) == sum(base["optimizer_numel"]), (
                where,
                run["optimizer_numel"],
            )


@pytest.mark.slow
def test_grouped_experts_equal_megatrons_loop_and_autocast_per_expert(qwen3_moe_dir, tmp_path):
    """experts.GroupedExperts (two grouped GEMMs over all local experts) on routed tokens with uneven
    counts and an expert that gets none: Megatron's per-expert loop in fp32, and a per-expert F.linear
    loop under bf16 autocast (the cast GPUs take), give its outputs and gradients."""
    out = tmp_path / "experts.pt"
    script = ROOT / "tests" / "harness" / "megatron_experts_check.py"
    done = torchrun(script, [str(qwen3_moe_dir), str(out)], 1, 29791, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = torch.load(out)
    assert r["module"] == "GroupedExperts"
    # the fp32 router (MoE quirk) really gates in fp32 under autocast, and its backward runs
    assert r["router"] == {"module": "Fp32Router", "dtype": "torch.float32", "weight_grad": True}

    def same(a: dict, b: dict, atol: float) -> None:
        assert a["dtype"] == b["dtype"]
        assert torch.allclose(a["out"], b["out"], atol=atol) and torch.allclose(
            a["x_grad"], b["x_grad"], atol=atol
        )
        for name, grad in b["grads"].items():
            assert torch.allclose(a["grads"][name], grad, atol=atol), name

    same(r["grouped fp32"], r["sequential fp32"], 1e-7)
    same(r["grouped fp32"], r["plain fp32"], 1e-7)
    same(r["grouped bf16"], r["plain bf16"], 1e-6)
    assert r["grouped bf16"]["dtype"] == "torch.bfloat16"
    assert not torch.equal(r["grouped bf16"]["out"], r["grouped fp32"]["out"])  # the cast really happened
    empty = r["grouped fp32"]["grads"]["local_experts.1.linear_fc1.weight"]
    assert torch.count_nonzero(empty) == 0  # expert 1 got no token
    assert torch.count_nonzero(r["grouped fp32"]["grads"]["local_experts.2.linear_fc1.weight"]) > 0


def test_moe_plans_with_megatron_under_tensor_context_and_expert_tensor_parallel():
    site = ["cluster.slurm.account=a", "cluster.container.image=i.sqsh", "cluster=h100", *JOB_DOWNLOADS]
    ok = run_cli("plan", "model=qwen3_30b_a3b", "trainer=megatron", "trainer.ep=8", *site)
    assert "EP" in ok.stdout and ok.returncode == 0, ok.stdout[-2000:] + ok.stderr
    tp2 = run_cli("plan", "model=qwen3_30b_a3b", "trainer=megatron", "trainer.ep=4", "trainer.tp=2", *site)
    assert "EP" in tp2.stdout and tp2.returncode == 0, tp2.stdout[-2000:] + tp2.stderr
    no_sp = run_cli(
        "plan",
        "model=qwen3_30b_a3b",
        "trainer=megatron",
        "trainer.ep=4",
        "trainer.tp=2",
        "trainer.sequence_parallel=false",
        *site,
    )
    assert no_sp.returncode == 2 and "under tensor parallel with sequence parallel only" in no_sp.stderr
    cp2 = run_cli("plan", "model=qwen3_30b_a3b", "trainer=megatron", "trainer.ep=4", "trainer.cp=2", *site)
    assert "EP" in cp2.stdout and cp2.returncode == 0, cp2.stdout[-2000:] + cp2.stderr
    etp = run_cli(
        "plan",
        "model=qwen3_30b_a3b",
        "trainer=megatron",
        "trainer.ep=4",
        "trainer.tp=2",
        "trainer.expert_tp=2",
        *site,
    )
    assert "expert TP 2" in etp.stdout and etp.returncode == 0, etp.stdout[-2000:] + etp.stderr


@pytest.mark.slow
def test_router_replay_gives_fsdps_step_on_the_same_routes(qwen3_moe_dir, tmp_path):
    """trainer.router_replay with routes given in the batch (random: not the routers' own choice):
    megatron's step equals fsdp's on the same routes, at one rank, under TP=2 (sequence parallel: each
    rank's routers see half the tokens), EP=2 x PP=2 (each stage's routers their own layers, recomputed
    in 1F1B) and packed at TP=2; and it differs from the free step, so the routes were used."""
    mask = parity_batch().loss_mask.bool()
    replay, routes = ("trainer.router_replay=true",), {"HPCRL_PARITY_ROUTES": "1"}
    aux_off = ("trainer.moe_aux_loss_coeff=0",)
    fsdp = _torchrun(
        qwen3_moe_dir, tmp_path / "fsdp.pt", 1, 1, backend="fsdp", port=29801, algo=replay, env=routes
    )
    base = _torchrun(
        qwen3_moe_dir, tmp_path / "m1.pt", 1, 1, port=29802, extra=aux_off, algo=replay, env=routes
    )
    assert torch.allclose(base["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    for key in ("loss", "policy_loss", "kl", "grad_norm"):
        assert base["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-4, abs=1e-6), key
    # fsdp's expert parallel dispatch takes the replayed experts too (EP=2 over two gloo ranks)
    ep2 = _torchrun(
        qwen3_moe_dir, tmp_path / "fsdp_ep2.pt", 1, 1, backend="fsdp", dp=2, port=29808,
        algo=(*replay, "trainer.ep=2"), env=routes,
    )  # fmt: skip
    assert ep2["layout"]["dispatch"] and torch.allclose(ep2["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    assert ep2["metrics"]["loss"] == pytest.approx(fsdp["metrics"]["loss"], rel=1e-4, abs=1e-6)
    free = _torchrun(qwen3_moe_dir, tmp_path / "free.pt", 1, 1, port=29803, extra=aux_off)
    assert (free["logp"][mask] - base["logp"][mask]).abs().max() > 1e-3
    for i, (tp, ep, pp) in enumerate(((2, 1, 1), (1, 2, 2))):
        where = f"TP={tp} EP={ep} PP={pp}"
        run = _torchrun(
            qwen3_moe_dir, tmp_path / f"tp{tp}ep{ep}pp{pp}.pt", tp, pp, dp=ep, port=29804 + i,
            extra=(*aux_off, f"trainer.ep={ep}"), algo=replay, env=routes,
        )  # fmt: skip
        _assert_same_step(run, base, mask, where)
    # packed rows (TP=2: each rank's routers see half of each packed row) replay as the padded ones
    packing = ("trainer.packing=true", "trainer.micro_batch_tokens=16")
    run = _torchrun(
        qwen3_moe_dir,
        tmp_path / "packed.pt",
        2,
        1,
        port=29807,
        extra=(*aux_off, *packing),
        algo=replay,
        env=routes,
    )
    assert torch.allclose(run["logp"][mask], base["logp"][mask], atol=1e-5)
    for key in ("loss", "policy_loss", "kl", "grad_norm"):
        assert run["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-6), key
