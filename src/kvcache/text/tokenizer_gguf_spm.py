"""The sentencepiece tokenizer a GGUF file carries (`tokenizer.ggml.model` = "llama": Llama 2,
Mistral v0.1, Gemma, Phi-3 files), rebuilt on the `tokenizers` library as llama.cpp reads it.

llama.cpp's SPM tokenizer starts from the characters of the text (each space written "▁", and one
more in front when the file asks for a prefix space) and keeps merging the adjacent pair whose
joined text is a token of the highest score; a character that never became a token is written as
its UTF-8 bytes (the `<0xNN>` tokens). That is a BPE whose merge ranks come from the scores: every
cut of a token into two tokens is a merge, ranked by the whole token's score (equal scores: by the
token's place in the file, where llama.cpp takes the leftmost pair in the text). A Unigram model
over the same (piece, score) pairs picks the cut whose scores sum highest instead, which for these
BPE-trained vocabularies is another tokenization than the model was trained on.

The prefix space is a normalizer, so it goes at the start of the text and after every special
token, as in llama.cpp; the decoder writes "▁" as a space, joins `<0xNN>` bytes into characters
and takes the prefix space off the front again.
"""

from __future__ import annotations

from kvcache.text.tokenizer_error import TokenizerError

SPACE = "\u2581"  # sentencepiece's visible space
# token types a merge may build: undefined, normal, unused (control, user-defined and unknown
# tokens are matched whole in the text, byte tokens only stand for bytes)
_MERGEABLE = frozenset({0, 1, 5})
MAX_PIECE_CHARS = 1024  # a mergeable token's length; sentencepiece trains pieces of at most 16
MAX_MERGES = 1 << 22  # cuts of tokens into two tokens; a 262k vocabulary has well under 1M
SCORES_KEY = "tokenizer.ggml.scores"


def piece_scores(values, count: int, source: str) -> list[float]:
    """Each token's score, checked: one finite number per token."""
    import numpy as np

    if values is None:
        raise TokenizerError(
            f"{source}: {SCORES_KEY} is missing; a sentencepiece ('llama') tokenizer merges "
            "pieces by their scores"
        )
    numeric = hasattr(values, "dtype") and values.dtype.kind in "fiu" and values.ndim == 1
    if not numeric or len(values) != count:
        raise TokenizerError(f"{source}: {SCORES_KEY} must be {count:,} numbers, one per token")
    scores = np.asarray(values, dtype=np.float64)
    if not np.isfinite(scores).all():
        raise TokenizerError(f"{source}: {SCORES_KEY} holds a NaN or an infinity")
    return scores.tolist()


def score_merges(tokens: list[str], vocab: dict[str, int], scores: list[float], types: list[int],
                 source: str) -> list[tuple[str, str]]:
    """Every cut of a mergeable token into two tokens, as a (left, right) merge, the best-scored
    token's cuts first (ties: the token listed first, then the shorter left part)."""
    ranked = []
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind not in _MERGEABLE or len(token) < 2:
            continue
        if len(token) > MAX_PIECE_CHARS:
            raise TokenizerError(
                f"{source}: tokenizer.ggml.tokens[{index}] has {len(token):,} characters; "
                f"kvcache reads sentencepiece tokens of at most {MAX_PIECE_CHARS:,}"
            )
        for cut in range(1, len(token)):
            left = vocab.get(token[:cut])
            if left is not None:
                right = vocab.get(token[cut:])
                if right is not None:
                    ranked.append((-scores[index], index, cut, left, right))
        if len(ranked) > MAX_MERGES:
            raise TokenizerError(
                f"{source}: tokenizer.ggml.tokens can be cut into two tokens in more than "
                f"{MAX_MERGES:,} ways; kvcache reads sentencepiece vocabularies with fewer"
            )
    ranked.sort()
    return [(tokens[left], tokens[right]) for *_, left, right in ranked]


def sentencepiece_backend(tokens: list[str], scores: list[float], types: list[int], unknown: str | None,
                          add_space_prefix: bool, source: str):
    """The tokenizers.Tokenizer: a BPE of `score_merges` with byte fallback, unknown characters
    (no byte token for them) as `unknown`, the "▁" normalizer and the decoder undoing it."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    vocab = {token: index for index, token in enumerate(tokens)}
    merges = score_merges(tokens, vocab, scores, types, source)
    try:
        backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token=unknown, byte_fallback=True,
                                     fuse_unk=True))
    except Exception as error:  # noqa: BLE001 (tokenizers raises a bare Exception)
        raise TokenizerError(
            f"{source}: the sentencepiece vocabulary does not form a tokenizer: {error}"
        ) from None
    escape = normalizers.Replace(" ", SPACE)
    prefix = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, escape])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend
