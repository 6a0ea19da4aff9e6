"""One EOS resolver (`kvcache.text.eos`): the config's ids, then the tokenizer's where it adds one."""

from __future__ import annotations

from types import SimpleNamespace

from kvcache.text.eos import default_eos


def test_the_config_ids_come_first_and_the_tokenizers_is_added_once():
    assert default_eos((2, 7)) == (2, 7)
    assert default_eos((2, 7), SimpleNamespace(eos_token_id=9)) == (2, 7, 9)
    assert default_eos((2, 7), SimpleNamespace(eos_token_id=7)) == (2, 7)
    assert default_eos((), SimpleNamespace(eos_token_id=None)) == ()
    assert default_eos((3, 3)) == (3,)
