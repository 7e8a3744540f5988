"""Summarise a ``py-spy record --format raw --subprocesses [--threads]`` profile into a short text:
per process (and thread), the samples spent in the steady state, and the functions with the most
self and inclusive samples there. Raw profiles of a vLLM run are hundreds of MB; this is what comes
back from the GPU machine.

    python bench/pyspy_summary.py prof.raw [--match REGEX] [--top 30] > summary.txt

A stack counts only if one of its frames matches ``--match`` (default: vLLM's engine-core busy loop,
the front-end's step and output handling, the model runner), which leaves out start-up and compiling.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

STEADY = (
    r"run_busy_loop|step_with_batch_queue|_run_engine|process_outputs|process_outputs_socket|"
    r"execute_model|sample_tokens|generate_stream|worker_busy_loop|LLMEngine.step|\bstep \("
)


def short(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py:123)``; process frames -> ``pid cmd``."""
    if frame.startswith("process "):
        pid, _, cmd = frame[len("process ") :].partition(":")
        cmd = cmd.strip('"')[:60]
        return f"{pid} {cmd}"
    m = re.match(r"(.*) \((.*?)([^/]*:\d+)\)$", frame)
    return f"{m.group(1)} ({m.group(3)})" if m else frame


def merged(parts: list[str]) -> list[str]:
    """Frames of a raw stack split on ';': a process's command line may hold ';' itself."""
    frames: list[str] = []
    for part in parts:
        code = part.startswith(("process ", "thread ")) or re.search(r"\(.*:\d+\)$", part)
        if frames and frames[-1].startswith("process ") and not code:
            frames[-1] += ";" + part
        else:
            frames.append(part)
    return frames


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("raw")
    p.add_argument("--match", default=STEADY)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    steady = re.compile(args.match)
    total: Counter[str] = Counter()
    self_t: dict[str, Counter[str]] = defaultdict(Counter)
    incl: dict[str, Counter[str]] = defaultdict(Counter)
    everything: Counter[str] = Counter()
    with open(args.raw, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            frames = merged(stack.split(";"))
            procs = [i for i, fr in enumerate(frames) if fr.startswith("process ")]
            start = procs[-1] + 1 if procs else 0
            key = short(frames[procs[-1]]) if procs else "?"
            while start < len(frames) and frames[start].startswith("thread "):
                key += " / " + frames[start][len("thread ") :][:40]
                start += 1
            code = frames[start:]
            everything[key] += int(count)
            if not code or not any(steady.search(fr) for fr in code):
                continue
            n = int(count)
            total[key] += n
            self_t[key][short(code[-1])] += n
            for fr in set(code):
                incl[key][short(fr)] += n
    print("all samples per process/thread:", dict(everything.most_common(12)))
    for key, n in total.most_common(8):
        print(f"\n=== {key}: {n} steady samples")
        print("  -- self --")
        for fn, c in self_t[key].most_common(args.top):
            print(f"  {100 * c / n:5.1f}%  {fn}")
        print("  -- inclusive --")
        for fn, c in incl[key].most_common(args.top):
            print(f"  {100 * c / n:5.1f}%  {fn}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
