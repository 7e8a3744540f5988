"""Which side of the Qwen3-MoE GPU parity gap is off: Hugging Face's expert kernels on one GPU (fp32,
``experts_implementation`` eager loop vs the default grouped_mm) beside the megatron backend's and
the fsdp backend's (compiled and eager) log-probs on the same random checkpoint and batch
(``gemma_gpu_parity.py``'s).

    HPCRL_BENCH_MODEL_OVERRIDES="model.num_layers=4" python bench/moe_experts_reference.py

Prints max |log-prob| differences between them and, per layer, the smallest router margin (k-th minus
(k+1)-th logit over the tokens: where it is near float error, two exact implementations may route a
token differently); the JSON goes to $OUT. ``HPCRL_BENCH_DEVICE=cpu`` runs it here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemma_gpu_parity import batch
from gpu_bench import DEVICE, MODEL_OVERRIDES, make_model_dir

from hpcrl.config.compose import compose_config


def hf_logprobs(model_dir: Path, experts: str, b) -> tuple[torch.Tensor, list[float]]:
    """Log-probs of the batch's tokens, and per layer the smallest gap between a token's k-th and
    (k+1)-th router logit: a gap near float error means another implementation may route it elsewhere."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation=experts
    )
    model = model.to(DEVICE).eval()
    margins: list[float] = []

    def margin(module, _args, out) -> None:
        if module.top_k >= module.num_experts:  # every expert is picked: nothing to flip
            return
        top = out[0].float().topk(module.top_k + 1, dim=-1).values
        margins.append(float((top[:, -2] - top[:, -1]).min()))

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(margin)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids.to(DEVICE), use_cache=False).logits[:, :-1].float()
    out = logits.log_softmax(-1).gather(-1, b.input_ids[:, 1:, None].to(DEVICE)).squeeze(-1).cpu()
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out, margins


def main() -> int:
    model = "qwen3_30b_a3b"
    model_dir = make_model_dir(compose_config([f"model={model}", *MODEL_OVERRIDES]))
    n, seq = 2, 1024
    b = batch(n, seq)
    mask = b.loss_mask.bool()  # [n, T-1]: the completion tokens, as the trainer's log-probs are laid out
    logp, margins = {}, {}
    for e in ("eager", "grouped_mm"):
        logp[e], margins[e] = hf_logprobs(model_dir, e, b)
    here = Path(__file__).with_name("gemma_gpu_parity.py")
    for name, backend, variant in (("megatron", "megatron", ""), ("fsdp", "fsdp", ""),
                                   ("fsdp eager", "fsdp", "trainer.compile=false")):  # fmt: skip
        out = model_dir.parent / f"{name.replace(' ', '_')}.pt"
        subprocess.run([sys.executable, str(here), "--model", model, "--batch", str(n), "--seq", str(seq),
                        "--variant", variant, "--one", backend, str(model_dir), str(out)], check=True)  # fmt: skip
        logp[name] = torch.load(out)["logp"]
    w = logp["megatron"].shape[1]  # the trainer trims the batch's padding columns
    logp, mask = {k: v[:, :w] for k, v in logp.items()}, mask[:, :w]
    # (the fsdp backend's rows: compiled decoder layers, its default on GPUs, and eager)
    pairs = (("eager", "grouped_mm"), ("megatron", "eager"), ("megatron", "grouped_mm"), ("fsdp", "eager"),
             ("fsdp eager", "eager"), ("fsdp", "fsdp eager"))  # fmt: skip
    result = {"model": model, "overrides": MODEL_OVERRIDES, "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
              "max_logp_diff": {f"{a} vs {c}": float((logp[a] - logp[c])[mask].abs().max()) for a, c in pairs},
              "min_router_margin_per_layer (HF eager)": margins["eager"]}  # fmt: skip
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "moe_experts_reference.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
