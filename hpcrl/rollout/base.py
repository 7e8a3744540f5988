"""The rollout interface every backend implements: generate completions, take new weights."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hpcrl.rollout.config import RolloutConfig


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    """Log-probability of each generated token under the engine's weights (for IS correction)."""
    text: str
    truncated: bool
    """True when generation hit max_new_tokens instead of ending with EOS."""
    versions: tuple[int, int] = (0, 0)
    """The first and last policy version whose weights generated its tokens (optimizer steps behind
    them): stamped by the loop, equal unless weights changed while it was generated."""
    routes: Any = None
    """The experts the engine's MoE routers chose (``trainer.router_replay``): an int16 array
    [prompt + generated - 1, layers, k], one row per position a forward ran (the last generated token
    never ran through one); None when routes were not asked for, or the engine found none
    (``routes_missing``)."""
    routes_missing: bool = False
    """Routes were asked for and the engine recorded none for this completion: its tokens route
    freely in the trainer, counted in ``rollout/routes_missing`` (never silently)."""
    drafts: tuple[int, int] | None = None
    """(drafted, accepted) tokens of speculative decoding (``rollout.speculative``); None without it."""
    mask: list[int] | None = None
    """A multi-turn episode's (``envs/episodes.py``): 1 on each token the model generated, 0 on an
    environment's (trained on as context, never as a target); None: every token is the model's."""
    verdict: tuple[str, float] | None = None
    """An environment's grade of the episode (outcome, reward), which the reward pool takes as it is;
    None: the data set's verifier grades the text."""
    env_seconds: float = 0.0
    """A multi-turn episode's share of its batch's wall time in environment resets and steps (each
    round's time split over the episodes that stepped in it, so a batch's shares add up to its time)."""


def spec_acceptance(completions: list[Completion]) -> dict[str, float]:
    """``rollout/spec_acceptance``: the share of drafted tokens the model accepted, over completions
    generated with speculative decoding (none: no metric)."""
    counted = [c.drafts for c in completions if c.drafts is not None]
    drafted = sum(d for d, _ in counted)
    if not drafted:
        return {}
    return {"rollout/spec_acceptance": sum(a for _, a in counted) / drafted}


def routes_missing(completions: list[Completion]) -> dict[str, float]:
    """``rollout/routes_missing``: completions generated with routes recorded (``trainer.router_replay``)
    that came back without them; no metric when no routes were asked for."""
    if not any(c.routes is not None or c.routes_missing for c in completions):
        return {}
    return {"rollout/routes_missing": float(sum(c.routes_missing for c in completions))}


def environment_time(completions: list[Completion]) -> dict[str, float]:
    """``time/environment``: the seconds the batch's episodes spent in environment resets and steps
    (``envs/episodes.py``); single-turn completions (no episodes): no metric."""
    if not any(c.mask is not None for c in completions):
        return {}
    return {"time/environment": sum(c.env_seconds for c in completions)}


def completion_metrics(completions: list[Completion]) -> dict[str, float]:
    """What a batch's completions carry besides tokens: ``rollout/spec_acceptance``,
    ``rollout/routes_missing``, ``time/environment``."""
    return spec_acceptance(completions) | routes_missing(completions) | environment_time(completions)


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images, as the engines take it: the chat template's token ids, with the model's
    image placeholder where each image goes (the engine expands it into the image's tokens, as the
    model's processor does: ``run/vision.py``), and the images (PIL)."""

    token_ids: list[int]
    images: list[Any]


Prompt = list[int] | ImagePrompt
"""What an engine generates from: token ids, or token ids and images."""


@dataclass(frozen=True)
class SamplingSettings:
    """One call's sampling, as every engine applies it (``rollout/hf_engine.py``'s ``restrict`` mirrors
    vLLM's order): repetition penalty on the logits, then temperature (0: greedy), then ``min_p``, then
    ``top_k``, then ``top_p`` over what top-k left."""

    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    top_k: int = 0
    """Sample among the k most likely tokens (0: all)."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` x the most likely one's probability (0: none)."""
    repetition_penalty: float = 1.0
    """Tokens already in the prompt or the completion: positive logits divided by it, negative ones
    multiplied (1: off)."""

    @classmethod
    def of(cls, rollout: RolloutConfig, n: int, seed: int) -> SamplingSettings:
        """The training rollouts' settings: ``rollout.*``'s controls, ``n`` samples per prompt."""
        r = rollout
        return cls(n, r.temperature, r.top_p, r.max_new_tokens, seed, r.top_k, r.min_p, r.repetition_penalty)


class RolloutEngine(Protocol):
    """What the rollout actors (``run/actors.py``) and ``hpcrl eval`` call on an engine in their
    process: ``VLLMEngine`` and ``HFEngine`` implement it, and ``build_engine`` returns one. What an
    engine can do beyond it (sleep mode, in-flight updates, IPC refits) its spec declares
    (``rollout/backends.py``); an engine without a capability keeps the method and returns at once."""

    gate: WeightGate
    """Where a refit may land under a running generation, and the policy version stamped on completions."""
    ranks: int
    """How many ranks of a weight broadcast group the engine's workers take."""

    @property
    def weight_dtype(self) -> str:
        """The dtype the engine holds weights in: senders cast to it."""
        ...

    def generate(self, prompts: list[Prompt], settings: SamplingSettings) -> list[list[Completion]]:
        """``n`` completions per prompt (token ids, or an ``ImagePrompt``), in prompt order."""
        ...

    def generate_stream(
        self, prompts: list[Prompt], settings: SamplingSettings
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """``generate``, handing over (prompt index, its completions) as groups finish (an engine
        that cannot stream hands over the whole batch once)."""
        ...

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Replace the engine's weights in place (checkpoint names); caches from old weights are dropped."""
        ...

    def prefix_cache_counts(self) -> tuple[int, int] | None:
        """(prompt tokens looked up, found) in the engine's prefix cache since it started; None: it keeps
        no such cache (multi-turn episodes log the hit rate, ``envs/episodes.py``)."""
        ...

    # Colocated GPUs: the engine sleeps while the trainer trains. The loop calls sleep() after
    # generating and, before the next generation, wake_up(["weights"]), the refit, wake_up(["kv_cache"]).
    # Engines without a sleep mode (and engines with it off) return at once.
    def sleep(self) -> None:
        """Release the KV cache and the weights (the next refit sends every weight)."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of ``tags`` ("weights", "kv_cache"; None: both)."""
        ...

    # Colocated GPUs: buckets arrive as CUDA IPC handles from the trainer process on the same GPU.
    def load_ipc(self, args: Any, entries: list[tuple[str, tuple[int, ...], int]]) -> None:
        """Load one bucket: ``args`` = ``torch.multiprocessing.reductions.reduce_tensor(buf)[1]`` of a 1-D
        CUDA buffer in ``weight_dtype`` (a list, one per engine rank, when the engine has several),
        ``entries`` = (checkpoint name, shape, element offset) of each tensor in it. Returns once the
        buffer may be reused."""
        ...

    def finish_refit(self) -> None:
        """After the last bucket: drop caches computed with the old weights."""
        ...

    # The broadcast path (hpcrl.sync.broadcast): join the trainers' weight groups once, then take part
    # in one broadcast per step.
    def join_weight_group(self, wire: dict[str, Any], rank_base: int, local_ip: str) -> None:
        """Join every sending trainer rank's group (``WeightLayout.to_wire``) as ranks ``rank_base`` ..
        ``rank_base + ranks - 1``, reachable at ``local_ip``."""
        ...

    def receive_weights(self) -> dict[str, float]:
        """One broadcast's seconds on the wire (``receive_s``) and in the load (``load_s``)."""
        ...


class WeightGate:
    """Where weights may change under a running generation (``rollout.inflight_update``): between
    engine steps. ``pause`` waits for the step in progress and holds the next; the refit loads; then
    ``resume(version)`` lets the requests go on under the new weights, keeping the KV they computed
    under the old ones (Magistral-style, as NeMo RL's default; no recompute). The gate also keeps the
    policy version of the weights in place, which the engine stamps on every completion."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.paused = False
        self.stepping = False
        self.version = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        with self.cond:
            self.cond.wait_for(lambda: not self.paused)
            self.stepping = True
        try:
            yield
        finally:
            with self.cond:
                self.stepping = False
                self.cond.notify_all()

    def pause(self) -> None:
        with self.cond:
            self.paused = True
            self.cond.wait_for(lambda: not self.stepping)

    def resume(self, version: int) -> None:
        with self.cond:
            self.version = version
            self.paused = False
            self.cond.notify_all()
