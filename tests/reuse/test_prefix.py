"""Prefix reuse: a prompt that starts like a cached one prefills only its new tokens and gets
exactly the logits and tokens of a full prefill; multi-turn sessions and the automatic path."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, tiny_model

from kvcache.cache import PagedCache, make_cache
from kvcache.cache.paged.rows import prefill_inputs
from kvcache.generation import generate
from kvcache.reuse.prefix import ChatSession, PrefixCache

BLOCK = 4


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]  # (kernels: not in pytest --fast)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


class TokenCounter:
    """Counts the token ids the model embeds (every token it processes, padding included)."""

    def __init__(self, model) -> None:
        self.count = 0
        self.handle = model.model.embed_tokens.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.count += args[0].numel()


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        cache = make_cache("dynamic", config=model.config)
        return model(torch.tensor([ids]), past_key_values=cache).logits[0]


def reference_reply(model, ids: list[int], new_tokens: int) -> list[int]:
    result = generate(model, torch.tensor([ids]), max_new_tokens=new_tokens, cache="dynamic", eos_token_id=())
    return result.new_tokens[0]


def test_second_request_prefills_only_new_tokens_and_matches_full_prefill(model):
    torch.manual_seed(0)
    prefix = torch.randint(0, VOCAB, (3 * BLOCK + 2,)).tolist()
    first, second = prefix + [1, 2], prefix + [7, 8, 9]
    cache = PagedCache(32, BLOCK, config=model.config, dtype=torch.float32)
    counter = TokenCounter(model)
    with torch.no_grad():
        assert cache.add_sequence(first) == 0
        model(torch.tensor([first]), past_key_values=cache)
        cache.free_rows()
        assert cache.allocator.num_cached == 4  # 16 tokens in full blocks, kept after the request
        counter.count = 0
        attached = cache.add_sequence(second)
        assert attached == 3 * BLOCK + 2  # the shared prefix: 3 whole blocks, then 2 tokens of the 4th
        logits = model(torch.tensor([second[attached:]]), past_key_values=cache).logits[0]
    assert counter.count == len(second) - attached
    torch.testing.assert_close(logits, full_logits(model, second)[attached:], atol=1e-5, rtol=0)
    counter.handle.remove()


def test_a_prompt_made_of_cached_blocks_recomputes_its_last_token(model):
    ids = torch.randint(0, VOCAB, (2 * BLOCK,)).tolist()
    server = PrefixCache(model, num_blocks=16, block_size=BLOCK)
    server.generate(ids, max_new_tokens=1, eos_token_id=())
    again = server.generate(ids, max_new_tokens=3, eos_token_id=())
    assert (again.reused_tokens, again.prefilled_tokens) == (2 * BLOCK - 1, 1)
    assert again.new_tokens == reference_reply(model, ids, 3)


def test_automatic_path_reuses_the_history_of_earlier_turns(model):
    torch.manual_seed(1)
    server = PrefixCache(model, num_blocks=64, block_size=BLOCK)
    history: list[int] = []
    counter = TokenCounter(model)
    for turn in range(3):
        history += torch.randint(0, VOCAB, (5,)).tolist()  # the user's message
        counter.count = 0
        served = server.generate(history, max_new_tokens=6, eos_token_id=())
        assert counter.count == served.prefilled_tokens + 5  # the prompt, then 5 decode steps
        assert served.new_tokens == reference_reply(model, history, 6)
        # cached: the previous history and reply (whole blocks, then the previous turn's partial
        # last block, kept as its tail), less the reply's last token (never run through the
        # model) and this turn's 5 new tokens
        assert served.reused_tokens == (0 if turn == 0 else len(history) - 6)
        assert served.reused_tokens + served.prefilled_tokens == len(history)
        history += served.new_tokens
    assert server.cache.rows == [] and server.cache.allocator.num_in_use == 0
    server.cache.allocator.check_invariants()
    counter.handle.remove()


@pytest.mark.parametrize("chunk", [None, 3])
def test_batch_rows_reuse_different_prefix_lengths(model, chunk):
    torch.manual_seed(2)
    shared = torch.randint(0, VOCAB, (2 * BLOCK + 1,)).tolist()
    server = PrefixCache(model, num_blocks=64, block_size=BLOCK)
    server.generate(shared + [3, 3, 3, 3], max_new_tokens=1, eos_token_id=())
    prompts = [shared[:BLOCK] + [9, 9], shared + [3, 3, 3, 3, 5], [4, 4, 4]]
    served = server.generate_batch(prompts, max_new_tokens=5, eos_token_id=(), prefill_chunk_size=chunk)
    assert [s.reused_tokens for s in served] == [BLOCK, 3 * BLOCK + 1, 0]  # (+ the first's tail)
    for prompt, result in zip(prompts, served):
        assert result.new_tokens == reference_reply(model, prompt, 5)


def test_prefill_inputs_describe_held_and_new_tokens():
    cache = PagedCache(16, BLOCK, num_layers=1)
    cache.add_sequence()
    cache.add_sequence()
    cache.attention_masks(3, torch.tensor([[1, 1, 1], [0, 1, 1]]))
    cache.update(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4), 0)
    ids, mask = prefill_inputs(cache, [[5], [6, 7]])
    assert ids.tolist() == [[0, 5], [6, 7]]
    assert mask.tolist() == [[1, 1, 1, 0, 1], [0, 1, 1, 1, 1]]


def test_chat_session_sends_only_the_new_turn_and_matches_a_full_prefill(model):
    torch.manual_seed(3)
    chat = ChatSession(model, num_blocks=64, block_size=BLOCK, max_new_tokens=6, eos_token_id=())
    conversation: list[int] = []
    sent = 0
    for _ in range(4):
        conversation += torch.randint(0, VOCAB, (5,)).tolist()
        reply = chat.send_ids(conversation)
        assert reply == reference_reply(model, conversation, 6)
        # prefilled this turn: the new message and the last reply token, whose keys were never computed
        sent = sent + 5 + (1 if sent else 0)
        assert chat.prefilled_tokens == sent
        conversation += reply
    assert chat.held_tokens == len(conversation) - 1
    chat.close()
    chat.cache.allocator.check_invariants()


class LossyTokenizer:
    """A chat 'tokenizer' whose decode/encode round trip changes a reply's tokens, so the
    re-rendered history differs from the tokens the cache holds."""

    def encode(self, text: str) -> list[int]:
        return [4 + ord(c) % 56 for c in text]  # ids in [4, 60)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        # each id comes back as the character of the even id at or below it
        return "".join(chr(112 + max(0, i - 4) // 2 * 2) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False):
        ids: list[int] = []
        for message in messages:
            ids += [1 if message["role"] == "user" else 2] + self.encode(message["content"])
        return ids + ([3] if add_generation_prompt else [])


def test_chat_session_crops_to_the_common_prefix_when_the_history_is_rewritten(model):
    tokenizer = LossyTokenizer()
    chat = ChatSession(model, tokenizer, num_blocks=64, block_size=BLOCK, max_new_tokens=5, eos_token_id=())
    crops: list[int] = []
    crop = chat.cache.crop
    chat.cache.crop = lambda length: (crops.append(length), crop(length))
    for message in ("hello there", "and then?", "ok"):
        chat.send(message)
        rendered = tokenizer.apply_chat_template(chat.messages[:-1], add_generation_prompt=True)
        assert chat.last_result.new_tokens[0] == reference_reply(model, rendered, 5)
    assert crops, "the rewritten history never made the session crop"
    chat.cache.allocator.check_invariants()


def test_paged_cache_out_of_blocks_in_a_session_is_a_named_error(model):
    from kvcache.cache import OutOfBlocksError

    chat = ChatSession(model, num_blocks=2, block_size=BLOCK, max_new_tokens=2, eos_token_id=())
    with pytest.raises(OutOfBlocksError, match="available"):
        chat.send_ids(list(range(3 * BLOCK)))


def test_chat_session_with_a_real_chat_template_matches_re_sending_the_history(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "model"))
    from tiny_models import HF_VOCAB as TOKENIZER_VOCAB
    from tiny_models import write_tokenizer

    from kvcache.text.tokenizer import load_tokenizer

    write_tokenizer(tmp_path)  # byte-level BPE, BOS, a Llama-2 chat template
    tokenizer = load_tokenizer(tmp_path)
    model = tiny_model(seed=9, vocab=TOKENIZER_VOCAB)
    chat = ChatSession(model, tokenizer, num_blocks=128, block_size=BLOCK, system="Be brief.",
                       max_new_tokens=6, eos_token_id=())
    for message in ("Hello, what's your name?", "What does the cache keep?", "Thanks!"):
        before = chat.prefilled_tokens
        chat.send(message)
        prompt = tokenizer.apply_chat_template(chat.messages[:-1], add_generation_prompt=True)
        assert chat.last_result.new_tokens[0] == reference_reply(model, list(prompt), 6)
        assert chat.prefilled_tokens - before < len(prompt) or before == 0
