"""Megatron-core backend under torchrun with gloo on CPU: TP=2 (sequence parallel) / PP=2 / TP=2xPP=2 /
DP=2 / CP=2 / TP=2xCP=2 / PP=2xCP=2 giving the TP=1 losses and gradients, TP=1 giving fsdp's, resumes
on another layout, and a Qwen3 (Q/K norms) likewise. The parity batch holds the pad id inside
sequences (Hugging Face's padding_idx row)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.megatron_parity import parity_batch
from tests.megatron.common import (
    _assert_same_step,
    _torchrun,
    assert_exports_to,
)


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_match_tp1_and_tp1_matches_fsdp(tiny_dir, tmp_path):
    mask = parity_batch().loss_mask.bool()
    base = _torchrun(tiny_dir, tmp_path / "tp1.pt", 1, 1)
    fsdp = _torchrun(tiny_dir, tmp_path / "fsdp.pt", 1, 1, backend="fsdp")
    assert torch.allclose(base["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
        assert base["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-4, abs=1e-6), key
    for name, grad in fsdp["grads"].items():
        ours = base["grads"][name if name in base["grads"] else "model.embed_tokens.weight"]
        assert torch.allclose(ours, grad, atol=1e-5), name
    (state_elements,) = base["optimizer_numel"]  # Adam's m and v: two per parameter element
    assert base["state_restored"] == [True]
    assert state_elements == 2 * sum(w.numel() for n, w in base["weights"].items() if n != "lm_head.weight")
    for tp, pp, cp, dp in (
        (2, 1, 1, 1),
        (1, 2, 1, 1),
        (2, 2, 1, 1),
        (1, 1, 1, 2),
        (1, 1, 2, 1),
        (2, 1, 2, 1),
        (1, 2, 2, 1),
    ):
        where = f"TP={tp} PP={pp} CP={cp} DP={dp}"
        port = 29641 + tp * 10 + pp + dp * 3 + cp * 5
        name = f"tp{tp}pp{pp}cp{cp}dp{dp}"
        second = SECOND if name in RESHARDED else None
        run = _torchrun(tiny_dir, tmp_path / f"{name}.pt", tp, pp, port=port, dp=dp, cp=cp, env=second)
        # the layout Megatron really ran: sequence parallel with TP (the default), context parallel
        assert run["layout"]["sequence_parallel"] == (tp > 1) and run["layout"]["cp"] == cp, where
        assert run["state_restored"] == [True] * (tp * pp * cp * dp), where  # checkpoint -> resume, per rank
        if (
            dp * cp > 1 and tp * pp == 1
        ):  # the distributed optimizer: each DP x CP rank holds part of Adam's state
            assert sum(run["optimizer_numel"]) == state_elements, where
            assert max(run["optimizer_numel"]) < 0.75 * state_elements, (where, run["optimizer_numel"])
        _assert_same_step(run, base, mask, where)
    for i, name in enumerate(RESHARDED):
        _assert_resumes_resharded(tiny_dir, tmp_path, name, port=29701 + i)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        ("algo.policy_loss=gspo", "algo.loss_agg=sequence", "algo.num_minibatches=2"),
        ("algo=drgrpo", "algo.policy_loss=cispo", "algo.eps_low=1", "algo.num_minibatches=2"),
    ],
    ids=["gspo", "cispo-drgrpo"],
)
def test_loss_variants_step_alike_under_megatron_and_fsdp(tiny_dir, tmp_path, variant):
    """The loss variants through both backends' shared step, two optimizer steps (the second
    against the old policy's log-probs) and a sequence-level aggregation: the parity batch's 7 rows
    leave megatron a padded last micro-batch, which must not count as a sequence."""
    mask = parity_batch().loss_mask.bool()
    fsdp = _torchrun(tiny_dir, tmp_path / "fsdp.pt", 1, 1, backend="fsdp", port=29721, algo=variant)
    run = _torchrun(tiny_dir, tmp_path / "tp1.pt", 1, 1, port=29723, algo=variant)
    assert torch.allclose(run["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    for key in ("loss", "policy_loss", "kl", "clip_fraction", "grad_norm"):
        assert run["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-4, abs=1e-6), key
    # the second minibatch's gradients, and the weights after both steps (fsdp's tied head aside)
    for name, grad in fsdp["grads"].items():
        ours = run["grads"][name if name in run["grads"] else "model.embed_tokens.weight"]
        assert torch.allclose(ours, grad, atol=1e-5), name
    for name, weight in fsdp["weights"].items():
        assert torch.allclose(run["weights"][name], weight, atol=1e-6), name


@pytest.mark.slow
def test_fsdp_checkpoint_of_two_ranks_resumes_on_one(tiny_dir, tmp_path):
    two = _torchrun(tiny_dir, tmp_path / "fsdp2.pt", 1, 1, backend="fsdp", port=29711, dp=2, env=SECOND)
    assert two["state_restored"] == [True, True]  # each rank wrote and read back its own shards
    _assert_resumes_resharded(tiny_dir, tmp_path, "fsdp2", port=29712, backend="fsdp")


SECOND = {"HPCRL_PARITY_SECOND_STEP": "1"}
RESHARDED = ("tp2pp2cp1dp1", "tp1pp1cp1dp2")
"""Layouts whose checkpoint (taken after the first step) a TP=1 run resumes from."""


def _assert_resumes_resharded(
    model_dir: Path, tmp_path: Path, name: str, port: int, backend: str = "megatron"
) -> None:
    """A TP=1 run resumed from ``name``'s checkpoint holds its weights, and its next step equals the
    second step ``name`` took: the Adam state came along (resumed without it, weights-only, the
    step differed by 1.6e-6 from TP2's; with it by 3.7e-9)."""
    saved = torch.load(tmp_path / f"{name}.pt")
    resume = {"HPCRL_PARITY_RESUME": str(tmp_path / f"{name}.ckpt")}
    run = _torchrun(model_dir, tmp_path / f"{name}-as-tp1.pt", 1, 1, backend, port=port, env=resume)
    assert_exports_to(saved["weights"], tmp_path / f"{name}.ckpt", model_dir, backend)  # a tied model
    for key, weight in saved["weights"].items():
        assert torch.equal(run["loaded"][key], weight), (name, key)
        assert torch.allclose(run["weights"][key], saved["second_step"][key], atol=5e-8, rtol=0), (name, key)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A small random Qwen3 (Q/K norms, untied head) saved as a Hugging Face checkpoint."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("qwen3")
    Qwen3ForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.slow
def test_qwen3_qk_norms_match_fsdp_and_under_tensor_parallel(qwen3_dir, tmp_path):
    """Qwen3's Q/K norms are built (they were once silently left out of the layer spec) and their
    gradients, partial per TP rank (each holds some heads), are summed over TP with and without
    sequence parallelism."""
    mask = parity_batch().loss_mask.bool()
    base = _torchrun(qwen3_dir, tmp_path / "tp1.pt", 1, 1, port=29731)
    assert base["layout"]["qk_norms"] == 2  # one per layer
    fsdp = _torchrun(qwen3_dir, tmp_path / "fsdp.pt", 1, 1, backend="fsdp", port=29732)
    assert torch.allclose(base["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    for name, grad in fsdp["grads"].items():
        assert torch.allclose(base["grads"][name], grad, atol=1e-5), name
    for sp in (True, False):
        run = _torchrun(
            qwen3_dir,
            tmp_path / f"tp2sp{sp}.pt",
            2,
            1,
            port=29733 + sp,
            extra=(f"trainer.sequence_parallel={str(sp).lower()}",),
        )
        assert run["layout"]["sequence_parallel"] is sp
        _assert_same_step(run, base, mask, f"TP=2 sequence_parallel={sp}")


def test_spec_helpers_take_both_megatron_core_spec_shapes():
    """0.16 holds sub-specs as ModuleSpec, 0.19 as functools.partial (this machine has 0.16; the GPU
    image 0.19): both are retargeted to another module and built with the same arguments."""
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    from hpcrl.trainer.megatron.spec_utils import build, submodules_of, with_module

    class Slot(torch.nn.Module):
        def __init__(self, config: object, submodules: object = None, **kwargs: object) -> None:
            super().__init__()
            self.config, self.submodules, self.kwargs = config, submodules, kwargs

    class Ours(Slot):
        pass

    for spec in (ModuleSpec(module=Slot, submodules="subs"), functools.partial(Slot, submodules="subs")):
        assert submodules_of(spec) == "subs"
        built = build(with_module(spec, Ours), config="cfg", pg_collection="pg")
        assert type(built) is Ours and built.config == "cfg" and built.submodules == "subs"
        assert built.kwargs == {"pg_collection": "pg"}


def test_sp_norm_marks_its_weight_and_hands_the_next_matmul_its_autocast_dtype():
    from types import SimpleNamespace

    from hpcrl.trainer.megatron.attention import chunk_order
    from hpcrl.trainer.megatron.norms import SPNorm

    norm = SPNorm(SimpleNamespace(sequence_parallel=True), 8, eps=1e-6)
    assert norm.weight.sequence_parallel is True  # summed over TP by the trainer
    x = torch.randn(3, 8)
    plain = torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-6)
    assert torch.equal(norm(x), plain) and norm(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = norm(x)
    # Megatron's SP linear reduce-scatters its input gradient in the input's dtype: it must be bf16
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, plain.to(torch.bfloat16))
    # CP all-gather order: rank r contributes global chunks r and 2cp-1-r
    assert chunk_order(2) == [0, 2, 3, 1]
    assert chunk_order(3) == [0, 2, 4, 5, 3, 1]


@pytest.mark.slow
def test_packed_micro_batches_step_as_the_padded_ones(tiny_dir, tmp_path):
    """trainer.packing under megatron: the bins of 16 tokens run as packed rows, attention inside each
    sequence by its bounds (no [L, L] mask built), through TP (sequence parallel) and the pipeline
    schedule, give fsdp's padded step; two minibatches and a KL term, so the log-prob passes run packed too."""
    mask = parity_batch().loss_mask.bool()
    algo = ("algo.num_minibatches=2", "algo.kl_coef=0.05")
    packing = ("trainer.packing=true", "trainer.micro_batch_tokens=16")
    base = _torchrun(tiny_dir, tmp_path / "fsdp.pt", 1, 1, backend="fsdp", port=29731, algo=algo)
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        where = f"packed TP={tp} PP={pp}"
        port = 29733 + 2 * tp + 5 * pp
        run = _torchrun(
            tiny_dir, tmp_path / f"packed{tp}{pp}.pt", tp, pp, port=port, extra=packing, algo=algo
        )
        assert run["layout"]["packed_masks"] == 0, where
        assert torch.allclose(run["logp"][mask], base["logp"][mask], atol=1e-5), where
        for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
            assert run["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-6), (
                where,
                key,
            )
        for name, weight in base["weights"].items():
            assert torch.allclose(run["weights"][name], weight, atol=1e-6), (where, name)
