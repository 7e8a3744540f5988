"""The route recorder's bookkeeping (rollout/vllm_routes.py), without an engine: completions are matched
to the requests that recorded them by their tokens, and nothing taken stays behind."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hpcrl.rollout import vllm_routes
from hpcrl.rollout.vllm_compat import from_wire
from hpcrl.rollout.vllm_routes import RouteRecorder


def test_identical_samples_each_get_routes_and_no_request_is_left_behind():
    """GRPO draws several samples of a prompt; two may be the same tokens. Both get routes, and both
    requests are forgotten (a request left behind would stay in the worker for the whole run)."""
    rec = RouteRecorder(None, layers=1, k=1)
    tokens = np.array([5, 6, 7])
    rec.rows = {
        "a": (tokens, np.full((3, 1, 1), 1, np.int16)),
        "b": (tokens.copy(), np.full((3, 1, 1), 1, np.int16)),
        "c": (np.array([5, 9]), np.full((2, 1, 1), 2, np.int16)),
    }
    got = rec.take([[5, 6, 7], [5, 6, 7], [5, 8]])
    assert got[0] is not None and got[1] is not None and got[2] is None
    assert int(got[0][0, 0, 0]) == int(got[1][0, 0, 0]) == 1
    assert set(rec.rows) == {"c"}  # the unmatched request stays until its completion is taken


def test_speculative_steps_keep_the_accepted_tokens_routes_and_drop_the_final_drafts():
    """With drafts the runner feeds a request's last token and its drafts each step. A rejected
    draft's position comes again in the next step with the token the model chose (its rows replace
    the draft's); the last step leaves rows past the sequence's end, which ``take`` cuts off."""
    rec = RouteRecorder(None, layers=1, k=1)

    def step(positions, tokens, routes):
        rec._put("r", np.array(positions), np.array(tokens), np.array(routes, np.int16).reshape(-1, 1, 1))

    step([0, 1, 2], [1, 5, 6], [10, 11, 12])  # the prompt [1, 5, 6]; the model samples 7
    step([3, 4, 5], [7, 8, 9], [13, 99, 99])  # drafts 8, 9 rejected: the model says 20 at 4
    step([4, 5, 6], [20, 21, 22], [14, 15, 16])  # both drafts kept, bonus 23 at 7
    step([7, 8, 9], [23, 24, 25], [17, 98, 98])  # 24 kept, max_tokens reached: completion 7 20 21 22 23 24
    got = rec.take([[1, 5, 6, 7, 20, 21, 22, 23]])  # the prompt and every generated token but the last
    assert got[0] is not None
    assert got[0][:, 0, 0].tolist() == [10, 11, 12, 13, 14, 15, 16, 17]
    assert rec.rows == {}


def test_a_sequence_takes_its_own_request_where_another_begins_with_it():
    """A longer request of the same prompt whose rows begin with a shorter sequence is not the
    shorter one's: the request with the fewest rows past the sequence is, and the other stays."""
    rec = RouteRecorder(None, layers=1, k=1)
    rec.rows = {
        "long": (np.array([5, 6, 7, 8, 9]), np.full((5, 1, 1), 1, np.int16)),
        "short": (np.array([5, 6, 7, 3]), np.full((4, 1, 1), 2, np.int16)),
    }
    got = rec.take([[5, 6, 7]])
    assert got[0] is not None and got[0].shape == (3, 1, 1) and int(got[0][0, 0, 0]) == 2
    assert set(rec.rows) == {"long"}
    got = rec.take([[5, 6, 7, 8, 9], [4, 4]])
    assert got[0] is not None and int(got[0][0, 0, 0]) == 1 and got[1] is None


def test_completions_without_their_routes_are_counted():
    from hpcrl.rollout.base import Completion, completion_metrics

    def done(routes, missing=False):
        return Completion([3, 4], [], "", False, routes=routes, routes_missing=missing)

    assert "rollout/routes_missing" not in completion_metrics([done(None), done(None)])  # not asked
    routes = np.zeros((3, 1, 1), np.int16)
    assert completion_metrics([done(routes), done(routes)])["rollout/routes_missing"] == 0.0
    assert completion_metrics([done(routes), done(None, True)])["rollout/routes_missing"] == 1.0
    assert completion_metrics([done(None, True)])["rollout/routes_missing"] == 1.0


def test_routes_cross_the_engine_core_boundary_as_arrays():
    """A worker's routes through vLLM's own msgpack path for an RPC's result (engine core process ->
    client; untyped): a raw ndarray arrives as [dtype, shape, buffer] (what broke on GPU vLLM 0.26,
    whose engine runs in its own process), the wire form as the same array."""
    from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    routes = [np.arange(24, dtype=np.int16).reshape(4, 3, 2), None]

    def sent(result: object) -> list:
        message = EngineCoreOutputs(utility_output=UtilityOutput(call_id=1, result=UtilityResult(result)))
        got = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(message))
        return got.utility_output.result.result

    assert not isinstance(sent(routes)[0], np.ndarray)  # why the wire form exists
    worker = SimpleNamespace(_hpcrl_routes=SimpleNamespace(take=lambda sequences: routes))
    back = [from_wire(item) for item in sent(vllm_routes.take(worker, [[1], [2]]))]
    assert np.array_equal(back[0], routes[0])
    assert back[1] is None
