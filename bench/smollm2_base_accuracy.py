"""Greedy validation accuracy of the base SmolLM2-135M-Instruct on the smollm2 recipe's reasoning-gym
validation problems, with and without the recipe's few-shot turns (issue 33: the task is chosen so that
the base model starts between 5% and 50%).

    HF_HOME=... python bench/smollm2_base_accuracy.py [--n 64] [--variants recipe no_fewshot answers_only]
                                                      [hpcrl overrides ...]

The model is the snapshot ``hpcrl fetch`` converted (float32, transformers, CPU); the problems are the
recipe's validation problems (``hpcrl/data/procedural.py``, the run's seed), the first ``--n``; the
prompts are what the loop's encoder makes (``run/driver.py:make_encoder``: the chat template, the few-shot
turns); the score is the ``reasoning_gym`` verifier's (a problem counts only at a full score). Variants:
``recipe`` as shipped; ``no_fewshot`` without the earlier turns; ``answers_only`` the same two problems
answered with the tags alone (no worked line). One JSON line per variant, a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="+experiment=grpo-smollm2-1n1g-chainsum")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--variants", nargs="*", default=["recipe", "no_fewshot", "answers_only"])
    p.add_argument("--show", type=int, default=3, help="completions printed per variant")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    import re

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.config.compose import compose_config
    from hpcrl.data.loader import load_examples
    from hpcrl.hub.cache import hub_dir
    from hpcrl.hub.resolve import model_snapshot
    from hpcrl.rewards.verifiers import Outcome, get_verifier
    from hpcrl.run.driver import make_encoder

    torch.set_num_threads(2)
    cfg = compose_config([args.recipe, *args.overrides])
    snap = model_snapshot(hub_dir(cfg.cluster), cfg.model.hf_id, cfg.model.revision)
    model = AutoModelForCausalLM.from_pretrained(snap, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(snap)
    _train, val = load_examples(cfg.data, cfg.run.seed, hub_dir(cfg.cluster))
    val = val[: args.n]
    verify = get_verifier(cfg.data.verifier)
    shots = dict(cfg.data.fewshot)
    variants = {
        "recipe": shots,
        "no_fewshot": {},
        "answers_only": {q: re.sub(r"^.*\n", "", a) for q, a in shots.items()},  # "<answer>17</answer>"
    }
    rows = []
    for name in args.variants:
        cfg.data.fewshot = variants[name]
        encode, pad = make_encoder(snap, cfg.data)
        started = time.perf_counter()
        prompts = [encode(e.prompt) for e in val]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(q)) + q for q in prompts])
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=cfg.rollout.max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
        verdicts = [verify(t, e.answer) for t, e in zip(texts, val, strict=True)]
        row = {
            "variant": name,
            "n": len(val),
            "accuracy": sum(v.outcome is Outcome.correct for v in verdicts) / len(val),
            "tagged": sum("<answer>" in t and "</answer>" in t for t in texts) / len(val),
            "prompt_tokens": width,
            "s": round(time.perf_counter() - started, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        for e, t in list(zip(val, texts, strict=True))[: args.show]:
            print(f"  {e.prompt.splitlines()[0][-24:]!r} -> {t[:80]!r}", flush=True)
    print(f"{'variant':14s} {'n':>4s} {'accuracy':>9s} {'tagged':>7s} {'prompt':>7s}")
    for r in rows:
        print(
            f"{r['variant']:14s} {r['n']:4d} {r['accuracy']:9.3f} {r['tagged']:7.3f} {r['prompt_tokens']:7d}"
        )


if __name__ == "__main__":
    main()
