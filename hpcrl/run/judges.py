"""The judge engines (``rewards.judge``) on Ray: a rollout engine each, serving the judge's own model,
started once and never refit (the fleet's refit never sees them), scoring a step's samples in one batch
spread over them. The prompt, the parse and the mix are rewards/judge.py's."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.plan.judge import JudgePlan
from hpcrl.plan.planner import Plan
from hpcrl.rewards.judge import JudgedScorer, Verifiers
from hpcrl.rollout.config import VLLMRolloutConfig
from hpcrl.run.actors import JUDGE_RESOURCE, RolloutActor

if TYPE_CHECKING:
    from ray.actor import ActorHandle


class JudgeActor(RolloutActor):
    """One judge engine: text in, greedy replies out; its weights are the checkpoint's for the whole run."""

    def where(self) -> dict[str, Any]:
        return {**super().where(), "role": "judge"}

    def replies(self, prompts: list[str], max_tokens: int, max_prompt: int) -> list[str]:
        """Each prompt's reply; a prompt past ``max_prompt`` tokens keeps its end (the answer and the
        reference the template puts last)."""
        from hpcrl.rollout.base import SamplingSettings

        self._engine_threads()
        tok = self.engine.tokenizer  # type: ignore[attr-defined]
        ids = [tok.encode(p, add_special_tokens=False)[-max_prompt:] or [0] for p in prompts]
        settings = SamplingSettings(n=1, temperature=0.0, top_p=1.0, max_tokens=max_tokens, seed=0)
        return [group[0].text for group in self.engine.generate(ids, settings)]

    def weights_digest(self) -> Any:
        """The engine's weights, summed per tensor: what the run checks unchanged at its end."""
        return self.engine.weights_digest()  # type: ignore[attr-defined]


def judge_engine_config(cfg: Any, judge: JudgePlan) -> Any:
    """``cfg`` as a judge engine runs it: vLLM with the judge's own settings, its checkpoint's weights,
    no sleep, no log-probs, no routes."""
    s = judge.settings
    engine = VLLMRolloutConfig(
        tp=s.tp,
        max_new_tokens=s.max_new_tokens,
        gpu_memory_utilization=s.gpu_memory_utilization,
        max_num_seqs=s.max_num_seqs,
        load_format="auto",
        sleep=False,
        logprobs=False,
    )
    return replace(cfg, rollout=engine, trainer=replace(cfg.trainer, router_replay=False))


@dataclass
class JudgeGroup:
    actors: list[ActorHandle[JudgeActor]]
    plan: JudgePlan
    digest: list[Any]
    """Each engine's weights at start."""

    @classmethod
    def start(cls, plan: Plan, model_dir: Path, scratch: Path, *, on_gpus: bool) -> JudgeGroup:
        """The judge engines: on the judge nodes (``rewards.judge.nodes``) where there are some, else
        beside the run's other actors; on GPUs (``on_gpus``) or the CPU."""
        import ray

        judge = plan.judge
        assert judge is not None
        s = judge.settings
        on_cpu = not on_gpus
        options: dict[str, Any] = {"num_cpus": 0, "num_gpus": s.tp if on_gpus else 0}
        if judge.nodes:
            options["resources"] = {JUDGE_RESOURCE: s.tp}
        kv_gb = judge.cpu_kv_gb() if on_cpu else None
        cfg = judge_engine_config(plan.cfg, judge)
        actor = ray.remote(JudgeActor)
        actors = [
            actor.options(**options).remote(
                str(model_dir), cfg, judge.max_model_len, str(scratch), on_cpu, kv_gb
            )
            for _ in range(s.engines)
        ]
        digest = ray.get([a.weights_digest.remote() for a in actors])
        return cls(actors, judge, digest)

    def replies(self, prompts: list[str]) -> list[str]:
        """Every prompt's reply, the batch spread over the engines (prompts i::k to engine i)."""
        import ray

        s, k = self.plan.settings, len(self.actors)
        max_prompt = self.plan.max_model_len - s.max_new_tokens
        shares = spread(prompts, k)
        refs = [
            a.replies.remote(p, s.max_new_tokens, max_prompt)
            for a, p in zip(self.actors, shares, strict=True)
        ]
        return gathered(ray.get(refs), len(prompts))

    def where(self) -> list[dict[str, Any]]:
        import ray

        return list(ray.get([a.where.remote() for a in self.actors]))

    def unchanged(self) -> bool:
        """Whether every engine's weights are still those it started with (a judge is never refit)."""
        import ray

        return bool(ray.get([a.weights_digest.remote() for a in self.actors]) == self.digest)


def spread(prompts: list[str], k: int) -> list[list[str]]:
    """Engine ``i``'s share of a batch: prompts ``i::k`` (a batch's long and short prompts mixed)."""
    return [prompts[i::k] for i in range(k)]


def gathered(parts: list[list[str]], n: int) -> list[str]:
    """The engines' replies (``spread``'s shares) back in the batch's order."""
    out = [""] * n
    for i, part in enumerate(parts):
        out[i :: len(parts)] = part
    return out


@contextmanager
def judged(
    plan: Plan, pool: Verifiers, run_dir: Path, scratch: Path, say: Any, prepare: Callable[[Plan], Path]
) -> Iterator[Verifiers]:
    """The loop's scorer: ``pool`` alone, or with ``rewards.judge`` the judges behind it (their model's
    directory from ``prepare``, the driver's ``prepare_model``, as for the run's model); at the end
    ``judge.json`` in the run directory says where they ran and that their weights never changed."""
    if plan.judge is None:
        yield pool
        return
    from hpcrl.plan.topology import on_gpus

    judge = plan.judge
    model_dir = prepare(replace(plan, cfg=replace(plan.cfg, model=judge.model)))
    say(f"starting {judge.settings.engines} judge engine(s) of {judge.model.name}")
    group = JudgeGroup.start(plan, model_dir, scratch, on_gpus=on_gpus(plan.cfg.cluster))
    say(f"judges on {', '.join(sorted({str(w['host']) for w in group.where()}))}")
    yield JudgedScorer(pool, group.replies, judge.settings)
    # the run ended well (a failed one is left as it failed): say where the judges ran, and check them
    unchanged = group.unchanged()
    about = {"model": judge.model.name, "engines": group.where(), "weights_unchanged": unchanged}
    (run_dir / "judge.json").write_text(json.dumps(about, indent=1))
    if not unchanged:
        raise RuntimeError(
            "internal: a judge engine's weights changed during the run (judges are never refit)"
        )
