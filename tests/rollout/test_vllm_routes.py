"""The route recorder's bookkeeping (rollout/vllm_routes.py), without an engine: completions are matched
to the requests that recorded them by their tokens, and nothing taken stays behind."""

from __future__ import annotations

import numpy as np

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
