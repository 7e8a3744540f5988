"""The experts vLLM's MoE routers chose for every token, recorded inside a vLLM worker
(``trainer.router_replay``: the trainer replays them, ``trainer/router_replay.py``).

vLLM has its own routed-experts output (``enable_return_routed_experts``), but only on its V2 model
runner, which the CPU build (0.32, no Triton) and GPU vLLM 0.26's MoE models do not run. So hpcrl binds
its own recorder through vLLM's capture hook (``vllm_compat.bind_router_capture``: each router hands the logical expert ids it
chose, before any expert-load-balancing remap) and files each forward's rows
under the requests that ran, by the runner's flat batch order (requests in ``input_batch`` order, each
with its scheduled tokens) at the positions the runner fed. The engine takes a finished sequence's
routes by its tokens (prompt + completion but the last token, which no forward ran): token ids, not
request ids, because vLLM renames requests (``n`` samples of a prompt become child requests) on the way
to the worker.

One route per forward position, the prompt's included: prefix caching would skip a cached prompt's
forward (and its routes), so the engine turns it off while routes are recorded.

Speculative decoding (``rollout.speculative``): each step the runner feeds a request's last token and
its drafts, and the routers route every one of them, rejected drafts included. A rejected draft's
position is fed again, with the token the model chose there, in the request's next step, whose rows
overwrite it; so every position but the last holds the routes of the token that stayed, computed on
the accepted tokens before it, as without drafts (vLLM's own output drops the rejected suffix instead,
``aux_output_connector``). Only a request's final step leaves rows past its end (drafts it never kept,
or tokens past ``max_tokens``): ``take`` matches a sequence to the request whose rows begin with it
and cuts them there. The drafter's routers (a model of its own) are not bound: MTP layers route
freely in the trainer (``trainer/router_replay.py``).
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
        # the device buffer: under async scheduling the host one lacks the tokens sampled on device
        tokens = runner.input_ids.gpu[:n].cpu().numpy()
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
        """The routes of each sequence (None where none was recorded), each from its own request:
        the one whose rows begin with its tokens with the fewest rows past them (speculative
        decoding's last step: module docstring), cut to its length; the requests handed out are
        forgotten. Two samples of a prompt may be the same tokens (GRPO draws several): each gets a
        request of its own."""
        out: list[np.ndarray | None] = [None] * len(sequences)
        if not sequences:
            return out
        # requests by their first h tokens (the shortest sequence's length): a prompt's samples share one
        h = min(len(s) for s in sequences)
        heads: dict[tuple[int, ...], list[str]] = {}
        for req, (t, _) in self.rows.items():
            if len(t) >= h:
                heads.setdefault(tuple(t[:h].tolist()), []).append(req)
        for i in sorted(range(len(sequences)), key=lambda i: -len(sequences[i])):
            seq, candidates = np.asarray(sequences[i], dtype=np.int64), heads.get(tuple(sequences[i][:h]), [])
            fits = [
                r for r in candidates
                if len(self.rows[r][0]) >= len(seq) and np.array_equal(self.rows[r][0][: len(seq)], seq)
            ]  # fmt: skip
            if fits:
                req = min(fits, key=lambda r: len(self.rows[r][0]))
                candidates.remove(req)
                out[i] = self.rows.pop(req)[1][: len(seq)]
        return out


def take(worker: Any, sequences: list[list[int]]) -> list[tuple[bytes, list[int]] | None]:
    """``RouteRecorder.take`` in a worker, in the form an RPC result crosses the engine core's process
    boundary in (``vllm_compat.to_wire``)."""
    from hpcrl.rollout import vllm_compat

    recorder: RouteRecorder = worker._hpcrl_routes  # set by install
    return vllm_compat.to_wire(recorder.take(sequences))


def install(worker: Any) -> tuple[int, int]:
    """Bind a ``RouteRecorder`` to a vLLM worker's MoE routers and runner; (layers, k)."""
    from types import MethodType

    from hpcrl.rollout import vllm_compat

    runner = worker.model_runner
    config = runner.vllm_config.model_config
    layers, k = config.get_total_num_hidden_layers(), vllm_compat.experts_per_token(config)
    recorder = RouteRecorder(runner, layers, k)
    vllm_compat.bind_router_capture(runner.model, recorder)
    original = runner.execute_model
    runner.execute_model = MethodType(
        lambda _self, *a, **kw: recorder.execute_model(original, *a, **kw), runner
    )
    worker._hpcrl_routes = recorder
    return layers, k
