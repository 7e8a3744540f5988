"""fsdp's expert parallelism (trainer/fsdp/expert_parallel.py) under torchrun, gloo on CPU: EP2, EP2 x
expert-DP 2 and EP4 take the one-rank step on a small Qwen3-MoE, EP2 x CP2 with recompute on a small
Gemma 4 MoE (26B-A4B's block); an EP checkpoint resumes on one rank, a one-rank one under EP; the
dispatch alone (two ranks, uneven routes, no FSDP) equals the whole experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.megatron_parity import parity_batch
from tests.megatron.common import _assert_same_step, _torchrun, gemma4_moe_model
from tests.megatron.test_megatron_dense import SECOND, _assert_resumes_resharded
from tests.megatron.test_megatron_moe import qwen3_moe_dir  # noqa: F401 (the fixture)


@pytest.mark.slow
def test_expert_parallel_takes_the_one_rank_step_and_resumes(qwen3_moe_dir, tmp_path):  # noqa: F811
    """Each layout holds num_experts / ep experts per EP rank (split again over expert DP) and runs
    the all-to-all dispatch; log-probs, metrics, gradients (gathered whole) and updated weights equal
    the one-rank step's, and each rank reads back its own checkpoint shards."""
    mask = parity_batch().loss_mask.bool()
    base = _torchrun(qwen3_moe_dir, tmp_path / "one.pt", 1, 1, backend="fsdp", port=29861, env=SECOND)
    assert base["layout"]["expert_mesh"] == {"world": 1} and not base["layout"]["dispatch"]
    layouts = ((2, 2, 29862, {"edp": 1, "ep": 2}, 2), (4, 2, 29863, {"edp": 2, "ep": 2}, 1))
    layouts += ((4, 4, 29864, {"edp": 1, "ep": 4}, 1),)
    for world, ep, port, mesh, rows in layouts:
        name = f"w{world}ep{ep}"
        env = SECOND if world == 2 else None
        run = _torchrun(
            qwen3_moe_dir,
            tmp_path / f"{name}.pt",
            1,
            1,
            "fsdp",
            port,
            dp=world,
            algo=(f"trainer.ep={ep}",),
            env=env,
        )
        _assert_same_step(run, base, mask, f"fsdp world {world} EP{ep}")
        # 4 experts: 4 / ep per EP rank, split over expert DP (rank 0's share)
        assert run["layout"]["expert_mesh"] == mesh and run["layout"]["dispatch"], run["layout"]
        assert run["layout"]["expert_rows"] == rows, run["layout"]
        assert all(run["state_restored"]), run["state_restored"]
    # the EP2 checkpoint on one rank (exported too: it loads in transformers with the trained weights)
    _assert_resumes_resharded(qwen3_moe_dir, tmp_path, "w2ep2", port=29865, backend="fsdp")
    # and the one-rank checkpoint under EP2: its next step is the one-rank run's second
    resume = {"HPCRL_PARITY_RESUME": str(tmp_path / "one.ckpt")}
    run = _torchrun(
        qwen3_moe_dir,
        tmp_path / "one-as-ep2.pt",
        1,
        1,
        "fsdp",
        29866,
        dp=2,
        algo=("trainer.ep=2",),
        env=resume,
    )
    for key, weight in base["weights"].items():
        assert torch.equal(run["loaded"][key], weight), key
        assert torch.allclose(run["weights"][key], base["second_step"][key], atol=5e-8, rtol=0), key


@pytest.mark.slow
def test_expert_parallel_under_context_parallel_on_gemma4_moe(tmp_path):
    """Gemma 4's MoE block (26B-A4B's, the seed's EP16 x CP2 recipe) at EP2 x CP2 with activation
    checkpointing: the dispatch runs again in the recompute, and the step equals one rank's."""
    gemma4_moe_model().save_pretrained(tmp_path / "model")
    mask = parity_batch().loss_mask.bool()
    base = _torchrun(tmp_path / "model", tmp_path / "one.pt", 1, 1, backend="fsdp", port=29867)
    split = ("trainer.ep=2", "trainer.cp=2", "trainer.activation_checkpointing=true")
    run = _torchrun(tmp_path / "model", tmp_path / "epcp.pt", 1, 1, "fsdp", 29868, cp=2, dp=2, algo=split)
    _assert_same_step(run, base, mask, "fsdp EP2 x CP2")
    layout = run["layout"]
    assert layout["expert_mesh"] == {"edp": 2, "ep": 2} and layout["dispatch"], layout
    assert (layout["cp"], layout["dp"], layout["widths"]) == (2, 2, [4]), layout


def test_experts_that_do_not_split_evenly_are_refused(qwen3_moe_dir):  # noqa: F811
    from hpcrl.trainer.fsdp.expert_parallel import check_model
    from hpcrl.trainer.hf_load import meta_model

    model = meta_model(qwen3_moe_dir)
    assert len(check_model(model, 2)) == 2  # one grouped-experts module per layer
    with pytest.raises(ValueError, match=r"trainer\.ep=3 must divide the model's 4 experts"):
        check_model(model, 3)


def _experts(num_experts: int = 4) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=6, num_experts=num_experts)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5)
    return experts


def _routes(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank 0: 5 tokens over every expert; rank 1: 3 tokens only to experts 0 and 1 (so rank 1's
    experts get nothing from it, and rank 0 sends it more rows than it gets back)."""
    gen = torch.Generator().manual_seed(rank)
    tokens = (5, 3)[rank]
    index = (
        torch.tensor([[0, 3], [1, 2], [3, 0], [2, 1], [0, 2]]) if rank == 0 else torch.tensor([[0, 1]] * 3)
    )
    return torch.randn(tokens, 8, generator=gen), index, torch.rand(tokens, 2, generator=gen)


def _dispatch_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.trainer.fsdp.expert_parallel import split_experts

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        experts = _experts()
        split_experts(experts, init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "ep")))
        x, index, weights = _routes(rank)
        x.requires_grad_(True)
        y = experts(x, index, weights)
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        grads = {n: p.grad.to_local() for n, p in experts.named_parameters()}
        torch.save({"y": y.detach(), "dx": x.grad, "grads": grads}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_all_to_all_dispatch_equals_every_expert_on_every_rank(tmp_path):
    """Two gloo ranks, EP2, uneven routes: each rank's outputs and input gradients are those of the
    whole experts on its own tokens, and each rank's expert gradients sum both ranks' tokens."""
    from hpcrl.trainer.process_group import free_port

    torch.multiprocessing.spawn(_dispatch_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    whole = _experts()
    for rank in (0, 1):
        x, index, weights = _routes(rank)
        x.requires_grad_(True)
        y = whole(x, index, weights)
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.allclose(got["y"], y, atol=1e-6), rank
        assert torch.allclose(got["dx"], x.grad, atol=1e-6), rank
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")["grads"]
        for name, p in whole.named_parameters():
            assert torch.allclose(got[name], p.grad[2 * rank : 2 * rank + 2], atol=1e-6), (rank, name)
    assert torch.count_nonzero(whole.down_proj.grad) > 0
