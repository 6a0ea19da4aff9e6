"""A conversation's cache moves between kvcache and transformers models (both ways, sliding
layers at absolute positions), the quantized cache drifts as `kvcache drift` measures it in
kvcache's own model, and misuse gets a named error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import WINDOW, checkpoint_pair

import kvcache
import kvcache.hf as kh
from kvcache.hf.version import check_transformers_version
from kvcache.report.drift import DriftSetting, measure_drift

ARCHS = ("llama", "mistral", "qwen2_mixed", "gemma2")  # full, every-layer window, mixed, mixed
STEPS = 8


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """arch -> (transformers model, kvcache model of the same weights)."""
    return {arch: checkpoint_pair(arch, tmp_path_factory.mktemp(arch), 10 + index)
            for index, arch in enumerate(ARCHS)}


@torch.no_grad()
def continue_greedy(model, first: torch.Tensor, cache, steps: int = STEPS, forced=None):
    """Feed `first` (1, T) then `steps - 1` greedy tokens (or those of `forced`); the tokens
    chosen and the logits they were chosen from."""
    tokens, rows, feed = [], [], first
    for step in range(steps):
        logits = model(feed, past_key_values=cache, use_cache=True).logits[:, -1]  # (1, vocab)
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        feed = torch.tensor([[tokens[-1] if forced is None else forced[step]]])
    return tokens, torch.cat(rows)


def prompt(length: int = 2 * WINDOW + 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 259, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("hf_kind", ["dynamic", "static"])
def test_a_transformers_cache_continues_in_kvcaches_model(pairs, arch, hf_kind):
    hf, ours = pairs[arch]
    ids = prompt()
    if hf_kind == "dynamic":
        hf_cache = transformers.DynamicCache(config=hf.config)
    else:
        hf_cache = transformers.StaticCache(config=hf.config, max_cache_len=40)
    with torch.no_grad():
        first = hf(ids, past_key_values=hf_cache, use_cache=True).logits[:, -1:].argmax(-1)  # (1, 1)
    sliding = [layer for layer in hf_cache.layers if layer.is_sliding]
    if hf_kind == "dynamic" and sliding:  # transformers keeps only the last window - 1 rows
        assert all(layer.keys.shape[2] == WINDOW - 1 for layer in sliding)
    converted = kh.from_transformers(hf_cache)
    assert [layer.get_seq_length() for layer in converted.layers] == [ids.shape[1]] * len(hf_cache.layers)
    windows = [WINDOW if sliding else None for sliding in hf_cache.is_sliding]
    assert [layer.window for layer in converted.layers] == windows
    expected, expected_logits = continue_greedy(hf, first, hf_cache)
    tokens, logits = continue_greedy(ours, first, converted)
    assert tokens == expected
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["dynamic", "paged"])
def test_a_kvcache_cache_continues_in_a_transformers_model(pairs, arch, kind):
    hf, ours = pairs[arch]
    ids = prompt(seed=1)
    cache = kvcache.make_cache(kind, config=ours.config, max_cache_len=64, block_size=4)
    with torch.no_grad():
        first = ours(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    tokens, logits = continue_greedy(hf, first, kh.to_transformers(cache))
    unconverted = transformers.DynamicCache(config=hf.config)
    expected, expected_logits = continue_greedy(hf, torch.cat([ids, first], 1), unconverted)
    assert tokens[0] == expected[0] and tokens == expected
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_a_round_trip_through_both_models_keeps_the_answer(pairs, arch):
    """transformers prefills, kvcache decodes a few tokens, transformers decodes the rest."""
    hf, ours = pairs[arch]
    ids = prompt(seed=2)
    reference, _ = continue_greedy(hf, ids, transformers.DynamicCache(config=hf.config), 2 * STEPS)
    hf_cache = transformers.DynamicCache(config=hf.config)
    start, _ = continue_greedy(hf, ids, hf_cache, 1)
    converted = kh.from_transformers(hf_cache)
    middle, _ = continue_greedy(ours, torch.tensor([start]), converted, STEPS)
    rest, _ = continue_greedy(hf, torch.tensor([middle[-1:]]), kh.to_transformers(converted), STEPS)
    assert start + middle + rest[:-1] == reference


def test_quantized_drift_in_a_transformers_model_matches_kvcaches_own(pairs):
    """The same quantized cache drifts as much in transformers' model as in kvcache's (the same
    weights): the figures `kvcache drift` reports hold for the adapter too."""
    hf, ours = pairs["llama"]
    ids = prompt(24, seed=3)[0]
    setting = DriftSetting(bits=4, group_size=16, residual_length=8)
    (measured,) = measure_drift(ours, [ids], [setting], tokens=24)
    unquantized = transformers.DynamicCache(config=hf.config)
    reference, reference_logits = continue_greedy(hf, ids[None], unquantized, 24)
    cache = kh.to_transformers(setting.make_cache(hf.config))
    free, _ = continue_greedy(hf, ids[None], cache, 24)
    assert cache.kvcache.layers[0].quantized_tokens > 0  # rows really were quantized
    agreement = sum(a == b for a, b in zip(free, reference)) / 24
    assert agreement == pytest.approx(measured.greedy_agreement, abs=0.05)
    # teacher-forced on the reference tokens, as measure_drift measures logits once runs diverge
    forced_cache = kh.to_transformers(setting.make_cache(hf.config))
    _, logits = continue_greedy(hf, ids[None], forced_cache, 24, forced=reference)
    difference = float((logits - reference_logits).abs().max())
    assert measured.max_abs_logit_diff > 0.01  # a real drift, which both models show alike
    assert difference == pytest.approx(measured.max_abs_logit_diff, rel=0.02, abs=1e-4)


# ---- named errors ---------------------------------------------------------------------------------
def test_conversions_of_a_converted_cache_give_back_the_same_cache():
    cache = kvcache.DynamicCache(2)
    wrapped = kh.to_transformers(cache)
    assert kh.to_transformers(wrapped) is wrapped
    assert kh.from_transformers(wrapped) is cache


def test_misuse_gets_named_errors():
    with pytest.raises(TypeError, match="keeps no keys"):
        kh.to_transformers(kvcache.NoCache(num_layers=2))
    with pytest.raises(TypeError, match="kvcache.hf.from_transformers"):
        kh.TransformersCache(transformers.DynamicCache())
    with pytest.raises(kh.CacheConversionError, match="takes a transformers Cache"):
        kh.from_transformers(kvcache.DynamicCache(2))
    with pytest.raises(ValueError, match="0 or a negative int"):
        kh.DynamicCache(2).crop(3)
    quantized = transformers.cache_utils.Cache(layers=[transformers.cache_utils.Fp8QuantizedLayer()])
    with pytest.raises(kh.CacheConversionError, match="Fp8QuantizedLayer"):
        kh.from_transformers(quantized)


def test_crop_removes_tokens_as_transformers_caches_do(pairs):
    hf, _ = pairs["llama"]
    ids = prompt(seed=4)
    ours, theirs = kh.DynamicCache(config=hf.config), transformers.DynamicCache(config=hf.config)
    for cache in (ours, theirs):
        continue_greedy(hf, ids, cache, 3)
        cache.crop(-4)
    assert ours.get_seq_length() == theirs.get_seq_length() == ids.shape[1] - 2
    assert continue_greedy(hf, ids[:, -1:], ours)[0] == continue_greedy(hf, ids[:, -1:], theirs)[0]


@pytest.mark.parametrize("version", ["4.57.1", "5.23.0", "6.0.0", "10.1"])
def test_an_unsupported_transformers_version_is_refused_by_name(version):
    with pytest.raises(kh.TransformersVersionError, match=f"supports transformers .*found {version}"):
        check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.24.0", "5.24.1", "5.30.0.dev0", transformers.__version__])
def test_supported_transformers_versions_pass(version):
    check_transformers_version(version)


def test_the_docs_state_the_supported_versions():
    root = Path(__file__).resolve().parents[2]
    for page in ("README.md", "docs/transformers.md"):
        assert f"`{kh.SUPPORTED}`" in (root / page).read_text(encoding="utf-8"), page


def test_a_cache_handed_to_the_wrong_model_says_how_to_convert_it(pairs):
    hf, ours = pairs["llama"]
    ids = prompt(seed=5)
    with pytest.raises(AttributeError, match=r"to_transformers\(cache\), or build it with kvcache.hf.Dyn"):
        hf.generate(ids, max_new_tokens=2, cache=kvcache.DynamicCache(config=hf.config))
    with pytest.raises(AttributeError, match=r"to_transformers\(cache\)$"):
        hf(ids, cache=kvcache.make_cache("none", num_layers=2))
    with pytest.raises(TypeError, match=r"kvcache.hf.from_transformers\(cache\)"):
        ours(ids, past_key_values=transformers.DynamicCache(config=hf.config))
    with pytest.raises(AttributeError, match="has no attribute 'something_else'"):
        getattr(kvcache.DynamicCache(2), "something_else")  # noqa: B009
