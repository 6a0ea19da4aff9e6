"""The tokenizer a GGUF file carries in its metadata, rebuilt on the `tokenizers` library: the
vocabulary (`tokenizer.ggml.tokens`, as many as the embedding has rows), control and unknown tokens
as special tokens, user-defined ones as added tokens, BOS/EOS/padding/unknown ids, whether a BOS
and an EOS are added, and the chat template (rendered, like every template, in jinja2's sandbox by
`kvcache.text.tokenizer.Tokenizer`, which `load_tokenizer` builds from these parts).

Two kinds are read (`tokenizer.ggml.model`): "gpt2", a byte-level BPE with its merges, and
"llama", sentencepiece's pieces and scores (`kvcache.text.tokenizer_gguf_spm`). How a byte-level
BPE splits text before merging depends on the model (`tokenizer.ggml.pre`); the splits known here
are written out below, and a file that names another is refused by name rather than tokenized
differently from how the model was trained. What a file leaves out reads as llama.cpp reads it:
a sentencepiece file adds a BOS and a prefix space unless it says otherwise, and its BOS, EOS and
unknown tokens are 1, 2 and 0 unless it names others.
"""

from __future__ import annotations

from pathlib import Path

from kvcache.text.tokenizer_error import TokenizerError
from kvcache.text.tokenizer_gguf_spm import piece_scores, sentencepiece_backend

# token_type values in GGUF (llama.cpp's: undefined, normal, unknown, control, user-defined, unused, byte)
_UNKNOWN, _CONTROL, _USER_DEFINED, _TOKEN_TYPES = 2, 3, 4, range(7)
MAX_VOCABULARY = 1 << 20  # tokens; the largest published vocabularies hold ~262k
_GPT2, _SENTENCEPIECE = "gpt2", "llama"  # tokenizer.ggml.model: byte-level BPE, sentencepiece
# llama.cpp's ids for a sentencepiece file that names none (tokenizer.ggml.<name>_token_id)
_SENTENCEPIECE_IDS = {"bos": 1, "eos": 2, "unknown": 0}
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


def _tokens(meta: dict, source: str) -> list[str]:
    """The vocabulary, checked: a non-empty list of distinct strings, not too many."""
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
    return tokens


def _check_rows(reader, meta: dict, count: int, source: str) -> None:
    """One token per row of the embedding (token_embd.weight), or per the vocabulary size the
    metadata gives when the file holds no embedding: an id past them would have no row."""
    embedding = next((tensor for tensor in reader.tensors if tensor.name == "token_embd.weight"), None)
    if embedding is not None and len(embedding.shape) == 2:  # (hidden, rows): innermost first
        rows, what = embedding.shape[1], "the embedding token_embd.weight has"
    else:
        key = f"{meta.get('general.architecture')}.vocab_size"
        rows, what = meta.get(key), f"{key} says"
        if rows is None:
            return
    if rows != count:
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens holds {count:,} tokens; {what} {rows!r} rows")


def _flag(meta: dict, key: str, default: bool | None, source: str) -> bool | None:
    value = meta.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise TokenizerError(f"{source}: {key} must be a bool, got {value!r}")
    return value


def _special_id(meta: dict, name: str, count: int, default: int | None, source: str) -> int | None:
    """tokenizer.ggml.<name>_token_id, checked to be a token id; absent: `default`."""
    key = f"tokenizer.ggml.{name}_token_id"
    index = meta.get(key, default)
    if index is None:
        return None
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise TokenizerError(f"{source}: {key} {index!r} is not a token id (0..{count - 1:,})")
    return index


def _model(meta: dict, kind: str, tokens: list[str], types: list[int], unknown: str | None, source: str):
    """The tokenizers.Tokenizer of the file's kind, before its special tokens are added."""
    from tokenizers import decoders

    if kind == _SENTENCEPIECE:
        scores = piece_scores(meta.get("tokenizer.ggml.scores"), len(tokens), source)
        add_space_prefix = _flag(meta, "tokenizer.ggml.add_space_prefix", True, source)
        return sentencepiece_backend(tokens, scores, types, unknown, add_space_prefix, source)
    backend = _bpe(tokens, _merges(meta.get("tokenizer.ggml.merges"), source), source)
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), source)
    backend.decoder = decoders.ByteLevel()
    return backend


def _added_ends(meta: dict, kind: str, specials: dict[str, str | None], source: str) -> tuple:
    """(add a BOS, add an EOS), each flag checked against the id it needs; add_bos None: the file
    does not say (a byte-level BPE adds none then)."""
    add_bos = _flag(meta, "tokenizer.ggml.add_bos_token", True if kind == _SENTENCEPIECE else None, source)
    add_eos = _flag(meta, "tokenizer.ggml.add_eos_token", False, source)
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and specials[f"{name}_token"] is None:
            raise TokenizerError(
                f"{source}: tokenizer.ggml.add_{name}_token is true but "
                f"tokenizer.ggml.{name}_token_id is not set"
            )
    return add_bos, add_eos


def read_gguf_tokenizer(path: str | Path) -> tuple:
    """The tokenizer stored in the GGUF file at `path`, as `kvcache.text.tokenizer.Tokenizer`'s
    arguments: (a tokenizers.Tokenizer, special tokens, chat template, add_bos_token)."""
    from tokenizers import AddedToken, processors

    from kvcache.model.gguf_file import metadata, open_gguf

    source = str(path)
    reader = open_gguf(path)
    meta = metadata(reader)
    kind = meta.get("tokenizer.ggml.model")
    if kind not in (_GPT2, _SENTENCEPIECE):
        raise TokenizerError(
            f"{source}: the GGUF tokenizer is of kind {kind!r}; kvcache reads byte-level BPE ('gpt2') and "
            "sentencepiece ('llama') tokenizers from GGUF files; load the model's Hugging Face folder "
            "(tokenizer.json) instead"
        )
    tokens = _tokens(meta, source)
    _check_rows(reader, meta, len(tokens), source)
    types = _token_types(meta.get("tokenizer.ggml.token_type"), len(tokens), source)
    defaults = _SENTENCEPIECE_IDS if kind == _SENTENCEPIECE else {}
    ids = {name: _special_id(meta, name, len(tokens), defaults.get(name), source)
           for name in ("bos", "eos", "padding", "unknown")}
    specials = {f"{short}_token": None if ids[name] is None else tokens[ids[name]]
                for short, name in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}
    backend = _model(meta, kind, tokens, types, specials["unk_token"], source)
    special = [tokens[i] for i, token_type in enumerate(types) if token_type in (_CONTROL, _UNKNOWN)]
    added = [tokens[i] for i, token_type in enumerate(types) if token_type == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    add_bos, add_eos = _added_ends(meta, kind, specials, source)
    if add_eos:  # (a BOS is added by `Tokenizer.encode`, which adds none twice)
        eos = specials["eos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=["$A", eos], pair=["$A", eos, "$B", eos], special_tokens=[(eos, ids["eos"])]
        )
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{source}: tokenizer.chat_template must be a string")
    return backend, specials, template, add_bos
