"""Image prompts (``data.image_field``) through the real vLLM CPU engine and the fsdp trainer, on a tiny
random Idefics3 (tests/tiny_vlm.py): the engine generates from the placeholder form and the image, the
trainer scores the processor's expanded ids with its pixel values, and the two log-probs agree; a step
leaves the frozen vision tower without gradients, outside the optimizer and out of the refit, and the
refit's language-model weights reach the engine."""

from __future__ import annotations

import pytest
import torch

from hpcrl.data.loader import Example
from hpcrl.data.templates import render_prompt
from hpcrl.rollout.base import ImagePrompt, SamplingSettings
from hpcrl.run.vision import Encoded, ImageEncoder
from hpcrl.trainer.batch import TrainBatch, build_batch
from hpcrl.trainer.process_group import free_port
from tests.conftest import compose
from tests.tiny_vlm import VISION, build_tiny_vlm, png

SETTINGS = SamplingSettings(n=4, temperature=1.0, top_p=1.0, max_tokens=5, seed=0)
FREEZE = "trainer.freeze=[" + ",".join(VISION) + "]"
IMAGE_TOKENS = (
    4 + 3
)  # for the one placeholder: the image's tokens and <fake_token_around_image><global-img> ... <fake_token_around_image>


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def cfg():
    return compose("data=geo3k", "data.check_source=false", FREEZE, "algo.kl_coef=0", "algo.lr=1e-2")


@pytest.fixture(scope="module")
def encode(vlm_dir, cfg):
    return ImageEncoder(vlm_dir, cfg.data)


@pytest.fixture(scope="module")
def engine(vlm_dir, cfg, tmp_path_factory):
    from hpcrl.rollout.vllm_engine import VLLMEngine

    scratch = tmp_path_factory.mktemp("vllm")
    return VLLMEngine(
        vlm_dir, cfg.rollout, seed=0, max_model_len=128, on_cpu=True, scratch=scratch, kv_cache_gb=0.05
    )


@pytest.fixture(scope="module")
def trainer(vlm_dir, cfg):
    from hpcrl.trainer.fsdp import FSDPTrainer

    return FSDPTrainer(vlm_dir, cfg, master=f"127.0.0.1:{free_port()}")


def example(cfg, picture: int) -> Example:
    return Example(render_prompt(cfg.data.template, "Find x."), "3", (png(picture),))


def rollout_batch(engine, enc: Encoded, images: dict[str, torch.Tensor] | None = None) -> TrainBatch:
    """The engine's completions of ``enc`` as a training batch (``images``: score them with these)."""
    [group] = engine.generate([enc.engine], SETTINGS)
    assert all(c.token_ids and len(c.logprobs) == len(c.token_ids) for c in group)
    rows = len(group)
    return build_batch(
        [enc.ids] * rows,
        [c.token_ids for c in group],
        [c.logprobs for c in group],
        [1.0, -1.0] * (rows // 2),
        [1.0] * rows,
        0,
        [images or enc.images] * rows,
    )


def gap(trainer, batch: TrainBatch) -> float:
    mask = batch.loss_mask.bool()
    return float((trainer.logprobs(batch)[mask] - batch.rollout_logp[mask]).abs().max())


def weights(trainer) -> dict[str, torch.Tensor]:
    """A copy of every weight, whole (from the sharded state dict: the tensors registered on a
    one-rank FSDP module may have had their storage freed)."""
    state = trainer.model.state_dict()
    return {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for n, t in state.items()
    }


def test_the_processor_expands_the_image_the_engine_gets_as_a_placeholder(cfg, encode):
    enc = encode(example(cfg, 0))
    assert isinstance(enc.engine, ImagePrompt) and len(enc.engine.images) == 1
    assert len(enc.ids) == len(enc.engine.token_ids) - 1 + IMAGE_TOKENS
    assert enc.images is not None and enc.images["pixel_values"].shape[-2:] == (56, 56)
    text = encode(Example("Find x.", "3"))  # a row without images: the text path
    assert text.images is None and text.engine == text.ids


def test_engine_and_trainer_logprobs_agree_on_an_image_prompt(cfg, encode, engine, trainer):
    enc, other = encode(example(cfg, 0)), encode(example(cfg, 1))
    batch = rollout_batch(engine, enc)
    assert gap(trainer, batch) < 1e-4
    # the same completions scored with another picture: the image reaches both forwards
    assert gap(trainer, rollout_batch(engine, enc, other.images)) > 1e-3


def test_a_step_leaves_the_vision_tower_and_the_refit_reaches_the_engine(cfg, encode, engine, trainer):
    """The vision tower: no gradient, not in the optimizer, unchanged, not sent. The text weights:
    stepped, sent, and the engine's log-probs then equal the trainer's new ones."""
    enc = encode(example(cfg, 0))
    batch = rollout_batch(engine, enc)
    params = dict(trainer.model.named_parameters())
    vision = {n for n in params if n.startswith(VISION)}
    before = weights(trainer)
    trainer.train_step(batch)
    assert vision and all(params[n].grad is None and not params[n].requires_grad for n in vision)
    # (by count: FSDP registers other tensor objects under the names while a one-rank model is unsharded)
    stepped = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert len(stepped) == len(params) - len(vision) and all(p.requires_grad for p in stepped)
    after = weights(trainer)
    moved = {n for n in before if not torch.equal(after[n], before[n])}
    assert moved and not moved & vision
    sent = trainer.export_weights()
    assert sent and not any(n.startswith(VISION) for n in sent)
    engine.load_weights(sent)
    assert gap(trainer, rollout_batch(engine, enc)) < 1e-4


def test_a_batch_keeps_each_rows_images_through_every_cut():
    """Rows cut by the fleet's data ranks (strided slices), the step's minibatches (index tensors) and
    masks keep their own images; a forward's inputs stack them, token-aligned marks (Gemma's
    ``token_type_ids``) right-padded to the batch's width; a batch mixing image and text rows is refused."""
    rows = [
        {"pixel_values": torch.full((1, 2), float(i)), "token_type_ids": torch.ones(1, 3)} for i in range(4)
    ]
    batch = build_batch([[1, 2, 3]] * 4, [[4]] * 4, [[-0.1]] * 4, [0.0] * 4, [1.0] * 4, 0, rows)
    assert batch.input_ids.shape == (4, 4)

    def firsts(b: TrainBatch) -> list[float]:
        return b.image_inputs()["pixel_values"][:, 0].tolist()

    assert firsts(batch.select(slice(1, None, 2))) == [1.0, 3.0]
    assert firsts(batch.select(torch.tensor([2, 0]))) == [2.0, 0.0]
    assert firsts(batch.select(torch.tensor([False, True, True, False]))) == [1.0, 2.0]
    marks = batch.image_inputs()["token_type_ids"]
    assert marks.shape == (4, 4) and marks[:, 3].eq(0).all() and marks[:, :3].eq(1).all()
    assert build_batch([[1]], [[2]], [[]], [0.0], [1.0], 0).image_inputs() == {}
    with pytest.raises(ValueError, match="1 of 2 rows carry images"):
        build_batch([[1]] * 2, [[2]] * 2, [[]] * 2, [0.0] * 2, [1.0] * 2, 0, [rows[0], None])


def fixed_batch(vlm_dir, cfg) -> TrainBatch:
    """Two image prompts with fixed completions (no engine): rows of opposite advantage."""
    encode = ImageEncoder(vlm_dir, cfg.data)
    encs = [encode(example(cfg, i)) for i in (0, 1)]
    return build_batch(
        [e.ids for e in encs],
        [[30, 31, 32], [33, 34]],
        [[], []],
        [1.0, -1.0],
        [1.0, 1.0],
        0,
        [e.images for e in encs],
    )


def _vlm_rank(rank: int, master: str, vlm_dir: str, out: str) -> None:
    from pathlib import Path

    from hpcrl.trainer.fsdp import FSDPTrainer

    cfg = compose("data=geo3k", "data.check_source=false", FREEZE, "algo.kl_coef=0", "algo.lr=1e-2")
    t = FSDPTrainer(Path(vlm_dir), cfg, rank=rank, world=2, master=master)
    whole = fixed_batch(Path(vlm_dir), cfg)
    logp = t.logprobs(whole)
    t.train_step(whole.select(slice(rank, None, 2)))
    grads = [p.grad is None for n, p in t.model.named_parameters() if n.startswith(VISION)]
    torch.save({"logp": logp, "vision_grads_none": grads}, Path(out) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_fsdp_ranks_score_image_rows_as_transformers_and_keep_the_tower_frozen(vlm_dir, cfg, tmp_path):
    """FSDP over two gloo ranks (the towers units of their own, sharded): each rank's log-probs of an
    image batch equal transformers' own model's; a step on each rank's rows leaves the tower without
    gradients."""
    from transformers import AutoModelForImageTextToText

    master = f"127.0.0.1:{free_port()}"
    torch.multiprocessing.spawn(_vlm_rank, args=(master, str(vlm_dir), str(tmp_path)), nprocs=2)
    batch = fixed_batch(vlm_dir, cfg)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, **batch.image_inputs()).logits[:, :-1].float()
    want = logits.log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.loss_mask.bool()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert (got["logp"][mask] - want[mask]).abs().max() < 1e-5
        assert got["vision_grads_none"] and all(got["vision_grads_none"])
