"""The engine on the bundled default model: every greedy request's tokens equal its solo
`generate` whatever else runs beside it and whenever it arrives (chunked prefill, preemption and
cancellations included); prefix blocks are shared and counted; the allocator returns to its
baseline; bad requests are refused at submit; one request's failure stays its own."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvcache
from kvcache.blocks.allocator import common_prefix
from kvcache.engine import Engine, RequestError, SamplingParams
from kvcache.memory import KVShape, paged_blocks_in_budget

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


@pytest.fixture(scope="module")
def model(one_thread):
    return kvcache.load_model()


@pytest.fixture(scope="module")
def tokenizer():
    return kvcache.load_tokenizer()


@pytest.fixture(scope="module")
def solo(model):
    """Greedy solo generate of (prompt ids, max tokens), memoised: the reference of every test."""
    memo: dict = {}

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            ids = torch.tensor([prompt])
            memo[key] = kvcache.generate(model, ids, max_new_tokens=max_tokens, eos_token_id=()).new_tokens[0]
        return memo[key]

    return run


def _assert_baseline(engine: Engine) -> None:
    """No row left, no block in use, the bookkeeping consistent."""
    allocator = engine.pool.cache.allocator
    allocator.check_invariants()
    assert not engine.running and not engine.waiting and not engine.pool.cache.rows
    assert allocator.num_in_use == 0 and allocator.num_free + allocator.num_cached == allocator.num_blocks


requests = st.lists(
    st.tuples(
        st.integers(0, 12),  # the step it arrives at
        st.lists(st.integers(0, 1023), min_size=1, max_size=48),  # prompt ids
        st.integers(1, 24),  # max tokens
        st.none() | st.integers(1, 30),  # cancelled this many steps after it arrived
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=requests,
    budget=st.sampled_from([8, 24, 64]),
    blocks=st.sampled_from([12, 40, 200]),
    shared=st.lists(st.integers(0, 1023), min_size=0, max_size=40),
    road=st.sampled_from(["kernels", "kernels and oneDNN", "torch"]),
)
def test_each_request_gives_its_solo_tokens_whatever_runs_beside_it(
    model, solo, batch, budget, blocks, shared, road
):
    """Random arrivals, prompt lengths (some sharing a prefix), max tokens, cancellations, token
    budgets (chunked prefill) and pool sizes (preemption), on every road a step takes (numba's
    kernels for every product, oneDNN's past two rows, the model's forward): greedy tokens equal
    the solo run, a cancelled request's are a prefix of it, and every block comes back."""
    backend = kvcache.backends.TorchBackend(model) if road == "torch" else "float32"
    engine = Engine(model, backend=backend, num_blocks=blocks, block_size=4, max_running=4,
                    token_budget=budget)
    rows = engine.backend.kernel_rows if road != "torch" else None
    if road != "torch":  # (the model's one numpy backend: put back below)
        engine.backend.kernel_rows = 1 << 30 if road == "kernels" else 2
    try:
        _run_and_check(engine, solo, batch, shared, blocks, budget)
    finally:
        if rows is not None:
            engine.backend.kernel_rows = rows


def _run_and_check(engine, solo, batch, shared, blocks, budget) -> None:
    """Submit `batch` (arrival step, prompt, max tokens, cancel after) to `engine` step by step;
    every request's tokens are its solo run's (a cancelled one's a prefix of them)."""
    batch = [
        (arrive, shared + prompt, min(max_tokens, 4 * blocks - len(shared + prompt)), cancel)
        for arrive, prompt, max_tokens, cancel in batch
        if len(shared + prompt) < 4 * blocks
    ]
    batch = [item for item in batch if item[2] >= 1]
    handles: dict[int, object] = {}
    step = 0
    while len(handles) < len(batch) or not all(h.done for h in handles.values()):
        for index, (arrive, prompt, max_tokens, cancel) in enumerate(batch):
            if arrive == step and index not in handles:
                handles[index] = engine.submit(prompt, max_tokens=max_tokens, ignore_eos=True)
            if cancel is not None and index in handles and step == arrive + cancel:
                handles[index].cancel()
        engine.step()
        step += 1
        assert step < 5000
    event(f"preempted: {engine.metrics.preemptions > 0}")
    event(f"chunked: {any(len(prompt) > budget for _, prompt, _, _ in batch)}")
    event(f"prefix hits: {engine.metrics.cached_prompt_tokens > 0}")
    event(f"requests: {len(batch)}")
    for index, (_, prompt, max_tokens, _) in enumerate(batch):
        result = handles[index].result()
        event(f"finish: {result.finish_reason}")
        expected = solo(prompt, max_tokens)
        if result.finish_reason == "cancelled":
            assert result.tokens == expected[: len(result.tokens)]
        else:
            assert result.finish_reason == "length" and result.tokens == expected, index
    _assert_baseline(engine)


def test_a_shared_system_prompt_is_served_from_cache(model, tokenizer, solo):
    engine = Engine(model, tokenizer, kv_budget="4MiB", block_size=16)
    system = tokenizer.encode("You answer questions about Python. " * 6)
    first = engine.submit(
        system + tokenizer.encode("What is a class?"), max_tokens=8, ignore_eos=True
    ).result()
    second = engine.submit(
        system + tokenizer.encode("What is a with?"), max_tokens=8, ignore_eos=True
    ).result()
    assert first.usage.cached_tokens == 0
    # every token the two prompts share: whole blocks, then the leading tokens of the next one
    assert second.usage.cached_tokens == common_prefix(first.prompt, second.prompt) > len(system)
    assert second.tokens == solo(second.prompt, 8)
    stats = engine.stats()
    assert stats["prefix_hit_rate"] == pytest.approx(
        second.usage.cached_tokens / (len(first.prompt) + len(second.prompt))
    )
    _assert_baseline(engine)


def test_preemption_recomputes_and_still_gives_the_solo_tokens(model, solo):
    """A pool too small for every running sequence: the newest are preempted and recomputed."""
    engine = Engine(model, num_blocks=16, block_size=4, max_running=4, token_budget=32)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1024, (12,), generator=generator).tolist() for _ in range(4)]
    handles = [engine.submit(prompt, max_tokens=16, ignore_eos=True) for prompt in prompts]
    results = [handle.result() for handle in handles]
    assert engine.metrics.preemptions > 0
    for prompt, result in zip(prompts, results):
        assert result.tokens == solo(prompt, 16)
    _assert_baseline(engine)


def test_a_hundred_random_cancellations_return_every_block(model):
    engine = Engine(model, num_blocks=64, block_size=4, max_running=6, token_budget=24)
    generator = torch.Generator().manual_seed(4)
    handles = []
    for _ in range(100):
        prompt = torch.randint(
            0, 1024, (int(torch.randint(1, 30, (1,), generator=generator)),), generator=generator
        ).tolist()
        handles.append(engine.submit(prompt, max_tokens=20, ignore_eos=True))
        for _ in range(int(torch.randint(0, 3, (1,), generator=generator))):
            engine.step()
        handles[int(torch.randint(0, len(handles), (1,), generator=generator))].cancel()
    for handle in handles:
        handle.cancel()
    while engine.step():
        pass
    assert all(handle.done for handle in handles)
    assert sum(h.result().finish_reason == "cancelled" for h in handles) >= 50
    _assert_baseline(engine)


def test_a_dropped_handle_cancels_its_request_and_frees_its_blocks(model):
    engine = Engine(model, num_blocks=64, block_size=4, max_running=4, token_budget=24)
    kept = engine.submit([5, 6, 7], max_tokens=12, ignore_eos=True)
    engine.submit([1, 2, 3, 4, 5, 6], max_tokens=40, ignore_eos=True)  # the handle is dropped at once
    engine.step()
    assert len(engine.running) == 1  # the dropped one never took a row
    assert kept.result().finish_reason == "length"
    assert engine.stats()["finished"] == {"cancelled": 1, "length": 1}
    _assert_baseline(engine)


def test_bad_requests_are_refused_at_submit_and_nothing_is_queued(model, tokenizer):
    for bad in (dict(num_blocks=0), dict(num_blocks=2.5), dict(kv_budget="1KiB"), dict(kv_budget=True)):
        with pytest.raises(RequestError, match="num_blocks|kv_budget"):
            Engine(model, **bad)
    engine = Engine(model, tokenizer, num_blocks=8, block_size=16)
    cases = [
        ([], {}, "holds no tokens"),
        ([1, 2], {"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ([1, 2], {"max_tokens": 10_000}, "past the model's context"),
        ([1, 2], {"max_tokens": 200}, "the KV pool holds 8 blocks"),
        ([1, 2], {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ([1, 2], {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ([1, 2], {"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ([1, 2], {"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ([1, 2], {"stop_token_ids": (5000,)}, r"stop_token_ids must lie in \[0, 1024\)"),
        ([1, 2], {"stop": ("",)}, "non-empty strings"),
        ([1, 5000], {}, r"prompt token ids must be ints in \[0, 1024\)"),
        ([1, 2], {"top_k": 0}, "top_k must be an integer >= 1"),
    ]
    for prompt, fields, match in cases:
        with pytest.raises(RequestError, match=match):
            engine.submit(prompt, **fields)
    assert engine.stats()["waiting"] == 0 and engine.metrics.submitted == 0
    with pytest.raises(RequestError, match="needs the engine's tokenizer"):
        Engine(model, num_blocks=8).submit("text")
    with pytest.raises(TypeError, match="max_new_tokens"):
        engine.submit([1, 2], max_new_tokens=4)  # a misspelt field, not ignored


def test_a_failing_stop_check_fails_that_request_only(model, solo):
    engine = Engine(model, num_blocks=64, block_size=4)
    good = engine.submit([1, 2, 3], max_tokens=6, ignore_eos=True)
    bad = engine.submit([4, 5, 6], max_tokens=6, ignore_eos=True)
    request = engine._incoming[-1]

    def broken(token):
        raise ValueError("a stop check that breaks")

    request.stop_rule.take = broken
    assert good.result().tokens == solo([1, 2, 3], 6)
    failed = bad.result()
    assert failed.finish_reason == "error" and "a stop check that breaks" in failed.error
    assert len(failed.tokens) == 1  # the token chosen before the check failed
    _assert_baseline(engine)


def test_the_pool_is_what_the_memory_planner_predicts(model):
    shape = KVShape.from_config(kvcache.defaults.default_model_dir())
    for budget in (2**20, 3 * 2**20 + 12345, 64 * 2**20):
        engine = Engine(model, kv_budget=budget, block_size=16)
        assert engine.num_blocks == paged_blocks_in_budget(shape, budget, 16, "float32")
        assert engine.pool.cache.nbytes == engine.num_blocks * engine.pool.block_bytes <= budget
    assert Engine(model, kv_budget="8MiB", block_size=16).capacity(256) == 8


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_keep_decoding(model, solo):
    engine = Engine(model, num_blocks=256, block_size=16, max_running=4, token_budget=40)
    running = [engine.submit([7, 8, 9], max_tokens=30, ignore_eos=True) for _ in range(3)]
    engine.step()  # their prefill, and each one's first token
    long_prompt = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    late = engine.submit(long_prompt, max_tokens=4, ignore_eos=True)
    request = engine._incoming[-1]
    steps = 0
    while not request.generated:
        counts = [len(r.generated) for r in engine.running if r.id != request.id]
        cap, before = engine.step_costs.prefill_cap(3), request.cached
        engine.step()
        steps += 1
        after = [len(r.generated) for r in engine.running if r.id != request.id]
        assert after == [count + 1 for count in counts], steps  # every decoding row moved on
        # the prompt took what was left of the step's budget, at most the measured cap
        assert 0 < request.cached - before <= min(40 - 3, cap)
        assert request.cached - before == min(40 - 3, cap, 300 - before)
    assert late.result().tokens == solo(long_prompt, 4)
    assert all(h.result().tokens == solo([7, 8, 9], 30) for h in running)


def test_the_background_thread_serves_submitters_on_other_threads(model, solo):
    engine = Engine(model, num_blocks=128, block_size=8, max_running=8)
    engine.start()
    try:
        results: dict[int, list[int]] = {}

        def client(index: int) -> None:
            prompt = [index + 1, index + 2, index + 3]
            results[index] = list(engine.submit(prompt, max_tokens=10, ignore_eos=True))

        threads = [threading.Thread(target=client, args=(index,)) for index in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert engine.running_in_background
    finally:
        engine.stop(timeout=10)
    assert not engine.running_in_background
    for index in range(6):
        assert results[index] == solo([index + 1, index + 2, index + 3], 10)


def test_sampling_penalties_and_biases_are_per_request_in_one_batch(model, solo):
    engine = Engine(model, num_blocks=128, block_size=8)
    prompt, other = [1, 2, 3], [4, 5, 6, 7]
    plain = solo(prompt, 24)
    asks = [
        SamplingParams(max_tokens=24, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(max_tokens=24, presence_penalty=2.0, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=24, logit_bias={str(plain[0]): -100}, ignore_eos=True),
        SamplingParams(max_tokens=24, ignore_eos=True),
    ]
    handles = [engine.submit(prompt, params) for params in asks[:3]] + [engine.submit(other, asks[3])]
    repeated, present, biased, beside = [handle.result().tokens for handle in handles]
    ids = torch.tensor([prompt])
    assert repeated == kvcache.generate(model, ids, max_new_tokens=24, eos_token_id=(),
                                        repetition_penalty=1.8).new_tokens[0]
    assert repeated != plain
    assert len(set(present)) > len(set(plain))  # fewer repetitions
    assert biased[0] != plain[0]
    assert beside == solo(other, 24)  # a row without any is untouched by its neighbours'


def test_sampling_params_are_per_request(model, tokenizer):
    engine = Engine(model, tokenizer, num_blocks=128, block_size=8)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=11, ignore_eos=True)
    first = engine.submit([1, 2, 3], sampled).result().tokens
    again = engine.submit([1, 2, 3], sampled).result().tokens
    other = engine.submit([1, 2, 3], SamplingParams(**{**sampled.__dict__, "seed": 12})).result().tokens
    assert first == again and first != other  # the seed is the request's own
    text = engine.submit("The with statement", max_tokens=40, stop=" statement", ignore_eos=True).result()
    assert text.finish_reason == "stop" and " statement" in tokenizer.decode(text.tokens)
    ids = engine.submit([1, 2, 3], max_tokens=20, ignore_eos=True).result().tokens
    stopped = engine.submit([1, 2, 3], max_tokens=20, ignore_eos=True, stop_token_ids=(ids[4],)).result()
    assert stopped.finish_reason == "stop" and stopped.tokens == ids[: ids.index(ids[4]) + 1]
    chat = engine.submit([{"role": "user", "content": "What is a class?"}], max_tokens=5).result()
    assert chat.usage.prompt_tokens == len(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is a class?"}], add_generation_prompt=True
        )
    )


def test_offline_generate_reports_progress_and_refuses_a_bad_batch_whole(model, solo, capsys):
    engine = Engine(model, num_blocks=128, block_size=8)
    seen: list[tuple[int, int]] = []
    prompts = [[1, 2], [3, 4, 5], [6]]
    results = engine.generate(
        prompts, max_tokens=5, ignore_eos=True, progress=lambda done, total: seen.append((done, total))
    )
    assert [r.tokens for r in results] == [solo(p, 5) for p in prompts]
    assert seen[-1] == (3, 3) and all(total == 3 for _, total in seen)
    engine.generate(prompts, max_tokens=2, progress=True)
    drawn = capsys.readouterr().err.splitlines()
    assert drawn and drawn[-1].startswith("kvcache engine [") and "3/3 requests finished" in drawn[-1]
    with pytest.raises(RequestError):
        engine.generate([[1, 2], []], max_tokens=5)
    assert engine.stats()["waiting"] == 0


@pytest.mark.parametrize("arch", ["mistral", "qwen2_mixed", "qwen2", "qwen3", "phi3", "olmo2", "gemma2"])
def test_every_model_family_is_served_including_sliding_windows(checkpoints, arch):
    """Windows of 4, shorter than every sequence: the sliding layers hold only their window's
    blocks, the full ones every token; tokens equal each request's solo generate."""
    model = kvcache.load_model(checkpoints[arch][0])
    engine = Engine(model, kv_budget="2MiB", block_size=4, max_running=3, token_budget=8)
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 259, (n,), generator=generator).tolist() for n in (5, 11, 17, 3)]
    prompts.append(prompts[2][:13] + [5, 6])  # a prefix hit on a sliding model: the window's blocks
    handles = [engine.submit(prompt, max_tokens=9, ignore_eos=True) for prompt in prompts]
    for prompt, handle in zip(prompts, handles):
        expected = kvcache.generate(model, torch.tensor([prompt]), max_new_tokens=9, eos_token_id=())
        assert handle.result().tokens == expected.new_tokens[0], prompt
    assert handles[-1].result().usage.cached_tokens == 13  # 3 whole blocks, then 1 token of the 4th
    for allocator in engine.pool.cache.allocators:
        allocator.check_invariants()
        assert allocator.num_in_use == 0
    windows = [allocator.window for allocator in engine.pool.cache.allocators]
    assert (4 in windows) == (model.config.sliding_window is not None)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_bfloat16_model_is_served_by_the_half_step_and_differs_from_solo_runs_only_at_near_ties(
    checkpoints, arch
):
    """The engine's batched step on bfloat16 weights is the half step. Rounding in bfloat16
    depends on how rows are batched and prompts chunked, so a request's tokens may leave its solo
    run's, but only where two tokens' logits are a near tie: at the first difference the float32
    forward of the same weights scores the two within a few bfloat16 steps of its largest logit."""
    model = kvcache.load_model(checkpoints[arch][0], dtype="bfloat16")
    exact = kvcache.load_model(checkpoints[arch][0], dtype="bfloat16").float()
    engine = Engine(model, kv_budget="2MiB", block_size=4, max_running=3, token_budget=8)
    assert engine.backend.name == "half"
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 259, (n,), generator=generator).tolist() for n in (5, 11, 17, 3)]
    handles = [engine.submit(prompt, max_tokens=9, ignore_eos=True) for prompt in prompts]
    for prompt, handle in zip(prompts, handles):
        served = handle.result().tokens
        solo = kvcache.generate(model, torch.tensor([prompt]), max_new_tokens=9, eos_token_id=(),
                                backend="half").new_tokens[0]
        differ = [i for i, (a, b) in enumerate(zip(served, solo)) if a != b]
        if differ:
            at = differ[0]
            with torch.no_grad():
                logits = exact(torch.tensor([prompt + served[:at]])).logits[0, -1]
            gap = float((logits[served[at]] - logits[solo[at]]).abs())
            assert gap <= 8 * torch.finfo(torch.bfloat16).eps * float(logits.abs().max()), (prompt, at, gap)


def test_warming_up_runs_every_road_a_step_takes_then_starts_the_counters_again(model):
    engine = Engine(model, num_blocks=64, block_size=8)
    seen = []
    step = engine.backend.step

    def spy(model, batch):
        seen.append((len(batch.rows), sum(map(len, batch.tokens))))
        return step(model, batch)

    engine.backend.step = spy
    engine.warm_up()
    assert any(tokens > rows for rows, tokens in seen)  # a prompt chunk beside single tokens
    assert any(rows > engine.backend.kernel_rows and tokens == rows for rows, tokens in seen)  # many decode
    assert (1, 1) in seen  # one row alone
    assert engine.metrics.steps == 0 and engine.metrics.generated_tokens == 0
    assert engine.step_costs.prefill_cap(1) == engine.step_costs.initial  # costs measured afresh
    _assert_baseline(engine)
    # what the warm-up left cached is no one's: prompts that start as its requests did attach none
    for prompt in ([0] * 41, [1, 2, 3], [0, 5, 6], [4, 4]):
        assert engine.pool.cache.prefix_cost(prompt) == (0, 0), prompt


@pytest.mark.parametrize("kv_dtype, key_rows", [("int8", np.uint8), ("int4", np.uint8),
                                                ("fp8/bfloat16", np.int8)])
def test_quantized_blocks_give_a_solo_run_on_a_quantized_cache_through_preemption_and_prefixes(
    model, kv_dtype, key_rows
):
    """The pool's blocks stored in a kv_dtype (`kv_dtype`): each token's row is quantized on its
    own, so how a prompt was chunked, whether its prefix was attached from another request's
    blocks and whether it was preempted and recomputed change nothing: greedy tokens equal a solo
    generate on a quantized PagedCache (the seam's torch arithmetic, the kernels' own)."""
    from kvcache.cache import PagedCache

    def solo_quantized(prompt, max_tokens):
        cache = PagedCache(64, 4, config=model.config, dtype=model.dtype, kv_dtype=kv_dtype)
        return kvcache.generate(model, torch.tensor([prompt]), cache=cache, max_new_tokens=max_tokens,
                                eos_token_id=()).new_tokens[0]

    engine = Engine(model, num_blocks=24, block_size=4, max_running=4, token_budget=16, kv_dtype=kv_dtype)
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 1024, (9,), generator=generator).tolist()
    prompts = [shared + torch.randint(0, 1024, (n,), generator=generator).tolist() for n in (3, 14, 6, 1, 20)]
    handles = [engine.submit(prompt, max_tokens=14, ignore_eos=True) for prompt in prompts]
    results = [handle.result() for handle in handles]
    assert engine.metrics.preemptions > 0 and engine.metrics.cached_prompt_tokens > 0
    for prompt, result in zip(prompts, results):
        assert result.tokens == solo_quantized(prompt, 14)
    assert engine.pool.cache.layers[0].storage_rows()[0].dtype == key_rows  # (bfloat16 as its bits)
    _assert_baseline(engine)


def test_a_full_precision_window_wider_than_every_request_answers_as_full_precision(model, solo):
    """kv_window: each running row's last tokens kept in the model's dtype beside int4 blocks.
    A window wider than every request reads none of them as stored: through preemption (rows
    recomputed, without prefix caching) the greedy tokens equal a full-precision solo run; the
    same int4 pool without the window changes some."""
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1024, (n,), generator=generator).tolist() for n in (12, 23, 17, 10, 29)]
    answers = {}
    for window in (0, 48):
        engine = Engine(model, num_blocks=24, block_size=4, max_running=4, token_budget=16, kv_dtype="int4",
                        kv_window=window, prefix_caching=False)
        handles = [engine.submit(prompt, max_tokens=14, ignore_eos=True) for prompt in prompts]
        answers[window] = [handle.result().tokens for handle in handles]
        assert engine.metrics.preemptions > 0
        _assert_baseline(engine)
    expected = [solo(prompt, 14) for prompt in prompts]
    assert answers[48] == expected
    assert answers[0] != expected


def test_a_full_precision_windows_bytes_come_out_of_the_budget(model):
    plain = Engine(model, kv_budget="1MiB", block_size=4, max_running=4, kv_dtype="int8")
    windowed = Engine(model, kv_budget="1MiB", block_size=4, max_running=4, kv_dtype="int8", kv_window=32)
    config = model.config
    window_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * 32 * (
        config.hidden_size // config.num_attention_heads) * 4 * 4  # (float32, 4 rows)
    assert windowed.num_blocks == (2**20 - window_bytes) // plain.pool.block_bytes
    assert plain.num_blocks == 2**20 // plain.pool.block_bytes
    with pytest.raises(RequestError, match="kv_window"):
        Engine(model, num_blocks=8, kv_window=8)
    with pytest.raises(RequestError, match="kv_window"):
        Engine(model, num_blocks=8, kv_dtype="int8", kv_window=-1)
    with pytest.raises(RequestError, match="kv_window"):
        Engine(model, kv_budget=window_bytes, max_running=4, kv_dtype="int8", kv_window=32)


def test_a_repeated_request_answers_as_its_first_copy_under_a_full_precision_window(model):
    """kv_window keeps a row's last tokens exact, but a prefix attached from the cache comes as
    stored: a hit may cover only the prompt before its last kv_window tokens, so the same
    request sent again reads what its first copy read (and answers the same), with a hit."""
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1024, (n,), generator=generator).tolist() for n in (30, 41, 27, 36)]
    engine = Engine(model, num_blocks=96, block_size=4, max_running=1, kv_dtype="int4", kv_window=16)
    first = [engine.submit(prompt, max_tokens=12, ignore_eos=True).result() for prompt in prompts]
    again = [engine.submit(prompt, max_tokens=12, ignore_eos=True).result() for prompt in prompts]
    assert [result.tokens for result in again] == [result.tokens for result in first]
    for prompt, result in zip(prompts, again):
        assert 0 < result.usage.cached_tokens <= len(prompt) - 16
    _assert_baseline(engine)
