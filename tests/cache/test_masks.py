"""One mask rule (`cache.masks.visible_keys`), which every mask builder calls: against a naive
double loop on random positions, windows and empty slots."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.cache.masks import build_mask, visible_keys


@settings(max_examples=100, deadline=None)
@given(queries=st.lists(st.integers(-1, 20), min_size=1, max_size=6),
       keys=st.lists(st.integers(-1, 20), min_size=1, max_size=8),
       window=st.none() | st.integers(1, 6))
def test_a_query_sees_the_keys_at_or_before_it_within_its_window(queries, keys, window):
    q, k = torch.tensor(queries), torch.tensor(keys)
    got = visible_keys(q[:, None], k[None, :], window)
    for i, at in enumerate(queries):
        for j, key in enumerate(keys):
            want = 0 <= key <= at and (window is None or key > at - window)
            assert bool(got[i, j]) == want, (at, key, window)
    own = build_mask(q, k, window=window)[0, 0]  # the seam's: the same, plus each query's own key
    assert torch.equal(own, got | (k[None, :] == q[:, None]))
