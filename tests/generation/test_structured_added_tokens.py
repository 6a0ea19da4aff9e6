"""A grammar's text that the tokenizer writes as one added token which is not special (Qwen2.5's
`<tool_call>`, `</tool_call>`: text its chat template writes, one token each): the mask allows that
token where the grammar forces the text, and the grammar follows it when it is chosen (llguidance
reads every added token of a tokenizer.json as special, so without kvcache's token table the mask
allowed the token and following it failed: a forced tool call on Qwen2.5 ended in an engine error)."""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

import kvcache
from kvcache.generation.structured import GrammarState, StructuredOutput, TokenTable, allowed_rows
from kvcache.text.tokenizer import Tokenizer

GRAMMAR = 'start: "<tool_call>\\n" ("yes" | "no") "\\n</tool_call>"\n'


def _with_added_text(names: list[str]) -> Tokenizer:
    """The bundled tokenizer with `names` added as tokens that are text (special false), and a special
    token to end a reply."""
    bundled = kvcache.load_tokenizer()
    backend = Backend.from_str(bundled.backend.to_str())
    backend.add_tokens([AddedToken(name, special=False, normalized=False) for name in names])
    backend.add_special_tokens([AddedToken("<|stop|>", special=True, normalized=False)])
    return Tokenizer(backend, bundled.special_tokens, bundled.chat_template, bundled.add_bos_token)


def _allowed(state: GrammarState, table: TokenTable) -> np.ndarray:
    packed = np.zeros((1, table.words), np.int32)
    state.fill(packed[0])
    return allowed_rows(packed, table.vocab_size)[0]


def test_an_added_text_token_the_grammar_forces_is_allowed_and_followed():
    tokenizer = _with_added_text(["<tool_call>", "</tool_call>"])
    opening, closing = (tokenizer.backend.token_to_id(name) for name in ("<tool_call>", "</tool_call>"))
    stop = tokenizer.backend.token_to_id("<|stop|>")
    table = TokenTable(tokenizer, tokenizer.backend.get_vocab_size() + 7, (stop,))  # (logits wider)
    state = GrammarState(StructuredOutput("grammar", GRAMMAR, "test"), table)
    reply = tokenizer.encode("<tool_call>\nyes\n</tool_call>", add_special_tokens=False)
    assert reply[0] == opening and reply[-1] == closing
    for token in reply:
        assert _allowed(state, table)[token], tokenizer.decode([token])
        state.take(token)
    assert state.done

