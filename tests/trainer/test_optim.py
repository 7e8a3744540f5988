"""The fsdp backend's optimizers (gloo, CPU ranks): Adafactor on FSDP2 shards against torch's on the
whole model; bf16 and offloaded state; resume."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from hpcrl.trainer.process_group import free_port
from tests.megatron.test_megatron_moe import qwen3_moe_dir  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow


class Tiny(torch.nn.Module):
    """Matrices of 7 and 5 rows (uneven halves on two ranks), a vector, a 3-D tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 7)
        self.b = torch.nn.Linear(7, 5, bias=False)
        self.c = torch.nn.Parameter(torch.randn(3, 2, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return (h.unsqueeze(0) * self.c.sum(1, keepdim=True)).square().mean()


def _adafactor_rank(rank: int, master: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from hpcrl.trainer.fsdp.optim import ShardedAdafactor
    from hpcrl.trainer.process_group import init_process_group

    init_process_group(rank, 2, master, "gloo")
    torch.manual_seed(0)
    whole = Tiny()
    sharded = fully_shard(copy.deepcopy(whole))
    ours = ShardedAdafactor(sharded.parameters(), lr=0.05, weight_decay=0.1)
    theirs = torch.optim.Adafactor(whole.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(4):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        for model, opt in ((sharded, ours), (whole, theirs)):
            opt.zero_grad()
            model(x).backward()
            opt.step()
    got = {n: p.full_tensor() for n, p in sharded.named_parameters()}
    state = {name: ours.state[p] for name, p in sharded.named_parameters()}
    placements = {n: {k: str(v.placements) for k, v in s.items() if k != "step"} for n, s in state.items()}
    if rank == 0:
        torch.save({"got": got, "want": dict(whole.named_parameters()), "placements": placements}, Path(out))
    torch.distributed.destroy_process_group()


def test_adafactor_on_shards_equals_torch_on_the_whole_model(tmp_path):
    """Two ranks, each holding half the rows of every tensor (FSDP2), take four Adafactor steps with
    weight decay: every tensor equals torch's Adafactor on the unsharded model (to fp32 rounding)."""
    out = tmp_path / "rank0.pt"
    torch.multiprocessing.spawn(_adafactor_rank, args=(f"127.0.0.1:{free_port()}", str(out)), nprocs=2)
    result = torch.load(out)
    start = dict(Tiny().named_parameters())  # (a different init: only shapes are read)
    for name, want in result["want"].items():
        assert want.shape == start[name].shape
        torch.testing.assert_close(result["got"][name], want.detach(), rtol=1e-5, atol=1e-6)
    # a matrix's row statistics are sharded like it, its column statistics whole on each rank; a 3-D
    # tensor's are both sharded on dim 0 (the dims they reduce are whole on each rank)
    shard, whole = "(Shard(dim=0),)", "(Replicate(),)"
    assert result["placements"]["a.weight"] == {"row_var": shard, "col_var": whole}
    assert result["placements"]["c"] == {"row_var": shard, "col_var": shard}
    assert result["placements"]["a.bias"] == {"variance": shard}


def test_bf16_rounding_is_unbiased():
    """A value between two bf16 numbers rounds to either, in proportion: its mean stays (round to
    nearest would give 1.0 every time, so v's small decays at beta2=0.999 would never land)."""
    from hpcrl.trainer.fsdp.optim import _round_bf16

    x = torch.full((200_000,), 1 + 2**-10)
    rounded = _round_bf16(x, torch.Generator().manual_seed(0))
    assert rounded.dtype == torch.bfloat16 and set(rounded.float().unique().tolist()) == {1.0, 1 + 2**-7}
    assert rounded.double().mean().item() == pytest.approx(1 + 2**-10, abs=2e-5)


def _trainer(tiny_dir, *overrides):
    from hpcrl.trainer.fsdp import FSDPTrainer
    from tests.conftest import compose

    cfg = compose("algo.lr=3e-3", "algo.kl_coef=0", *overrides)
    return FSDPTrainer(tiny_dir, cfg, master=f"127.0.0.1:{free_port()}")


def _state(t) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor of ``t`` by parameter (its place in the optimizer) and key, as
    kept (local shards)."""
    params = t.optimizer.param_groups[0]["params"]
    return {
        f"{i}.{k}": v.to_local() if hasattr(v, "to_local") else v
        for i, p in enumerate(params)
        for k, v in t.optimizer.state[p].items()
    }


OPTIONS = {
    "bf16": ["trainer.optimizer_dtype=bfloat16"],
    "offload": ["trainer.optimizer_offload=true"],
    "adafactor": ["trainer.optimizer=adafactor"],
    "adafactor-bf16-offload": [
        "trainer.optimizer=adafactor",
        "trainer.optimizer_dtype=bfloat16",
        "trainer.optimizer_offload=true",
    ],
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_each_optimizer_option_trains_and_resumes(tiny_dir, tmp_path, options):
    """Each option trains (rows with positive advantages become more likely), keeps its state in the
    dtype and memory it promises, and a run resumed from its checkpoint steps exactly as the
    uninterrupted one (the bf16 rounding included)."""
    from tests.trainer.test_trainer import batch

    t = _trainer(tiny_dir, *options)
    b = batch()
    before = (t.logprobs(b) * b.loss_mask).sum(1)
    for _ in range(3):
        t.train_step(b)
    change = ((t.logprobs(b) * b.loss_mask).sum(1) - before).tolist()
    assert change[0] > 0 and change[2] > 0 and change[1] < 0 and change[3] < 0
    kept = {k: v for k, v in _state(t).items() if v.dim() > 0}
    bf16 = "trainer.optimizer_dtype=bfloat16" in options
    assert kept and all(v.dtype == (torch.bfloat16 if bf16 else torch.float32) for v in kept.values())
    assert all(v.device.type == "cpu" for v in kept.values())  # (on CPU ranks: see the GPU run's check)
    adafactor = "trainer.optimizer=adafactor" in options
    assert any(k.endswith(".col_var") for k in kept) == adafactor
    assert len({k.partition(".")[0] for k in kept}) == len(t.optimizer.param_groups[0]["params"])
    t.save_checkpoint(str(tmp_path / "ckpt"), async_save=False)
    resumed = _trainer(tiny_dir, *options)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    ours, theirs = _state(t), _state(resumed)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in ours)
    t.train_step(b)
    resumed.train_step(b)
    wa, wb = t.export_weights(), resumed.export_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_offload_and_bf16_change_where_the_state_lives_not_the_step(tiny_dir):
    """Offloaded fp32 state steps as resident state does; bf16 state stays within a small fraction of
    the fp32 run's movement over three steps (stochastic rounding, no drift)."""
    from tests.trainer.test_trainer import batch

    runs = {}
    for name, options in (("fp32", []), ("offload", OPTIONS["offload"]), ("bf16", OPTIONS["bf16"])):
        t = _trainer(tiny_dir, *options)
        start = t.export_weights()
        for _ in range(3):
            t.train_step(batch())
        runs[name] = {k: v - start[k] for k, v in t.export_weights().items()}
    fp32 = runs["fp32"]
    for k in fp32:
        torch.testing.assert_close(runs["offload"][k], fp32[k], rtol=1e-6, atol=1e-8)
    moved = torch.cat([v.flatten() for v in fp32.values()])
    off = torch.cat([(runs["bf16"][k] - fp32[k]).flatten() for k in fp32])
    assert moved.abs().max() > 1e-3 and off.norm() < 0.05 * moved.norm()


def _adafactor_trainer_rank(rank: int, master: str, tiny_dir: str, out: str) -> None:
    """fsdp rank ``rank`` of two with Adafactor, both ranks on the whole batch (so the averaged
    gradient is one rank's)."""
    from hpcrl.trainer.fsdp import FSDPTrainer
    from tests.conftest import compose
    from tests.trainer.test_trainer import batch

    cfg = compose("algo.lr=3e-3", "algo.kl_coef=0", "trainer.optimizer=adafactor")
    t = FSDPTrainer(Path(tiny_dir), cfg, rank=rank, world=2, master=master)
    for _ in range(2):
        t.train_step(batch())
    weights = t.export_weights()
    if rank == 0:
        torch.save(weights, Path(out))
    torch.distributed.destroy_process_group()


def test_adafactor_trainer_on_two_ranks_steps_as_one(tiny_dir, tmp_path):
    """The trainer's Adafactor over two FSDP2 ranks (every tensor split in half) moves the tiny model
    as one rank holding it whole does."""
    from tests.trainer.test_trainer import batch

    out = tmp_path / "rank0.pt"
    args = (f"127.0.0.1:{free_port()}", str(tiny_dir), str(out))
    torch.multiprocessing.spawn(_adafactor_trainer_rank, args=args, nprocs=2)
    two = torch.load(out)
    one = _trainer(tiny_dir, "trainer.optimizer=adafactor")
    start = one.export_weights()
    for _ in range(2):
        one.train_step(batch())
    whole = one.export_weights()
    assert two.keys() == whole.keys()
    assert max((whole[k] - start[k]).abs().max().item() for k in whole) > 1e-3  # it moved
    for k in whole:
        torch.testing.assert_close(two[k], whole[k], rtol=1e-4, atol=1e-5)


def test_adafactor_under_expert_parallel_takes_the_one_rank_step(tmp_path, qwen3_moe_dir):  # noqa: F811
    """Adafactor on a Qwen3-MoE's experts split over EP2 (each fused expert tensor sharded on dim 0
    over the EP group): the same step as on one rank holding every expert."""
    from tests.harness.megatron_parity import parity_batch
    from tests.megatron.common import _assert_same_step, _torchrun

    mask = parity_batch().loss_mask.bool()
    algo = ("trainer.optimizer=adafactor", "algo.lr=0.5")  # a relative step: weights move by ~1e-2
    base = _torchrun(qwen3_moe_dir, tmp_path / "one.pt", 1, 1, "fsdp", free_port(), algo=algo)
    algo += ("trainer.ep=2",)
    run = _torchrun(qwen3_moe_dir, tmp_path / "ep2.pt", 1, 1, "fsdp", free_port(), dp=2, algo=algo)
    assert run["layout"]["expert_mesh"] == {"edp": 1, "ep": 2}
    _assert_same_step(run, base, mask, "fsdp EP2 adafactor")
    adamw = _torchrun(qwen3_moe_dir, tmp_path / "adamw.pt", 1, 1, "fsdp", free_port(), algo=("algo.lr=1e-8",))
    apart = max((adamw["weights"][k] - w).abs().max().item() for k, w in base["weights"].items())
    assert apart > 1e-3  # Adafactor's step moved the weights far past tolerance (AdamW at lr 1e-8 barely)
