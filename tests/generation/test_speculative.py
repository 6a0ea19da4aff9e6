"""Speculative decoding on `generate`'s paged road (`kvcache.generation.speculative`): the drafts,
their length, and the property that matters: the tokens are the tokens of plain decoding, to the
bit, greedy or sampled, on a backend whose steps are chunk-invariant."""

from __future__ import annotations

import pytest
import torch
from gguf_files import write_gguf

from kvcache import load_model
from kvcache.backends import choose_backend
from kvcache.cache import PagedBatch, make_cache
from kvcache.generation import generate
from kvcache.generation.speculative import DraftLength, NgramDrafts


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_longest_ending_ngram():
    drafts = NgramDrafts(longest=3)
    drafts.extend([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    assert drafts.draft(4) == [2, 3, 6, 7]  # "6 7" last seen before the end at index 6..7
    drafts.extend([8])  # "6 7 8" ends it now: its only earlier occurrence wins over "7 8"
    assert drafts.draft(2) == [9, 1]
    assert NgramDrafts().draft(3) == []
    lone = NgramDrafts()
    lone.extend([4, 4])
    assert lone.draft(5) == [4]  # (what follows it: only the tokens there are)
    with pytest.raises(ValueError, match="shortest"):
        NgramDrafts(longest=2, shortest=3)


def test_the_draft_length_follows_what_drafts_give_and_what_longer_steps_cost():
    length = DraftLength(most=15)
    assert length.next() == 1  # (the prior: a short draft, to learn)
    for _ in range(6):
        length.taken(4, 4)  # drafts taken whole: longer ones pay
    assert 1 < length.next() < 15
    length.timed(1, 0.010)
    for _ in range(40):
        length.timed(9, 0.0108)  # further tokens nearly free (a wide machine): the longest
    assert length.slope < 0.05 and length.next() == 15
    length = DraftLength(most=15)  # (a step's further tokens cost: SLOPE)
    for _ in range(20):
        length.taken(3, 0)  # every draft refused: plain decoding
    assert length.next() == 0
    steps = 0
    while length.next() == 0:  # plain steps drift back toward the prior: a draft is tried again
        length.taken(0, 0)
        steps += 1
    assert 0 < steps < 100


@pytest.fixture(scope="module")
def q8_model(checkpoints, tmp_path_factory):
    """A tiny qwen2 (biases on q, k, v) from a Q8_0 file, its products reading 8-bit activations:
    the blocks backend, whose steps are chunk-invariant."""
    folder = tmp_path_factory.mktemp("spec")
    path = write_gguf(checkpoints["qwen2"][0], folder / "q8.gguf", tensor_type="Q8_0")
    return load_model(path, activations="q8")


@pytest.mark.kernels
def test_a_step_gives_the_logits_of_a_rows_last_tokens_each_as_it_gets_them_alone(q8_model):
    backend = choose_backend(q8_model, "auto")
    assert backend.name == "blocks" and backend.chunk_invariant
    ids = torch.randint(0, q8_model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(3))
    ids = ids.tolist()

    def steps(chunks, wanted):
        cache = make_cache("paged", config=q8_model.config, dtype=q8_model.dtype, max_batch_size=1,
                           max_cache_len=40, block_size=4)
        cache.add_sequence()
        out = []
        for chunk in chunks:
            batch = PagedBatch(cache, [0], [chunk], [wanted(chunk)])
            cache.reserve(batch.rows, batch.totals)
            out.append(backend.step(q8_model, batch))
            cache.commit(batch.rows, batch.totals)
        return torch.cat(out)

    one_by_one = steps([ids[:20]] + [[token] for token in ids[20:]], lambda chunk: 1)
    together = steps([ids[:20], ids[20:]], lambda chunk: 1 if len(chunk) == 20 else len(chunk))
    assert together.shape == one_by_one.shape == (11, q8_model.config.vocab_size)
    assert torch.equal(together, one_by_one)


def _repetitive_prompts(vocab: int, count: int) -> list[torch.Tensor]:
    """Prompts that repeat spans of themselves (so drafts are found), of random lengths."""
    generator = torch.Generator().manual_seed(11)
    prompts = []
    for _ in range(count):
        lengths = (torch.randint(low, high, (1,), generator=generator) for low, high in ((3, 9), (1, 6)))
        span, noise = (torch.randint(0, vocab, (int(n),), generator=generator) for n in lengths)
        prompts.append(torch.cat([span, noise, span, noise[:2], span])[None])
    return prompts


@pytest.mark.kernels
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("lengths", ["chosen", "random", "longest"])
def test_speculation_gives_the_tokens_of_plain_decoding_to_the_bit(q8_model, sampled, lengths, monkeypatch):
    """Whatever the drafts' lengths (as chosen, random, always the longest: drafts running up to
    the last token the call makes), the tokens and what the cache holds are plain decoding's."""
    import random

    pick = random.Random(7)
    if lengths != "chosen":
        monkeypatch.setattr(DraftLength, "next", lambda self: self.most if lengths == "longest"
                            else pick.randint(0, self.most))
    drafted = accepted = 0
    options = dict(max_new_tokens=24, eos_token_id=(), do_sample=sampled, temperature=0.05)
    for seed, prompt in enumerate(_repetitive_prompts(q8_model.config.vocab_size, 6)):
        plain = generate(q8_model, prompt, generator=torch.Generator().manual_seed(seed), **options)
        for most in (1, 3, None):
            fast = generate(q8_model, prompt, generator=torch.Generator().manual_seed(seed),
                            speculate="ngram", draft_tokens=most, **options)
            assert fast.new_tokens == plain.new_tokens
            assert fast.cache.get_seq_length() == plain.cache.get_seq_length()  # drafts trimmed
            drafted, accepted = drafted + fast.drafted_tokens, accepted + fast.accepted_tokens
    assert drafted > accepted > 0  # drafts ran, some were taken and some refused


@pytest.mark.kernels
def test_a_speculative_cache_continues_as_a_plain_one(q8_model):
    options = dict(max_new_tokens=10, eos_token_id=())
    for prompt in _repetitive_prompts(q8_model.config.vocab_size, 6):
        caches = [make_cache("paged", config=q8_model.config, dtype=q8_model.dtype, max_batch_size=1,
                             max_cache_len=80, block_size=4) for _ in range(2)]
        results = [generate(q8_model, prompt, cache=cache, **options, **extra)
                   for cache, extra in zip(caches, ({}, {"speculate": "ngram"}))]
        if results[1].drafted_tokens:  # (a prompt whose output repeats it: drafts ran, some refused)
            break
    assert results[0].new_tokens == results[1].new_tokens and results[1].drafted_tokens > 0
    following = torch.tensor([[7, 8, 9]])
    after = [generate(q8_model, following, cache=cache, **options).new_tokens for cache in caches]
    assert after[0] == after[1]


@pytest.mark.kernels
def test_drafts_longer_than_the_layer_kernels_steps_still_give_plain_decodings_tokens(q8_model):
    """A draft of up to 30 tokens: its verify step runs past `kernel_rows` (the products outside
    the layer calls, each token's norms and attention on the kernels' own functions)."""
    pattern = torch.randint(3, q8_model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(9))
    prompt = pattern.repeat(3)[None]  # (its continuation drafts whole spans of the pattern)
    options = dict(max_new_tokens=40, eos_token_id=())
    plain = generate(q8_model, prompt, cache="paged", **options)
    fast = generate(q8_model, prompt, cache="paged", speculate="ngram", draft_tokens=30, **options)
    assert fast.new_tokens == plain.new_tokens
    assert fast.drafted_tokens > 0


@pytest.mark.kernels
def test_speculation_is_refused_where_it_could_change_a_token(q8_model, checkpoints):
    prompt = torch.tensor([[1, 2, 3, 1, 2]])
    with pytest.raises(ValueError, match="one row"):
        generate(q8_model, prompt.repeat(2, 1), speculate="ngram")
    with pytest.raises(ValueError, match="cache='paged'"):
        generate(q8_model, prompt, cache="dynamic", speculate="ngram")
    with pytest.raises(ValueError, match="give speculate"):
        generate(q8_model, prompt, draft_tokens=3)
    with pytest.raises(ValueError, match="speculate must be None or one of"):
        generate(q8_model, prompt, speculate="eagle")
    float32_model = load_model(checkpoints["llama"][0])
    with pytest.raises(ValueError, match="backend 'float32' sums a step"):
        generate(float32_model, prompt, speculate="ngram")


def test_the_torch_step_gives_a_rows_last_tokens_logits_as_its_forward_does(checkpoints):
    model = load_model(checkpoints["llama"][0])
    backend = choose_backend(model, "torch")
    ids = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    ids = ids.tolist()
    cache = make_cache("paged", config=model.config, dtype=model.dtype, max_batch_size=1, max_cache_len=16)
    cache.add_sequence()
    batch = PagedBatch(cache, [0], [ids], [4])
    cache.reserve(batch.rows, batch.totals)
    with torch.inference_mode():
        logits = backend.step(model, batch)
        whole = model(torch.tensor([ids])).logits[0, -4:].float()
    assert logits.shape == (4, model.config.vocab_size)
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
