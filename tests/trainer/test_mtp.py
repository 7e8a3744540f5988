"""Nemotron-H's MTP layers under the fsdp backend (``trainer.mtp_loss_scale``): the tiny model's
checkpoint carries one MTP block (attention, LatentMoE) under the names vLLM and Megatron-Bridge read;
the trainer loads it, trains it with its loss (which reaches the decoder too), and sends it back under
the same names. Real parts: transformers' Nemotron-H blocks, FSDP2 on a one-rank gloo group."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hpcrl.trainer.fsdp import FSDPTrainer
from hpcrl.trainer.process_group import free_port
from tests.conftest import compose, plan
from tests.trainer.test_tiny_nemotronh import batch

MASTER = f"127.0.0.1:{free_port()}"
MTP = ("+experiment=grpo-tinynemotronh-1n1g-fsdp", "model.mtp_layers=1", "model.hybrid.mtp_pattern=*E")
BIAS = "e_score_correction_bias"


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from hpcrl.run.tiny_model import ensure_tiny_model

    cache = tmp_path_factory.mktemp("cache")
    return ensure_tiny_model(compose(*MTP).model, cache, sft_steps=3, log=lambda _: None)


def mtp_part(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights.items() if k.startswith("mtp.")}


def test_the_checkpoint_has_the_mtp_block_under_vllms_names(mtp_dir):
    from safetensors.torch import load_file

    names = set(mtp_part(load_file(mtp_dir / "model.safetensors")))
    start = {f"mtp.layers.0.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "norm")}
    attention = {f"mtp.layers.0.mixer.{p}_proj.weight" for p in "qkvo"}
    experts = {f"mtp.layers.1.mixer.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("up", "down")}
    end = {
        "mtp.layers.1.final_layernorm.weight",
        "mtp.layers.1.norm.weight",
        f"mtp.layers.1.mixer.gate.{BIAS}",
    }
    assert start | attention | experts | end <= names
    assert not {n for n in names if ".mixer.experts.up_proj" in n or "layers.2" in n}  # per expert, one block


def test_mtp_loads_trains_with_its_loss_and_goes_back_under_its_names(mtp_dir, tmp_path):
    from safetensors.torch import load_file

    on_disk = mtp_part(load_file(mtp_dir / "model.safetensors"))
    trainers = {}
    for scale, detach in ((0.0, True), (1.0, True), (1.0, False)):
        # with a reference policy, which leaves the MTP layers out (read from the same checkpoint pass)
        keys = (f"trainer.mtp_loss_scale={scale}", f"trainer.mtp_detach={detach}", "algo.kl_coef=0.01")
        cfg = plan(*MTP, *keys, "algo.lr=1e-2", "trainer.grad_clip=1e9").cfg  # no clip: below
        trainers[scale, detach] = trainer = FSDPTrainer(mtp_dir, cfg, master=MASTER)
        assert hasattr(trainer.model, "mtp") and not hasattr(trainer.ref, "mtp")
        loaded = mtp_part(trainer.export_weights())
        assert set(loaded) == {k for k in on_disk if not k.endswith(BIAS)}  # the frozen bias stays out
        assert all(torch.equal(v, on_disk[k]) for k, v in loaded.items())
    left_out = FSDPTrainer(mtp_dir, plan(*MTP).cfg, master=MASTER)  # no trainer.mtp_loss_scale
    assert not mtp_part(left_out.export_weights()) and "mtp_loss" not in left_out.train_step(batch())
    untrained, trained, whole = (trainers[k].train_step(batch()) for k in trainers)
    # the same forward, so the same policy loss and MTP loss; the MTP loss is a real NLL
    assert untrained["policy_loss"] == pytest.approx(trained["policy_loss"], rel=1e-6)
    assert untrained["mtp_loss"] == pytest.approx(trained["mtp_loss"], rel=1e-6) and trained["mtp_loss"] > 1.0
    assert whole["mtp_loss"] == pytest.approx(trained["mtp_loss"], rel=1e-6)
    still, moved = (mtp_part(trainers[k].export_weights()) for k in ((0.0, True), (1.0, True)))
    assert all(torch.equal(v, on_disk[k]) for k, v in still.items())  # scale 0: carried, untrained
    assert not torch.equal(moved["mtp.layers.0.eh_proj.weight"], on_disk["mtp.layers.0.eh_proj.weight"])
    # detached (the default), the MTP loss leaves the policy as the policy loss alone moves it; with
    # trainer.mtp_detach=false it reaches the decoder through its last hidden state
    policy = {
        k: {n: v for n, v in t.export_weights().items() if not n.startswith("mtp.")}
        for k, t in trainers.items()
    }
    # (bit-equal without clipping: a clipped norm counts the MTP layers' gradient too)
    gaps = {
        k: max((policy[k][n] - v).abs().max().item() for n, v in policy[0.0, True].items()) for k in policy
    }
    assert gaps[1.0, True] == 0 and gaps[1.0, False] > 1e-3
    later = [trainers[1.0, True].train_step(batch())["mtp_loss"] for _ in range(5)]
    assert later[-1] < trained["mtp_loss"] * 0.8  # it learns the batch's token after next
    exported = export(trainers[1.0, True], mtp_dir, tmp_path)
    assert set(mtp_part(exported)) == set(on_disk)  # the frozen bias from the source checkpoint
    for name, value in mtp_part(trainers[1.0, True].export_weights()).items():
        assert torch.equal(exported[name], value), name


def export(trainer, model_dir, tmp_path, backend: str = "fsdp") -> dict[str, torch.Tensor]:
    """``hpcrl export`` of a checkpoint the trainer writes (fp32: the weights bit for bit)."""
    from safetensors.torch import load_file

    from hpcrl.cli import main
    from hpcrl.run.checkpoint import CheckpointManager

    layout = (
        {"world": 1}
        if backend == "fsdp"
        else {"world": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "expert_tp": 1}
    )
    about = {"model": "tiny_nemotronh", "backend": backend, "layout": layout, "source": str(model_dir)}
    ckpt = CheckpointManager(tmp_path / "run" / "checkpoints", 3, "m", True, about=about, model_dir=model_dir)
    ckpt.save(1, trainer, {"step": 1}, {"m": 1.0}, async_save=False)
    ckpt.settle(trainer)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    return load_file(tmp_path / "out" / "model.safetensors")


def test_each_depth_predicts_the_token_after_next_at_the_loss_tokens_only():
    """The MTP loss's alignment, on the tiny model's real modules: with one loss token (target
    ``ids[j+1]``) depth 0 is scored on ``ids[j+1]`` from position j-1 (its hidden state and the
    embedding of ``ids[j]``): later tokens change nothing, that target does."""
    from hpcrl.run.tiny_model import build_model

    model = build_model(compose(*MTP).model, seed=0)
    ids = torch.tensor([[1, 5, 14, 6, 18, 7, 12, 9, 2]])
    j = 4
    mask = torch.zeros(1, ids.shape[1] - 1)
    mask[0, j] = 1.0

    def nll(tokens: torch.Tensor, loss_mask: torch.Tensor = mask) -> torch.Tensor:
        with torch.no_grad():
            hidden = model.model(input_ids=tokens).last_hidden_state
            embed = model.get_input_embeddings()
            return model.mtp.nll(hidden, tokens, loss_mask, embed, model.lm_head.weight)

    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        out = model.mtp.depth(0, hidden[:, :j], model.get_input_embeddings()(ids[:, 1 : j + 1]))
        expected = -torch.log_softmax(model.lm_head(out[:, -1]), -1)[0, ids[0, j + 1]]
    torch.testing.assert_close(nll(ids), expected)
    later = ids.clone()
    later[0, j + 2 :] = 3
    torch.testing.assert_close(nll(later), nll(ids))  # causal: nothing after the target counts
    target = ids.clone()
    target[0, j + 1] = 40
    assert not torch.allclose(nll(target), nll(ids))
    assert nll(ids, torch.zeros_like(mask)) == 0  # no loss token, no MTP loss


MEGATRON = ("+experiment=grpo-tinynemotronh-1n1g-megatron", *MTP[1:])


def test_megatron_loads_streams_and_exports_the_mtp_layers_under_their_names(mtp_dir, tmp_path):
    """The megatron backend's MTP layers (megatron/mtp.py: the decoder's own layer kinds) take the
    checkpoint's ``mtp.*`` bit for bit, go to the engines in the refit under the same names, and
    ``hpcrl export`` gives them back; without trainer.mtp_loss_scale the model has none."""
    from safetensors.torch import load_file

    from hpcrl.trainer.base import CollectSink
    from hpcrl.trainer.megatron import MegatronTrainer

    on_disk = mtp_part(load_file(mtp_dir / "model.safetensors"))
    trainer = MegatronTrainer(mtp_dir, plan(*MEGATRON, "trainer.mtp_loss_scale=0").cfg, master=MASTER)
    loaded = mtp_part(trainer.export_weights())
    assert set(loaded) == {k for k in on_disk if not k.endswith(BIAS)} and len(loaded) > 20
    assert all(torch.equal(v, on_disk[k]) for k, v in loaded.items())
    sink = CollectSink()
    trainer.stream_weights(sink, torch.float32)
    streamed = mtp_part(sink.weights)
    assert streamed.keys() == loaded.keys() and all(torch.equal(v, loaded[k]) for k, v in streamed.items())
    assert {n: s for n, s in trainer.weight_metas() if n.startswith("mtp.")} == {
        k: tuple(v.shape) for k, v in loaded.items()
    }
    exported = export(trainer, mtp_dir, tmp_path, backend="megatron")
    assert set(mtp_part(exported)) == set(on_disk)  # the frozen bias from the source checkpoint
    assert all(torch.equal(exported[k], v) for k, v in on_disk.items())
    left_out = MegatronTrainer(mtp_dir, plan(*MEGATRON).cfg, master=MASTER)
    assert not mtp_part(left_out.export_weights()) and not hasattr(left_out.model, "mtp_block")


@pytest.mark.parametrize("detach, replay", [(True, False), (False, True)], ids=["detached", "replayed"])
def test_megatron_mtp_loss_and_gradients_equal_fsdps(mtp_dir, detach, replay, tmp_path):
    """One step on the same weights and batch: the megatron backend's MTP loss, policy loss, gradient
    norm and the gradients of the MTP layers, the head and the routers (the MTP layers' included)
    equal the fsdp backend's, through either log-prob head; the trained MTP layers come back from a
    megatron checkpoint. Replayed (``trainer.router_replay``, random routes in the batch): on both
    backends the decoder's routers take the batch's experts while the MTP layers' route freely
    (trainer/router_replay.py: the engine records no MTP routes), and the step is still the same."""
    from hpcrl.trainer.megatron import MegatronTrainer
    from tests.harness.megatron_parity import stepped_grads, with_routes

    keys = ("trainer.mtp_loss_scale=0.5", f"trainer.mtp_detach={detach}", "algo.kl_coef=0")
    if replay:  # the hf engine returns no routes: the plan wants one that does
        keys += ("trainer.router_replay=true", "rollout=vllm")
    fsdp = FSDPTrainer(mtp_dir, plan(*MTP, *keys).cfg, master=MASTER)
    # not detached: through the output layer's logits and the vocab-parallel loss, not the chunked head
    head = () if detach else ("trainer.fused_logprob=false",)
    meg = MegatronTrainer(mtp_dir, plan(*MEGATRON, *keys, *head).cfg, master=MASTER)
    assert meg.mtp is not None
    assert meg.mtp.chunked == detach
    b = with_routes(batch(), mtp_dir) if replay else batch()
    routed = {"fsdp": watch_routers(fsdp, "fsdp"), "megatron": watch_routers(meg, "megatron")}
    if replay:
        decoder_takes_the_given_routes(fsdp, meg, b)
    grads = {"fsdp": stepped_grads(fsdp, "fsdp"), "megatron": stepped_grads(meg, "megatron")}
    m_fsdp, m_meg = fsdp.train_step(b), meg.train_step(b)
    for backend, seen in routed.items():  # [own choice, tokens] per kind of router
        (own, tokens), (mtp_own, mtp_tokens) = seen["decoder"], seen["mtp"]
        assert mtp_tokens > 0 and mtp_own == mtp_tokens, backend  # free, replayed or not
        assert own < tokens / 2 if replay else own == tokens, backend  # random routes: rarely its own
    for key in ("mtp_loss", "policy_loss", "grad_norm"):
        assert m_meg[key] == pytest.approx(m_fsdp[key], rel=1e-4), key
    assert m_meg["mtp_loss"] > 1.0
    g_fsdp = {k.replace("model.", "backbone.", 1): v for k, v in grads["fsdp"].items()}
    g_meg = grads["megatron"]
    mtp_names = [k for k in g_fsdp if k.startswith("mtp.")]
    assert len(mtp_names) > 10 and any(g_fsdp[k].abs().max() > 0 for k in mtp_names)
    assert g_fsdp["mtp.layers.1.mixer.gate.weight"].abs().max() > 0  # the MTP router learns
    for name in [*mtp_names, "lm_head.weight", "backbone.layers.6.mixer.gate.weight"]:
        torch.testing.assert_close(per_expert(g_meg, name), g_fsdp[name], rtol=1e-4, atol=1e-6, msg=name)
    if detach:  # resume: the step's MTP weights (moved from the checkpoint's) load back
        meg.save_checkpoint(str(tmp_path / "ckpt"), async_save=False)
        trained = mtp_part(meg.export_weights())
        resumed = MegatronTrainer(mtp_dir, plan(*MEGATRON, *keys).cfg, master=MASTER)
        assert not torch.equal(
            mtp_part(resumed.export_weights())["mtp.layers.0.eh_proj.weight"],
            trained["mtp.layers.0.eh_proj.weight"],
        )
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        back = mtp_part(resumed.export_weights())
        assert back.keys() == trained.keys() and all(torch.equal(v, trained[k]) for k, v in back.items())


def watch_routers(trainer, backend: str) -> dict[str, list[int]]:
    """Counts, as the policy's MoE routers run (after router replay's own hooks), the tokens sent to
    the router's own top-k experts and all tokens: ``{"decoder": [own, tokens], "mtp": [own, tokens]}``.
    Own: the top-k of its sigmoid scores plus the correction bias (both backends' Nemotron-H router)."""
    from megatron.core.transformer.moe.router import TopKRouter

    seen = {"decoder": [0, 0], "mtp": [0, 0]}

    def own_and_chosen(router, args, out) -> tuple[torch.Tensor, torch.Tensor]:
        """(own experts [tokens, k], the chosen ones as a [tokens, experts] map)."""
        if backend == "fsdp":  # (logits, weights, ids)
            logits, bias, k = out[0], router.e_score_correction_bias, router.top_k
            chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, out[2], True)
        else:  # (probs, routing map)
            logits = router.gating(args[0]).view(-1, router.config.num_moe_experts)
            bias, k, chosen = router.expert_bias, router.topk, out[1]
        return (logits.float().sigmoid() + bias).topk(k, dim=-1).indices, chosen

    def counter(kind: str):
        def count(router, args, out) -> None:
            with torch.no_grad():
                own, chosen = own_and_chosen(router, args, out)
                same = (torch.zeros_like(chosen).scatter(1, own, True) == chosen).all(dim=-1)
            seen[kind][0] += int(same.sum())
            seen[kind][1] += same.numel()

        return count

    for name, module in trainer.model.named_modules():
        if type(module).__name__ == "NemotronHTopkRouter" or isinstance(module, TopKRouter):
            module.register_forward_hook(counter("mtp" if "mtp" in name else "decoder"))
    return seen


def decoder_takes_the_given_routes(fsdp, meg, b) -> None:
    """Both backends' log-probs on ``b``'s routes are the same, and other experts give others."""
    moved = b.routes.long()
    moved = torch.where(moved >= 0, (moved + 1) % 8, -1).to(torch.int16)  # still k distinct of 8
    mask = b.loss_mask > 0
    given = {t: t.logprobs(b)[mask] for t in (fsdp, meg)}
    other = {t: t.logprobs(replace(b, routes=moved))[mask] for t in (fsdp, meg)}
    torch.testing.assert_close(given[meg], given[fsdp], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(other[meg], other[fsdp], rtol=1e-4, atol=1e-5)
    # the tiny model's experts move its log-probs little (3.8e-4 here), far above the backends' gap
    assert all((other[t] - given[t]).abs().max() > 1e-4 for t in (fsdp, meg))


def per_expert(grads: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """``grads[name]``; a transformers stacked expert weight (``experts.up_proj``) from the per-expert
    checkpoint names the megatron backend exports."""
    if name in grads:
        return grads[name]
    stem, proj = name.rsplit(".", 1)
    experts = sorted(
        int(k[len(stem) + 1 :].split(".")[0]) for k in grads if k.startswith(f"{stem}.") and proj in k
    )
    return torch.stack([grads[f"{stem}.{e}.{proj}.weight"] for e in experts])


def test_packed_mtp_loss_and_gradients_are_the_padded_rows():
    """Two MTP depths of a Mamba, an attention and a MoE layer on four sequences packed into one row:
    the loss on every target (a full loss mask: the next sequence's first targets count too) and every
    gradient (the decoder's included) are the padded rows'. Scored over the whole row, a depth's rolled
    targets cross into the next sequence (the mutation)."""
    from functools import partial

    from hpcrl.run.tiny_model import build_model
    from hpcrl.trainer import mtp
    from hpcrl.trainer.fsdp.segments import reset_at_sequence_starts, use_kernels
    from hpcrl.trainer.logprob_head import chunked_logprob
    from hpcrl.trainer.packing import Packed
    from hpcrl.trainer.ssd import seq_index
    from hpcrl.trainer.varlen import packed_attention, use_packed_attention
    from tests.trainer.test_packing import batch as rows

    reset_at_sequence_starts(use_kernels("auto", "cpu"))  # the torch Mamba path restarts by seq_idx
    tiny = compose(MTP[0], "model.mtp_layers=2", "model.hybrid.mtp_pattern=M*E").model
    model = build_model(tiny, seed=0).eval()
    b = rows([4, 9, 3, 6], [5, 2, 8, 4])
    full = b.attention_mask[:, 1:].float()  # every real target
    embed, head = model.get_input_embeddings(), model.lm_head.weight
    packed = Packed.of(b.input_ids, b.attention_mask)
    seq = seq_index(packed.positions)
    assert use_packed_attention(model)

    def step(loss_of):
        model.zero_grad()
        loss = loss_of()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    def padded():
        hidden = model.model(input_ids=b.input_ids, use_cache=False).last_hidden_state
        return model.mtp.nll(hidden, b.input_ids, full, embed, head)

    def packed_row(scored_whole: bool = False):
        with packed_attention(packed.positions):
            inputs = {
                "input_ids": packed.ids,
                "position_ids": packed.positions,
                "seq_idx": seq,
                "use_cache": False,
            }
            hidden = model.model(**inputs).last_hidden_state
            if not scored_whole:
                return model.mtp.nll(hidden, packed.ids, packed.loss_mask(full), embed, head, seq)
            depth = partial(model.mtp.depth, seq_idx=seq)  # the layers per sequence, the targets not
            logp = lambda out, targets: chunked_logprob(out, head, targets)[0]  # noqa: E731
            return mtp.nll(depth, 2, hidden, packed.ids, packed.loss_mask(full), embed, logp)

    want, want_grads = step(padded)
    got, got_grads = step(packed_row)
    assert len(got_grads) == len(want_grads) > 20
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    crossing, _ = step(partial(packed_row, scored_whole=True))
    assert (crossing - want).abs() > 1e-3


@pytest.mark.parametrize("cp", [2, 3])
def test_a_cp_ranks_depths_embed_and_score_its_chunks_of_the_whole_rows_roll(cp):
    """Context parallel (``mtp.on_chunks``), every rank played in one process: a rank runs its chunks
    of the hidden states (``rank_positions``, Megatron's load-balanced pair) through two depths of
    per-position layers (CP attention and Mamba mixers: the nemotron_h torchrun's CP=2 MTP case) and
    scores its chunks of the whole row's rolled tokens; each rank's log-probs in their places (the
    others' zero here: ``cp_join``'s backward keeps a rank's own part), so the ranks' losses and
    gradients sum to the unsplit row's. The rank's embedded tokens cross chunk bounds: rank 0's first
    chunk ends on the first token of chunk 1 (rank 1's). The mutation: each rank rolling its own
    chunks (no token from another chunk) scores other targets."""
    from hpcrl.trainer import mtp
    from hpcrl.trainer.context_parallel import rank_positions

    gen = torch.Generator().manual_seed(0)
    b, chunk, h, vocab = 2, 3, 8, 50
    width = 2 * cp * chunk
    ids = torch.randint(vocab, (b, width), generator=gen)
    loss_mask = (torch.rand(b, width - 1, generator=gen) > 0.3).float()
    table, head = torch.nn.Embedding(vocab, h), torch.nn.Linear(h, vocab, bias=False)
    proj = torch.nn.ModuleList(torch.nn.Linear(2 * h, h) for _ in range(2))
    hidden = torch.randn(b, width, h, generator=gen, requires_grad=True)
    leaves = [hidden, table.weight, head.weight, *proj.parameters()]

    def depth(d: int, x: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return torch.tanh(proj[d](torch.cat([embedded, x], -1)))

    def logp(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(head(out), -1).gather(-1, targets[..., None])[..., 0]

    def loss_and_grads(loss: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return loss.detach(), list(torch.autograd.grad(loss, leaves))

    want, want_grads = loss_and_grads(mtp.nll(depth, 2, hidden, ids, loss_mask, table, logp))
    seen: list[torch.Tensor] = []
    got, got_grads = torch.zeros(()), [torch.zeros_like(g) for g in want_grads]
    chunk_rolled = torch.zeros(())
    for rank in range(cp):
        mine = rank_positions(rank, cp, chunk)

        def join(local: torch.Tensor, mine: torch.Tensor = mine) -> torch.Tensor:
            return torch.zeros(b, width).index_copy(1, mine, local)

        def recorded(tokens: torch.Tensor) -> torch.Tensor:
            seen.append(tokens)
            return table(tokens)

        embed, score = mtp.on_chunks(recorded, logp, lambda t, mine=mine: t[:, mine], join)
        loss, grads = loss_and_grads(mtp.nll(depth, 2, hidden[:, mine], ids, loss_mask, embed, score))
        got, got_grads = got + loss, [g + x for g, x in zip(got_grads, grads, strict=True)]
        # the mutation: the rank's own tokens and targets, rolled inside its two chunks
        full = torch.nn.functional.pad(loss_mask, (0, 1))[:, mine][:, :-1]
        chunk_rolled = chunk_rolled + mtp.nll(depth, 2, hidden[:, mine], ids[:, mine], full, table, logp)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert torch.equal(seen[0][:, chunk - 1], ids[:, chunk])  # rank 0, depth 0: from rank 1's chunk
    assert (chunk_rolled - want).abs() > 1e-3


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_packed_mtp_step_equals_the_padded_step(mtp_dir, backend):
    """One step with the MTP loss reaching the decoder (not detached), packed (a budget of 24 tokens:
    rows 0-2 in one row, row 3 in another) and padded in the same micro-batches (3 rows): the MTP loss,
    policy loss, gradient norm and every gradient are equal."""
    from hpcrl.trainer.megatron import MegatronTrainer
    from tests.harness.megatron_parity import stepped_grads

    preset, make = (MTP, FSDPTrainer) if backend == "fsdp" else (MEGATRON, MegatronTrainer)
    keys = ("trainer.mtp_loss_scale=0.5", "trainer.mtp_detach=false", "algo.kl_coef=0")
    padded = make(mtp_dir, plan(*preset, *keys, "trainer.micro_batch_size=3").cfg, master=MASTER)
    packing = ("trainer.packing=true", "trainer.micro_batch_tokens=24")
    packed = make(mtp_dir, plan(*preset, *keys, *packing).cfg, master=MASTER)
    assert [g.tolist() for g in packed.step.cut(batch().attention_mask.sum(dim=1))] == [[0, 1, 2], [3]]
    grads = {"padded": stepped_grads(padded, backend), "packed": stepped_grads(packed, backend)}
    m_padded, m_packed = padded.train_step(batch()), packed.train_step(batch())
    for key in ("mtp_loss", "policy_loss", "grad_norm"):
        assert m_packed[key] == pytest.approx(m_padded[key], rel=1e-5), key
    assert m_packed["mtp_loss"] > 1.0
    assert grads["packed"].keys() == grads["padded"].keys()
    assert any(k.startswith("mtp.") for k in grads["packed"])
    for name, want in grads["padded"].items():
        torch.testing.assert_close(grads["packed"][name], want, rtol=1e-4, atol=1e-6, msg=name)
