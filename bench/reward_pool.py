"""What 5% pathological answers add to scoring a step's completions (issue 20 item 4).

1,024 completions like the tiny model's on the synthetic task ('a+b=' / 'a-b=', integer answers: a
line of working, then a boxed or bare number, right or wrong, sometimes none) are scored by the
reward pool with real math-verify, once clean and once with every 20th replaced by a pathological
answer: power towers (``\\boxed{9^{9^{9^{9}}}}``), huge factorials (``\\boxed{100000!}``), unbalanced
braces (``\\boxed{\\frac{1}{2}``), sums, products, integrals and limits SymPy would evaluate, a surd
raised to 100000, 30 nested parentheses, 20 nested fractions (issue 37 item 6). Both with the ``math``
verifier (the screen in front of SymPy) and with math-verify alone (the verifier as it was: each tower runs into the time limit and costs a
process restart). Prints each time, the pathological - clean difference (goal: <= 2 s on 2 processes)
and the outcome counts. Times start once the processes are up.

    PYTHONPATH=. python bench/reward_pool.py [--processes 2] [--timeout-s 5]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.reward_pool`, for the processes

from hpcrl.data.synthetic import synthetic_split
from hpcrl.rewards.config import RewardsConfig
from hpcrl.rewards.pool import RewardPool, Task
from hpcrl.rewards.verifiers import Verdict, register, sympy_verify

PLUGIN = "bench.reward_pool"


@register("bench_unscreened")
def unscreened(completion: str, answer: str, prompt: str = "") -> Verdict:
    """The ``math`` verifier before the screen: math-verify alone."""
    return sympy_verify(completion, answer)


PATHOLOGICAL = [
    "\\boxed{9^{9^{9^{9}}}}",
    "so the result is \\boxed{100000!}",
    "\\boxed{\\frac{1}{2}",
    "\\boxed{8^{8^{8}}}",
    "\\boxed{250000!}",
    "we get \\boxed{\\sqrt{2",
    "\\boxed{7^{7^{7^{7}}}}",
    "\\boxed{(10^{5})!}",
    "\\boxed{\\frac{3}{4",
    # issue 37 item 6: big operators SymPy evaluates, symbolic towers, deep nests, boxed or not
    "\\boxed{\\sum_{k=1}^{100000} \\frac{1}{k}}",
    "\\boxed{\\int_0^1 x^{50} e^{x} \\sin(x) \\, dx}",
    "so it is $\\sum_{a=1}^{10^{6}} \\sum_{b=1}^{a} \\frac{a}{b}$.",
    "\\boxed{(1+\\sqrt{2})^{100000}}",
    "\\boxed{" + "(" * 30 + "1" + ")" * 30 + "}",
    "we get \\[" + "\\frac{1}{" * 20 + "2" + "}" * 20 + "\\]",
    "\\boxed{\\prod_{k=1}^{10^{9}} \\left(1+\\frac{1}{k^{2}}\\right)}",
    "\\boxed{\\lim_{n \\to \\infty} \\left(1+\\frac{1}{n}\\right)^{n^{2}}}",
]


def completions(n: int, seed: int = 0) -> list[Task]:
    """``n`` completions of synthetic problems: right, off by a little, bare, or without a number."""
    rng = random.Random(seed)
    problems, _ = synthetic_split(n, 0, seed=seed)
    tasks = []
    for i, p in enumerate(problems):
        answer = int(p.answer) + rng.choice([0, 0, 0, 1, -1, 10])
        work = f"We compute {p.prompt[:-1]} step by step, carrying where needed. "
        kind = rng.random()
        if kind < 0.7:
            text = f"{work}The answer is \\boxed{{{answer}}}."
        elif kind < 0.9:
            text = f"{work}{p.prompt}{answer}"
        else:
            text = f"{work}I am not sure."
        tasks.append(Task(i, text, p.answer, p.prompt))
    return tasks


def with_pathological(tasks: list[Task], every: int = 20) -> list[Task]:
    return [
        Task(t.index, PATHOLOGICAL[(t.index // every) % len(PATHOLOGICAL)], t.answer, t.prompt)
        if t.index % every == every - 1
        else t
        for t in tasks
    ]


def timed(pool: RewardPool, tasks: list[Task]) -> tuple[float, Counter[str], int]:
    restarts = pool.restarts
    start = time.perf_counter()
    out = pool.score(tasks)
    return time.perf_counter() - start, Counter(o.value for o in out), pool.restarts - restarts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=RewardsConfig.timeout_s)
    parser.add_argument("--n", type=int, default=1024)
    args = parser.parse_args()
    os.environ["HPCRL_PLUGINS"] = ",".join(filter(None, [os.environ.get("HPCRL_PLUGINS", ""), PLUGIN]))
    clean = completions(args.n)
    mixed = with_pathological(clean)
    settings = RewardsConfig(processes=args.processes, timeout_s=args.timeout_s)
    print(
        f"{args.n} completions, {sum(a != b for a, b in zip(clean, mixed, strict=True))} pathological; "
        f"{args.processes} processes, {args.timeout_s:g} s per-sample limit"
    )
    rows = {}
    for name, verifier in (("math (screen)", "math"), ("math-verify alone (before)", "bench_unscreened")):
        with RewardPool(verifier, settings) as pool:
            pool.score(clean[:8])  # the processes are up and warm
            for label, tasks in (("clean", clean), ("5% pathological", mixed)):
                seconds, counts, restarts = timed(pool, tasks)
                rows[name, label] = seconds
                print(f"  {name:28s} {label:16s} {seconds:7.2f} s  restarts {restarts:3d}  {dict(counts)}")
    for name in ("math (screen)", "math-verify alone (before)"):
        extra = rows[name, "5% pathological"] - rows[name, "clean"]
        print(f"{name}: pathological adds {extra:+.2f} s (goal <= 2 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
