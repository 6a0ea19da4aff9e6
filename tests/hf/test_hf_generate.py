"""kvcache caches as `past_key_values` of transformers models: every kind gives transformers' own
greedy tokens and logits, in `generate` and in the caching guide's hand-written loop, with either
spelling of the argument, on padded batches, and with a reused prompt prefix."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import ARCHS, WINDOW, hf_model, left_padded_batch

import kvcache
import kvcache.hf as kh

NEW_TOKENS = 9
WINDOWED_EVERY_LAYER = ("mistral", "phi3")  # a config window on every layer: the sliding kind fits


@pytest.fixture(scope="module")
def models():
    built = {}
    for arch in ARCHS:
        torch.manual_seed(ARCHS.index(arch))
        built[arch] = hf_model(arch)
    return built


def kinds_for(arch: str) -> list[str]:
    return ["dynamic", "static", "paged", "quantized"] + (["sliding"] if arch in WINDOWED_EVERY_LAYER else [])


def kvcache_cache(kind: str, config, **sizes) -> kvcache.Cache:
    if kind == "sliding":
        return kvcache.make_cache("sliding", config=config, window=config.sliding_window)
    if kind == "quantized":  # a residual shorter than the run: some rows are really quantized
        return kvcache.make_cache("quantized", config=config, bits=8, group_size=16, residual_length=4)
    return kvcache.make_cache(kind, config=config, max_cache_len=64, **sizes)


def greedy(model, ids, mask=None, **cache):
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
        return_dict_in_generate=True, output_logits=True, pad_token_id=0, **cache,
    )
    return out.sequences, torch.stack(out.logits, 1)  # (B, T + N), (B, N, vocab)


CASES = [(arch, kind) for arch in ARCHS for kind in kinds_for(arch)]


@pytest.mark.parametrize("arch, kind", CASES)
@pytest.mark.parametrize("prompt_length", [1, 2 * WINDOW + 3])
def test_generate_with_a_kvcache_cache_matches_transformers_dynamic_cache(models, arch, kind, prompt_length):
    model = models[arch]
    ids = torch.randint(3, 259, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    tokens, logits = greedy(model, ids, cache=transformers.DynamicCache(config=model.config))
    cache = kvcache_cache(kind, model.config, block_size=4)
    ours, our_logits = greedy(model, ids, cache=kh.to_transformers(cache))
    if kind == "quantized":  # lossy: test_quantized_drift_matches_kvcache_models measures how much
        assert (ours == tokens).float().mean() >= 0.8
        return
    assert torch.equal(ours, tokens)
    torch.testing.assert_close(our_logits, logits, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == prompt_length + NEW_TOKENS - 1  # the cache held the run


PADDED = [(arch, kind) for arch in ("llama", "mistral", "gemma2") for kind in ("dynamic", "static", "paged")]


@pytest.mark.parametrize("arch, kind", [*PADDED, ("mistral", "sliding"), ("phi3", "sliding")])
def test_left_padded_batch_rows_equal_their_solo_runs(models, arch, kind):
    model = models[arch]
    ids, mask = left_padded_batch((11, 6, 2))
    cache = kvcache_cache(kind, model.config, max_batch_size=ids.shape[0])
    batch, _ = greedy(model, ids, mask, cache=kh.to_transformers(cache))
    for row in range(ids.shape[0]):
        real = ids[row : row + 1, mask[row].bool()]
        solo, _ = greedy(model, real, cache=kh.to_transformers(kvcache_cache(kind, model.config)))
        assert batch[row, ids.shape[1] :].tolist() == solo[0, real.shape[1] :].tolist(), row


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_both_spellings_of_the_cache_argument_work_in_forward_and_generate(models, arch):
    model = models[arch]
    ids = torch.randint(3, 259, (1, 7), generator=torch.Generator().manual_seed(1))
    expected, _ = greedy(model, ids, past_key_values=transformers.DynamicCache(config=model.config))
    spelled_new, _ = greedy(model, ids, cache=kh.DynamicCache(config=model.config))
    assert torch.equal(spelled_new, expected)
    reference = model(ids, past_key_values=transformers.DynamicCache(config=model.config)).logits
    for keyword in ("cache", "past_key_values"):
        cache = kh.StaticCache(1, 32, config=model.config)
        logits = model(ids, use_cache=True, **{keyword: cache}).logits
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
        assert cache.get_seq_length() == 7


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_the_caching_guides_loop_runs_with_kvcaches_dynamic_cache(models, arch):
    model = models[arch]

    def guide_loop(cache_class):  # the guide's loop; only the cache class differs
        past_key_values = cache_class(config=model.config)
        input_ids = torch.randint(3, 259, (1, 10), generator=torch.Generator().manual_seed(2))
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        generated_ids = inputs["input_ids"]
        for _ in range(NEW_TOKENS):
            outputs = model(**inputs, past_key_values=past_key_values, use_cache=True)
            next_token_ids = outputs.logits[:, -1:].argmax(-1)
            generated_ids = torch.cat([generated_ids, next_token_ids], dim=-1)
            attention_mask = inputs["attention_mask"]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)  # noqa: E501
            inputs = {"input_ids": next_token_ids, "attention_mask": attention_mask}
        return generated_ids

    assert torch.equal(guide_loop(kh.DynamicCache), guide_loop(transformers.DynamicCache))


def test_a_reused_prompt_prefix_is_not_recomputed_and_changes_no_token(models):
    model = models["llama"]
    generator = torch.Generator().manual_seed(3)
    system = torch.randint(3, 259, (1, 13), generator=generator)
    first = torch.cat([system, torch.randint(3, 259, (1, 3), generator=generator)], 1)
    second = torch.cat([system, torch.randint(3, 259, (1, 4), generator=generator)], 1)
    pool = kh.PagedCache(32, 4, config=model.config)
    pool.kvcache.add_sequence(first[0].tolist())  # declares the prompt's ids: its blocks get hashed
    greedy(model, first, past_key_values=pool)
    pool.kvcache.free_rows()  # the request ends; its full blocks stay cached
    attached = pool.kvcache.add_sequence(second[0].tolist())
    assert attached == 13  # the shared 13 tokens: three whole blocks, then 1 token of the 4th
    assert pool.get_seq_length() == attached  # generate runs only the tokens after them
    ours, our_logits = greedy(model, second, past_key_values=pool)
    tokens, logits = greedy(model, second, past_key_values=transformers.DynamicCache(config=model.config))
    assert torch.equal(ours, tokens)
    torch.testing.assert_close(our_logits, logits, atol=1e-4, rtol=1e-4)


def test_beam_search_reorders_a_kvcache_cache_as_transformers_own(models):
    model = models["llama"]
    ids = torch.randint(3, 259, (1, 6), generator=torch.Generator().manual_seed(4))
    options = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, past_key_values=transformers.DynamicCache(config=model.config), **options)
    ours = model.generate(ids, past_key_values=kh.DynamicCache(config=model.config), **options)
    assert torch.equal(ours, expected)


WRAPPING = [("mistral", "sliding"), ("gemma2", "dynamic"), ("qwen2_mixed", "paged"), ("phi3", "quantized"),
            ("llama", "static")]


@pytest.mark.parametrize("arch, kind", WRAPPING)
@pytest.mark.parametrize("reply_length", [1, WINDOW + 2])
def test_a_second_turn_of_several_tokens_after_the_window_wrapped_matches_transformers(
    models, arch, kind, reply_length
):
    """The second turn's chunk (the last reply token and the new ones) meets a sliding ring whose
    slots are out of order: the adapter hands the keys to the model in position order. With a
    chunk shorter than the window, the logits generate returns depend on the ring's rows."""
    model = models[arch]
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 259, (1, 2 * WINDOW + 3), generator=generator)
    reply = torch.randint(3, 259, (1, reply_length), generator=generator)

    def two_turns(cache):
        first, _ = greedy(model, prompt, cache=cache)
        return greedy(model, torch.cat([first, reply], 1), cache=cache)

    tokens, logits = two_turns(transformers.DynamicCache(config=model.config))
    ours, our_logits = two_turns(kh.to_transformers(kvcache_cache(kind, model.config, block_size=4)))
    if kind == "quantized":
        assert (ours == tokens).float().mean() >= 0.8
        return
    assert torch.equal(ours, tokens)
    torch.testing.assert_close(our_logits, logits, atol=1e-4, rtol=1e-4)
