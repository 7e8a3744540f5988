"""Multi-turn episodes: model turn, environment turn, ... until the environment ends the episode or a
limit (``env.max_turns`` model turns, ``env.max_tokens`` tokens after the prompt) is reached.

``Episodes`` wraps the run's actors: the loop asks it for completions as it asks the engines
(``generate_stream``), and each completion it hands back is a whole episode: the token ids of every
turn after the prompt, a mask that is 1 on the model's tokens and 0 on the environment's (the trainer's
loss mask, ``TrainBatch.loss_mask``), the engine's log-probs on the model's tokens (0 under the mask),
and the environment's verdict, which the reward pool records without running a verifier.

Each model turn continues from the episode's exact token ids (prompt, earlier turns, observations),
never from re-tokenized text: the trained tokens are the sampled ones, their log-probs line up, and
the engine's prefix cache (``rollout.enable_prefix_caching``) keeps the episode's KV from turn to turn.
All live episodes take their turn in one engine call, then their environments step in parallel
(``envs/pool.py``); up to ``env.processes`` episodes run at once, the rest start as others end.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from hpcrl.envs.base import Step
from hpcrl.envs.config import EnvConfig
from hpcrl.envs.pool import EnvPool
from hpcrl.rollout.base import Completion, Prompt, SamplingSettings


class EpisodePrompt(list[int]):
    """A prompt's token ids that carry its problem (prompt text, reference answer) to the environment."""

    def __init__(self, ids: list[int], prompt: str, answer: str) -> None:
        super().__init__(ids)
        self.prompt, self.answer = prompt, answer


class EnvSession(Protocol):
    """An episode's environment: ``envs/pool.py``'s ``Session`` (beside the driver) or ``envs/remote.py``'s."""

    error: str

    def close(self) -> None: ...


class Pool(Protocol):
    """Where the episodes' environments run: ``EnvPool`` here, or ``RemotePool`` on nodes of their own."""

    def start(self, count: int) -> list[Any]: ...

    def reset(self, sessions: list[Any], problems: list[tuple[str, str]]) -> list[str | None]: ...

    def step(self, sessions: list[Any], turns: list[str]) -> list[Step | None]: ...


@dataclass
class Episode:
    prompt: list[int]
    session: EnvSession
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    turns: int = 0
    versions: tuple[int, int] | None = None
    truncated: bool = False
    done: bool = False
    verdict: tuple[str, float] = ("wrong", 0.0)
    env_seconds: float = 0.0
    """Its share of the environment's wall time (``Completion.env_seconds``)."""
    unscored: bool = False
    """A model turn came without the engine's log-probs (``rollout.logprob_fraction``): the episode
    then has none ([]: NaN in the batch, left out of the IS correction), never zeros posing as them."""

    def add_model(self, c: Completion) -> None:
        self.ids += c.token_ids
        self.mask += [1] * len(c.token_ids)
        self.logprobs += c.logprobs if c.logprobs else [0.0] * len(c.token_ids)
        self.unscored |= bool(c.token_ids) and not c.logprobs
        self.texts.append(c.text)
        self.turns += 1
        first, last = self.versions or c.versions
        self.versions = (min(first, c.versions[0]), max(last, c.versions[1]))

    def add_env(self, ids: list[int], text: str, budget: int) -> None:
        """An observation's tokens, cut where the episode's token budget ends (which ends it)."""
        room = budget - len(self.ids)
        if len(ids) >= room:
            ids, self.done, self.truncated = ids[: max(room, 0)], True, True
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.texts.append(text)

    def fail(self, why: str) -> None:
        self.done, self.verdict = True, ("error", 0.0)
        self.texts.append(f"[environment error: {why}]")

    def completion(self) -> Completion:
        return Completion(
            self.ids,
            [] if self.unscored else self.logprobs,
            "".join(self.texts),
            self.truncated,
            self.versions or (0, 0),
            mask=self.mask,
            verdict=self.verdict,
            env_seconds=self.env_seconds,
        )


def _ended(step: Step) -> tuple[str, float]:
    """The episode's grade so far; a reward outside [0, 1] (or NaN) or an unknown outcome is the
    environment's error, graded as one rather than stopping the step."""
    from hpcrl.rewards.verifiers import Outcome

    outcome = step.info.get("outcome") or ("correct" if step.reward >= 1.0 else "wrong")
    if outcome not in Outcome.__members__ or not 0.0 <= step.reward <= 1.0:
        return "error", 0.0
    return str(outcome), float(step.reward)


class Episodes:
    """The run's actors, with ``generate_stream`` playing multi-turn episodes (everything else is theirs)."""

    def __init__(self, actors: Any, cfg: EnvConfig, pool: Pool, observe: Callable[[str], list[int]]) -> None:
        self.actors, self.cfg, self.pool, self.observe = actors, cfg, pool, observe
        self.cache_seen = (0, 0)
        """The engines' prefix-cache counters when ``stats`` was last asked."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.actors, name)

    def stats(self) -> dict[str, float]:
        """``rollout/prefix_cache_hit_rate`` since last asked: the share of the prompt tokens of the
        episodes' engine calls that the engines found in their prefix cache (an episode's later turns
        continue its earlier ones, and a group's episodes share their prompt); none where the engines
        keep no counters."""
        counts = self._cache_counts()
        if counts is None:
            return {}
        (queries, hits), self.cache_seen = self.cache_seen, counts
        queries, hits = counts[0] - queries, counts[1] - hits
        return {"rollout/prefix_cache_hit_rate": hits / queries} if queries > 0 and hits >= 0 else {}

    def _cache_counts(self) -> tuple[int, int] | None:
        engines = getattr(self.actors, "engines", None)  # the run's engines (Fleet), else one engine here
        if engines is None:  # a RolloutEngine itself
            return self.actors.prefix_cache_counts()
        import ray

        try:
            got = [c for c in ray.get([e.prefix_cache_counts.remote() for e in engines]) if c is not None]
        except ray.exceptions.RayActorError:  # an engine lost (its counters with it): no figure this time
            return None
        return (sum(q for q, _ in got), sum(h for _, h in got)) if got else None

    def generate_stream(
        self, prompts: list[Prompt], settings: SamplingSettings
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """``settings.n`` episodes per prompt (each an ``EpisodePrompt``); a group is handed over once
        its episodes are all over."""
        n = settings.n
        queue = deque((i, j) for i in range(len(prompts)) for j in range(n))
        groups: dict[int, list[Completion | None]] = {i: [None] * n for i in range(len(prompts))}
        live: list[tuple[int, int, Episode]] = []
        round_ = 0
        try:
            while queue or live:
                take = [queue.popleft() for _ in range(min(len(queue), self.cfg.processes - len(live)))]
                live += self._begin(prompts, take)
                self._turn([e for _, _, e in live if not e.done], settings, round_)
                round_ += 1
                finished = [(i, j, e) for i, j, e in live if e.done]
                live = [x for x in live if not x[2].done]
                ready = []
                for i, j, e in finished:
                    e.session.close()
                    groups[i][j] = e.completion()
                    if all(c is not None for c in groups[i]):
                        ready.append((i, [c for c in groups.pop(i) if c is not None]))
                if ready:
                    yield ready
        finally:
            for _, _, e in live:
                e.session.close()

    def _begin(self, prompts: list[Prompt], take: list[tuple[int, int]]) -> list[tuple[int, int, Episode]]:
        if not take:
            return []
        started = time.perf_counter()
        sessions = self.pool.start(len(take))
        problems = []
        for i, _ in take:
            p = prompts[i]
            if not isinstance(p, EpisodePrompt):
                raise TypeError(
                    "multi-turn episodes need EpisodePrompt prompts (envs/episodes.py: tag_problems)"
                )
            problems.append((p.prompt, p.answer))
        first = self.pool.reset(sessions, problems)
        share = (time.perf_counter() - started) / len(take)
        out = []
        for (i, j), s, obs in zip(take, sessions, first, strict=True):
            e = Episode(list(prompts[i]), s, env_seconds=share)  # type: ignore[arg-type]
            if obs is None:
                e.fail(s.error)
            elif obs:
                e.add_env(self.observe(obs), obs, self.cfg.max_tokens)
            out.append((i, j, e))
        return out

    def _turn(self, episodes: list[Episode], settings: SamplingSettings, round_: int) -> None:
        """One model turn for every episode, then one environment step for each."""
        by_room: dict[int, list[Episode]] = {}
        for e in episodes:
            by_room.setdefault(min(settings.max_tokens, self.cfg.max_tokens - len(e.ids)), []).append(e)
        for room, part in by_room.items():
            if room <= 0:  # the budget is spent
                for e in part:
                    e.done, e.truncated = True, True
                continue
            call = replace(settings, n=1, max_tokens=room, seed=settings.seed * 1009 + round_ * 31 + room)
            for e, c in zip(part, self._generate([e.prompt + e.ids for e in part], call), strict=True):
                e.add_model(c)
                e.truncated = c.truncated and len(e.ids) >= self.cfg.max_tokens
        stepping = [e for e in episodes if not e.done]
        started = time.perf_counter()
        steps = self.pool.step([e.session for e in stepping], [e.texts[-1] for e in stepping])
        share = (time.perf_counter() - started) / max(1, len(stepping))
        for e, s in zip(stepping, steps, strict=True):
            e.env_seconds += share  # the environments step in parallel: the round's time, split
            self._after(e, s)

    def _after(self, e: Episode, s: Step | None) -> None:
        if s is None:
            e.fail(e.session.error)
            return
        e.verdict = _ended(s)
        if s.done:
            e.done = True
            return
        if e.turns >= self.cfg.max_turns:
            e.done, e.truncated = True, True
            return
        if s.observation:
            e.add_env(self.observe(s.observation), s.observation, self.cfg.max_tokens)

    def _generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[Completion]:
        got: dict[int, Completion] = {}
        for part in self.actors.generate_stream(prompts, settings):
            got.update((i, g[0]) for i, g in part)
        return [got[i] for i in range(len(prompts))]


def observation_renderer(tokenizer: Any) -> Callable[[str], list[int]]:
    """An observation's token ids, as the model's chat template writes a tool's result after an
    assistant turn and opens the next assistant turn (the part after the assistant's end-of-turn
    token, which the model generated); a tokenizer without a template: the text on its own lines."""
    before, after = _template_pieces(tokenizer)

    def observe(text: str) -> list[int]:
        return list(tokenizer.encode(before + text + after, add_special_tokens=False))

    return observe


_MARK = "\x00OBSERVATION\x00"


def _template_pieces(tokenizer: Any) -> tuple[str, str]:
    if getattr(tokenizer, "chat_template", None):
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        for role in ("tool", "user"):  # templates without a tool role take the result as a user turn
            with contextlib.suppress(Exception):
                head = tokenizer.apply_chat_template(base, tokenize=False).rstrip()
                full = tokenizer.apply_chat_template(
                    [*base, {"role": role, "content": _MARK}], tokenize=False, add_generation_prompt=True
                )
                if full.startswith(head) and _MARK in full:
                    before, _, after = full[len(head) :].partition(_MARK)
                    return before, after
    return "\n", "\n"


def tag_problems(encode: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The loop's prompt encoder, with each prompt's ids carrying its problem to the environment."""

    def tagged(example: Any) -> Any:
        enc = encode(example)
        if not isinstance(enc.engine, list):
            raise ValueError("env.name: multi-turn episodes take text prompts; this data set has images")
        return replace(enc, engine=EpisodePrompt(enc.engine, example.prompt, example.answer))

    return tagged


@contextlib.contextmanager
def multi_turn(
    cfg: Any, actors: Any, prep: Any, private: tuple[str, ...], run_dir: Any, say: Any
) -> Iterator[Any]:
    """The actors as the loop should see them: ``Episodes`` when ``env.name`` is set (and the driver's
    prompt encoder, ``prep.encode``, tagging each prompt with its problem), else themselves. The
    environments run beside the driver, or with ``env.nodes`` on those nodes (``envs/remote.py``)."""
    if not cfg.env.enabled:
        yield actors
        return
    from transformers import AutoTokenizer

    from hpcrl.envs.remote import remote_pool

    observe = observation_renderer(AutoTokenizer.from_pretrained(prep.model_dir))
    remote = remote_pool(cfg.env, cfg.data.verifier, private, run_dir, say) if cfg.env.nodes else None
    prep.encode = tag_problems(prep.encode)
    try:
        yield Episodes(actors, cfg.env, remote or EnvPool(cfg.env, cfg.data.verifier, private), observe)
    finally:
        if remote is not None:
            remote.shutdown()


def private_paths(run_dir: Any, checkpoint_dir: str | None) -> tuple[str, ...]:
    """What an environment's sandboxed tools must not read: the run directory, the checkpoints, the
    driver's working directory (the user's checkout, often with keys) and the home directory."""
    import os
    from pathlib import Path

    paths = [str(run_dir), os.getcwd(), str(Path.home())]
    return tuple(paths + ([checkpoint_dir] if checkpoint_dir else []))
