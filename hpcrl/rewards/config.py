"""Reward schema (``rewards.*``): how the verifier processes run. Which verifier runs is the data set's
choice (``data.verifier``): its answers need that checker; the names it may take are here
(``VERIFIER_NAMES``), so that the config layer checks the name without importing the verifiers."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from hpcrl.core.checks import in_range, positive
from hpcrl.errors import ConfigError

CPUS_PER_PROCESS = 8
"""One reward process per this many CPUs of the driver's node: the trainer ranks, the engines and Ray
share the node, and scoring a step's samples is a small part of the step."""
MIN_PROCESSES = 2
"""At least two, so that a sample that hangs until its time limit does not stop the others."""
MAX_PROCESSES = 16
"""Each process imports SymPy and math-verify (~0.2 GB, seconds of start-up); more than 16 only add that."""
BUILT_IN_VERIFIERS = ("math", "math_structural", "exact", "reasoning_gym")
"""The verifiers ``rewards/verifiers.py`` registers (tests/data/test_rewards.py holds the two equal)."""
PERCENT_VERIFIERS = ("math", "math_structural")
"""The verifiers whose answers ``data.percent`` rewrites (``verifiers.read_percent``)."""
PERCENT_READINGS = ("number", "fraction")
"""``data.percent``'s values."""
VERIFIER_NAMES: set[str] = set(BUILT_IN_VERIFIERS)
"""Every ``data.verifier`` this process knows: the built-in ones and each name a plugin module
(``HPCRL_PLUGINS``, ``load_plugins``) registered with ``rewards.verifiers.register``."""


def load_plugins(modules: str) -> None:
    """Import comma-separated modules whose ``@register`` calls add verifiers (``HPCRL_PLUGINS``)."""
    import importlib

    for module in filter(None, (m.strip() for m in modules.split(","))):
        importlib.import_module(module)


def available_cpus() -> int:
    """CPUs this process may run on: its affinity, and under Slurm no more than the job holds on this
    node (``SLURM_CPUS_ON_NODE``: without task/affinity or cgroups the affinity is the whole node)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        cpus = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_ON_NODE", "")
    return min(cpus, int(slurm)) if slurm.isdigit() and int(slurm) > 0 else cpus


def default_processes(cpus: int) -> int:
    """Reward processes for a node with ``cpus`` CPUs: one per CPUS_PER_PROCESS, within
    [MIN_PROCESSES, MAX_PROCESSES] (2 on a laptop or the test cluster, 16 on a 192-CPU GPU node)."""
    return max(MIN_PROCESSES, min(MAX_PROCESSES, cpus // CPUS_PER_PROCESS))


JUDGE_PARSERS = ("number", "yes_no")
"""How a judge's reply becomes a reward (``rewards/judge.py``'s ``parse_score``)."""
JUDGE_FIELDS = ("prompt", "answer", "reference")
"""What ``rewards.judge.template`` may name: the problem, the model's completion, the data set's answer."""


@dataclass
class JudgeConfig:
    """An LLM judge (``rewards.judge``): a frozen model, served by vLLM engines of its own (never refit),
    scores every sample of a step in one batch; its reward joins the verifier's (``weight``)."""

    model: str = "tiny"
    """The judge's model: a ``conf/model`` entry (its architecture sizes the judge's engines in the plan)."""
    template: str = "{prompt}{answer}={reference}?"
    """The judge's prompt, ``str.format`` with ``{prompt}``, ``{answer}`` (the completion) and
    ``{reference}`` (the data set's answer); sent as plain text (no chat template)."""
    parse: str = "number"
    """``number``: the first number of the reply, divided by ``scale`` (clipped to [0, 1]); ``yes_no``:
    a reply starting with yes is 1, with no 0. Anything else is unparsable: reward 0, counted in
    ``judge/parse_failures``."""
    scale: float = 10.0
    """With ``parse=number``: the judge's top score (a reply of ``scale`` is reward 1)."""
    weight: float = 1.0
    """The judge's share of the reward: ``(1 - weight) * verifier + weight * judge`` (1: the judge's alone)."""
    max_new_tokens: int = 8
    """The judge's reply length (greedy)."""
    engines: int = 1
    """Judge engines; the step's samples are spread over them."""
    tp: int = 1
    """GPUs of one judge engine (tensor parallel)."""
    nodes: int = 0
    """Nodes of the judges' own (their engines placed there); 0: the judges share the run's machine,
    which only a CPU run can (on GPUs the rollout engines and trainer ranks hold every GPU)."""
    gpu_memory_utilization: float = 0.8
    """Share of each judge GPU one engine takes (weights + KV cache)."""
    max_num_seqs: int = 256
    """Most samples one judge engine scores at once."""
    max_model_len: int | None = None
    """Judge prompt + reply, in tokens (longer prompts lose their start); None: the run's prompt and
    completion (``max_seq_len``), 512 more for the template and the reference, and the reply, within the
    judge model's ``max_position_embeddings``."""

    def check(self) -> None:
        if self.parse not in JUDGE_PARSERS:
            raise ConfigError(f"rewards.judge.parse={self.parse!r} must be one of {', '.join(JUDGE_PARSERS)}")
        try:
            self.template.format(**dict.fromkeys(JUDGE_FIELDS, ""))
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"rewards.judge.template names {exc} (or is not a format string): it may use only "
                + ", ".join("{" + f + "}" for f in JUDGE_FIELDS)
            ) from None
        if not 0.0 <= self.weight <= 1.0:
            raise ConfigError(f"rewards.judge.weight={self.weight} must be in [0, 1] (the judge's share)")
        for key in ("scale", "max_new_tokens", "engines", "tp", "max_num_seqs"):
            positive(f"rewards.judge.{key}", getattr(self, key))
        if self.nodes < 0:
            raise ConfigError(f"rewards.judge.nodes={self.nodes} must be >= 0 (0: on the run's machine)")
        if self.max_model_len is not None:
            positive("rewards.judge.max_model_len", self.max_model_len)
        in_range("rewards.judge.gpu_memory_utilization", self.gpu_memory_utilization, 0.05, 0.98)


@dataclass
class RewardsConfig:
    processes: int | None = None
    """Verifier processes in the reward pool (``hpcrl/rewards/pool.py``) on the driver's node. None:
    derived when the run starts from the CPUs the driver may use (``default_processes``)."""
    timeout_s: float = 5.0
    """Per-sample time limit (seconds): a verifier still busy after this long is killed, its process
    replaced and the sample scored as a timeout (counted in ``train/verifier_timeouts``). Answers
    known to keep SymPy busy never get here (``rewards/screen.py``); legitimate ones take
    milliseconds, up to ~2 s for deeply nested ones on a loaded 2-core machine, hence the margin."""
    memory_mb: int | None = 4096
    """Address space a reward process may use (MiB, ``RLIMIT_AS``): a verifier allocating past it
    gets a MemoryError, which scores that sample as an error, where it would otherwise take the
    node's memory from the trainer and engines. A math-verify process uses ~70 MB of address space,
    ~200 MB with reasoning-gym. None: no limit."""
    start_timeout_s: float = 300.0
    """A reward process that has not started (imported its verifier and built its parsers) by then is
    broken, not slow: the run stops with an error that names the verifier."""
    judge: JudgeConfig | None = None
    """An LLM judge's reward (``rewards/judge.py``); None: the verifier's alone."""

    def process_count(self) -> int:
        """``processes``, or the default for this node's CPUs."""
        return self.processes if self.processes is not None else default_processes(available_cpus())

    def check(self) -> None:
        if self.judge is not None:
            self.judge.check()
        if self.processes is not None and self.processes < 1:
            raise ConfigError(
                f"rewards.processes={self.processes} must be >= 1 (or null: derived from the node's CPUs)"
            )
        if self.memory_mb is not None and self.memory_mb < 256:
            raise ConfigError(
                f"rewards.memory_mb={self.memory_mb} is too little for Python and SymPy: at least 256 "
                "(or null: no limit)"
            )
        for key, seconds in (
            ("rewards.timeout_s", self.timeout_s),
            ("rewards.start_timeout_s", self.start_timeout_s),
        ):
            positive(key, seconds)
            if not math.isfinite(seconds):  # inf would turn the hard limit off; NaN passes every comparison
                raise ConfigError(f"{key}={seconds} must be a finite number of seconds")
