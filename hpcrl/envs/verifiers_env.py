"""``verifiers`` environments (prime-rl's environment library, 0.4.0): ``env.name=verifiers:<module>:<factory>``.

A verifiers environment is a ``vf.Taskset`` (its tasks: prompt, system prompt, the task type's own
fields), the tools its taskset and task type declare (``toolsets``: ``vf.Toolset`` objects whose
``@vf.tool`` methods the model calls) and the task's grade: its ``@vf.reward`` methods (and plugged
judges), weighted and summed over a ``vf.Trace`` by ``Task.score``. verifiers plays these through its
own harness, an OpenAI-compatible client and MCP tool servers; this adapter plays the same parts in
hpcrl's episode loop instead, so the turns are the engine's exact tokens (``envs/episodes.py``):

- ``<factory>`` (``module:attr``) is called with no arguments and returns the ``vf.Taskset``;
- its tasks become a data file with ``export_tasks`` (``python -m hpcrl.envs.verifiers_env
  <module>:<factory> out.jsonl``): ``prompt`` is the task's system prompt and prompt text, ``answer``
  the task's data as JSON, from which each episode rebuilds its task (no lookup in the taskset);
- a model turn's tool calls (``env.tool_format``) run the tools' methods in the episode's process and
  their results are the observation; a turn without a call is the answer and ends the episode;
- after every turn the trace so far is scored and the task's ``@vf.stop`` predicates on the trace are
  asked: an episode cut by ``env.max_turns`` keeps its trace's score, as verifiers scores a truncated
  rollout. The episode's reward is ``trace.reward``; outside [0, 1] it is graded an error.

Tasks that need a container runtime (``NEEDS_CONTAINER``) are refused; signals that take a runtime
are skipped, as ``Task.score`` does without one.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcrl.envs.base import EnvSpec, Step, register_env, tool_calls
from hpcrl.envs.toolcall import ToolCall


def load_taskset(argument: str) -> Any:
    """The taskset ``module:attr`` names (``attr()``, called with no arguments)."""
    module, sep, attr = argument.partition(":")
    if not (module and sep and attr):
        raise ValueError(
            f"env.name=verifiers:<module>:<factory> names a function that returns a vf.Taskset, got {argument!r}"
        )
    taskset = getattr(importlib.import_module(module), attr)()
    import verifiers.v1 as vf

    if not isinstance(taskset, vf.Taskset):
        raise ValueError(f"{argument} returned a {type(taskset).__name__}, not a verifiers Taskset")
    if taskset.task_type().NEEDS_CONTAINER:
        raise ValueError(
            f"{argument}: {taskset.task_type().__name__} needs a container runtime; the verifiers adapter "
            "runs tools and rewards in the episode's process"
        )
    return taskset


def task_prompt(task: Any) -> str:
    """The text the model is prompted with: the task's system prompt, then its prompt."""
    return "\n\n".join(filter(None, (task.data.system_prompt, task.data.prompt_text)))


def export_tasks(taskset: Any, path: Path, limit: int | None = None) -> int:
    """Write the taskset's tasks (the first ``limit``) as a data file (``prompt``, ``answer``)."""
    rows = 0
    with path.open("w") as f:
        for task in taskset if limit is None else taskset.take(limit):
            answer = task.data.model_dump_json()
            f.write(json.dumps({"prompt": task_prompt(task), "answer": answer}) + "\n")
            rows += 1
    return rows


def tools_of(toolsets: list[Any]) -> dict[str, Callable[..., Any]]:
    """The ``@vf.tool`` methods of ``toolsets`` by the name the model calls them."""
    from verifiers.v1.utils.decorators import discover_decorated

    return {
        getattr(fn, "tool_name", None) or fn.__name__: fn
        for ts in toolsets
        for fn in discover_decorated(ts, "tool")
    }


class VerifiersEnv:
    def __init__(self, spec: EnvSpec) -> None:
        self.taskset, self.fmt = load_taskset(spec.argument), spec.tool_format
        self.loop = asyncio.new_event_loop()  # the tools' and rewards' coroutines, one episode's
        self.tools = tools_of(self.taskset.toolsets(self.taskset.config))
        self.task: Any = None
        self.trace: Any = None
        self.calls = 0

    def reset(self, prompt: str, answer: str) -> str:
        import verifiers.v1 as vf
        from verifiers.v1.state import state_cls

        kind = self.taskset.task_type()
        self.task = kind(kind.data_type().model_validate_json(answer), self.taskset.config.task)
        self.tools |= tools_of(kind.toolsets(self.task.config))
        self.trace = vf.Trace(
            task=vf.TraceTask(
                type=kind.__name__, data=self.task.data, key=self.task.key, hash=self.task.hash
            ),
            state=state_cls(kind)(),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="hpcrl"),
        )
        d = self.task.data
        messages = [vf.SystemMessage(content=d.system_prompt)] if d.system_prompt else []
        if isinstance(d.prompt, str):
            messages.append(vf.UserMessage(content=d.prompt))
        else:
            messages += list(d.prompt or [])
        for m in messages:
            self._add(m, sampled=False)
        return ""

    def step(self, turn: str) -> Step:
        import verifiers.v1 as vf

        calls = tool_calls(turn, self.fmt)
        if isinstance(calls, Step):  # a malformed call: the error is the model's next observation
            self._add(vf.AssistantMessage(content=turn), sampled=True)
            self._add(vf.UserMessage(content=calls.observation), sampled=False)  # what the model reads
            return self._graded(calls.observation, done=False)
        ids = [f"call_{self.calls + k}" for k in range(len(calls))]
        self.calls += len(calls)
        wire = [
            vf.ToolCall(id=i, name=c.name, arguments=json.dumps(c.arguments))
            for i, c in zip(ids, calls, strict=True)
        ]
        self._add(vf.AssistantMessage(content=turn, tool_calls=wire or None), sampled=True)
        results = [self._call(c) for c in calls]
        for i, c, r in zip(ids, calls, results, strict=True):
            self._add(vf.ToolMessage(tool_call_id=i, content=r, name=c.name), sampled=False)
        return self._graded("\n".join(results), done=not calls or self._stopped())

    def _call(self, call: ToolCall) -> str:
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: no tool {call.name!r}; tools: {', '.join(sorted(self.tools))}"
        try:
            result = tool(**call.arguments)
            if inspect.isawaitable(result):
                result = self.loop.run_until_complete(result)
        except Exception as exc:  # the tool's failure is what the model reads, as verifiers shows it
            return f"error: {call.name}: {type(exc).__name__}: {exc}"
        return result if isinstance(result, str) else json.dumps(result, default=str)

    def _stopped(self) -> bool:
        """Whether one of the task's ``@vf.stop`` predicates on the trace says the episode is over."""
        import verifiers.v1 as vf
        from verifiers.v1.session import hook_boundary

        for fn in self.task.hooks("stop"):
            if hook_boundary(fn, allow_trace=True) is not vf.Trace:
                continue  # request/response predicates belong to verifiers' own client
            result = fn(self.trace)
            if self.loop.run_until_complete(result) if inspect.isawaitable(result) else result:
                return True
        return False

    def _graded(self, observation: str, done: bool) -> Step:
        self.loop.run_until_complete(self.task.score(self.trace))
        scores = {k: r.score for k, r in self.trace.rewards.items() if r is not None}
        return Step(observation, float(self.trace.reward), done, {"rewards": scores})

    def _add(self, message: Any, sampled: bool) -> None:
        from verifiers.v1.graph import MessageNode

        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))


@register_env("verifiers")
def verifiers_env(spec: EnvSpec) -> VerifiersEnv:
    return VerifiersEnv(spec)


def main(argv: list[str]) -> None:
    """``python -m hpcrl.envs.verifiers_env <module>:<factory> <out.jsonl> [limit]``."""
    if len(argv) not in (2, 3):
        raise SystemExit("usage: python -m hpcrl.envs.verifiers_env <module>:<factory> <out.jsonl> [limit]")
    rows = export_tasks(load_taskset(argv[0]), Path(argv[1]), int(argv[2]) if len(argv) == 3 else None)
    print(f"{rows} tasks written to {argv[1]} (data.source={argv[1]}, env.name=verifiers:{argv[0]})")


if __name__ == "__main__":
    main(sys.argv[1:])
