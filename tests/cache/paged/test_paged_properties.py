"""PagedCache against a naive per-row history, over random sequences of adds (with prefix
reuse), forwards of left-padded batches, forks, drops, crops and frees: every row must see
exactly its own tokens' keys, in order, and the mask must show each query exactly its past."""

from __future__ import annotations

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvcache.cache import OutOfBlocksError, PagedCache
from kvcache.cache.paged.rows import prefill_inputs

LAYERS, BLOCK = 2, 3
OPERATIONS = ["add", "add", "forward", "forward", "fork", "drop", "crop", "free"]


def key_row(token: int, position: int, layer: int) -> float:
    """The key a token at a position has on a layer: what a model would compute from them."""
    return token * 1000.0 + position * 2.0 + layer


def forward(cache: PagedCache, truth: list[list[int]], pending: list[list[int]]) -> None:
    """Run every row's pending tokens through the seam and check what comes back."""
    input_ids, attention_mask = prefill_inputs(cache, pending)
    batch, new_tokens = input_ids.shape
    columns = cache.get_seq_length()
    masks = cache.attention_masks(new_tokens, attention_mask)
    real = attention_mask[:, columns:].bool()  # (B, T_new)
    positions = (attention_mask.cumsum(1) - 1)[:, columns:]  # (B, T_new)
    for row, tokens in enumerate(pending):
        truth[row] += tokens
    for layer in range(LAYERS):
        keys = torch.full((batch, 1, new_tokens, 2), -1.0)  # padding: must never be stored
        for row in range(batch):
            for column in range(new_tokens):
                if real[row, column]:
                    token, position = int(input_ids[row, column]), int(positions[row, column])
                    keys[row, 0, column] = key_row(token, position, layer)
        got, _ = cache.update(keys, -keys, layer)  # (B, 1, T_kv, 2)
        mask = masks[layer].expand(batch, 1, new_tokens, got.shape[2])
        for row in range(batch):
            expected = torch.tensor([key_row(t, p, layer) for p, t in enumerate(truth[row])])
            assert torch.equal(got[row, 0, : len(expected), 0], expected)
            for column in range(new_tokens):
                if real[row, column]:
                    query = int(positions[row, column])
                    allowed = torch.arange(got.shape[2]) <= query
                    assert torch.equal(mask[row, 0, column], allowed)
    assert cache.row_lengths == [len(tokens) for tokens in truth]


@settings(max_examples=80, deadline=None)
@given(st.data(), st.integers(4, 24))
def test_every_row_sees_exactly_its_own_history(data, num_blocks):
    cache = PagedCache(num_blocks, BLOCK, num_layers=LAYERS, kv_heads=1, head_dim=2, dtype=torch.float32)
    truth: list[list[int]] = []  # tokens each row holds
    pending: list[list[int]] = []  # tokens each row has declared but not yet run
    tokens = st.lists(st.integers(0, 2), min_size=1, max_size=7)
    shared = [0, 1, 2, 2, 1, 0, 1]  # prompts often start alike, so cached prefixes get found
    prompts = st.builds(
        lambda alike, n, tail: shared[:n] * alike + tail, st.booleans(), st.integers(3, 7), tokens
    )
    for _ in range(data.draw(st.integers(1, 16))):
        kind = data.draw(st.sampled_from(OPERATIONS))
        rows = len(cache.rows)
        if kind == "add":
            prompt = data.draw(prompts)
            attached = cache.add_sequence(prompt)
            assert attached < len(prompt)  # (whole blocks, then part of a cached block)
            event(f"prefix attached: {attached > 0}, within a block: {attached % BLOCK > 0}")
            truth.append(prompt[:attached])
            pending.append(prompt[attached:])
        elif kind == "forward" and rows:
            for row in range(rows):
                if not pending[row]:
                    pending[row] = data.draw(tokens)
                    cache.declare_tokens(row, pending[row], start=len(truth[row]))
            try:
                forward(cache, truth, pending)
            except OutOfBlocksError:
                cache.free_rows()
                truth, pending = [], []
                continue
            pending = [[] for _ in range(rows)]
        elif kind == "fork" and rows:
            row = data.draw(st.integers(0, rows - 1))
            cache.fork(row)
            truth.append(list(truth[row]))
            pending.append(list(pending[row]))
        elif kind == "drop" and rows:
            keep = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows, unique=True))
            cache.select(keep)
            truth = [truth[row] for row in keep]
            pending = [pending[row] for row in keep]
        elif kind == "crop" and rows and all(not p for p in pending):
            columns = cache.get_seq_length()
            keep = data.draw(st.integers(0, columns))
            cache.crop(keep)
            truth = [t[: max(0, keep - (columns - len(t)))] for t in truth]
            if any(not t for t in truth):  # a row with no token left cannot run a forward alone
                cache.free_rows()
                truth, pending = [], []
            else:
                pending = [[] for _ in truth]
        elif kind == "free":
            cache.free_rows()
            truth, pending = [], []
        cache.allocator.check_invariants()
