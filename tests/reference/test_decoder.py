"""The tiny multi-layer, multi-head decoder: cache changes counts, never tokens or logits."""

import pytest

from kvcache import reference as ref
from kvcache.reference import formulas

CONFIGS = [
    ref.TinyDecoderConfig(vocab_size=11, d_model=4, n_heads=1, n_layers=1),
    ref.TinyDecoderConfig(vocab_size=16, d_model=8, n_heads=2, n_layers=2),
    ref.TinyDecoderConfig(vocab_size=7, d_model=6, n_heads=3, n_layers=3),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("prompt_len,new_tokens", [(1, 1), (1, 6), (4, 5), (7, 2)])
def test_cached_and_uncached_decoding_agree_with_closed_form_counts(config, prompt_len, new_tokens):
    model = ref.TinyDecoder(config, seed=prompt_len)
    prompt = [(3 * i + 1) % config.vocab_size for i in range(prompt_len)]
    ref.reset_muls()
    cached = model.generate(prompt, new_tokens, use_cache=True)
    cached_count = ref.muls()
    ref.reset_muls()
    plain = model.generate(prompt, new_tokens, use_cache=False)
    plain_count = ref.muls()
    assert cached.tokens == plain.tokens
    assert len(cached.tokens) == new_tokens
    assert ref.allclose(cached.logits, plain.logits, rtol=1e-9, atol=1e-12)
    args = (prompt_len, new_tokens, config.d_model, config.n_layers, config.vocab_size)
    assert cached_count == formulas.decoder_cached_total(*args)
    assert plain_count == formulas.decoder_nocache_total(*args)
    if new_tokens > 1:
        assert plain_count > cached_count


def test_decoder_forward_formula_by_hand():
    # one layer, d=2, V=3, prompt of 2 positions: 4·4·2 + 2·2·(1+2) + 3·2
    assert formulas.decoder_forward(2, 0, d=2, n_layers=1, vocab_size=3) == 32 + 12 + 6


def test_decoder_config_and_token_errors():
    with pytest.raises(ValueError, match="not divisible"):
        ref.TinyDecoderConfig(d_model=6, n_heads=4)
    model = ref.TinyDecoder(ref.TinyDecoderConfig(vocab_size=5))
    with pytest.raises(ValueError, match="token id 9 outside"):
        model.generate([9], 1)
    with pytest.raises(ValueError, match="no tokens"):
        model.generate([], 1)
    assert model.generate([1], 0).tokens == []
