"""The experts vLLM's MoE routers chose for every token, recorded inside a vLLM worker
(``trainer.router_replay``: the trainer replays them, ``trainer/router_replay.py``).

vLLM has its own routed-experts output (``enable_return_routed_experts``), but only on its V2 model
runner, which the CPU build (0.32, no Triton) and GPU vLLM 0.26's MoE models do not run. So hpcrl binds
its own recorder through vLLM's capture hook (``bind_routed_experts_capturer``: each router hands the
logical expert ids it chose, before any expert-load-balancing remap) and files each forward's rows
under the requests that ran, by the runner's flat batch order (requests in ``input_batch`` order, each
with its scheduled tokens) at the positions the runner fed. The engine takes a finished sequence's
routes by its tokens (prompt + completion but the last token, which no forward ran): token ids, not
request ids, because vLLM renames requests (``n`` samples of a prompt become child requests) on the way
to the worker.

One route per forward position, the prompt's included: prefix caching would skip a cached prompt's
forward (and its routes), so the engine turns it off while routes are recorded.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class RouteRecorder:
    """Per-request routes of one worker: ``rows[request] = (tokens [n], routes [n, layers, k])``."""

    def __init__(self, runner: Any, layers: int, k: int) -> None:
        self.runner = runner
        self.layers, self.k = layers, k
        self.step: dict[int, torch.Tensor] = {}
        self.rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """vLLM's capture callback: one layer's [tokens, k] expert ids (the buffer is reused: copy)."""
        self.step[layer_id] = topk_ids.detach().to("cpu", torch.int16, copy=True)

    def execute_model(self, original: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        """The runner's ``execute_model``, filing the routes its forward chose."""
        self.step = {}
        out = original(scheduler_output, *args, **kwargs)
        if self.step:
            self._file(scheduler_output)
        return out

    def _file(self, scheduler_output: Any) -> None:
        runner, batch = self.runner, self.runner.input_batch
        order = list(batch.req_ids[: batch.num_reqs])
        counts = [int(scheduler_output.num_scheduled_tokens.get(r, 0)) for r in order]
        n = sum(counts)
        routes = torch.zeros((n, self.layers, self.k), dtype=torch.int16)
        for layer, ids in self.step.items():
            routes[:, layer] = ids[:n]
        positions = runner.positions[:n].cpu().numpy()
        tokens = runner.input_ids.cpu[:n].numpy()
        start = 0
        for req, count in zip(order, counts, strict=True):
            span = slice(start, start + count)
            self._put(req, positions[span], tokens[span], routes[span].numpy())
            start += count

    def _put(self, req: str, positions: np.ndarray, tokens: np.ndarray, routes: np.ndarray) -> None:
        if not len(positions):
            return
        have_tokens, have_routes = self.rows.get(
            req, (np.zeros(0, np.int64), np.zeros((0, self.layers, self.k), np.int16))
        )
        end = int(positions.max()) + 1
        if end > len(have_tokens):  # grow; a recomputed (preempted) request overwrites its rows
            grow = end - len(have_tokens)
            have_tokens = np.concatenate([have_tokens, np.full(grow, -1, np.int64)])
            have_routes = np.concatenate([have_routes, np.zeros((grow, self.layers, self.k), np.int16)])
        have_tokens[positions] = tokens
        have_routes[positions] = routes
        self.rows[req] = (have_tokens, have_routes)

    def take(self, sequences: list[list[int]]) -> list[np.ndarray | None]:
        """The routes of each sequence (by its tokens; None where none was recorded); the requests
        they came from are forgotten."""
        # two samples of a prompt may be the same tokens (GRPO draws several): each request once,
        # and every request with a taken sequence's tokens is forgotten, not only the one handed out
        by_tokens: dict[tuple[int, ...], list[str]] = {}
        for req, (t, _) in self.rows.items():
            by_tokens.setdefault(tuple(t.tolist()), []).append(req)
        routes = {key: self.rows[reqs[0]][1] for key, reqs in by_tokens.items()}
        out = [routes.get(tuple(seq)) for seq in sequences]
        for seq in sequences:
            for req in by_tokens.get(tuple(seq), []):
                self.rows.pop(req, None)
        return out


def install(worker: Any) -> tuple[int, int]:
    """Bind a ``RouteRecorder`` to a vLLM worker's MoE routers and runner; (layers, k)."""
    from types import MethodType

    try:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            bind_routed_experts_capturer,
        )
    except ImportError as e:
        import vllm

        raise RuntimeError(
            f"trainer.router_replay=true: vLLM {vllm.__version__} has no routed-experts capture hook "
            "(bind_routed_experts_capturer); use a vLLM that has it or trainer.router_replay=false"
        ) from e

    runner = worker.model_runner
    config = runner.vllm_config.model_config
    layers, k = config.get_total_num_hidden_layers(), config.get_num_experts_per_tok()
    recorder = RouteRecorder(runner, layers, k)
    bind_routed_experts_capturer(runner.model, recorder)  # raises where the model has no MoE router
    original = runner.execute_model
    runner.execute_model = MethodType(
        lambda _self, *a, **kw: recorder.execute_model(original, *a, **kw), runner
    )
    worker._hpcrl_routes = recorder
    return layers, k
