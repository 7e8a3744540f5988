"""Nemotron-H in the megatron backend: HF <-> Megatron weights bit-identical through TP 1, 2 and 4 (the
Mamba in_proj/conv1d cut part by part), the parity risks of notes/nemotron-h.md each pinned (dt floor,
router precision, top-k renormalisation, padding side), and, under torchrun with gloo on CPU, megatron
TP=1 = fsdp (transformers' NemotronHForCausalLM) and TP=2 (sequence parallel) / PP=2 / EP=2 / TP=2 x EP=2
/ CP=2 / TP=2 x CP=2 = TP=1 in log-probs, metrics, every gradient and the updated weights (the CP
reorders and group copies by hand: tests/megatron/test_megatron_mamba_cp.py). The torchrun layouts and the
mixer check are cases of the session's one torchrun per world size (tests/conftest.py's
torchrun_cases, shared with tests/recipes/test_recipes_build.py)."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch

from hpcrl.trainer.megatron.weights import Shape, relocate, shard, unshard
from hpcrl.trainer.megatron.weights_hybrid import MTP_PREFIX, QKV, partitions, to_hf, to_megatron
from tests.conftest import TorchrunCase, register_torchrun_case
from tests.harness.mamba_mixer_check import OVERRIDES as MIXER_OVERRIDES
from tests.harness.megatron_parity import overrides as parity_overrides
from tests.harness.megatron_parity import parity_batch
from tests.megatron.common import _assert_same_step, assert_exports_to

PATTERN = "MEM*EMEM"  # Super's own layers 4..11: every kind, and 8 layers split over PP=2


def nemotron_h_config(**overrides: object) -> object:
    """tests/harness/tiny_checkpoints.py's Nemotron-H (Super's kinds at a width TP/CP/EP 2 split), all kinds."""
    from transformers import NemotronHConfig

    from tests.harness.tiny_checkpoints import NEMOTRON_H

    fields = {**NEMOTRON_H, "hybrid_override_pattern": PATTERN, "moe_latent_size": 32, "time_step_min": 0.001}
    return NemotronHConfig(**{**fields, "tie_word_embeddings": False, **overrides})


def nemotron_h_model(**overrides: object) -> torch.nn.Module:
    """Random weights, with the parts the risks live in made to bite: a correction bias that changes
    which experts win, and dt biases that put some heads' softplus(dt) under the 0.001 floor (their
    skip weight D near 0, so their output is the scan's)."""
    from transformers import NemotronHForCausalLM

    torch.manual_seed(0)
    model = NemotronHForCausalLM(nemotron_h_config(**overrides))
    with torch.no_grad():
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn_like(t) * 0.1)
            elif name.endswith("dt_bias"):
                t.copy_(torch.linspace(-12.0, 1.0, t.numel()))
            elif name.endswith("mixer.D"):  # no skip path to drown the floored heads' (0-3) output
                t.copy_((torch.arange(t.numel()) >= t.numel() // 2).float())
    return model.eval()


CHECKPOINT = "nemotron_h_parity"
LAYOUTS = ((2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1), (1, 1, 1, 2), (2, 1, 1, 2))
"""TP, PP, EP, CP: each against TP=1 (EP=2 alone over DP=2 ranks)."""


def _save_model(out: Path) -> None:
    nemotron_h_model().save_pretrained(out)


MTP_CHECKPOINT = "nemotron_h_parity_mtp"


def _save_mtp_model(out: Path) -> None:
    """The parity model (the same decoder) with one MTP block of Super's kinds (attention, LatentMoE),
    saved under the checkpoint's ``mtp.*`` names (hpcrl/trainer/mtp.py's module, as the tiny model's)."""
    from hpcrl.trainer.mtp import attach

    model = nemotron_h_model(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
    attach(model, 1)
    model.mtp.apply(model._init_weights)
    with torch.no_grad():  # a correction bias that changes which of the block's experts win
        model.mtp.layers[1].mixer.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    model.save_pretrained(out)


def _parity_case(
    name: str,
    tp: int,
    pp: int,
    backend: str = "megatron",
    packing: tuple[str, ...] = (),
    checkpoint: str = CHECKPOINT,
    **kw: int,
) -> TorchrunCase:
    """tests/harness/megatron_parity.py's run of a layout (its overrides; cp and ep as test_megatron's
    ``_torchrun`` passes them, ``packing``'s after them: any further overrides) on ``checkpoint`` as a
    case of the session's torchrun of its world size."""
    cp, ep = kw.get("cp", 1), kw.get("ep")
    extra = (f"trainer.cp={cp}", *([f"trainer.ep={ep}"] if ep else [])) if backend == "megatron" else ()
    extra = (*extra, *packing)
    with mock.patch.dict(os.environ, {"HPCRL_PARITY_OVERRIDES": " ".join(extra)}):
        cfg = tuple(parity_overrides(tp, pp, backend))
    world = tp * pp * cp * max(1, (ep or 1) // tp)
    return register_torchrun_case(
        TorchrunCase(
            f"nemotron_h-parity-{name}",
            __name__,
            world,
            backend,
            cfg,
            checkpoint,
            _save_mtp_model if checkpoint == MTP_CHECKPOINT else _save_model,
            "parity",
            False,
        )
    )


BASE, FSDP = _parity_case("tp1", 1, 1), _parity_case("fsdp", 1, 1, backend="fsdp")
PARALLEL = {
    (tp, pp, ep, cp): _parity_case(f"tp{tp}pp{pp}ep{ep}cp{cp}", tp, pp, cp=cp, ep=ep)
    for tp, pp, ep, cp in LAYOUTS
}
PACKING = ("trainer.packing=true", "trainer.micro_batch_tokens=21")
"""Bins [8, 8, 5], [8, 8], [8, 8] of the parity batch's rows (chunks of 8), each row padded to a
multiple of TP x 2·CP (22 at TP=2, 24 at CP=2 and at TP=2 x CP=2)."""
PACKED = {
    (tp, pp, ep, cp): _parity_case(f"packed-tp{tp}pp{pp}ep{ep}cp{cp}", tp, pp, packing=PACKING, cp=cp, ep=ep)
    for tp, pp, ep, cp in ((1, 1, 1, 1), *LAYOUTS)
}
"""Every layout the padded parity runs (TP=1 too), packed."""
PACKED_CP_EP = _parity_case(
    "packed-tp2pp1ep2cp2etp2",
    2,
    1,
    packing=("trainer.expert_tp=2", "trainer.packing=true", "trainer.micro_batch_tokens=48"),
    cp=2,
    ep=2,
)
"""TP=2 x CP=2 (sequence parallel) with the experts over EP=2 x expert TP=2, the Super recipe's tiny
layout in the world-4 torchrun, packed at a budget of 48: bins [8 x 6] (48 tokens) and [5], a row
shorter than a chunk (12), so CP rank 1's chunks of it hold only padding (its attention reads no key:
``varlen._reads`` keeps the K/V gather's backward collective on that rank; without it the step hung)."""
MTP = ("trainer.mtp_loss_scale=0.5", "trainer.mtp_detach=false")
"""The MTP block trained, its loss reaching the decoder (the gradient through the sequence-parallel
hidden states, the embedding and the vocab-parallel head too)."""
MTP_RUNS = {
    (tp, pp, ep, cp, replay): _parity_case(
        f"mtp-{'replay-' if replay else ''}tp{tp}ep{ep}"
        + (f"cp{cp}" if cp > 1 else "")
        + (f"pp{pp}" if pp > 1 else ""),
        tp,
        pp,
        packing=(*MTP, *(["trainer.router_replay=true"] if replay else [])),
        checkpoint=MTP_CHECKPOINT,
        ep=ep,
        cp=cp,
    )
    for tp, pp, ep, cp, replay in (
        (1, 1, 1, 1, False),
        (2, 1, 1, 1, False),
        (1, 1, 1, 2, False),
        (1, 2, 1, 1, False),
        (1, 1, 1, 1, True),
        (2, 1, 2, 1, True),
    )
}
"""TP, PP, EP, CP, router replay: the MTP layers at TP=1, TP=2 (sequence parallel), CP=2 and PP=2 (the
block on the last stage with its copy of the first stage's embedding), on the checkpoint with them; with router
replay (the batch's random routes, tests/harness/recipe_build.py: the decoder's routers replay them,
the MTP layers' route freely, trainer/router_replay.py) at TP=1 and TP=2 x EP=2 (each rank's routers
see half the tokens; the experts, the MTP block's too, on the decoder's expert ranks)."""
MTP_PACKED = {
    (tp, cp): _parity_case(
        f"mtp-packed-tp{tp}ep1" + (f"cp{cp}" if cp > 1 else ""),
        tp,
        1,
        packing=(*MTP, "trainer.packing=true", "trainer.micro_batch_tokens=16"),
        checkpoint=MTP_CHECKPOINT,
        cp=cp,
    )
    for tp, cp in ((2, 1), (1, 2))
}
"""Packed at TP=2 (sequence parallel) and at CP=2 (the row's chunks): bins [0, 1], [2, 3], [4, 5], [6],
the padded runs' micro-batches of 2, so the MTP loss (a mean per micro-batch) is the padded TP=1 step's
too."""
MIXER = register_torchrun_case(
    TorchrunCase(
        "nemotron_h-mixer",
        __name__,
        1,
        "megatron",
        tuple(MIXER_OVERRIDES),
        CHECKPOINT,
        _save_model,
        "mixer",
        False,
    )
)


def _checkpoint(tmp_path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    nemotron_h_model().save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors")


def _shape() -> Shape:
    return Shape(
        heads=4,
        groups=2,
        head_dim=16,
        vocab=128,
        padded_vocab=128,
        pattern=PATTERN,
        mamba=(8 * 16, 4 * 16, 8),
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hf_to_megatron_to_hf_is_bit_identical_through_tensor_parallel(tmp_path, tp):
    hf = _checkpoint(tmp_path)
    assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in hf  # the checkpoint's per-expert layout
    shape, parts = _shape(), partitions(_shape())
    mtp = {f"{MTP_PREFIX}layers.0.eh_proj.weight": torch.ones(64, 128)}
    meg = to_megatron({**hf, **mtp}, shape, tied=False)
    assert not any(k.startswith(MTP_PREFIX) for k in meg)  # MTP dropped by name
    # each kind's block norm in its slot; router weight and correction bias as Bridge names them
    assert torch.equal(meg["decoder.layers.0.norm.weight"], hf["backbone.layers.0.norm.weight"])
    assert torch.equal(meg["decoder.layers.3.input_layernorm.weight"], hf["backbone.layers.3.norm.weight"])
    assert torch.equal(meg["decoder.layers.4.pre_mlp_layernorm.weight"], hf["backbone.layers.4.norm.weight"])
    bias = hf["backbone.layers.1.mixer.gate.e_score_correction_bias"]
    assert torch.equal(meg["decoder.layers.1.mlp.router.expert_bias"], bias) and bias.dtype == torch.float32
    sliced = {}
    for name, full in meg.items():
        suffix = next((p for s, p in parts.items() if name.endswith(s)), None)
        ranks = [shard(name, full, tp, r, suffix) for r in range(tp)]
        sliced[name] = ranks
        assert torch.equal(unshard(name, ranks, suffix), full), name
    back = to_hf(
        {
            k: unshard(k, v, next((p for s, p in parts.items() if k.endswith(s)), None))
            for k, v in sliced.items()
        },
        shape,
        tied=False,
    )
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    # rank r's in_proj rows are [z_r | x_r | B_r | C_r | dt_r]: what TorchMambaMixer splits
    w = hf["backbone.layers.0.mixer.in_proj.weight"]
    z, x, b, c, dt = w.split([128, 128, 64, 64, 8])
    last = sliced["decoder.layers.0.mixer.in_proj.weight"][tp - 1]
    want = torch.cat([p.chunk(tp)[tp - 1] for p in (z, x, b, c, dt)])
    assert torch.equal(last, want)
    # the squared-ReLU fc1 is one part (no gate/up halves): rank 0 holds the first rows
    fc1 = meg["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
    assert torch.equal(sliced["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"][0], fc1.chunk(tp)[0])


def test_carried_mtp_layers_map_as_the_decoders_layers_of_their_kind(tmp_path):
    """With ``Shape.mtp`` (``trainer.mtp_loss_scale``) an MTP block (attention, LatentMoE: Super's) maps
    to ``mtp_block.layers.<i>`` by its layers' kinds, the depth's own weights as they are, and back;
    placed under TP and EP as the decoder's layers are."""
    from dataclasses import replace

    hf = _checkpoint(tmp_path)
    block = {  # the decoder's attention layer 3 and MoE layer 4, as the MTP block's two layers
        f"mtp.layers.{j}.{k.split('.', 3)[3]}": v
        for j, i in enumerate((3, 4))
        for k, v in hf.items()
        if k.startswith(f"backbone.layers.{i}.")
    }
    own = {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.1.final_layernorm.weight"}
    block |= {n: torch.randn(64) for n in own} | {"mtp.layers.0.eh_proj.weight": torch.randn(64, 128)}
    shape = replace(_shape(), mtp="*E")
    meg = to_megatron(block, shape, tied=False)
    assert torch.equal(meg["mtp_block.layers.0.eh_proj.weight"], block["mtp.layers.0.eh_proj.weight"])
    assert torch.equal(meg["mtp_block.layers.0.input_layernorm.weight"], hf["backbone.layers.3.norm.weight"])
    fused = to_megatron({k: v for k, v in hf.items() if k.startswith("backbone.layers.3.")}, _shape(), False)
    assert torch.equal(
        meg["mtp_block.layers.0.self_attention.linear_qkv.weight"], fused[f"decoder.layers.3.{QKV}"]
    )
    assert torch.equal(
        meg["mtp_block.layers.1.mlp.experts.local_experts.7.linear_fc1.weight"],
        hf["backbone.layers.4.mixer.experts.7.up_proj.weight"],
    )
    back = to_hf(meg, shape, tied=False)
    assert back.keys() == block.keys() and all(torch.equal(back[k], block[k]) for k in block)
    # under TP eh_proj is cut by rows (column-parallel, as Megatron's MTP layer); under EP the block's
    # experts take global indices as the decoder's do (no pipeline offset: the block numbers its own)
    eh = meg["mtp_block.layers.0.eh_proj.weight"]
    assert torch.equal(shard("mtp_block.layers.0.eh_proj.weight", eh, 2, 1), eh.chunk(2)[1])
    local = "mtp_block.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert relocate(local, 4, 4) == local.replace("experts.3.", "experts.7.")


def _logp(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.slow
def test_mamba_mixer_equals_transformers_and_keeps_its_dt_floor(torchrun_cases):
    """TorchMambaMixer = transformers' mixer (outputs and input gradients) on an input where the dt
    floor (``time_step_min``, which Hugging Face and vLLM apply and Megatron's kernels do not) moves
    the output far beyond rounding: without the floor on both sides they agree again, and ours without
    it no longer matches Hugging Face's with it (tests/harness/mamba_mixer_check.py, in the one-rank torchrun)."""
    r = torchrun_cases.result(MIXER.id)
    assert "error" not in r, r["error"]
    assert r["module"] == "TorchMambaMixer"
    for case in ("floor", "no floor"):
        ours, hf = r[case]["ours"], r[case]["hf"]
        scale = hf["out"].abs().max()
        assert torch.allclose(ours["out"], hf["out"], atol=1e-5 * scale), case
        assert torch.allclose(ours["x_grad"], hf["x_grad"], atol=1e-5 * hf["x_grad"].abs().max()), case
    moved = (r["no floor"]["ours"]["out"] - r["floor"]["hf"]["out"]).abs().max()
    assert moved > 1e-3 * r["floor"]["hf"]["out"].abs().max()  # the two agree to 0 where they should


def test_the_scan_calls_mamba_ssm_kernels_with_the_torch_paths_arguments():
    """Where mamba_ssm installs (CUDA hosts with it; not here), ``mamba_scan`` hands its arguments to
    ``mamba_chunk_scan_combined``. Fake at that edge: transformers' torch reference of the same
    function (its signature and semantics, dt_limit included) stands in for the kernel, and must give
    the torch path's numbers, floor and all."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    from hpcrl.trainer.kernels import Kernels
    from hpcrl.trainer.megatron.ssm import mamba_scan

    gen = torch.Generator().manual_seed(3)
    x, b, c = (
        torch.randn(2, 21, 4, 8, generator=gen),
        torch.randn(2, 21, 2, 5, generator=gen),
        torch.randn(2, 21, 2, 5, generator=gen),
    )
    dt, a = torch.randn(2, 21, 4, generator=gen), -torch.rand(4, generator=gen) - 0.5
    d, dt_bias = torch.rand(4, generator=gen), torch.tensor([-12.0, -8.0, 0.0, 1.0])
    ours = mamba_scan(x, dt, a, b, c, 8, d, dt_bias, 1e-3)
    fake = Kernels(scan=mamba2_chunk_scan)
    assert torch.allclose(mamba_scan(x, dt, a, b, c, 8, d, dt_bias, 1e-3, fake), ours, atol=1e-5)
    assert not torch.allclose(mamba_scan(x, dt, a, b, c, 8, d, dt_bias, 0.0, fake), ours, atol=1e-5)
    # a packed row: the kernel gets the sequences as ``seq_idx`` (the stand-in: transformers' torch
    # scan wrapped as the fsdp backend runs it, which takes ``seq_idx`` as mamba_ssm's kernel does)
    from functools import partial

    from hpcrl.trainer.fsdp.segments import _scan

    seq_idx = torch.tensor([[0] * 5 + [1] * 9 + [2] * 7] * 2, dtype=torch.int32)
    packed = mamba_scan(x, dt, a, b, c, 8, d, dt_bias, 1e-3, seq_idx=seq_idx)
    fake = Kernels(scan=partial(_scan, mamba2_chunk_scan))
    assert torch.allclose(mamba_scan(x, dt, a, b, c, 8, d, dt_bias, 1e-3, fake, seq_idx), packed, atol=1e-5)
    assert not torch.allclose(packed, ours, atol=1e-3)


def test_router_is_sigmoid_renormalised_scaled_in_fp32_as_transformers_routes():
    """Megatron's top-k routing with the family's fields = transformers' NemotronHTopkRouter: the bias
    picks the experts, the unbiased sigmoid scores weigh them, renormalised over the k, times 5."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    from hpcrl.trainer.config import MegatronTrainerConfig
    from hpcrl.trainer.megatron.families.nemotron_h import NemotronH

    hf = nemotron_h_config(hidden_size=8)
    fields = NemotronH(hf).moe_fields(hf, MegatronTrainerConfig())
    assert fields["moe_router_dtype"] == "fp32" and fields["moe_router_score_function"] == "sigmoid"
    assert fields["moe_router_bias_update_rate"] == 0.0 and fields["moe_aux_loss_coeff"] == 0.0
    router = NemotronHTopkRouter(hf)
    with torch.no_grad():
        router.weight.copy_(torch.eye(8))
        router.e_score_correction_bias.copy_(torch.randn(8) * 0.5)
    h = torch.randn(16, 8)
    _, weights, idx = router(h)
    probs, chosen = topk_routing_with_score_function(
        h,
        fields["moe_router_topk"],
        scaling_factor=fields["moe_router_topk_scaling_factor"],
        score_function="sigmoid",
        expert_bias=router.e_score_correction_bias,
    )
    assert torch.equal(chosen, torch.zeros_like(chosen).scatter(1, idx, True))
    assert torch.allclose(probs.gather(1, idx), weights, atol=1e-6)
    # a checkpoint that does not renormalise (Megatron always does for k > 1) is refused by name
    with pytest.raises(ValueError, match="norm_topk_prob"):
        NemotronH(nemotron_h_config(norm_topk_prob=False))


def test_right_padding_leaves_real_tokens_alone_left_padding_would_not():
    """The megatron pipeline right-pads and runs without a mask (as Megatron does): trailing pads
    cannot reach earlier tokens through causal attention, the causal conv or the scan. Left pads
    without a mask would (they enter every state), which is why the batch is right-padded."""
    model = nemotron_h_model()
    ids = torch.randint(3, 120, (1, 11), generator=torch.Generator().manual_seed(2))
    alone = _logp(model, ids)
    right = _logp(model, torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], 1))[:, : alone.shape[1]]
    left = _logp(model, torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1))[:, 5:]
    assert torch.allclose(right, alone, atol=1e-6)
    assert (left - alone).abs().max() > 1e-3
    batch = parity_batch()
    assert all(
        row[: int(n)].all()
        for row, n in zip(batch.attention_mask.bool(), batch.attention_mask.sum(1), strict=True)
    )


@pytest.mark.slow
def test_nemotron_h_matches_fsdp_and_under_parallel_layouts(torchrun_cases):
    """megatron TP=1 = fsdp, then TP=2 (sequence parallel), PP=2, EP=2, TP=2 x EP=2, CP=2 and
    TP=2 x CP=2 = TP=1; the checkpoint round trip restores every rank's optimizer state."""
    from transformers import AutoModelForCausalLM

    from hpcrl.trainer.fsdp import checkpoint_names

    mask = parity_batch().loss_mask.bool()
    runs = {case.id: torchrun_cases.result(case.id) for case in (BASE, FSDP, *PARALLEL.values())}
    assert not [(k, r["error"]) for k, r in runs.items() if "error" in r]
    base, fsdp = runs[BASE.id], runs[FSDP.id]
    assert base["layout"]["experts"] == ["GroupedExperts"]
    assert torch.allclose(base["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    assert base["metrics"]["grad_norm"] == pytest.approx(fsdp["metrics"]["grad_norm"], rel=1e-5)
    model = AutoModelForCausalLM.from_pretrained(torchrun_cases.checkpoint(CHECKPOINT))
    hf_grads = checkpoint_names(model, fsdp["grads"])
    assert hf_grads.keys() == base["grads"].keys()
    for name, grad in hf_grads.items():
        assert torch.allclose(base["grads"][name], grad, atol=1e-5), name
    assert not any("e_score_correction_bias" in k for k in base["grads"])  # a buffer: never trained
    # checkpoints of both backends (and of TP=2 x EP=2) export to the trained weights, the frozen
    # correction biases included (the source's names, no others)
    source = torchrun_cases.checkpoint(CHECKPOINT)
    for case, backend in ((BASE, "megatron"), (FSDP, "fsdp"), (PARALLEL[(2, 1, 2, 1)], "megatron")):
        ckpt = next(torchrun_cases.root.glob(f"run*/{case.id}.ckpt"))
        assert_exports_to(runs[case.id]["weights"], ckpt, source, backend)
    # CP=2: each rank scans whole sequences for 4 heads in 2 groups (mamba_cp.py); TP=2 x CP=2: 2 heads,
    # 1 group per rank, sequence parallel
    for (tp, pp, ep, cp), case in PARALLEL.items():
        where = f"TP={tp} PP={pp} EP={ep} CP={cp}"
        run = runs[case.id]
        assert run["layout"]["sequence_parallel"] == (tp > 1) and run["layout"]["cp"] == cp, where
        _assert_same_step(run, base, mask, where)
        assert all(run["state_restored"]), where


@pytest.mark.slow
def test_mtp_layers_under_tensor_and_expert_parallel_step_as_at_tp1(torchrun_cases):
    """The MTP block (attention, LatentMoE) under TP=2 (sequence parallel: eh_proj column-parallel, the
    loss on vocab-parallel logits), TP=2 x EP=2 (its experts on the decoder's expert ranks), CP=2 (its
    attention on the gathered keys; each depth's rolled tokens across the ranks' chunks) and PP=2 (on the
    last stage, with a copy of the first stage's embedding kept equal to it): loaded and
    streamed bit for bit as the checkpoint holds it, and one step as TP=1's: MTP loss, log-probs, every
    gradient (the MTP layers' and, the loss not detached, the decoder's), the updated weights; the
    checkpoints export them under their names. Packed at TP=2 and at CP=2 too: the padded TP=1 step.
    EP runs with router replay (the decoder's routers on the batch's routes, the MTP routers free), as
    TP=1 does on the same routes."""
    from safetensors.torch import load_file

    mask = parity_batch().loss_mask.bool()
    runs = {key: torchrun_cases.result(case.id) for key, case in MTP_RUNS.items()}
    assert not [(k, r["error"]) for k, r in runs.items() if "error" in r]
    source = torchrun_cases.checkpoint(MTP_CHECKPOINT)
    on_disk = load_file(source / "model.safetensors")
    carried = {
        k: v for k, v in on_disk.items() if k.startswith("mtp.") and "e_score_correction_bias" not in k
    }
    base, plain = runs[1, 1, 1, 1, False], torchrun_cases.result(BASE.id)
    assert base["metrics"]["mtp_loss"] > 1.0
    mtp_grads = {k: g for k, g in base["grads"].items() if k.startswith("mtp.")}
    assert mtp_grads.keys() == carried.keys()
    # every MTP weight learns but the experts no token went to; tokens reach both EP ranks' experts
    moved = {k for k, g in mtp_grads.items() if g.abs().max() > 0}
    assert {k for k in mtp_grads if ".experts." not in k} <= moved
    assert {int(k.split(".experts.")[1].split(".")[0]) // 4 for k in moved if ".experts." in k} == {0, 1}
    # the same decoder as the plain parity run's: its MTP loss reached the head and the decoder
    assert torch.equal(base["logp"], plain["logp"])
    for name in ("lm_head.weight", "backbone.layers.7.mixer.in_proj.weight"):
        assert not torch.allclose(base["grads"][name], plain["grads"][name], atol=1e-5), name
    # router replay: other experts, other log-probs (the routes were taken); each run steps as TP=1 on
    # the same routes (the MTP routers free: megatron = fsdp at one rank in tests/trainer/test_mtp.py)
    assert (runs[1, 1, 1, 1, True]["logp"][mask] - base["logp"][mask]).abs().max() > 1e-4
    for (tp, pp, ep, cp, replay), run in runs.items():
        where, ref = f"MTP TP={tp} PP={pp} EP={ep} CP={cp} replay={replay}", runs[1, 1, 1, 1, replay]
        assert run["mtp_loaded"].keys() == carried.keys(), where
        assert all(torch.equal(run["mtp_loaded"][k], v) for k, v in carried.items()), where
        assert run["mtp_streamed"].keys() == carried.keys(), where
        assert all(torch.equal(run["mtp_streamed"][k], v) for k, v in carried.items()), where
        assert run["embedding_senders"] == 1, where  # PP=2: the first stage's, not the MTP layers' copy
        assert run["layout"]["sequence_parallel"] == (tp > 1) and run["layout"]["cp"] == cp, where
        assert run["metrics"]["mtp_loss"] == pytest.approx(ref["metrics"]["mtp_loss"], rel=1e-5), where
        _assert_same_step(run, ref, mask, where)
        assert all(run["state_restored"]), where
        ckpt = next(torchrun_cases.root.glob(f"run*/{MTP_RUNS[tp, pp, ep, cp, replay].id}.ckpt"))
        exported = _exported(ckpt, source)
        assert exported.keys() == on_disk.keys(), where  # the frozen biases from the source
        assert all(torch.equal(exported[k], v) for k, v in run["weights"].items()), where
    # PP=2: the last stage's copy of the embedding (the MTP layers') is the first stage's after the
    # step, and the trained one (its gradient the sum of both stages', as at PP=1); one copy at PP=1
    held = [e for e in runs[1, 2, 1, 1, False]["embeddings"] if e is not None]
    assert len(held) == 2 and torch.equal(held[0], held[1])
    assert torch.allclose(held[0], base["weights"]["backbone.embeddings.weight"], atol=1e-6)
    assert not torch.equal(held[0], on_disk["backbone.embeddings.weight"])
    assert sum(e is not None for e in base["embeddings"]) == 1
    # packed rows: each depth's targets and its layers inside each sequence, as the padded rows
    for (tp, cp), case in MTP_PACKED.items():
        where, packed = f"MTP packed TP={tp} CP={cp}", torchrun_cases.result(case.id)
        assert "error" not in packed, (where, packed.get("error"))
        assert packed["layout"]["sequence_parallel"] == (tp > 1) and packed["layout"]["cp"] == cp, where
        assert packed["metrics"]["mtp_loss"] == pytest.approx(base["metrics"]["mtp_loss"], rel=1e-5), where
        _assert_same_step(packed, base, mask, where)


def _exported(ckpt: Path, source: Path) -> dict[str, torch.Tensor]:
    """``hpcrl export`` of a megatron parity run's checkpoint, fp32, every tensor by its name
    (transformers would drop the MTP block)."""
    from safetensors.torch import load_file

    from hpcrl.tools.export import write_export

    out = ckpt.with_suffix(".hf")
    write_export(
        ckpt, {"backend": "megatron", "source": str(source)}, source, out, "fp32", log=lambda _: None
    )
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_packed_rows_step_as_the_padded_ones(torchrun_cases):
    """trainer.packing on Nemotron-H under megatron: each packed row's bounds reach the Mamba mixers
    (``packed_seq_params``), whose conv and scan restart at every sequence, under every layout the
    padded runs take: TP=2 (sequence parallel: the mixer gathers the whole row), PP=2 (every stage
    gets the bounds), EP=2, TP=2 x EP=2, CP=2 (the row split in 2·CP chunks as a sequence is:
    attention runs each chunk's piece of each sequence against its gathered keys, the mixer scans the
    whole row again), TP=2 x CP=2, and TP=2 x CP=2 x EP=2 x expert TP=2 with a CP rank holding only
    padding (``PACKED_CP_EP``): the padded TP=1 step's log-probs (the reference's passes packed
    too), metrics, gradients and weights. Every layout's attention reads the bounds: no [L, L] mask is
    built, under CP neither."""
    mask = parity_batch().loss_mask.bool()
    base = torchrun_cases.result(BASE.id)
    for (tp, pp, ep, cp), case in PACKED.items():
        where = f"packed TP={tp} PP={pp} EP={ep} CP={cp}"
        run = torchrun_cases.result(case.id)
        assert "error" not in run, run["error"]
        assert run["layout"]["cp"] == cp and run["layout"]["sequence_parallel"] == (tp > 1), where
        assert run["layout"]["packed_masks"] == 0, where
        _assert_same_step(run, base, mask, where)
    run = torchrun_cases.result(PACKED_CP_EP.id)
    assert "error" not in run, run["error"]
    assert (run["layout"]["cp"], run["layout"]["expert_tp"]) == (2, 2), run["layout"]
    _assert_same_step(run, base, mask, "packed TP=2 x CP=2 x EP=2 x ETP=2, a row of padding on CP rank 1")
