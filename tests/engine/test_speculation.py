"""Speculative decoding in the engine (`kvcache.engine.speculation`): rows with drafts beside rows
without, drafts refused at every position, preemption and prefix sharing with a draft in flight;
every request gets its solo greedy tokens, and the pool's blocks and published events are plain
decoding's."""

from __future__ import annotations

import random

import pytest
import torch
from gguf_files import write_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import generate, load_model
from kvcache.engine import Engine
from kvcache.engine.speculation import RowDrafts
from kvcache.generation.params import RequestError, SamplingParams
from kvcache.generation.speculative import DraftLength, NgramDrafts

pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def q8_model(checkpoints, tmp_path_factory, one_thread):
    """A tiny qwen2 from a Q8_0 file read with q8 activations: the blocks backend, chunk-invariant."""
    folder = tmp_path_factory.mktemp("spec")
    path = write_gguf(checkpoints["qwen2"][0], folder / "q8.gguf", tensor_type="Q8_0")
    return load_model(path, activations="q8")


@pytest.fixture(scope="module")
def solo(q8_model):
    """Greedy solo `generate` of (prompt, max tokens), memoised."""
    memo: dict = {}

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            result = generate(q8_model, torch.tensor([prompt]), max_new_tokens=max_tokens, eos_token_id=())
            memo[key] = result.new_tokens[0]
        return memo[key]

    return run


def _prompt(vocab: int, seed: int, repeating: bool) -> list[int]:
    """A prompt that repeats spans of itself (drafts are found, its continuation often repeats
    them), or random tokens (drafts seldom found, and refused)."""
    pick = random.Random(seed)
    if not repeating:
        return [pick.randrange(vocab) for _ in range(pick.randint(3, 20))]
    span = [pick.randrange(vocab) for _ in range(pick.randint(3, 8))]
    noise = [pick.randrange(vocab) for _ in range(pick.randint(1, 5))]
    return span + noise + span + noise[:2] + span


class _Stored:
    """A block allocator's listener: the digests of the blocks made findable."""

    def __init__(self) -> None:
        self.digests: set[bytes] = set()

    def stored(self, digests, parent, token_ids) -> None:
        self.digests.update(digests)

    def removed(self, digest) -> None:
        pass


def _run(model, prompts, params, draft_lengths=None, **settings):
    """The completions of `prompts` (each with its params) submitted together, the engine's
    stored digests and stats; draft_lengths: a Random that picks each draft's length."""
    engine = Engine(model, backend="auto", block_size=4, **settings)
    stored = _Stored()
    engine.pool.cache.allocator.listener = stored
    handles = [engine.submit(prompt, param) for prompt, param in zip(prompts, params)]
    completions = [handle.result() for handle in handles]
    allocator = engine.pool.cache.allocator
    allocator.check_invariants()
    assert allocator.num_in_use == 0 and not engine.running
    return completions, stored.digests, engine.stats()


def _oracle(monkeypatch, solo, prompts, most: int, pick: random.Random, vocab: int = 272) -> None:
    """Drafts that are the request's solo greedy continuation with one token changed at a random
    place (or none): drafts taken whole, refused at their first token, and anywhere between."""
    by_prompt = {tuple(prompt): solo(prompt, most) for prompt in prompts}

    def draft(self, count: int) -> list[int]:
        for prompt, truth in by_prompt.items():
            if tuple(self.tokens[: len(prompt)]) == prompt and self.tokens[len(prompt) :] == truth[
                    : len(self.tokens) - len(prompt)]:
                made = truth[len(self.tokens) - len(prompt) :][:count]
                wrong = pick.randint(0, len(made))
                return [token if at != wrong else (token + 1) % vocab for at, token in enumerate(made)]
        return []

    monkeypatch.setattr(NgramDrafts, "draft", draft)


def _random_lengths(monkeypatch, pick: random.Random) -> None:
    """Drafts of random lengths, up to the longest (rejections land anywhere)."""
    monkeypatch.setattr(DraftLength, "next", lambda self: pick.randint(0, self.most))


cases = st.lists(
    st.tuples(st.integers(0, 10_000), st.booleans(), st.booleans(), st.integers(1, 20)),
    min_size=1, max_size=5,
)  # (prompt seed, repeating, speculates, max tokens)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(cases=cases, lengths_seed=st.integers(0, 1000))
def test_rows_with_and_without_drafts_get_their_solo_greedy_tokens(q8_model, solo, monkeypatch, cases,
                                                                    lengths_seed):
    _random_lengths(monkeypatch, random.Random(lengths_seed))
    vocab = q8_model.config.vocab_size
    prompts = [_prompt(vocab, seed, repeating) for seed, repeating, _, _ in cases]
    params = [SamplingParams(max_tokens=most, ignore_eos=True, speculate="ngram" if spec else None)
              for _, _, spec, most in cases]
    fast, fast_stored, stats = _run(q8_model, prompts, params, max_running=4, token_budget=64)
    plain, plain_stored, _ = _run(q8_model, prompts, [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True)
                                                      for p in params], max_running=4, token_budget=64)
    for prompt, param, done, reference in zip(prompts, params, fast, plain):
        assert done.tokens == reference.tokens == solo(prompt, param.max_tokens)
        assert done.finish_reason == "length"
        assert done.usage.accepted_tokens <= done.usage.drafted_tokens
        if param.speculate is None:
            assert done.usage.drafted_tokens == 0
    assert fast_stored == plain_stored  # no draft's block ever findable or published
    assert stats["drafted_tokens"] == sum(done.usage.drafted_tokens for done in fast)
    assert stats["accepted_tokens"] == sum(done.usage.accepted_tokens for done in fast)


def test_drafts_are_refused_at_every_position_and_the_tokens_stay_plain(q8_model, solo, monkeypatch):
    """Drafts of four tokens, each the solo continuation changed at a random place or not at all:
    the verdicts (tokens accepted of a draft) cover every count from 0 to a whole draft."""
    verdicts: list[tuple[int, int]] = []
    original = RowDrafts.verified
    monkeypatch.setattr(RowDrafts, "verified", lambda self, drafted, accepted: (
        verdicts.append((drafted, accepted)), original(self, drafted, accepted))[1])
    monkeypatch.setattr(DraftLength, "next", lambda self: 4)
    vocab = q8_model.config.vocab_size
    prompts = [_prompt(vocab, seed, seed % 3 != 0) for seed in range(12)]
    _oracle(monkeypatch, solo, prompts, 24, random.Random(2))
    params = [SamplingParams(max_tokens=24, ignore_eos=True, speculate="ngram")] * len(prompts)
    fast, _, stats = _run(q8_model, prompts, params, max_running=6, token_budget=64)
    for prompt, done in zip(prompts, fast):
        assert done.tokens == solo(prompt, 24)
    accepted = {taken for drafted, taken in verdicts if drafted == 4}
    assert accepted == {0, 1, 2, 3, 4}, verdicts
    assert stats["drafted_tokens"] > stats["accepted_tokens"] > 0


def test_a_pool_too_small_for_every_row_preempts_rows_mid_draft_and_their_tokens_stay_plain(
        q8_model, solo, monkeypatch):
    _random_lengths(monkeypatch, random.Random(5))
    vocab = q8_model.config.vocab_size
    prompts = [_prompt(vocab, seed, True) for seed in range(6)]
    _oracle(monkeypatch, solo, prompts, 20, random.Random(6))
    params = [SamplingParams(max_tokens=20, ignore_eos=True, speculate="ngram")] * len(prompts)
    longest = max(len(prompt) for prompt in prompts) + 20
    fast, _, stats = _run(q8_model, prompts, params, max_running=6, token_budget=64,
                          num_blocks=-(-longest // 4) + 6)
    assert stats["preemptions"] > 0 and stats["drafted_tokens"] > 0
    for prompt, done in zip(prompts, fast):
        assert done.tokens == solo(prompt, 20)


def test_a_request_sharing_a_prefix_with_a_speculating_one_reads_only_accepted_blocks(q8_model, solo,
                                                                                      monkeypatch):
    """A request arrives while another drafts, its prompt the other's prompt and the tokens it has
    taken so far: it attaches the speculating row's blocks and gets its solo tokens; a third whose
    prompt is the first's whole reply finds the same cached tokens with and without speculation."""
    monkeypatch.setattr(DraftLength, "next", lambda self: 5)
    prompt = _prompt(q8_model.config.vocab_size, 3, True)
    _oracle(monkeypatch, solo, [prompt], 24, random.Random(8))
    found = {}
    for speculate in ("ngram", "off"):
        engine = Engine(q8_model, backend="auto", block_size=4, max_running=4, token_budget=64)
        handle = engine.submit(prompt, max_tokens=24, ignore_eos=True, speculate=speculate)
        while not engine.running or len(engine.running[0].generated) < 9:
            engine.step()
        taken = engine.running[0].generated
        sharing = prompt + taken[:9] + [5]
        second = engine.submit(sharing, max_tokens=12, ignore_eos=True).result()
        first = handle.result()
        assert first.tokens == solo(prompt, 24) and second.tokens == solo(sharing, 12)
        assert second.usage.cached_tokens >= (len(prompt) + 8) // 4 * 4  # (the first's blocks)
        follow = engine.submit(prompt + first.tokens + [5], max_tokens=4, ignore_eos=True).result()
        assert follow.tokens == solo(prompt + first.tokens + [5], 4)
        found[speculate] = (follow.usage.cached_tokens, first.usage.accepted_tokens)
        engine.pool.cache.allocator.check_invariants()
    assert found["ngram"][0] == found["off"][0] and found["ngram"][1] > 0


def test_a_seeded_sampled_request_gets_the_same_tokens_and_logprobs_with_drafts(q8_model, solo, monkeypatch):
    """Seeded sampling with a repetition penalty and log-probs asked: each position's token drawn
    from the request's own generator as plain decoding draws it, its penalties counting the
    tokens taken before it in the same step."""
    vocab = q8_model.config.vocab_size
    prompts = [_prompt(vocab, seed, True) for seed in range(4)]
    _oracle(monkeypatch, solo, prompts, 16, random.Random(3))
    runs = []
    for speculate in ("ngram", "off"):
        params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.05, seed=seed, logprobs=2,
                                 repetition_penalty=1.1, speculate=speculate) for seed in range(len(prompts))]
        runs.append(_run(q8_model, prompts, params, max_running=4)[0])
    assert [done.tokens for done in runs[0]] == [done.tokens for done in runs[1]]
    assert [done.logprobs for done in runs[0]] == [done.logprobs for done in runs[1]]
    assert sum(done.usage.accepted_tokens for done in runs[0]) > 0


def test_stops_inside_an_accepted_draft_emit_nothing_past_them(q8_model, solo, monkeypatch):
    """A stop token among the tokens a draft gives: the request ends there, as plain decoding's."""
    monkeypatch.setattr(DraftLength, "next", lambda self: 6)
    vocab = q8_model.config.vocab_size
    prompts = [_prompt(vocab, seed, True) for seed in range(8)]
    _oracle(monkeypatch, solo, prompts, 20, random.Random(4))
    for prompt in prompts:
        reference = solo(prompt, 20)
        stop = reference[len(reference) // 2]
        expected = reference[: reference.index(stop) + 1]
        engine = Engine(q8_model, backend="auto", block_size=4, speculate="ngram")
        done = engine.submit(prompt, max_tokens=20, ignore_eos=True, stop_token_ids=[stop]).result()
        assert done.tokens == expected and done.finish_reason == "stop"
        engine.pool.cache.allocator.check_invariants()


def test_the_engine_default_speculates_and_a_request_opts_out(q8_model, solo):
    engine = Engine(q8_model, backend="auto", block_size=4, speculate="ngram")
    prompt = _prompt(q8_model.config.vocab_size, 1, True)
    default = engine.submit(prompt, max_tokens=20, ignore_eos=True).result()
    off = engine.submit(prompt, max_tokens=20, ignore_eos=True, speculate="off").result()
    assert default.tokens == off.tokens == solo(prompt, 20)
    assert default.usage.drafted_tokens > 0 and off.usage.drafted_tokens == 0
    assert engine.stats()["drafted_tokens"] == default.usage.drafted_tokens
    plain = Engine(q8_model, backend="auto", block_size=4)
    assert plain.submit(prompt, max_tokens=20, ignore_eos=True).result().usage.drafted_tokens == 0


def test_a_row_decoding_alone_times_its_steps_for_its_draft_length(q8_model, monkeypatch):
    """Alone in its steps, a row's draft length learns what a further token costs from their
    seconds (one-token steps and longer ones); beside other rows it does not."""
    timed: list[int] = []
    original = DraftLength.timed
    monkeypatch.setattr(DraftLength, "timed", lambda self, tokens, seconds: (
        timed.append(tokens), original(self, tokens, seconds))[1])
    prompt = _prompt(q8_model.config.vocab_size, 1, True)
    engine = Engine(q8_model, backend="auto", block_size=4, speculate="ngram")
    done = engine.submit(prompt, max_tokens=20, ignore_eos=True).result()
    assert done.usage.drafted_tokens > 0 and 1 in timed and max(timed) > 1
    timed.clear()
    handles = [engine.submit(prompt, max_tokens=8, ignore_eos=True) for _ in range(2)]
    assert [handle.result().tokens for handle in handles] == [done.tokens[:8]] * 2
    assert len(timed) <= 2  # (only steps where one row is left decoding)


def test_speculation_is_refused_where_it_could_change_a_token(q8_model, checkpoints):
    with pytest.raises(RequestError, match="speculate must be None or one of"):
        SamplingParams(speculate="eagle")
    with pytest.raises(RequestError, match="speculate must be None or one of"):
        Engine(q8_model, backend="auto", speculate="off")
    float32_model = load_model(checkpoints["llama"][0])
    with pytest.raises(RequestError, match="speculate='ngram': the engine's backend 'float32'"):
        Engine(float32_model, speculate="ngram")
    engine = Engine(float32_model)
    with pytest.raises(RequestError, match="speculate='ngram'.*chunk_invariant"):
        engine.submit([1, 2, 3], speculate="ngram")
    assert engine.submit([1, 2, 3], max_tokens=2, speculate="off").result().finish_reason == "length"
    with pytest.raises(RequestError, match="kv_dtype='int8'"):
        Engine(q8_model, backend="auto", kv_dtype="int8", speculate="ngram")
