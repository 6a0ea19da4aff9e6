"""Prompt caches on disk: a saved prompt loads back into a PagedCache and continues exactly
like a full prefill; files made for another model or layout, or damaged, are refused before
anything is allocated."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB, tiny_model

from kvcache.cache import OutOfBlocksError, PagedCache
from kvcache.generation import generate
from kvcache.memory import kv_dtype_pair
from kvcache.reuse.prefix import PrefixCache
from kvcache.reuse.prompt_cache import PromptCacheError, load_prompt_cache, save_prompt_cache

BLOCK = 4


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]  # (kernels: not in pytest --fast)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=7)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    torch.manual_seed(4)
    return torch.randint(0, VOCAB, (2 * BLOCK + 3,)).tolist()


@pytest.fixture
def saved(model, prompt, tmp_path):
    cache = PagedCache(16, BLOCK, config=model.config, dtype=torch.float32)
    cache.add_sequence(prompt)
    with torch.no_grad():
        model(torch.tensor([prompt]), past_key_values=cache)
    path = tmp_path / "prompt.kv"
    assert save_prompt_cache(path, cache, model) == len(prompt)
    return path


def test_loaded_prompt_continues_like_a_full_prefill(model, prompt, saved):
    cache = load_prompt_cache(saved, model, block_size=2)  # re-blocked from 4 to 2
    assert cache.row_lengths == [len(prompt)] and cache.block_size == 2
    follow = [3, 1, 4]
    got = generate(model, torch.tensor([follow]), cache=cache, max_new_tokens=5, eos_token_id=())
    want = generate(model, torch.tensor([prompt + follow]), max_new_tokens=5, eos_token_id=())
    assert got.new_tokens == want.new_tokens


def test_loaded_blocks_are_found_by_later_prompts(model, prompt, saved):
    cache = load_prompt_cache(saved, model, num_blocks=32)
    cache.free_rows()
    served = PrefixCache(model, cache).generate(prompt + [5, 6], max_new_tokens=3, eos_token_id=())
    assert served.reused_tokens == len(prompt)  # 2 whole blocks, then the row's partial last one
    want = generate(model, torch.tensor([prompt + [5, 6]]), max_new_tokens=3, eos_token_id=())
    assert served.new_tokens == want.new_tokens[0]


def test_a_file_from_another_model_is_refused(saved):
    with pytest.raises(PromptCacheError, match="another model"):
        load_prompt_cache(saved, tiny_model(seed=8))  # same shapes, other weights


@pytest.mark.parametrize("weight", ["model.layers.1.self_attn.v_proj.weight", "model.norm.weight",
                                    "lm_head.weight"])
def test_a_model_differing_in_one_value_of_any_weight_is_another_model(saved, weight):
    """The fingerprint hashes every byte: one element of the last layer, the final norm or
    lm_head (which shape no stored key) moved by one float32 step is refused."""
    other = tiny_model(seed=7)
    with torch.no_grad():
        param = dict(other.named_parameters())[weight].view(-1)
        param[-1] = torch.nextafter(param[-1], torch.tensor(float("inf")))
    with pytest.raises(PromptCacheError, match="another model"):
        load_prompt_cache(saved, other)
    load_prompt_cache(saved, tiny_model(seed=7))  # the same weights, another object: accepted


def test_a_file_for_another_layout_is_refused(saved):
    with pytest.raises(PromptCacheError, match="layers=2; this model has layers=3"):
        load_prompt_cache(saved, tiny_model(seed=7, layers=3))


def test_damaged_or_foreign_files_are_refused_before_allocating(model, saved, tmp_path):
    cache = PagedCache(16, BLOCK, config=model.config, dtype=torch.float32)
    tensors = load_file(saved)
    from safetensors import safe_open

    with safe_open(str(saved), "pt") as handle:
        metadata = handle.metadata()
    cases = {
        "not a kvcache prompt cache": (tensors, {}),
        "token_ids must be": (tensors, {**metadata, "num_tokens": "12"}),
        "do not match": ({**tensors, "keys.0": tensors["keys.0"][:5]}, metadata),
        "damaged metadata": (tensors, {**metadata, "token_ids": "[1, 2"}),
    }
    for message, (content, meta) in cases.items():
        path = tmp_path / "bad.kv"
        save_file(content, str(path), metadata=meta)
        with pytest.raises(PromptCacheError, match=message):
            load_prompt_cache(path, model, cache)
    (tmp_path / "junk.kv").write_bytes(b"\xff" * 64)
    with pytest.raises(PromptCacheError, match="not a readable safetensors"):
        load_prompt_cache(tmp_path / "junk.kv", model, cache)
    small = PagedCache(2, BLOCK, config=model.config, dtype=torch.float32)
    with pytest.raises(OutOfBlocksError):
        load_prompt_cache(saved, model, small)
    assert cache.rows == [] and small.rows == [] and small.allocator.num_in_use == 0


def test_saving_needs_the_token_ids(model, tmp_path):
    cache = PagedCache(8, BLOCK, config=model.config, dtype=torch.float32)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), past_key_values=cache)
    with pytest.raises(PromptCacheError, match="declare them"):
        save_prompt_cache(tmp_path / "x.kv", cache, model)


def _rewrite(path, change_tensors=None, **metadata):
    """Rewrite a saved file with some tensors or metadata changed (the checksum left as it was)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        kept = dict(handle.metadata())
    tensors = load_file(path)
    if change_tensors is not None:
        change_tensors(tensors)
    save_file(tensors, path, metadata={**kept, **metadata})


def _recheck(path) -> None:
    """Give a rewritten file a checksum that matches what it now holds (a careful forger)."""
    import json

    from safetensors import safe_open

    from kvcache.reuse.prompt_cache import _checksum

    with safe_open(str(path), "pt") as handle:
        kept = dict(handle.metadata())
    tensors = load_file(path)
    save_file(tensors, path, metadata={**kept, "checksum": _checksum(json.loads(kept["token_ids"]), tensors)})


@pytest.mark.parametrize("damage", ["token id", "tensor byte", "scaled values"])
def test_a_tampered_file_is_refused_by_its_checksum(model, prompt, saved, damage):
    if damage == "token id":
        _rewrite(saved, token_ids=str([prompt[0] ^ 1, *prompt[1:]]).replace(" ", ""))
    elif damage == "tensor byte":
        _rewrite(saved, lambda tensors: tensors["keys.0"].view(-1)[5:6].add_(1e-3))
    else:
        _rewrite(saved, lambda tensors: tensors["values.1"].mul_(2))
    with pytest.raises(PromptCacheError, match="checksum"):
        load_prompt_cache(saved, model)


def test_non_finite_values_are_refused_even_with_a_matching_checksum(model, saved):
    _rewrite(saved, lambda tensors: tensors["keys.1"].view(-1)[0:1].fill_(float("nan")))
    _recheck(saved)
    with pytest.raises(PromptCacheError, match="non-finite"):
        load_prompt_cache(saved, model)


@pytest.mark.parametrize("field, value", [("block_size", "0"), ("block_size", str(2**28)),
                                          ("value_head_dim", "5"), ("num_tokens", "100000")])
def test_insane_metadata_is_refused_before_anything_is_allocated(model, saved, field, value):
    _rewrite(saved, **{field: value})
    with pytest.raises(PromptCacheError, match="not a prompt cache of this model|token_ids must be"):
        load_prompt_cache(saved, model)


def test_a_failed_load_leaves_the_callers_cache_as_it_was(model, saved):
    cache = PagedCache(16, BLOCK, config=model.config, dtype=torch.float32)
    cache.add_sequence([1, 2, 3])
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), past_key_values=cache)
    def state():
        pool = cache.allocator
        return cache.row_lengths, pool.num_free, pool.num_in_use, pool.num_cached

    before = state()
    _rewrite(saved, lambda tensors: tensors["keys.0"].view(-1)[0:1].add_(1.0))
    with pytest.raises(PromptCacheError):
        load_prompt_cache(saved, model, cache)
    assert state() == before


@pytest.mark.parametrize("kv_dtype, stored", [("int8", (torch.uint8,) * 2), ("int4", (torch.uint8,) * 2),
                                              ("fp8/bfloat16", (torch.int8, torch.bfloat16))])
def test_a_row_in_a_kv_dtype_is_saved_as_stored_and_loads_only_into_its_own_kv_dtype(model, prompt, tmp_path,
                                                                                   kv_dtype, stored):
    from kvcache.reuse import prompt_cache

    cache = PagedCache(16, BLOCK, config=model.config, dtype=torch.float32, kv_dtype=kv_dtype)
    cache.add_sequence(prompt)
    with torch.no_grad():
        model(torch.tensor([prompt]), past_key_values=cache)
    path = tmp_path / "quantized.kv"
    save_prompt_cache(path, cache, model)
    tensors = load_file(path)
    assert (tensors["keys.0"].dtype, tensors["values.0"].dtype) == stored  # packed: codes, scale, zero
    loaded = load_prompt_cache(path, model)
    assert loaded.kv_dtype == kv_dtype
    torch.testing.assert_close(loaded.layers[1].values, cache.layers[1].values, atol=0, rtol=0)
    follow = [3, 1, 4]
    got = generate(model, torch.tensor([follow]), cache=loaded, max_new_tokens=5, eos_token_id=())
    fresh = PagedCache(16, BLOCK, config=model.config, dtype=torch.float32, kv_dtype=kv_dtype)
    want = generate(model, torch.tensor([prompt + follow]), cache=fresh, max_new_tokens=5, eos_token_id=())
    assert got.new_tokens == want.new_tokens
    for other in (None, "int4" if kv_dtype == "int8" else "int8"):
        target = PagedCache(16, BLOCK, config=model.config, dtype=torch.float32, kv_dtype=other)
        with pytest.raises(PromptCacheError, match="kv_dtype"):
            load_prompt_cache(path, model, target)
    header = prompt_cache.read_prompt_cache_header(path, model)
    poisoned = dict(tensors)
    side = "keys.0" if stored[1].is_floating_point else "values.0"  # a packed side: its scale
    poisoned[side] = tensors[side].clone()
    poisoned[side][0, 0, -4:-2] = torch.tensor([float("inf")], dtype=torch.float16).view(tensors[side].dtype)
    metadata = {key: value for key, value in load_metadata(path).items()}
    metadata["checksum"] = prompt_cache._checksum(header["token_ids"], poisoned)  # a valid file's
    save_file(poisoned, tmp_path / "poisoned.kv", metadata=metadata)
    with pytest.raises(PromptCacheError, match="non-finite"):
        load_prompt_cache(tmp_path / "poisoned.kv", model)
    spelled = {**load_metadata(path), "kv_dtype": "/".join(kv_dtype_pair(kv_dtype))}  # "int8/int8"
    save_file(tensors, tmp_path / "spelled.kv", metadata=spelled)
    target = PagedCache(16, BLOCK, config=model.config, dtype=torch.float32, kv_dtype=kv_dtype)
    load_prompt_cache(tmp_path / "spelled.kv", model, target)  # the same dtype, however it is written
    assert target.row_lengths == [len(prompt)]


def load_metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return dict(handle.metadata())
