"""The chunked log-prob head against the plain logits path: values, gradients, masks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hpcrl.trainer.forward import is_right_padded, logprob_and_entropy
from hpcrl.trainer.logprob_head import LogprobHead, chunked_logprob, install_logprob_head


def reference(hidden, weight, targets, cap=None):
    logits = hidden @ weight.t()
    return logprob_and_entropy(logits if cap is None else cap * torch.tanh(logits / cap), targets)


# one row per chunk, ragged last chunk, a single chunk; soft-capped logits (Gemma) at 2 (logits reach it)
@pytest.mark.parametrize("rows,cap", [(1, None), (3, None), (7, None), (100, None), (3, 2.0), (100, 2.0)])
def test_values_and_gradients_match_the_logits_path(rows, cap):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=g, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7), generator=g)
    upstream = torch.randn(2, 7, generator=g, dtype=torch.float32)  # a loss that weights tokens unequally

    logp, entropy = chunked_logprob(hidden, weight, targets, rows=rows, cap=cap)
    (logp * upstream).sum().backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_logp, ref_entropy = reference(hidden, weight, targets, cap)
    if cap is not None:  # the cap really bites: uncapped log-probs are far from these
        assert (reference(hidden, weight, targets)[0] - ref_logp).abs().max() > 1.0
    (ref_logp * upstream).sum().backward()

    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy)
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], weight.grad)
    assert not entropy.requires_grad  # a metric: never part of the loss graph


def test_head_is_installed_with_the_tied_weight_and_refuses_calls_without_targets():
    emb = nn.Embedding(50, 16)
    model = nn.Module()
    model.lm_head = nn.Linear(16, 50, bias=False)
    model.lm_head.weight = emb.weight
    head = install_logprob_head(model)
    assert isinstance(head, LogprobHead) and model.lm_head is head
    assert head.weight is emb.weight  # the tie survives: one parameter, one gradient
    with pytest.raises(RuntimeError, match="needs targets"):
        head(torch.zeros(1, 16))
    with head.targets(torch.tensor([[3]])):
        out = head(torch.zeros(1, 1, 16))
    assert out.shape == (1, 1, 2)
    assert out[0, 0, 0].item() == pytest.approx(-torch.log(torch.tensor(50.0)).item())  # uniform logits


def test_biased_or_scaled_heads_are_left_alone():
    biased = nn.Module()
    biased.lm_head = nn.Linear(4, 8, bias=True)
    scaled = nn.Module()
    scaled.lm_head = nn.Linear(4, 8, bias=False)
    scaled.config = type("C", (), {"logit_scale": 0.5})()
    assert install_logprob_head(biased) is None
    assert install_logprob_head(scaled) is None and type(scaled.lm_head) is nn.Linear


@pytest.mark.parametrize("vlm", [False, True])
def test_soft_capped_gemma_gets_the_head_with_its_cap_and_the_logits_paths_numbers(vlm, tmp_path):
    """Gemma 4 soft-caps its logits (a VLM names the cap on its text config only): the head takes the cap
    over, the model's forward no longer caps (it would cap the head's output), and log-probs and
    gradients are the capped logits path's."""
    from transformers import AutoModelForCausalLM

    from hpcrl.trainer.batch import build_batch
    from hpcrl.trainer.forward import token_logprobs
    from tests.megatron.common import gemma4_model

    gemma4_model(vlm=vlm, final_logit_softcapping=2.0).save_pretrained(tmp_path)
    batch = build_batch(
        [[1, 5, 9, 20], [1, 7]],
        [[33, 7, 12], [40, 41, 42, 43]],
        [[-1.0] * 3, [-1.0] * 4],
        [1.0, -1.0],
        [1.0, 1.0],
        pad_id=0,
    )
    runs = []
    for install in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
        head = install_logprob_head(model) if install else None
        logp, entropy = token_logprobs(model, batch)
        (logp * batch.loss_mask).sum().backward()
        emb = model.get_input_embeddings().weight.grad.clone()
        runs.append((logp, entropy, emb, head, model))
    (logp0, ent0, emb0, _, _), (logp1, ent1, emb1, head, model) = runs
    assert isinstance(head, LogprobHead) and head.cap == 2.0
    assert model.config.get_text_config().final_logit_softcapping is None  # the forward must not cap again
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(logp1[mask], logp0[mask])
    torch.testing.assert_close(ent1[mask], ent0[mask])
    # HF's backward multiplies by the cap and divides by it again: ~1e-6 of the gradient's scale (20)
    torch.testing.assert_close(emb1, emb0, atol=1e-4, rtol=1e-5)
    assert emb0.abs().max() > 1.0


def test_right_padding_detection():
    assert is_right_padded(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]))
    assert not is_right_padded(torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]]))  # left padding keeps its mask


@pytest.mark.parametrize("install", [False, True])
def test_the_head_runs_from_the_first_loss_target_only_with_the_same_numbers(install, tmp_path):
    """build_batch's ``loss_from`` (shortest prompt - 1) has the model compute its head on the last
    T - loss_from positions only (``logits_to_keep``): log-probs, entropy and gradients over the loss
    tokens are the whole head's, with the plain head and the chunked one."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from hpcrl.trainer.batch import build_batch
    from hpcrl.trainer.forward import token_logprobs

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    prompts = [[1, 5, 9, 20, 3, 3], [1, 7, 8, 9], [2, 4, 6, 8, 10]]
    comps = [[33, 7, 12], [40, 41, 42, 43, 44], [50]]
    batch = build_batch(
        prompts, comps, [[-1.0] * len(c) for c in comps], [1.0, -1.0, 0.5], [1, 1, 1], pad_id=0
    )
    assert batch.loss_from == 3
    runs = []
    for loss_from in (0, batch.loss_from):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
        head = install_logprob_head(model) if install else model.lm_head
        widths: list[int] = []
        head.register_forward_hook(lambda _m, args, _out, seen=widths: seen.append(args[0].shape[1]))
        trimmed = dataclasses.replace(batch, loss_from=loss_from)
        logp, entropy = token_logprobs(model, trimmed)
        (logp * batch.loss_mask).sum().backward()
        runs.append((logp, entropy, model.get_input_embeddings().weight.grad.clone(), widths))
    (logp0, ent0, grad0, widths0), (logp1, ent1, grad1, widths1) = runs
    width = batch.input_ids.shape[1]
    assert widths0 == [width] and widths1 == [width - batch.loss_from]
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(logp1[mask], logp0[mask])
    torch.testing.assert_close(ent1[mask], ent0[mask])
    assert (logp1[:, : batch.loss_from] == 0).all()
    torch.testing.assert_close(grad1, grad0)
    assert grad0.abs().max() > 0
