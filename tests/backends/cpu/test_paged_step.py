"""The engine's step on numba's kernels (`paged_step`: every row of a batch in one pass, keys and
values written to their slots and read through the block tables in place) against the model's
forward on the same blocks (`torch_step.forward_rows`), on random batches: rows at their own
lengths, decode rows beside prompt chunks, few tokens (every product the kernels') and many (the
products on oneDNN), shuffled block tables, GQA groups, a sliding window, q/k norms, biases.
float32 logits and stored keys equal the forward's; bfloat16 and float16 ones lie within the
forward's own error of a float32 forward of the same weights."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import OwnErrors, random_model, step_families, tiny_config

from kvcache.backends import Float32Backend, HalfBackend, TorchBackend
from kvcache.backends.cpu import numba_products
from kvcache.cache import PagedBatch, PagedCache

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]  # (kernels: not in pytest --fast)

FAMILIES = step_families(window=7)
BLOCK = 4


def step(backend, model, cache: PagedCache, rows: list[int], tokens: list[list[int]]) -> torch.Tensor:
    """One engine step as the engine's pool runs it: every row's blocks reserved, the backend's
    step, the positions committed, the new tokens declared; the logits of every row."""
    batch = PagedBatch(cache, rows, tokens, [True] * len(rows))
    seqs = [cache.rows[row] for row in rows]
    for allocator in cache.allocators:
        assert not allocator.reserve(seqs, batch.totals)  # (no shared partial block: no copy)
    with torch.inference_mode():
        logits = backend.step(model, batch)
    for seq, total in zip(seqs, batch.totals):
        for allocator in cache.allocators:
            allocator.commit(seq, total)
    for row, new in zip(rows, tokens):
        cache.declare_tokens(row, new)
    return logits


def scenario(seed: int, rows: int, vocab: int) -> list[list[list[int]]]:
    """Steps of a batch: each a list of the new tokens of every row (prompts first: chunks of
    1-20 tokens, rows joining at different steps; then single tokens)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(rows)]
    steps, held = [], [0] * rows
    while any(held[row] < len(prompts[row]) for row in range(rows)):
        chunk = []
        for row in range(rows):
            count = min(rng.randint(1, 20), len(prompts[row]) - held[row])
            chunk.append(prompts[row][held[row]: held[row] + count] if count > 0 else [rng.randrange(vocab)])
            held[row] += max(count, 0)
        steps.append(chunk)
    steps += [[[rng.randrange(vocab)] for _ in range(rows)] for _ in range(3)]
    return steps


def shuffled_cache(model, rows: int, seed: int, kv_dtype: str | None = None, kv_window: int = 0
                   ) -> PagedCache:
    """A PagedCache of `rows` rows whose free blocks are handed out in a shuffled order (so no
    row's blocks are consecutive): every block taken by a sequence of its own, then given back
    in a random order. kv_dtype: what its blocks store ("int8", "fp8", "bfloat16" …); kv_window:
    its full-precision window."""
    cache = PagedCache(96, BLOCK, config=model.config, dtype=model.dtype, kv_dtype=kv_dtype,
                       kv_window=kv_window)
    for allocator in cache.allocators:
        spacers = [("spacer", index) for index in range(allocator.num_blocks)]
        for spacer in spacers:
            allocator.add_sequence(spacer, [])
            allocator.reserve([spacer], [BLOCK])
        random.Random(seed).shuffle(spacers)
        for spacer in spacers:
            allocator.free_sequence(spacer)
    for _ in range(rows):
        cache.add_sequence()
    return cache


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(list(FAMILIES)), seed=st.integers(0, 2**16), rows=st.integers(1, 5),
       kernel_rows=st.sampled_from([1 << 30, 4]))
def test_float32_steps_equal_the_forward_on_the_same_blocks(family, seed, rows, kernel_rows):
    assert numba_products.available()
    model = random_model(tiny_config(**FAMILIES[family]), seed % 7)
    ours, theirs = Float32Backend(model), TorchBackend(model)
    ours.kernel_rows = kernel_rows  # 4: steps of more tokens run their products on oneDNN
    mine, reference = shuffled_cache(model, rows, seed), shuffled_cache(model, rows, seed)
    for tokens in scenario(seed, rows, model.config.vocab_size):
        picked = list(range(rows))
        got = step(ours, model, mine, picked, tokens)
        expected = step(theirs, model, reference, picked, tokens)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for layer, other in zip(mine.layers, reference.layers):  # (the products sum in other orders)
        torch.testing.assert_close(layer.keys, other.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.values, other.values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_half_steps_lie_within_the_forwards_own_error(family, dtype):
    config = tiny_config(**FAMILIES[family])
    exact = random_model(config, 4)
    model = random_model(config, 4).to(dtype)
    ours, theirs, truth = HalfBackend(model), TorchBackend(model), TorchBackend(exact)
    caches = [shuffled_cache(m, 3, 5) for m in (model, model, exact)]
    errors = OwnErrors(dtype)
    for kernel_rows in (1 << 30, 4):
        ours.kernel_rows = kernel_rows
        caches = [shuffled_cache(m, 3, 5) for m in (model, model, exact)]
        for tokens in scenario(kernel_rows % 97, 3, config.vocab_size):
            logits = [step(backend, m, cache, [0, 1, 2], tokens)
                      for backend, m, cache in zip((ours, theirs, truth), (model, model, exact), caches)]
            errors.add(logits[0], logits[1], logits[2])
    errors.check()


@pytest.mark.parametrize("family, kv_dtype", [
    *((family, kv_dtype) for family in FAMILIES for kv_dtype in ("int8", "int4", "int8/int4")),
    # fp8 keys (int8 bytes) beside float values of a kv_dtype of their own (bfloat16 under a
    # float32 model), one family: every new pair of row types compiles the kernels once more, so
    # the tests that run the kernels on new dtypes share this one pair
    ("mistral, window 7", "fp8/bfloat16"),
])
def test_quantized_blocks_are_read_in_place_as_the_forward_reads_them_dequantized(family, kv_dtype):
    """The kernels store rows in the kv_dtype's format as `formats` does (quantized or rounded)
    and read them in place: their logits equal the torch forward's over the same cache (which
    converts every read), on the kernels alone and with prompt chunks on the products; int4
    drifts further from the exact cache than int8 does."""
    model = random_model(tiny_config(**FAMILIES[family]), 6)
    ours, theirs = Float32Backend(model), TorchBackend(model)
    drift = {}
    for kernel_rows in (1 << 30, 4):
        ours.kernel_rows = kernel_rows
        caches = [shuffled_cache(model, 3, 8, kind) for kind in (kv_dtype, kv_dtype, None, "int8")]
        for tokens in scenario(kernel_rows % 89, 3, model.config.vocab_size):
            got, expected, exact, int8 = (
                step(backend, model, cache, [0, 1, 2], tokens)
                for backend, cache in zip((ours, theirs, theirs, theirs), caches)
            )
            # (a key whose projection sums in another order may round to the next code: one step)
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
            drift.setdefault("int8", []).append((int8 - exact).abs().max())
            drift.setdefault(kv_dtype, []).append((got - exact).abs().max())
        for layer, other in zip(caches[0].layers, caches[1].layers):  # (the products' sums may
            for kernels_wrote, torch_wrote in zip(layer.storage_rows(), other.storage_rows()):  # round a
                assert (kernels_wrote == torch_wrote).mean() >= 0.99  # tie apart)
    assert max(drift["int8"]) > 0
    if kv_dtype == "int4":
        assert sum(drift["int4"]) > 2 * sum(drift["int8"])


@pytest.mark.parametrize("family, kv_window", [("llama, 2 groups", 3), ("mistral, window 7", 6),
                                               ("llama, 2 groups", 64)])
def test_a_full_precision_window_is_read_on_the_kernels_as_the_seam_reads_it(family, kv_window):
    """With a kv_window, the kernels keep each row's last positions in the forward's dtype and
    read them from there, on the kernels alone and with prompt chunks on the products: their
    logits equal the torch forward's over the same cache; a window wider than every row reads
    what a float pool reads."""
    model = random_model(tiny_config(**FAMILIES[family]), 6)
    ours, theirs = Float32Backend(model), TorchBackend(model)
    for kernel_rows in (1 << 30, 4):
        ours.kernel_rows = kernel_rows
        caches = [shuffled_cache(model, 3, 8, "int4", kv_window) for _ in range(2)]
        caches.append(shuffled_cache(model, 3, 8, "int4"))
        caches.append(shuffled_cache(model, 3, 8))
        for tokens in scenario(kernel_rows % 89, 3, model.config.vocab_size):
            got, expected, stored, exact = (
                step(backend, model, cache, [0, 1, 2], tokens)
                for backend, cache in zip((ours, theirs, ours, ours), caches)
            )
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
            if kv_window == 64:
                torch.testing.assert_close(got, exact, atol=1e-4, rtol=1e-4)
            else:
                assert not torch.equal(got, stored)


def test_a_row_that_does_not_sample_gets_no_logits_and_its_keys_are_stored():
    model = random_model(tiny_config(), 2)
    backend = Float32Backend(model)
    cache = shuffled_cache(model, 2, 3)
    batch = PagedBatch(cache, [0, 1], [[1, 2, 3], [4, 5]], [False, True])
    for allocator in cache.allocators:
        allocator.reserve([cache.rows[0], cache.rows[1]], batch.totals)
    with torch.inference_mode():
        logits = backend.step(model, batch)
    assert logits.shape == (1, model.config.vocab_size)
    reference = shuffled_cache(model, 2, 3)
    expected = step(TorchBackend(model), model, reference, [0, 1], [[1, 2, 3], [4, 5]])
    torch.testing.assert_close(logits[0], expected[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [None, "int8", "int4", "fp8/bfloat16"])
def test_generate_on_a_paged_cache_decodes_on_the_kernels_as_the_seam_does(kv_dtype):
    """A decode step of `generate` on a PagedCache runs the engine's step (the blocks read in
    place, packed ones scored through their codes), with the tokens of the torch forward's seam
    (rows converted on write and on every read), one row or several."""
    from kvcache.generation import generate

    model = random_model(tiny_config(**FAMILIES["llama, 2 groups"]), 9)
    prompts = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    for ids in (prompts[:1], prompts):
        found = []
        for backend in (Float32Backend(model), TorchBackend(model)):
            cache = PagedCache(32, BLOCK, config=model.config, dtype=model.dtype, kv_dtype=kv_dtype)
            found.append(generate(model, ids, cache=cache, backend=backend, max_new_tokens=12,
                                  eos_token_id=()).new_tokens)
            assert cache.get_seq_length() == 7 + 11  # (the last token is never run)
        assert found[0] == found[1]


def test_a_kv_dtype_equal_to_the_models_changes_nothing_on_the_kernels():
    """A bfloat16 model's pool with kv_dtype "bfloat16" stores and reads what a pool in the
    model's dtype does: the kernels round queries to the forward's dtype for rows in a kv_dtype,
    as the seam's attention does, so the logits are the same bits."""
    model = random_model(tiny_config(**FAMILIES["llama, 2 groups"]), 3).to(torch.bfloat16)
    backend = HalfBackend(model)
    caches = [shuffled_cache(model, 2, 4, kv_dtype) for kv_dtype in (None, "bfloat16")]
    for tokens in scenario(7, 2, model.config.vocab_size):
        plain, stored = (step(backend, model, cache, [0, 1], tokens) for cache in caches)
        assert torch.equal(plain, stored)


@pytest.mark.parametrize("rows", [0, 2])
def test_a_decode_whose_rows_are_not_the_caches_takes_the_seam_as_before(rows):
    """One token on a PagedCache of another row count (none yet, or two) is not the engine's step:
    the float32 backend answers as the torch forward's seam does, or refuses as it does."""
    from kvcache.generation import generate

    model = random_model(tiny_config(), 5)
    ids = torch.tensor([[3, 1, 4]])
    outcomes = []
    for backend in (Float32Backend(model), TorchBackend(model)):
        cache = PagedCache(32, BLOCK, config=model.config, dtype=model.dtype)
        for _ in range(rows):
            cache.add_sequence()
        try:
            outcomes.append(generate(model, ids, cache=cache, backend=backend, max_new_tokens=4,
                                     eos_token_id=()).new_tokens)
        except Exception as error:  # noqa: BLE001 (the two must fail alike)
            outcomes.append(type(error))
    assert outcomes[0] == outcomes[1]
