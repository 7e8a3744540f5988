"""One rank (under torchrun, gloo on CPU) of the sharded-loading checks of tests/trainer/test_hf_load.py.

``parity OUT DIR...``: for each checkpoint directory, an ``FSDPTrainer`` (reference policy included)
against ``from_pretrained``: rank 0 writes OUT, a JSON list of what differs (empty: nothing does).
``memory OUT DIR``: this rank's resident-memory growth while ``FSDPTrainer`` is built (peak RSS from
/proc/self/status, reset first through /proc/self/clear_refs), and its shard's size; OUT.<rank>.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl.trainer.fsdp import FSDPTrainer
from tests.conftest import compose


def status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))  # type: ignore[union-attr]


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def trainer(model_dir: Path, *overrides: str) -> FSDPTrainer:
    cfg = compose("algo.kl_coef=0.1", *overrides)
    return FSDPTrainer(model_dir, cfg, rank=dist.get_rank(), world=dist.get_world_size())


def parity(model_dir: Path) -> list[str]:
    """What differs between the trainer's policy and reference and ``from_pretrained``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from hpcrl.trainer.forward import token_logprobs
    from hpcrl.trainer.logprob_head import install_logprob_head
    from tests.trainer.test_trainer import batch

    t = trainer(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    install_logprob_head(hf)
    want, bad = hf.state_dict(), []
    for role, model in (("policy", t.model), ("ref", t.ref)):
        got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        bad += [f"{role}: keys {sorted(set(got) ^ set(want))}"] * (set(got) != set(want))
        bad += [f"{role}: {k}" for k in want if k in got and not torch.equal(got[k], want[k])]
        buffers = dict(model.named_buffers())  # FSDP2 keeps buffers whole: compared directly
        bad += [f"{role} buffer: {k}" for k, b in hf.named_buffers() if not torch.equal(buffers[k], b)]
        if hf.config.get_text_config().tie_word_embeddings and model.lm_head.weight is not (
            model.get_input_embeddings().weight
        ):
            bad.append(f"{role}: lm_head no longer tied to the input embedding")
    b = batch()
    with torch.no_grad():
        expect = token_logprobs(hf.eval(), b)[0]
    for ref in (False, True):
        if not torch.equal(t.logprobs(b, reference=ref), expect):
            bad.append(
                f"logprobs (reference={ref}) differ by {(t.logprobs(b, reference=ref) - expect).abs().max()}"
            )
    return [f"{model_dir.name}: {m}" for m in bad]


def memory(model_dir: Path) -> dict[str, float]:
    """MiB: peak RSS growth while the trainer is built, and the shard it holds."""
    from hpcrl.trainer.hf_load import meta_model

    meta_model(model_dir)  # the model code imported first: its modules' memory is no part of loading
    base = status_kib("VmRSS")
    reset_peak()
    t = trainer(model_dir, "algo.kl_coef=0")
    peak = status_kib("VmHWM")
    shard = sum(p.to_local().numel() * p.element_size() for p in t.model.parameters())
    return {
        "growth": (peak - base) / 1024,
        "shard": shard / 2**20,
        "after": (status_kib("VmRSS") - base) / 1024,
    }


def main() -> None:
    mode, out, dirs = sys.argv[1], Path(sys.argv[2]), [Path(d) for d in sys.argv[3:]]
    dist.init_process_group("gloo")  # torchrun's environment; FSDPTrainer then finds it initialised
    if mode == "parity":
        bad = [m for d in dirs for m in parity(d)]
        if dist.get_rank() == 0:
            out.write_text(json.dumps(bad))
    else:
        Path(f"{out}.{dist.get_rank()}").write_text(json.dumps(memory(dirs[0])))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
