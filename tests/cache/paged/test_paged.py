"""PagedCache behind the model seam: the same tokens and logits as the dynamic cache for batches
of different lengths across block boundaries, forks, named errors, bytes."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, tiny_model

from kvcache.cache import CacheError, CacheShapeError, OutOfBlocksError, PagedCache, RowState, make_cache
from kvcache.generation import generate
from kvcache.memory import kv_cache_bytes
from kvcache.model import LlamaForCausalLM

BLOCK = 4


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]  # (kernels: not in pytest --fast)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_model()


def paged(model, num_blocks: int = 64, block_size: int = BLOCK) -> PagedCache:
    return PagedCache(num_blocks, block_size, config=model.config, dtype=torch.float32)


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def step_logits(model, cache, prompts, steps: int) -> list[torch.Tensor]:
    """Greedy decoding by hand; the logits of every real position of every forward."""
    ids, mask = left_padded(prompts)
    out = []
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits  # (B, T, V)
        out.append(logits[mask.bool()])
        for _ in range(steps):
            token = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits = model(token, attention_mask=mask, past_key_values=cache).logits
            out.append(logits[:, -1])
    return out


def test_batch_of_lengths_around_a_block_matches_dynamic_logits_and_tokens(model):
    torch.manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 1)]
    dynamic = step_logits(model, make_cache("dynamic", config=model.config), prompts, 2 * BLOCK + 1)
    cache = paged(model)
    ours = step_logits(model, cache, prompts, 2 * BLOCK + 1)
    for expected, got in zip(dynamic, ours):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert cache.row_lengths == [len(p) + 2 * BLOCK + 1 for p in prompts]  # padding not stored
    ids, mask = left_padded(prompts)
    want = generate(model, ids, mask, max_new_tokens=9, cache="dynamic", eos_token_id=())
    got = generate(model, ids, mask, max_new_tokens=9, cache=paged(model), eos_token_id=())
    assert torch.equal(got.sequences, want.sequences)


@pytest.mark.parametrize("prompt_length", [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 1])
def test_single_sequence_prefill_and_decode_match_dynamic(model, prompt_length):
    torch.manual_seed(prompt_length)
    prompts = [torch.randint(0, VOCAB, (prompt_length,)).tolist()]
    dynamic = step_logits(model, make_cache("dynamic", config=model.config), prompts, BLOCK + 2)
    ours = step_logits(model, make_cache("paged", config=model.config, num_blocks=8, block_size=BLOCK,
                                         dtype=torch.float32), prompts, BLOCK + 2)
    for expected, got in zip(dynamic, ours):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_chunked_prefill_with_padding_matches_dynamic(model):
    torch.manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (3, 11)]
    ids, mask = left_padded(prompts)
    want = generate(model, ids, mask, max_new_tokens=6, cache="dynamic", eos_token_id=())
    got = generate(model, ids, mask, max_new_tokens=6, cache=paged(model), eos_token_id=(),
                   prefill_chunk_size=BLOCK)  # the first chunk is all padding in row 0
    assert torch.equal(got.sequences, want.sequences)


def test_update_alone_works_as_in_the_guide():
    cache = PagedCache(8, 4, num_layers=2)
    history = []
    for new in (5, 1, 3):
        k, v = torch.randn(2, 2, new, 8), torch.randn(2, 2, new, 8)  # (B, H_kv, T_new, D)
        history.append(k)
        for layer in range(2):
            keys, values = cache.update(k, v, layer)
        torch.testing.assert_close(keys, torch.cat(history, dim=2), atol=0, rtol=0)
    assert cache.get_seq_length() == 9 and cache.row_lengths == [9, 9]
    torch.testing.assert_close(cache.layers[1].keys, torch.cat(history, dim=2), atol=0, rtol=0)
    assert cache.allocator.num_in_use == 2 * 3  # two rows of 9 tokens in blocks of 4


def test_fork_shares_blocks_until_the_continuations_diverge(model):
    torch.manual_seed(3)
    prompt = torch.randint(0, VOCAB, (2 * BLOCK + 2,)).tolist()  # ends inside a block
    cache = paged(model)
    with torch.no_grad():
        model(torch.tensor([prompt]), past_key_values=cache)
        cache.fork(0)
        parent, child = (cache.allocator.sequence(seq).table for seq in cache.rows)
        assert parent == child and cache.allocator.num_in_use == 3
        continuations = torch.tensor([[5], [9]])  # the rows diverge here
        logits = [model(continuations, past_key_values=cache).logits[:, -1]]
        parent, child = (cache.allocator.sequence(seq).table for seq in cache.rows)
        assert parent[:2] == child[:2] and parent[2] != child[2]  # full blocks still shared
        logits.append(model(torch.tensor([[7], [7]]), past_key_values=cache).logits[:, -1])
        for row, first in enumerate((5, 9)):
            alone = make_cache("dynamic", config=model.config)
            model(torch.tensor([prompt]), past_key_values=alone)
            expected = [model(torch.tensor([[first]]), past_key_values=alone).logits[:, -1]]
            expected.append(model(torch.tensor([[7]]), past_key_values=alone).logits[:, -1])
            for got, want in zip(logits, expected):
                torch.testing.assert_close(got[row], want[0], atol=1e-5, rtol=0)


def test_select_repeats_a_row_by_forking_and_frees_dropped_rows(model):
    cache = paged(model)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (2, 6)), past_key_values=cache)
        in_use = cache.allocator.num_in_use
        cache.select([1, 1])
        assert len(cache.rows) == 2 and cache.allocator.num_in_use == in_use // 2
        cache.repeat_interleave(2)
        assert cache.row_lengths == [6] * 4 and cache.allocator.num_in_use == in_use // 2
        cache.crop(4)
        assert cache.row_lengths == [4] * 4 and cache.get_seq_length() == 4
        cache.allocator.check_invariants()


def test_out_of_blocks_raises_before_the_forward_writes(model):
    cache = paged(model, num_blocks=3)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 2 * BLOCK)), past_key_values=cache)
        with pytest.raises(OutOfBlocksError, match="2 more block"):
            model(torch.randint(0, VOCAB, (1, 2 * BLOCK)), past_key_values=cache)
    assert cache.row_lengths == [2 * BLOCK] and cache.get_seq_length() == 2 * BLOCK
    cache.allocator.check_invariants()


def test_misuse_raises_named_errors():
    cache = PagedCache(8, 4, num_layers=2)
    k = torch.randn(1, 2, 3, 8)
    with pytest.raises(CacheShapeError, match="before layer 0"):
        cache.update(k, k, 1)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    with pytest.raises(CacheShapeError, match="before layer 0"):
        cache.update(k, k, 1)
    with pytest.raises(CacheShapeError, match="kv heads"):
        cache.update(torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8), 0)
    with pytest.raises(CacheShapeError, match="batch 2"):
        cache.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), 0)
    with pytest.raises(CacheShapeError, match="earlier tokens"):
        cache.attention_masks(1, torch.tensor([[0, 1, 1, 1]]))
    windowed = PagedCache(8, 4, config={"num_hidden_layers": 2, "sliding_window": 4})
    assert [allocator.window for allocator in windowed.allocators] == [4]  # its layers slide
    windowed.add_sequence([1, 2, 3])
    with pytest.raises(CacheShapeError, match="hold only their window"):
        windowed.row_state(0)


def test_rows_of_different_lengths_append_at_their_own_lengths_without_a_mask():
    """The serving case: no attention_mask, each row's new token at its own position, and each
    row sees exactly its own keys (a shorter row's right padding masked)."""
    cache = PagedCache(8, 4, num_layers=1)
    cache.add_sequence()
    cache.add_sequence()
    k = torch.randn(2, 2, 3, 8)
    cache.begin(3, torch.tensor([[1, 1, 1], [0, 1, 1]]))
    cache.update(k, k, 0)
    assert cache.row_lengths == [3, 2]
    plan = cache.begin(1)
    assert plan.positions.tolist() == [[3], [2]]
    assert plan.mask(0).tolist() == [[[[True, True, True, True]]], [[[True, True, True, False]]]]
    new = torch.randn(2, 2, 1, 8)
    keys, _ = cache.update(new, new, 0)
    assert cache.row_lengths == [4, 3] and keys.shape == (2, 2, 4, 8)
    torch.testing.assert_close(keys[1, :, 2], new[1, :, 0])  # row 1's token 2 is the new one
    torch.testing.assert_close(keys[1, :, :2], k[1, :, 1:])  # after its own two, not row 0's
    with pytest.raises(CacheShapeError, match="different token counts"):
        cache.positions(1)  # one position for all rows does not exist


def test_nbytes_match_the_memory_planner():
    cache = PagedCache(10, 4, num_layers=3, kv_heads=2, head_dim=8, dtype=torch.float16)
    assert cache.nbytes == kv_cache_bytes(3, 2, 10 * 4, 8, dtype="float16")
    k = torch.randn(1, 2, 5, 8, dtype=torch.float16)
    cache.update(k, k, 0)
    assert cache.nbytes_used == kv_cache_bytes(3, 2, 2 * 4, 8, dtype="float16")  # 2 whole blocks


def test_rows_that_stop_at_eos_early_match_dynamic(model):
    torch.manual_seed(6)
    ids, mask = left_padded([torch.randint(0, VOCAB, (n,)).tolist() for n in (3, 7, 5)])
    free_run = generate(model, ids, mask, max_new_tokens=8, cache="dynamic", eos_token_id=())
    eos = free_run.new_tokens[1][2]  # row 1's third token: that row stops there (or earlier)
    want = generate(model, ids, mask, max_new_tokens=8, cache="dynamic", eos_token_id=eos)
    got = generate(model, ids, mask, max_new_tokens=8, cache=paged(model), eos_token_id=eos)
    assert got.new_tokens == want.new_tokens and got.stop_reasons == want.stop_reasons
    assert "eos" in got.stop_reasons


def test_make_cache_paged_sizes_the_pool_from_batch_and_length(model):
    cache = make_cache("paged", config=model.config, max_batch_size=3, max_cache_len=10, block_size=4,
                       dtype=torch.float32)
    assert isinstance(cache, PagedCache) and cache.num_blocks == 3 * 3 and cache.block_size == 4
    with pytest.raises(ValueError, match="needs num_blocks or max_cache_len"):
        make_cache("paged", config=model.config)


def test_layer_keys_are_each_rows_tokens_right_padded_with_zeros():
    cache = PagedCache(8, 2, num_layers=1)
    k = torch.randn(2, 1, 3, 4)
    cache.attention_masks(3, torch.tensor([[1, 1, 1], [0, 0, 1]]))
    cache.update(k, k, 0)
    keys = cache.layers[0].keys  # (2, 1, 3, 4)
    torch.testing.assert_close(keys[0], k[0], atol=0, rtol=0)
    torch.testing.assert_close(keys[1, :, :1], k[1, :, 2:], atol=0, rtol=0)
    assert not keys[1, :, 1:].any()


def test_a_row_read_out_and_loaded_back_holds_the_same_keys_and_prefix():
    cache = PagedCache(8, 4, num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
    cache.add_sequence(list(range(10, 19)))  # 9 token ids declared
    k = torch.randn(1, 2, 9, 8)
    for layer in range(2):
        cache.update(k * (layer + 1), -k, layer)
    state = cache.row_state(0)
    assert state.token_ids == list(range(10, 19)) and state.keys[1].shape == (9, 2, 8)
    other = PagedCache(6, 2, num_layers=2)  # another block size, storage not yet allocated
    row = other.load_row_state(state)
    assert row == 0 and other.row_lengths == [9]
    for layer in range(2):
        torch.testing.assert_close(other.layers[layer].keys[0], (k * (layer + 1))[0])
        torch.testing.assert_close(other.layers[layer].values[0], -k[0])
    assert other.add_sequence(list(range(10, 19)) + [1]) == 8  # its full blocks are findable


def test_a_refused_row_state_leaves_the_cache_as_it_was():
    cache = PagedCache(4, 4, num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
    source = PagedCache(8, 4, num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
    source.add_sequence(list(range(9)))
    for layer in range(2):
        source.update(torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8), layer)
    good = source.row_state(0)
    wrong_dim = RowState(good.token_ids, [t[..., :4] for t in good.keys], good.values)
    wrong_dtype = RowState(good.token_ids, [t.double() for t in good.keys], [t.double() for t in good.values])
    too_long = RowState(list(range(20)), [torch.zeros(20, 2, 8)] * 2, [torch.zeros(20, 2, 8)] * 2)
    before = (cache.rows, cache.allocator.num_free, cache.allocator.num_in_use)
    refusals = ((wrong_dim, CacheShapeError), (wrong_dtype, CacheError), (too_long, OutOfBlocksError))
    for state, error in refusals:
        with pytest.raises(error):
            cache.load_row_state(state)
        assert (cache.rows, cache.allocator.num_free, cache.allocator.num_in_use) == before
        cache.allocator.check_invariants()
    assert cache.load_row_state(good) == 0 and cache.row_lengths == [9]


def test_truncate_rows_puts_each_row_back_to_its_own_length_all_or_nothing():
    """generate's rollback: rows at their own lengths, stepped on (reserved, written, committed),
    go back to what each held; the blocks they took past it are freed, and a row whose window
    gave back a block it would need refuses before any row changes."""
    cache = PagedCache(16, 4, num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32)
    ones = [torch.ones(6, 1, 2)]
    cache.add_sequence(list(range(6)))
    cache.append_to_row(0, ones, ones)
    cache.fork(0)  # row 1 shares row 0's blocks
    before = (cache.row_lengths, cache.allocator.num_free)
    cache.reserve([0, 1], [11, 7])
    cache.commit([0, 1], [11, 7])
    assert cache.row_lengths == [11, 7]
    cache.truncate_rows([6, 6])
    # every block past position 6 is free again; the shared partial block stays copied on write
    assert (cache.row_lengths, cache.allocator.num_free) == (before[0], before[1] - 1)
    cache.allocator.check_invariants()
    with pytest.raises(CacheShapeError, match="one length per row"):
        cache.truncate_rows([6])
    window = dict(num_hidden_layers=1, num_key_value_heads=1, head_dim=2, sliding_window=4,
                  layer_types=["sliding_attention"])
    sliding = PagedCache(16, 2, config=window, dtype=torch.float32)
    sliding.add_sequence()
    sliding.reserve([0], [12])
    sliding.commit([0], [12])  # the window gave back the first blocks
    with pytest.raises(CacheError):
        sliding.truncate_rows([1])
    assert sliding.row_lengths == [12]


def test_a_forward_the_pool_cannot_hold_reserves_nothing_in_any_group_of_layers():
    """The sliding group (planned first) has room, the full one not: begin raises and no group's
    tables change, so a retry after making room reads the rows it attached, copied."""
    config = dict(num_hidden_layers=2, num_key_value_heads=1, head_dim=2, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"])
    cache = PagedCache(2, 2, window_blocks=8, config=config, dtype=torch.float32)
    ones = [torch.ones(3, 1, 2) for _ in range(2)]
    cache.add_sequence([5, 6, 7])
    cache.append_to_row(0, ones, ones)
    cache.free_rows()  # a full block and a kept 1-token tail in each group
    assert cache.add_sequence([5, 6, 7, 9]) == cache.add_sequence([5, 6, 7, 8]) == 3
    tables = [[group.sequence(seq).table[:] for seq in cache.rows] for group in cache.allocators]
    with pytest.raises(OutOfBlocksError):
        cache.begin(1)  # two copies of the tail, and the full group has no block to give
    assert [[group.sequence(seq).table for seq in cache.rows] for group in cache.allocators] == tables
    cache.select([0])
    cache.begin(1)
    for layer in cache.layers:
        slots = torch.tensor(cache.allocators[layer.group].slots(cache.rows[0], 0, 3))
        assert torch.equal(layer.read_slots(slots)[0], torch.ones(3, 1, 2))
