"""The tokenizer a GGUF file carries in its metadata, rebuilt as a `tokenizers` byte-level BPE:
the vocabulary (`tokenizer.ggml.tokens`), the merges, control tokens as special tokens, BOS/EOS/
padding ids, whether a BOS is added, and the chat template (rendered, like every template, in
jinja2's sandbox by `kvcache.text.tokenizer.Tokenizer`, which `load_tokenizer` builds from these parts).

How text is split before BPE depends on the model (`tokenizer.ggml.pre`); the splits known here
are written out below, and a file that names another is refused by name rather than tokenized
differently from how the model was trained. SentencePiece-style vocabularies
(`tokenizer.ggml.model` = "llama") are refused too.
"""

from __future__ import annotations

from pathlib import Path

from kvcache.text.tokenizer_error import TokenizerError

# token_type values in GGUF (llama.cpp's: undefined, normal, unknown, control, user-defined, unused, byte)
_CONTROL, _USER_DEFINED, _TOKEN_TYPES = 3, 4, range(7)
MAX_VOCABULARY = 1 << 20  # tokens; the largest published vocabularies hold ~262k
# the GPT-2 split, then bytes as characters
_GPT2 = "gpt2"
# Llama-3-style split (Qwen2 takes digits one at a time where Llama 3 takes up to three)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("gpt-2", "smollm", "qwen2")


def _pre_tokenizer(name: str | None, source: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in (None, "gpt-2", "default"):
        return byte_level
    if name == "smollm":  # digits one at a time, then the GPT-2 split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name == "qwen2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise TokenizerError(
        f"{source}: the GGUF tokenizer's pre-tokenizer {name!r} is not one kvcache knows "
        f"({', '.join(PRE_TOKENIZERS)}); load the model's Hugging Face folder (tokenizer.json) instead"
    )


def _token_types(types, count: int, source: str) -> list[int]:
    """Each token's type (none given: all normal), checked: one integer of 0..6 per token."""
    if types is None:
        return [1] * count
    if not hasattr(types, "dtype") or types.dtype.kind not in "iu" or len(types) != count:
        raise TokenizerError(f"{source}: tokenizer.ggml.token_type must be {count:,} integers, one per token")
    if len(types) and (types.min() < _TOKEN_TYPES.start or types.max() >= _TOKEN_TYPES.stop):
        raise TokenizerError(f"{source}: tokenizer.ggml.token_type holds a type outside 0..6")
    return types.tolist()


def _merges(merges, source: str) -> list[tuple[str, str]]:
    """The merge rules as (left, right) pairs, each checked to be two tokens separated by a space."""
    if merges is None:
        return []
    if not isinstance(merges, list):
        raise TokenizerError(f"{source}: tokenizer.ggml.merges must be a list of strings")
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space or not left or not right:
            raise TokenizerError(f"{source}: a merge must be two tokens separated by a space, got {merge!r}")
        pairs.append((left, right))
    return pairs


def _bpe(tokens: list[str], merges: list[tuple[str, str]], source: str):
    """The byte-level BPE over `tokens`; a merge naming a token not in them is a TokenizerError."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    try:
        return Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                  byte_fallback=False))
    except Exception as error:  # noqa: BLE001 (tokenizers raises a bare Exception)
        raise TokenizerError(
            f"{source}: the vocabulary and merges "
            f"do not form a BPE tokenizer: {error}"
        ) from None


def read_gguf_tokenizer(path: str | Path) -> tuple:
    """The tokenizer stored in the GGUF file at `path`, as `kvcache.text.tokenizer.Tokenizer`'s
    arguments: (a tokenizers.Tokenizer, special tokens, chat template, add_bos_token)."""
    from tokenizers import AddedToken, decoders

    from kvcache.model.gguf_file import metadata, open_gguf

    source = str(path)
    meta = metadata(open_gguf(path))
    kind = meta.get("tokenizer.ggml.model")
    if kind != _GPT2:
        raise TokenizerError(
            f"{source}: the GGUF tokenizer is of kind {kind!r}; kvcache reads byte-level BPE ('gpt2') "
            "tokenizers from GGUF files; load the model's Hugging Face folder (tokenizer.json) instead"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens must be a non-empty list of strings")
    if len(tokens) > MAX_VOCABULARY:
        raise TokenizerError(
            f"{source}: the vocabulary holds {len(tokens):,} "
            f"tokens; kvcache reads at most {MAX_VOCABULARY:,}"
        )
    if len(set(tokens)) != len(tokens):
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens repeats a token")
    types = _token_types(meta.get("tokenizer.ggml.token_type"), len(tokens), source)
    backend = _bpe(tokens, _merges(meta.get("tokenizer.ggml.merges"), source), source)
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), source)
    backend.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, kind in enumerate(types) if kind == _CONTROL]
    added = [tokens[i] for i, kind in enumerate(types) if kind == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if index is None:
            return None
        if not isinstance(index, int) or not 0 <= index < len(tokens):
            raise TokenizerError(f"{source}: tokenizer.ggml.{key}_token_id {index!r} is not a token id")
        return tokens[index]

    specials = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{source}: tokenizer.chat_template must be a string")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise TokenizerError(f"{source}: tokenizer.ggml.add_bos_token must be a bool, got {add_bos!r}")
    return backend, specials, template, add_bos
