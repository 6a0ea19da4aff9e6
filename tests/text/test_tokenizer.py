"""load_tokenizer: the same ids and chat prompts as transformers' tokenizer on the same files."""

from __future__ import annotations

import json

import jinja2
import pytest
import torch

from kvcache import load_tokenizer
from kvcache.text.tokenizer import TokenizerError

MESSAGES = [{"role": "user", "content": "Hello, what's your name."}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi, I am a cache."},
    {"role": "user", "content": "The quick brown fox?"},
]


@pytest.fixture(scope="module")
def both(llama_dir):
    from transformers import AutoTokenizer

    return load_tokenizer(llama_dir), AutoTokenizer.from_pretrained(llama_dir)


@pytest.mark.parametrize("text", ["Hello there", "The quick brown fox jumps.", "", "ünïcödé 🙂"])
def test_encode_and_decode_equal_transformers(both, text):
    ours, theirs = both
    assert ours(text).input_ids == theirs(text).input_ids
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", [MESSAGES, CONVERSATION])
def test_chat_template_equals_transformers(both, messages):
    ours, theirs = both
    kwargs = dict(add_generation_prompt=True)
    assert ours.apply_chat_template(messages, tokenize=False, **kwargs) == theirs.apply_chat_template(
        messages, tokenize=False, **kwargs
    )
    mine = ours.apply_chat_template(messages, return_tensors="pt", return_dict=True, **kwargs)
    hf = theirs.apply_chat_template(messages, return_tensors="pt", return_dict=True, **kwargs)
    assert torch.equal(mine.input_ids, hf["input_ids"])
    assert torch.equal(mine["attention_mask"], hf["attention_mask"])
    assert ours.apply_chat_template(messages, **kwargs) == hf["input_ids"][0].tolist()


def test_batched_conversations_are_left_padded(both):
    ours, _ = both
    batch = ours.apply_chat_template(
        [MESSAGES, CONVERSATION], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    short = ours.apply_chat_template(MESSAGES, add_generation_prompt=True)
    width = batch.input_ids.shape[1]
    assert batch.attention_mask[0].tolist() == [0] * (width - len(short)) + [1] * len(short)
    assert batch.input_ids[0, width - len(short) :].tolist() == short
    assert batch.attention_mask[1].all()


def test_special_tokens_come_from_the_config(both):
    ours, theirs = both
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.pad_token_id == ours.eos_token_id  # no pad token: pad with EOS (masked anyway)


def test_template_errors_and_sandbox(llama_dir, tmp_path):
    tokenizer = load_tokenizer(llama_dir)
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer.apply_chat_template(MESSAGES, chat_template=escape)
    config = json.loads((llama_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (tmp_path / "tokenizer.json").write_text((llama_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer(tmp_path).apply_chat_template(MESSAGES)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert (
        load_tokenizer(tmp_path).apply_chat_template(MESSAGES, tokenize=False) == MESSAGES[0]["content"] + "!"
    )


def test_missing_folder_or_file_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="not a local folder"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
