"""The sliding window is the model's, not the cache's: a model with a window applies it whatever
cache it is handed (one built without a config, from a config.json dict, a transformers-style
loop), in the torch forward and the float32 step alike, and its logits equal transformers'."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import WINDOW, checkpoint_pair

import kvcache
from kvcache.cache import CacheConfigError, PagedCache

ARCHS = ("mistral", "qwen2_mixed", "gemma2", "phi3")
PROMPT = 5
LENGTH = 3 * WINDOW + 2


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    built = {}
    for index, arch in enumerate(ARCHS):
        folder = tmp_path_factory.mktemp(arch)
        pair = checkpoint_pair(arch, folder, 20 + index)
        config = json.loads((folder / "config.json").read_text())
        built[arch] = (*pair, config)
    return built


CACHES = {
    "config-less dynamic": lambda config: kvcache.DynamicCache(),
    "config-less static": lambda config: kvcache.StaticCache(1, 64),
    "config-less quantized": lambda config: kvcache.QuantizedCache(residual_length=64),
    "dict config dynamic": lambda config: kvcache.make_cache("dynamic", config=config),
    "dict config static": lambda config: kvcache.make_cache("static", config=config, max_cache_len=64),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", list(CACHES))
def test_a_models_window_applies_whatever_cache_it_is_handed(pairs, arch, kind):
    hf, ours, config = pairs[arch]
    ids = torch.randint(3, 259, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits  # (1, T, vocab): transformers' windowed attention, no cache
        cache = CACHES[kind](config)
        pieces = [ours(ids[:, :PROMPT], past_key_values=cache).logits]
        for position in range(PROMPT, LENGTH):  # a transformers-style loop, one token at a time
            pieces.append(ours(ids[:, position : position + 1], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.kernels
@pytest.mark.parametrize("arch", ["mistral", "qwen2_mixed", "phi3"])
def test_the_float32_step_applies_the_window(pairs, arch):
    hf, ours, _ = pairs[arch]
    ids = torch.randint(3, 259, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=LENGTH, do_sample=False, pad_token_id=0)
    result = kvcache.generate(ours, ids, cache="paged", max_new_tokens=LENGTH, backend="float32")
    assert result.backend == "float32"
    assert result.sequences.tolist() == expected.tolist()


def test_a_paged_cache_without_the_models_windows_is_refused_by_name(pairs):
    _, ours, _ = pairs["mistral"]
    cache = PagedCache(16, 4, num_layers=ours.config.num_hidden_layers)
    with pytest.raises(CacheConfigError, match="window"):
        ours(torch.tensor([[5, 6, 7]]), past_key_values=cache)
