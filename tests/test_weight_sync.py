"""Trainer -> engine weight broadcast: bucket plans by hand, and a real gloo group of three processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.sync.broadcast import (
    TensorMeta,
    WeightReceiver,
    WeightSender,
    dtype_of,
    metas_of,
    new_group,
    plan_buckets,
)
from hpcrl.trainer.fsdp import free_port

METAS = [
    TensorMeta("a", (3, 4)),  # 12
    TensorMeta("b", (5,)),  # 5
    TensorMeta("c", (2, 2, 2)),  # 8
    TensorMeta("d", (30,)),  # 30: larger than a bucket
    TensorMeta("e", (1,)),  # 1
]


def test_buckets_pack_in_order_and_never_split_a_tensor():
    buckets = plan_buckets(METAS, bucket_numel=16)
    layout = [[(m.name, off) for m, off in b.entries] for b in buckets]
    assert layout == [[("a", 0)], [("b", 0), ("c", 5)], [("d", 0)], [("e", 0)]]
    assert [b.numel for b in buckets] == [12, 13, 30, 1]
    assert plan_buckets(METAS, bucket_numel=10**6)[0].numel == 56  # one bucket holds everything


def test_metas_and_dtypes():
    assert metas_of({"w": torch.zeros(2, 3)}) == [TensorMeta("w", (2, 3))]
    assert dtype_of("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_of("float7")


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {m.name: torch.randn(m.shape, generator=g) for m in METAS}


def _rank(rank: int, port: int, dtype: str, out: Path) -> None:
    """One rank of the group, in its own process (``python tests/test_weight_sync.py ...``)."""
    group = new_group("gloo", f"127.0.0.1:{port}", rank, 3, local_ip="127.0.0.1", timeout_s=60)
    buckets = plan_buckets(METAS, bucket_numel=16)
    cpu = torch.device("cpu")
    if rank == 0:
        sender = WeightSender(group, buckets, dtype_of(dtype), cpu)
        for step in range(2):  # the same group serves every step
            sent = sender.send({k: v + step for k, v in _weights().items()})
        torch.save(sent, out)
    else:
        receiver = WeightReceiver(group, buckets, dtype_of(dtype), cpu)
        for _ in range(2):
            got = dict(receiver.receive())
        torch.save(got, out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_receiver_gets_the_senders_weights(dtype, tmp_path):
    port = free_port()
    outs = [tmp_path / f"rank{r}.pt" for r in range(3)]
    procs = [
        subprocess.Popen([sys.executable, __file__, str(r), str(port), dtype, str(outs[r])]) for r in range(3)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    results = [torch.load(o) for o in outs]
    assert results[0] == 56 * dtype_of(dtype).itemsize  # bytes of the second step
    want = {k: (v + 1).to(dtype_of(dtype)) for k, v in _weights().items()}
    for rank in (1, 2):
        assert results[rank].keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(results[rank][name], tensor), (rank, name)


def test_sender_refuses_a_weight_whose_shape_changed():
    class NoGroup:
        def broadcast(self, buf):
            raise AssertionError("nothing may be sent")

    sender = WeightSender(NoGroup(), plan_buckets(METAS, 16), torch.float32, torch.device("cpu"))  # type: ignore[arg-type]
    weights = _weights()
    weights["a"] = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"weight a: shape \(4, 3\), agreed \(3, 4\)"):
        sender.send(weights)


def test_mode_and_backend_follow_devices_and_placement():
    from hpcrl.run.fleet import choose_weight_sync

    assert choose_weight_sync("collective", on_cpu=True, split=False) == ("collective", "gloo")
    assert choose_weight_sync("collective", on_cpu=False, split=True) == ("collective", "nccl")
    # trainer and engine share GPUs: NCCL refuses two ranks on one device
    assert choose_weight_sync("collective", on_cpu=False, split=False)[0] == "object_store"
    assert choose_weight_sync("object_store", on_cpu=False, split=True)[0] == "object_store"


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
