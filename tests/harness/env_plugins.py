"""Environments that misbehave on purpose, loaded into episode processes through HPCRL_PLUGINS."""

from __future__ import annotations

import os
import time

from hpcrl.envs.base import EnvSpec, Step, register_env


class Scripted:
    """Goes on for ``env.max_turns``, answering turn k with "<obs k>"; its problem's answer says how
    it misbehaves: "hang" or "crash" on the second step, "eat" allocates past the memory limit there,
    "raise" raises, "bad_reward" ends with a reward of 7, "done" ends at the first step with reward 1."""

    def __init__(self, spec: EnvSpec) -> None:
        self.k, self.mode = 0, ""

    def reset(self, prompt: str, answer: str) -> str:
        self.mode = answer
        return "<start>" if answer == "greet" else ""

    def step(self, turn: str) -> Step:
        self.k += 1
        if self.mode == "done":
            return Step("", 1.0, True)
        if self.k == 2:
            if self.mode == "hang":
                time.sleep(3600)
            if self.mode == "crash":
                os._exit(3)
            if self.mode == "eat":
                _ = bytearray(8 * 1024**3)
            if self.mode == "raise":
                raise RuntimeError("broken environment")
            if self.mode == "bad_reward":
                return Step("", 7.0, True)
        return Step(f"<obs {self.k}>", 0.25)


register_env("test_scripted")(Scripted)
