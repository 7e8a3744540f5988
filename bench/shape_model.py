"""A catalog model's shape with random weights, as a model directory ``hpcrl submit`` can take
(``model.hf_id=DIR``): bf16 safetensors built on the GPU (billions of parameters initialise there in
seconds), plus a real tokenizer's files (``--tokenizer``: a chat template for ``data.fewshot``).

    python bench/shape_model.py --model qwen2_1p5b --tokenizer TOKDIR --out DIR [--layers 16]

The tokenizer may be smaller than the model's vocabulary (SmolLM2's 49k under Qwen2's 152k): the
engine samples ids past its end, which decoding drops; the figures here are speeds, not answers.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    from gpu_bench import make_model_dir

    from hpcrl.config.compose import compose_config

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--layers", type=int, default=0, help="0: the catalog's")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    overrides = [f"model={args.model}"] + ([f"model.num_layers={args.layers}"] if args.layers else [])
    cfg = compose_config(overrides)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        built = make_model_dir(cfg)
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.move(str(built), args.out)
    for f in args.out.iterdir():  # the placeholder tokenizer make_model_dir writes goes
        if not (
            f.name.endswith((".safetensors", ".safetensors.index.json")) or f.name.endswith("config.json")
        ):
            f.unlink()
    for f in args.tokenizer.iterdir():
        shutil.copy(f, args.out / f.name)
    print(f"{args.out}: {cfg.model.name} x {cfg.model.num_layers} layers, random bf16", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
