"""Trainer -> engine weight broadcast: bucket plans by hand, and a real gloo group of three processes
(one of which dies: issue 37)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.sync.broadcast import WeightLayout, WeightReceiver, WeightSender, dtype_of, new_group
from hpcrl.sync.packer import BucketPacker, TensorMeta, metas_of, plan_buckets
from hpcrl.trainer.process_group import free_port

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
    """One rank of the group, in its own process (``python tests/rollout/test_weight_sync.py ...``).
    float32: then rank 1 dies and the others refit once more (``_one_dies``)."""
    group = new_group("gloo", f"127.0.0.1:{port}", rank, 3, local_ip="127.0.0.1", timeout_s=60)
    buckets = plan_buckets(METAS, bucket_numel=16)
    cpu = torch.device("cpu")
    if rank == 0:
        sender = WeightSender(group, buckets, dtype_of(dtype), cpu)
        for step in range(2):  # the same group serves every step
            sent = sender.send({k: v + step for k, v in _weights().items()})
        torch.save(sent, out)
    else:
        receiver = WeightReceiver([group], [buckets], dtype_of(dtype), cpu)
        for _ in range(2):
            got = dict(receiver.receive())
        torch.save(got, out)
    if dtype == "float32":
        _one_dies(rank, sender if rank == 0 else receiver, out.with_suffix(".dies.pt"))


def _one_dies(rank: int, end: WeightSender | WeightReceiver, out: Path) -> None:
    """Rank 1 dies (issue 37: an engine killed in a refit); what the sender and the other receiver
    see of the next refit, and after how long."""
    import os
    import time

    if isinstance(end, WeightReceiver):
        if rank == 1:
            os._exit(0)  # its sockets close, as a SIGKILLed engine's do
        start = time.perf_counter()
        try:
            dict(end.receive())
            error = ""
        except RuntimeError as exc:
            error = str(exc)
        torch.save({"error": error, "s": time.perf_counter() - start}, out)
        return
    time.sleep(0.5)  # rank 1 is gone
    packer = end.packer()
    for name, tensor in _weights().items():  # the whole stream: the trainer's ranks gather together
        packer.put(name, tensor)
    stats = packer.finish()
    torch.save({"failed": packer.failed, "buckets": stats.buckets}, out)
    time.sleep(3.0)  # the other receiver fails from the closed group, not from this process ending


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
    if dtype == "float32":  # then rank 1 died: the send failed, the other receiver was let go at once
        sender, other = (torch.load(outs[r].with_suffix(".dies.pt")) for r in (0, 2))
        assert sender["failed"] and sender["failed"].startswith("RuntimeError: "), sender
        assert sender["buckets"] == 1  # of 4: its first broadcast failed, and nothing went out after it
        # let go by the group's closing: not its timeout (60 s), nor the sender's exit (after 3.5 s)
        assert other["error"] and other["s"] < 3.0, other


def test_sender_refuses_a_weight_whose_shape_changed():
    class NoGroup:
        def broadcast_async(self, buf):
            raise AssertionError("nothing may be sent")

    sender = WeightSender(NoGroup(), plan_buckets(METAS, 16), torch.float32, torch.device("cpu"))  # type: ignore[arg-type]
    weights = _weights()
    weights["a"] = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"got a \(4, 3\), agreed a \(3, 4\)"):
        sender.send(weights)


class Wire:
    """A send that stays in flight until the packer waits for it: the events say when that was."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"done {self.name}")


def _packer(metas: list[TensorMeta], bucket_numel: int, log: list[str]) -> BucketPacker:
    def emit(buf: torch.Tensor, bucket) -> Wire:
        name = "+".join(m.name for m, _ in bucket.entries)
        log.append(f"send {name}")
        return Wire(log, name)

    return BucketPacker(plan_buckets(metas, bucket_numel), torch.float32, torch.device("cpu"), emit)


def test_packer_overlaps_one_bucket_and_never_counts_more_than_two():
    # four tensors of 8 in buckets of 16: a+b, c+d. Scratch of 8 per tensor (the gathered copy).
    metas = [TensorMeta(n, (8,)) for n in "abcd"]
    log: list[str] = []
    packer = _packer(metas, 16, log)
    for m in metas:
        with packer.scratch(8):
            log.append(f"put {m.name}")
            packer.put(m.name, torch.full((8,), float(ord(m.name))))
    stats = packer.finish()
    # a+b goes out after b; c is gathered beside it (16 in flight + 8 scratch = 24 <= 32); allocating
    # c's bucket (16 more: 40) first waits for a+b; the last bucket is waited for by finish()
    assert log == ["put a", "put b", "send a+b", "put c", "done a+b", "put d", "send c+d", "done c+d"]
    # held at most: one bucket (in flight, or being packed) + one tensor's scratch = 24
    assert stats.peak_numel == 24 and stats.buckets == 2 and stats.bytes == 2 * 16 * 4
    assert packer.budget == 32


def test_packer_refuses_a_stream_out_of_step_or_short():
    metas = [TensorMeta("a", (2,)), TensorMeta("b", (3,))]
    with pytest.raises(ValueError, match=r"got b \(3,\), agreed a \(2,\)"):
        _packer(metas, 8, []).put("b", torch.zeros(3))
    short = _packer(metas, 8, [])
    short.put("a", torch.zeros(2))
    with pytest.raises(ValueError, match="ended before b"):
        short.finish()
    with pytest.raises(ValueError, match="more tensors than were agreed"):
        done = _packer(metas[:1], 8, [])
        done.put("a", torch.zeros(2))
        done.put("b", torch.zeros(3))


def test_layout_keeps_each_senders_order_and_refuses_a_name_sent_twice():
    per_rank = [[("a", (3, 4)), ("b", [5])], [], [("c", (2, 2, 2)), ("d", (30,))]]
    layout = WeightLayout.of(per_rank, "bfloat16", bucket_numel=16)
    assert [r for r, _ in layout.sources] == [0, 2]  # rank 1 only helps gather
    assert layout.names == ["a", "b", "c", "d"] and layout.numel == 12 + 5 + 8 + 30
    assert [[m.name for m, _ in b.entries] for b in layout.buckets(1)] == [["c"], ["d"]]  # per sender
    assert layout.source_index(2) == 1 and layout.source_index(1) is None
    again = WeightLayout.from_wire(layout.wire())
    assert again == layout
    with pytest.raises(ValueError, match=r"sent by two trainer ranks: \['b'\]"):
        WeightLayout.of([[("b", (1,))], [("b", (1,))]], "float32", 16)


def test_mode_and_backend_follow_devices_and_placement():
    from hpcrl.plan.engine_defaults import choose_refit

    assert choose_refit("collective", on_cpu=True, split=False, ipc=True) == ("broadcast", "gloo")
    assert choose_refit("collective", on_cpu=False, split=True, ipc=True) == ("broadcast", "nccl")
    # trainer and engine share GPUs: NCCL refuses two ranks on one device; IPC handles instead
    assert choose_refit("collective", on_cpu=False, split=False, ipc=True)[0] == "ipc"
    assert choose_refit("collective", on_cpu=False, split=False, ipc=False)[0] == "object_store"
    assert choose_refit("object_store", on_cpu=False, split=True, ipc=True)[0] == "object_store"


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
