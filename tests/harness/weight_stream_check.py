"""The weight stream at work, measured (tests/rollout/test_weight_stream.py; tests/harness/recipe_build.py's "stream"
record): every trainer rank streams its weights into a real gloo broadcast to a receiver process
(an engine worker's end, ``python tests/harness/weight_stream_check.py receive ...``), four times. On the last three
streams each sending rank's peak memory above what it held before is read from the kernel (VmHWM,
reset through /proc/self/clear_refs) — measured, not counted — beside the packer's own count; the
worst of the three measured streams is the figure. The receiver checks every name, shape and value
against the model directory's checkpoint.

The ranks run with ``MALLOC_ENV`` from their first allocation, so that the resident size follows what
is held. glibc serves a large block from a free chunk of its heap when one fits, before it maps fresh
memory; a trainer's build leaves such chunks (freed while glibc's threshold had risen with the large
blocks it freed), and this check's ``malloc_trim`` releases their pages. A stream reusing them faults
the pages back in and keeps them after ``free``: the peak grew by every heap page the stream ever
touched, not by what it held at once. Seen on TP2 x PP2 (2026-12-02): 24-46 MiB on one stage's sender
or the other against the 14.5 MiB the packer holds, every gathered tensor and most buckets at addresses
inside ``[heap]`` although ``mallopt`` had lowered the threshold; with ``MALLOC_ENV`` none there, and
13.9-14.7 MiB. (A trainer that never trims finds those pages resident already: reusing them costs it
nothing.)
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BUCKET_MB = 8
DTYPE = "bfloat16"
ROOT = Path(__file__).resolve().parents[2]
MALLOC_ENV = (("MALLOC_MMAP_THRESHOLD_", str(1 << 16)),)
"""Every block of 64 KiB or more a mapping of its own, unmapped on free (glibc; set before the process
starts: a ``mallopt`` at this point leaves blocks in the heap's free chunks)."""
PASSES = 4


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def stream_check(trainer: Any, model_dir: Path, out: Path) -> dict[str, Any]:
    from hpcrl.sync.broadcast import WeightLayout, dtype_of, join_as_sender
    from hpcrl.trainer.process_group import free_port

    unset = [f"{k}={v}" for k, v in MALLOC_ENV if os.environ.get(k) != v]
    if unset:
        raise RuntimeError(
            f"the weight stream is measured only with {' '.join(unset)} set when the ranks start"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    metas = trainer.weight_metas()
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, (metas, f"127.0.0.1:{free_port()}" if metas else ""))
    bucket_numel = BUCKET_MB * 2**20 // dtype_of(DTYPE).itemsize
    layout = WeightLayout.of([m for m, _ in per_rank], DTYPE, bucket_numel)
    masters = tuple(a for m, a in per_rank if m)
    layout = WeightLayout(layout.sources, DTYPE, bucket_numel, "gloo", masters, engine_ranks=1)
    receiver = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "layout.json").write_text(json.dumps(layout.wire()))
        cmd = [
            sys.executable,
            __file__,
            "receive",
            str(out / "layout.json"),
            str(model_dir),
            str(out / "received.json"),
        ]
        receiver = subprocess.Popen(cmd, cwd=ROOT)
    sender = join_as_sender(layout, rank, "cpu") if metas else None
    mine: list[dict[str, Any]] = []
    libc = ctypes.CDLL("libc.so.6")
    for _ in range(PASSES):  # the first warms up (gloo's buffers, first-touch pages); the rest are measured
        gc.collect()
        libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status("VmRSS")
        packer = sender.packer() if sender else None
        trainer.stream_weights(packer, dtype_of(DTYPE))
        stats = packer.finish() if packer else None
        mine.append({"extra": _status("VmHWM") - before, "counted": stats.peak_numel * 2 if stats else 0})
    measured = [m["extra"] for m in mine[1:]]  # the warm-up pass is not measured
    figure = {"extra": max(measured), "streams": measured, "counted": max(m["counted"] for m in mine[1:])}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, {"sends": bool(metas), **figure, "buckets": stats.buckets if stats else 0})
    result: dict[str, Any] = {"ranks": every, "bucket_bytes": BUCKET_MB * 2**20}
    if receiver is not None:
        assert receiver.wait(timeout=300) == 0, "the receiver failed"
        result["received"] = json.loads((out / "received.json").read_text())
    return result


def receive(layout_path: Path, model_dir: Path, out: Path) -> None:
    """The engine worker's end: join every sender's group, receive every stream, check the last."""
    from safetensors import safe_open

    from hpcrl.sync.broadcast import WeightLayout, join_as_receiver

    layout = WeightLayout.from_wire(json.loads(layout_path.read_text()))
    receiver = join_as_receiver(layout, 1, "cpu", "127.0.0.1")
    for _ in range(PASSES):
        got = {name: t.clone() for name, t in receiver.receive()}
    files = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            files |= {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
    differ = [n for n, t in got.items() if n in files and not torch.equal(t, files[n].to(t.dtype))]
    out.write_text(
        json.dumps(
            {
                "names": sorted(got),
                "checkpoint": sorted(files),
                "differ": differ,
                "buckets": receiver.buckets,
                "bytes": sum(t.numel() * t.element_size() for t in got.values()),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "receive":
        receive(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
