"""``torchrun`` for the tests without its start-up: a "zygote" process imports torch, transformers,
megatron-core and hpcrl once, then forks each run's ranks from itself.

A rank of ``python -m torch.distributed.run`` spends ~12 s importing (~1 s on a parity step); with 4
or 8 ranks on a 2-core machine that is most of a layout's time. The zygote is started on first use
(one per pytest session: ``torchrun`` below) and only imports: no torch compute, no thread of its
own, so forking it is safe. Per run it forks ``nproc`` children that each set the environment
torchrun gives a worker (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
..., OMP_NUM_THREADS=1 for more than one rank), send their stdout/stderr to files, run the script as
``__main__`` and leave with ``os._exit``. As torchrun does, a rank that fails ends the others
(SIGTERM, then SIGKILL after 5 s); a run past its timeout is killed (only the forked ranks).

What the zygote imports ahead is what a rank imports anyway before building anything; Megatron's
CPU shims (hpcrl.trainer.megatron.compat.prepare) patch the megatron.core modules present when
they run, so the zygote imports none beyond those ``prepare`` itself imports first.

HPCRL_TEST_TORCHRUN=1 runs the real ``python -m torch.distributed.run`` instead (to compare).

    python tests/harness/zygote.py     # the server: JSON requests on stdin, replies on stdout
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 5.0
"""After a rank fails, how long the others get to leave on SIGTERM (torchrun's default too)."""

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.gemma3.modeling_gemma3",
    "transformers.models.gemma4.modeling_gemma4",
    "transformers.models.nemotron_h.modeling_nemotron_h",
    "safetensors.torch",
    "hpcrl.config.compose",
    "hpcrl.plan.planner",
    "hpcrl.trainer.fsdp",
    "hpcrl.trainer.megatron",
    # what compat.prepare imports before it patches the megatron.core modules present
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer.moe.moe_utils",
    # the scripts beside this one (their own imports: torchrun runs them with tests/ on sys.path)
    "megatron_parity",
    "recipe_build",
    "megatron_experts_check",
)


# -- the server ------------------------------------------------------------------------------------
def _preload() -> list[str]:
    import importlib
    import warnings

    failed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a rank prints its own when it imports
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception as exc:  # another version's layout: the rank imports what it needs
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
    return failed


def _rank(rank: int, req: dict[str, Any]) -> None:
    """In the forked child: become rank ``rank`` of the run and run its script; never returns."""
    code = 1
    try:
        world = req["nproc"]
        logs = Path(req["logs"])
        out = os.open(logs / f"{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(logs / f"{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, to in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, to)
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        env = dict(req["env"])
        if world > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks
        env |= {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "default",
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(req["port"]),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none",
        }
        os.environ.clear()
        os.environ.update(env)
        os.chdir(req["cwd"])
        import torch

        if "OMP_NUM_THREADS" in env:  # read when torch loaded, in the zygote: set it as a fresh rank has it
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        import runpy

        script = req["script"]
        sys.argv = [script, *req["args"]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            import atexit as _atexit

            _atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _launch(req: dict[str, Any], reply: IO[str]) -> dict[str, Any]:
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            os.close(reply.fileno())  # the replies are the zygote's
            _rank(rank, req)
        pids[pid] = rank
    reply.write(json.dumps({"pids": list(pids)}) + "\n")
    reply.flush()
    codes: dict[int, int] = {}
    deadline = time.monotonic() + req["timeout"]
    failed_at = timed_out = first = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pids:
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0 and failed_at is None:
                failed_at, first = time.monotonic(), pids[pid]
                _signal(pids, codes, signal.SIGTERM)
            continue
        now = time.monotonic()
        if failed_at is not None and now > failed_at + GRACE_S:
            _signal(pids, codes, signal.SIGKILL)
        if timed_out is None and now > deadline:
            timed_out = now
            _signal(pids, codes, signal.SIGKILL)
        time.sleep(0.02)
    by_rank = [codes[r] for r in range(req["nproc"])]
    return {"codes": by_rank, "first_failed": first, "timed_out": timed_out is not None}


def _signal(pids: dict[int, int], codes: dict[int, int], sig: int) -> None:
    for pid, rank in pids.items():
        if rank not in codes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def serve() -> None:
    # replies go on a copy of stdout; fd 1 itself goes to stderr (an import that prints stays out)
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    started = time.perf_counter()
    failed = _preload()
    ready = {"ready": True, "preload_s": round(time.perf_counter() - started, 1), "failed": failed}
    reply.write(json.dumps(ready) + "\n")
    reply.flush()
    for line in sys.stdin:  # until the tests close it
        result = _launch(json.loads(line), reply)
        reply.write(json.dumps(result) + "\n")
        reply.flush()


# -- the tests' side -------------------------------------------------------------------------------
class Zygote:
    def __init__(self, start_env: dict[str, str]) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="hpcrl-zygote-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            bufsize=0,
            cwd=ROOT,
            env=os.environ | start_env,
        )
        self.pending = b""
        self.ready = self._read(600)

    def _read(self, timeout: float) -> dict[str, Any]:
        """The zygote's next reply (unbuffered: select sees every byte not yet read)."""
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError(f"the test zygote did not answer in {timeout:.0f} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the test zygote exited: {Path(self.log.name).read_text()[-3000:]}")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        data = memoryview(json.dumps(req).encode() + b"\n")
        while data:  # unbuffered: a write may take part of it
            data = data[os.write(self.proc.stdin.fileno(), data) :]
        pids = self._read(60)["pids"]
        try:
            return self._read(req["timeout"] + 60)  # the zygote kills a run past its timeout itself
        except BaseException:  # it did not: end what it forked, and the zygote
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.close()
            raise

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


_ZYGOTES: dict[tuple[tuple[str, str], ...], Zygote] = {}


def _zygote(start_env: dict[str, str] | None = None) -> Zygote:
    """The session's zygote started with ``start_env`` (started now if there is none, or it died)."""
    key = tuple(sorted((start_env or {}).items()))
    if key not in _ZYGOTES or _ZYGOTES[key].proc.poll() is not None:
        _ZYGOTES[key] = zygote = Zygote(dict(key))
        atexit.register(zygote.close)
    return _ZYGOTES[key]


def torchrun(
    script: Path,
    args: list[str],
    nproc: int,
    port: int,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    cwd: Path = ROOT,
    start_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --nproc_per_node=NPROC --master_port=PORT SCRIPT ARGS`` (one
    node), as the zygote's forks: the return code is 0 or that of the rank that failed first, stdout
    and stderr each rank's in turn (that rank's last). A run past ``timeout`` raises subprocess.TimeoutExpired.
    ``start_env``: variables the ranks must have from their first instruction (glibc reads MALLOC_*
    then), which ``env`` alone cannot give a fork: the ranks come from a zygote started with them."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    cmd += [f"--master_port={port}", str(script), *args]
    env = dict(os.environ if env is None else env) | (start_env or {})
    if os.environ.get("HPCRL_TEST_TORCHRUN") == "1" or not hasattr(os, "fork"):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    with tempfile.TemporaryDirectory(prefix="hpcrl-ranks-") as logs:
        req = {"script": str(script), "args": args, "nproc": nproc, "port": port, "env": env}
        got = _zygote(start_env).run(req | {"cwd": str(cwd), "timeout": timeout, "logs": logs})
        first = got["first_failed"]  # the rank that failed first (the others were ended): its output last
        order = sorted(range(nproc), key=lambda r: (r == first, got["codes"][r] != 0, r))
        read = lambda r, ext: Path(logs, f"{r}.{ext}").read_text(errors="replace")  # noqa: E731
        stdout = "".join(read(r, "out") for r in order)
        stderr = "".join(f"[rank {r}: exit {got['codes'][r]}]\n" + read(r, "err") for r in order)
    if got["timed_out"]:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    code = 0 if first is None else got["codes"][first]
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
