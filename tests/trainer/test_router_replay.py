"""Router replay (``trainer.router_replay``) end to end on a tiny Qwen3-MoE: the real vLLM CPU engine
records the experts its routers chose for every position, the routes travel in the batch (padded and
packed), and the fsdp trainer (one gloo rank) replays them: its experts are the engine's, also where
its own router would choose others, and its log-probs stay on the engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hpcrl.algo.losses import gen_kl_error
from hpcrl.errors import ConfigError
from hpcrl.rollout.base import SamplingSettings
from hpcrl.trainer.batch import TrainBatch, build_batch
from hpcrl.trainer.fsdp import FSDPTrainer
from hpcrl.trainer.packing import Packed
from hpcrl.trainer.process_group import free_port
from tests.conftest import compose, plan
from tests.harness.tiny_checkpoints import save_engine_moe

pytestmark = pytest.mark.slow
MASTER = f"127.0.0.1:{free_port()}"
PROMPTS = [[1, 5, 6, 14, 7, 18], [1, 9, 15, 6, 18, 22, 30, 4], [1, 40, 41]]
LAYERS, K, EXPERTS = 2, 2, 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_engine_moe(tmp_path_factory.mktemp("moe"), EXPERTS)


@pytest.fixture(scope="module")
def engine(moe_dir, tmp_path_factory):
    from hpcrl.rollout.config import VLLMRolloutConfig
    from hpcrl.rollout.vllm_engine import VLLMEngine

    scratch, cfg = tmp_path_factory.mktemp("vllm"), compose().rollout
    assert isinstance(cfg, VLLMRolloutConfig)
    return VLLMEngine(
        moe_dir, cfg, seed=0, max_model_len=48, on_cpu=True, scratch=scratch, kv_cache_gb=0.05, routes=True
    )


SETTINGS = SamplingSettings(n=4, temperature=1.0, top_p=1.0, max_tokens=8, seed=0)


@pytest.fixture(scope="module")
def rollout(engine):
    """(prompts, completions) of one generation with routes: 4 samples a prompt."""
    groups = engine.generate(PROMPTS, SETTINGS)
    return [p for p in PROMPTS for _ in range(4)], [c for g in groups for c in g]


def batch_of(rollout, routes: bool = True) -> TrainBatch:
    prompts, comps = rollout
    return build_batch(
        prompts,
        [c.token_ids for c in comps],
        [c.logprobs for c in comps],
        [1.0, -1.0] * (len(comps) // 2),
        [1.0] * len(comps),
        pad_id=0,
        routes=[c.routes for c in comps] if routes else None,
    )


def hf_routes(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """[positions, layers, k] the transformers model's own routers choose, sorted per position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    got: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out, i=i: got.__setitem__(i, out[2]))
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    return torch.stack([got[i] for i in range(LAYERS)], 1).sort(-1).values


def test_vllm_returns_the_experts_of_every_forward_position(rollout, moe_dir):
    prompts, comps = rollout
    for prompt, c in zip(prompts, comps, strict=True):
        assert c.routes is not None and c.routes.dtype.name == "int16"
        # every position a forward ran: the prompt's and the generated tokens' but the last
        assert c.routes.shape == (len(prompt) + len(c.token_ids) - 1, LAYERS, K)
        assert ((c.routes >= 0) & (c.routes < EXPERTS)).all()
    # the engine's routes are its routers' choice: transformers' router picks the same experts
    prompt, c = prompts[5], comps[5]
    want = hf_routes(moe_dir, prompt + c.token_ids)[:-1]
    assert torch.equal(torch.as_tensor(c.routes).long().sort(-1).values, want)


def test_streamed_completions_carry_their_routes(engine, rollout):
    """``generate_stream`` hands groups over as they finish, each with its routes: the same as
    ``generate``'s for the same seed."""
    streamed = dict(i_g for part in engine.generate_stream(PROMPTS, SETTINGS) for i_g in part)
    _, comps = rollout
    for i, group in streamed.items():
        for j, c in enumerate(group):
            whole = comps[4 * i + j]
            assert c.token_ids == whole.token_ids and (c.routes == whole.routes).all()


def test_routes_travel_in_the_batch_padded_and_packed(rollout):
    prompts, comps = rollout
    b = batch_of(rollout)
    assert b.routes is not None and b.routes.shape[:2] == b.input_ids.shape
    i, n = 9, len(prompts[9]) + len(comps[9].token_ids)
    assert torch.equal(b.routes[i, : n - 1], torch.as_tensor(comps[9].routes))
    assert (b.routes[i, n - 1 :] == -1).all()  # the last token and the padding route freely
    part = b.select(torch.tensor([3, 9]))
    assert part.routes is not None and torch.equal(part.routes[1], b.routes[9])
    packed = Packed.of(part.input_ids, part.attention_mask)
    flat = packed.gather(part.routes)
    assert flat.shape == (1, packed.ids.shape[1], LAYERS, K)
    start = packed.starts[1]
    assert torch.equal(flat[0, start : start + n - 1], torch.as_tensor(comps[9].routes))
    wide = packed.padded(packed.ids.shape[1] + 3).gather(part.routes)
    assert (wide[0, -3:] == -1).all() and torch.equal(wide[:, :-3], flat)


def trainer(model_dir: Path, *overrides: str) -> FSDPTrainer:
    return FSDPTrainer(model_dir, compose("algo.lr=1e-2", "algo.kl_coef=0", *overrides), master=MASTER)


def used_experts(t: FSDPTrainer, b: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs of ``b`` and the experts its MoE blocks ran each token on
    [rows, T, layers, k], sorted per position (unpacked forwards: rows in order)."""
    seen: list[list[torch.Tensor]] = [[] for _ in range(LAYERS)]
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(lambda _m, args, i=i: seen[i].append(args[1]))
        for i, layer in enumerate(t.model.model.layers)
    ]
    logp = t.logprobs(b)
    for h in hooks:
        h.remove()
    ids = torch.stack([torch.cat(s) for s in seen], 1).view(*b.input_ids.shape, LAYERS, K)
    return logp, ids.sort(-1).values


def replayed_where_given(used: torch.Tensor, b: TrainBatch) -> bool:
    assert b.routes is not None
    given = b.routes.long().sort(-1).values
    where = (b.routes >= 0).all(-1)
    return bool((used[where] == given[where]).all())


def kl_of(logp: torch.Tensor, b: TrainBatch) -> float:
    return float(gen_kl_error(logp, b.rollout_logp, b.loss_mask))


def test_the_trainer_replays_the_engines_experts(rollout, moe_dir):
    b = batch_of(rollout)
    logp, used = used_experts(trainer(moe_dir, "trainer.router_replay=true"), b)
    assert replayed_where_given(used, b)
    mask = b.loss_mask.bool()
    assert (logp - b.rollout_logp)[mask].abs().max() < 1e-4
    free, _ = used_experts(trainer(moe_dir), batch_of(rollout, routes=False))
    assert kl_of(logp, b) <= kl_of(free, b) + 1e-9


def perturbed_router(model_dir: Path, out: Path, scale: float) -> Path:
    """The checkpoint with noise on every router's weight (the engine keeps the original): the
    trainer's own top-k then differs from the engine's at some positions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight) * scale)
    model.save_pretrained(out)
    return out


def test_replay_keeps_the_engines_experts_where_the_trainers_router_would_not(rollout, moe_dir, tmp_path):
    drifted = perturbed_router(moe_dir, tmp_path / "drifted", 0.05)
    b = batch_of(rollout)
    replay_logp, replay_used = used_experts(trainer(drifted, "trainer.router_replay=true"), b)
    free_logp, free_used = used_experts(trainer(drifted), batch_of(rollout, routes=False))
    assert replayed_where_given(replay_used, b)
    assert not replayed_where_given(free_used, b)  # its own routers chose other experts somewhere
    assert kl_of(replay_logp, b) < kl_of(free_logp, b)


def test_packed_replay_equals_padded_replay_and_the_router_learns(rollout, moe_dir):
    b = batch_of(rollout)
    padded = trainer(moe_dir, "trainer.router_replay=true", "trainer.micro_batch_size=4")
    packed = trainer(
        moe_dir, "trainer.router_replay=true", "trainer.packing=true", "trainer.micro_batch_tokens=64"
    )
    logp_padded = padded.logprobs(b)
    logp_packed = packed.logprobs(b)
    assert (logp_packed - logp_padded)[b.loss_mask.bool()].abs().max() < 1e-5
    name = "model.layers.0.mlp.gate.weight"
    before = packed.export_weights()[name]
    m_padded, m_packed = padded.train_step(b), packed.train_step(b)
    assert m_packed["loss"] == pytest.approx(m_padded["loss"], rel=1e-4, abs=1e-6)
    assert m_packed["gen_kl_error"] == pytest.approx(m_padded["gen_kl_error"], rel=1e-3, abs=1e-8)
    # the recomputed routing weights carry the router's gradient
    assert (packed.export_weights()[name] - before).abs().max() > 1e-4


@pytest.mark.parametrize(
    "overrides, words",
    [
        (("model=tiny",), "is dense"),
        (("model=qwen3_30b_a3b", "rollout=hf"), "rollout=vllm"),
        (("model=qwen3_30b_a3b", "trainer.cp=2"), "trainer.cp=1"),
    ],
)
def test_router_replay_is_refused_where_it_cannot_run(overrides, words):
    with pytest.raises(ConfigError, match=words):
        plan("trainer.router_replay=true", *overrides)


def _moe_model(family: str) -> Any:
    from tests.harness.tiny_checkpoints import Kinds, _qwen_like, gemma4_model, nemotron_h_model

    torch.manual_seed(0)
    if family == "nemotron_h":  # LatentMoE between Mamba and attention layers
        return nemotron_h_model(Kinds(family, moe=True, layers="M*E", latent=True))
    return (gemma4_model if family == "gemma4" else _qwen_like)(Kinds(family, moe=True))


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4", "nemotron_h"])
def test_each_router_replays_given_experts_with_its_own_weights(family):
    """transformers' routers of every MoE family hpcrl trains: replaying a router's own choice changes
    no number (the routing weights are recomputed as the router computes them); replaying other experts
    sends the tokens there, and the router still gets a gradient."""
    from hpcrl.trainer.router_replay import WEIGHTS, install, set_routes

    model = _moe_model(family).eval()
    layers = model.get_decoder().layers
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    chosen: dict[int, torch.Tensor] = {}
    install(model)
    for i, layer in enumerate(layers):  # after install's hooks: sees what the experts get
        for router in (m for m in layer.modules() if type(m).__name__ in WEIGHTS):
            router.register_forward_hook(lambda _m, _a, out, i=i: chosen.__setitem__(i, out[2]))
    free = model(input_ids=ids).logits
    k = next(iter(chosen.values())).shape[1]
    own = torch.full((2, 10, len(layers), k), -1, dtype=torch.int16)
    for i, c in chosen.items():
        own[:, :, i] = c.view(2, 10, k)
    set_routes(model, own)
    assert torch.allclose(model(input_ids=ids).logits, free, atol=1e-6)
    experts = int(max(c.max() for c in chosen.values())) + 1
    other = (own.long() + 1) % max(experts, k + 1)  # every expert moved, still k distinct ones
    other[own < 0] = -1
    set_routes(model, other.to(torch.int16))
    out = model(input_ids=ids).logits
    assert all(torch.equal(chosen[i].view(2, 10, k), other[:, :, i]) for i in chosen)
    assert (out - free).abs().max() > 1e-4
    out.sum().backward()
    routers = [m for m in model.modules() if type(m).__name__ in WEIGHTS]
    grads = [[p.grad for n, p in r.named_parameters() if n in ("weight", "proj.weight")] for r in routers]
    assert all(g is not None and g.abs().sum() > 0 for (g,) in grads)
