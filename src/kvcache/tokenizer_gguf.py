"""The tokenizer a GGUF file carries in its metadata, rebuilt as a `tokenizers` byte-level BPE:
the vocabulary (`tokenizer.ggml.tokens`), the merges, control tokens as special tokens, BOS/EOS/
padding ids, whether a BOS is added, and the chat template (rendered, like every template, in
jinja2's sandbox by `kvcache.tokenizer.Tokenizer`, which `load_tokenizer` builds from these parts).

How text is split before BPE depends on the model (`tokenizer.ggml.pre`); the splits known here
are written out below, and a file that names another is refused by name rather than tokenized
differently from how the model was trained. SentencePiece-style vocabularies
(`tokenizer.ggml.model` = "llama") are refused too.
"""

from __future__ import annotations

from pathlib import Path

from kvcache.tokenizer_error import TokenizerError

# token_type values in GGUF
_CONTROL, _USER_DEFINED = 3, 4
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


def read_gguf_tokenizer(path: str | Path) -> tuple:
    """The tokenizer stored in the GGUF file at `path`, as `kvcache.tokenizer.Tokenizer`'s
    arguments: (a tokenizers.Tokenizer, special tokens, chat template, add_bos_token)."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as Backend

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
    merges = meta.get("tokenizer.ggml.merges") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens must be a non-empty list of strings")
    if len(set(tokens)) != len(tokens):
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens repeats a token")
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ") if isinstance(merge, str) else ("", "", "")
        if not space or not left or not right:
            raise TokenizerError(f"{source}: a merge must be two tokens separated by a space, got {merge!r}")
        pairs.append((left, right))
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), source)
    backend.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, kind in enumerate(types[: len(tokens)]) if kind == _CONTROL]
    added = [tokens[i] for i, kind in enumerate(types[: len(tokens)]) if kind == _USER_DEFINED]
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
    return backend, specials, template, bool(add_bos) if add_bos is not None else None
