"""A real verifiers (0.4.0) environment for the adapter's tests (``env.name=verifiers:tests.harness.vf_taskset:load``):
sums, ``add`` and ``calculator`` tools on a ``vf.Toolset``, and a rubric of two weighted ``@vf.reward`` methods (the right
sum as the last reply: 0.75; the tool used: 0.25) and a ``@vf.stop`` on the trace (a third tool result)."""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf

from hpcrl.envs.builtin import calculate


class SumData(vf.TaskData):
    a: int
    b: int


class Adder(vf.Toolset):
    @vf.tool
    def add(self, a: int, b: int) -> str:
        """The sum of two integers."""
        return str(int(a) + int(b))

    @vf.tool
    def calculator(self, expression: str) -> str:
        """Arithmetic (the tool ``model=tiny_tools`` learned to call)."""
        return str(calculate(expression))

    @vf.tool
    async def negate(self, x: int) -> int:
        """-x (a coroutine tool)."""
        return -int(x)


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.75)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply == str(task.a + task.b))

    @vf.reward(weight=0.25)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))

    @vf.stop
    def three_results(self, trace: vf.Trace) -> bool:
        return len(trace.tool_messages) >= 3


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self) -> Iterator[SumTask]:
        for i in range(32):
            a, b = 10 + i, 10 + 2 * i  # written as model=tiny_tools learned sums
            yield SumTask(SumData(prompt=f"{a} + {b} =", a=a, b=b), self.config.task)

    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        return [Adder(vf.ToolsetConfig())]


def load() -> SumTaskset:
    return SumTaskset(vf.TasksetConfig())
