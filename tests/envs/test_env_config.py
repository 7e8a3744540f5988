"""``env.*`` through the real entry point: a bad value is one line naming the key and the fix; the
recipe composes; the episode budget sets the sequence length; a plugin's environment is a known name."""

from __future__ import annotations

import pytest

from hpcrl.errors import ConfigError
from tests.conftest import compose

CASES = {
    "unknown": (["env.name=chess"], "env.name=chess is not an environment; use one of: calculator,"),
    "format": (["env.name=calculator", "env.tool_format=json"], "env.tool_format=json is not one of: hermes"),
    "turns": (["env.name=calculator", "env.max_turns=0"], "env.max_turns=0 must be > 0"),
    "timeout": (["env.name=calculator", "env.step_timeout_s=inf"], "env.step_timeout_s=inf must be a finite"),
    "overlong": (
        ["env.name=calculator", "algo=dapo", "rollout.max_new_tokens=1024"],
        "algo.overlong_buffer=512 would measure whole episodes",
    ),
    "routes": (
        ["env.name=calculator", "trainer.router_replay=true"],
        "episodes do not record the engine's routes across turns; set trainer.router_replay=false",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_env_settings_are_one_clear_line(cli, tmp_path, case):
    overrides, expected = CASES[case]
    result = cli("render", *overrides, "--out", str(tmp_path / "run"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("hpcrl: error: ") and expected in lines[0]


def test_the_recipe_composes_with_the_episode_budget_as_its_sequence_length():
    cfg = compose("+experiment=grpo-tiny-1n1g-fsdp-calculator")
    assert (cfg.env.name, cfg.env.max_tokens, cfg.model.name) == ("calculator", 40, "tiny_tools")
    assert cfg.max_seq_len == cfg.data.max_prompt_tokens + 40
    assert compose().max_seq_len == compose().data.max_prompt_tokens + compose().rollout.max_new_tokens


def test_a_plugin_environment_is_a_known_name(monkeypatch):
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.harness.env_plugins")
    assert compose("env.name=test_scripted").env.kind() == "test_scripted"
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.harness.no_such_module")
    with pytest.raises(
        ConfigError, match=r"HPCRL_PLUGINS=tests\.harness\.no_such_module does not import here"
    ):
        compose("env.name=test_missing")
