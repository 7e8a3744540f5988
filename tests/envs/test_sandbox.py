"""The Python tool's sandbox: code that tries the network, eats memory, loops forever, floods its
output or reads the run directory is refused or stopped, and nothing of the run's environment
reaches it. Real namespaces and limits (this machine makes them; ``sandbox_problem`` says when not)."""

from __future__ import annotations

import pytest

from hpcrl.envs.base import EnvSpec
from hpcrl.envs.builtin import PRIVATE_ENV, python_env
from hpcrl.envs.sandbox import Limits, SandboxUnavailable, hidden_paths, run_python, sandbox_problem
from hpcrl.envs.toolcall import ToolCall, format_tool_call

LIMITS = Limits(wall_s=2.0, cpu_s=1, memory_mb=256, output_bytes=200, file_mb=1)


@pytest.fixture(autouse=True)
def _needs_namespaces():
    assert sandbox_problem() is None, sandbox_problem()  # the CI machine makes them: a failure, not a skip


def test_plain_code_runs_and_prints():
    result = run_python("print(sum(range(10)))", LIMITS)
    assert (result.output, result.exit_code, result.timed_out) == ("45\n", 0, False)


def test_network_is_unreachable_even_loopback(tmp_path):
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    )
    try:
        result = run_python(code, LIMITS)
    finally:
        server.close()
    assert "connected" not in result.output and result.exit_code != 0
    assert "Error" in result.output  # refused/unreachable inside its own network namespace


def test_memory_past_the_limit_fails():
    result = run_python("x = bytearray(1024 ** 3)\nprint('allocated')", LIMITS)
    assert "MemoryError" in result.output and "allocated" not in result.output


def test_a_busy_loop_is_killed_by_its_cpu_limit():
    result = run_python("while True:\n    pass", Limits(wall_s=30.0, cpu_s=1))
    assert result.exit_code < 0 and not result.timed_out  # SIGXCPU/SIGKILL from the kernel


def test_a_sleeping_process_and_its_children_are_killed_at_the_wall_limit():
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(600)\ntime.sleep(600)"
    result = run_python(code, LIMITS)
    assert result.timed_out


def test_an_output_flood_is_cut():
    result = run_python("while True:\n    print('x' * 1000)", LIMITS)
    assert len(result.output) == LIMITS.output_bytes and result.exit_code != 0  # RLIMIT_FSIZE


def test_private_directories_read_empty_and_the_environment_is_scrubbed(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "secret.txt").write_text("token")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    code = (
        "import os\n"
        f"print(sorted(os.listdir({str(run_dir)!r})))\n"
        "print(sorted(k for k in os.environ if k not in ('PWD',)))\n"
        f"open({str(run_dir / 'secret.txt')!r}).read()"
    )
    result = run_python(code, Limits(output_bytes=2000), (str(run_dir),))
    lines = result.output.splitlines()
    assert lines[0] == "[]"
    assert lines[1] == "['HOME', 'LANG', 'PATH']"
    assert "FileNotFoundError" in result.output and result.exit_code == 1


def test_a_private_directory_above_the_interpreter_is_hidden_but_the_way_down(tmp_path):
    home = tmp_path / "home"
    (home / ".pyenv" / "python").mkdir(parents=True)
    (home / ".pyenv" / "cache").mkdir()
    (home / ".netrc").write_text("secret")
    hidden = hidden_paths((str(home),), str(home / ".pyenv" / "python"))
    assert hidden == [str(home / ".netrc"), str(home / ".pyenv" / "cache")]


def test_the_python_tool_runs_calls_and_hides_the_run_directory(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text("{}")
    monkeypatch.setenv(PRIVATE_ENV, str(tmp_path))
    env = python_env(EnvSpec("", "hermes", "exact"))
    env.reset("q", "a")
    call = ToolCall("python", {"code": f"import os; print(os.listdir({str(tmp_path)!r}))"})
    assert env.step(format_tool_call(call, "hermes")).observation == "[]\n"
    crashed = env.step(format_tool_call(ToolCall("python", {"code": "1/0"}), "hermes")).observation
    assert crashed.startswith("exit code 1") and "ZeroDivisionError" in crashed


def test_without_namespaces_the_tool_refuses_in_one_line(monkeypatch):
    from hpcrl.envs import sandbox

    monkeypatch.setattr(sandbox, "sandbox_problem", lambda: "no unshare here")
    with pytest.raises(SandboxUnavailable, match=r"^no unshare here$"):
        python_env(EnvSpec("", "hermes", "exact"))


def test_in_an_episode_process_the_tool_hides_the_private_paths_it_was_given(tmp_path):
    from hpcrl.envs.config import EnvConfig
    from hpcrl.envs.pool import EnvPool

    (tmp_path / "config.yaml").write_text("secret: 1")
    pool = EnvPool(EnvConfig("python", step_timeout_s=30), "exact", private=(str(tmp_path),))
    (session,) = pool.start(1)
    try:
        assert pool.reset([session], [("q", "4")]) == [""]
        code = f"import os; print(os.listdir({str(tmp_path)!r}), 2 + 2)"
        (step,) = pool.step([session], [format_tool_call(ToolCall("python", {"code": code}), "hermes")])
        assert step is not None and step.observation == "[] 4\n"
        (answer,) = pool.step([session], ["4"])
        assert answer is not None and (answer.done, answer.reward) == (True, 1.0)
    finally:
        session.close()
