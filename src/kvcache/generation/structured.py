"""Structured outputs: a request's output held to a JSON schema, any JSON object, a Lark grammar or
a regex, through llguidance. `StructuredOutput` is the request's choice (checked when it is made);
`TokenTable` is the model's vocabulary as llguidance reads it (built once per tokenizer, from its
tokenizer.json); `GrammarState` follows one request's tokens and gives, before each choice, the
packed mask of the tokens that keep the output inside the grammar (`allowed_rows` unpacks a
batch's masks for the sampler).

JSON is generated compact (no whitespace between tokens of JSON) unless the schema's own
"x-guidance" options say otherwise: a model left free to write whitespace may write only that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from kvcache.generation.params import RequestError

KINDS = ("json_object", "json_schema", "grammar", "regex")
#: llguidance's JSON options kvcache starts from (a schema's "x-guidance" key overrides them)
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_SOURCE_CHARS = 1 << 20  # a schema, grammar or regex longer than this is refused


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. kind: one of KINDS; source: the JSON schema (JSON text),
    the Lark grammar or the regex ("" for json_object); field: the request field it came from, named
    in errors. Raises RequestError naming `field` when llguidance refuses it."""

    kind: str
    source: str = ""
    field: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"{self.field}: the kind must be one of {', '.join(KINDS)}, "
                               f"got {self.kind!r:.40}")
        if not isinstance(self.source, str) or len(self.source) > MAX_SOURCE_CHARS:
            raise RequestError(f"{self.field} must be a string of at most {MAX_SOURCE_CHARS} characters")
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(self.grammar())
        if error:
            raise RequestError(f"{self.field} is not a {self.kind.replace('_', ' ')} llguidance can follow: "
                               f"{error[:400]}")

    def grammar(self) -> str:
        """llguidance's grammar text for this output."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except ValueError as error:
                raise RequestError(f"{self.field} must be a JSON schema (JSON text): {error}") from None
            if not isinstance(schema, (dict, bool)):
                raise RequestError(f"{self.field} must be a JSON schema (an object), got "
                                   f"{type(schema).__name__}")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as error:
                raise RequestError(f"{self.field} is not a JSON schema llguidance reads: {error}") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        return llguidance.LLMatcher.grammar_from_lark(self.source)


class TokenTable:
    """A tokenizer's vocabulary as llguidance reads it (its tokenizer.json, `vocab_size` rows: the
    model's logits), with `eos_ids` the ids that end a reply. Added tokens that are not special
    (Qwen2.5's `<tool_call>`: text its template writes) are text here: llguidance reads every added
    token of a tokenizer.json as special, yet tokenizes a grammar's forced text into them, so its
    mask would allow a token it then refuses to follow."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of one packed mask
        source = tokenizer.backend.to_str()
        self.llg = llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=list(eos_ids))
        added = json.loads(source).get("added_tokens") or []
        if any(not token.get("special", True) for token in added):
            texts = _AddedAsText(tokenizer.backend, self.llg, vocab_size, eos_ids,
                                 [token["id"] for token in added if token.get("special", True)])
            self.llg = llguidance.LLTokenizer(llguidance.TokenizerWrapper(texts), n_vocab=vocab_size,
                                              eos_token=list(eos_ids))


class _AddedAsText:
    """What llguidance's TokenizerWrapper reads: each token's bytes (as `llg`, a table built from the
    tokenizer.json, decodes them), the special ids (the added tokens marked special), and the
    tokenizer's own encoding of a text (added tokens that are text included)."""

    def __init__(self, backend, llg, vocab_size: int, eos_ids: tuple[int, ...], special: list[int]) -> None:
        self.backend = backend
        self.eos_token_id, self.bos_token_id = eos_ids[0], None
        self.tokens = [llg.decode_bytes([token]) for token in range(vocab_size)]
        self.special_token_ids = special

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # (llguidance then hands over text, splitting bytes itself)
            raise TypeError("the tokenizer encodes text, not bytes")
        return self.backend.encode(text, add_special_tokens=False).ids


class GrammarState:
    """One request's place in its grammar: `fill` writes the packed mask of the tokens it may take
    next; `take` follows a chosen token; `done` once the grammar is complete and takes nothing
    more (the reply ends there, finish reason "stop")."""

    def __init__(self, output: StructuredOutput, table: TokenTable) -> None:
        import llguidance

        self.table = table
        self.matcher = llguidance.LLMatcher(table.llg, output.grammar(), log_level=0)
        if self.matcher.is_error():
            raise RequestError(f"{output.field}: llguidance refused it: {self.matcher.get_error()[:400]}")

    def fill(self, packed: np.ndarray) -> None:
        """Write the allowed tokens into packed (words,) int32, bit t of word t // 32 for token t."""
        self.matcher.unsafe_compute_mask_ptr(packed.ctypes.data, packed.nbytes)

    def take(self, token: int) -> None:
        """Follow the chosen `token`; RuntimeError when the grammar does not allow it."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"token {token} is outside the request's grammar: "
                               f"{self.matcher.get_error()[:200]}")

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()


def packed_masks(states: list[GrammarState], table_words: int) -> np.ndarray:
    """(len(states), words) int32: each state's packed mask of allowed tokens."""
    packed = np.zeros((len(states), table_words), dtype=np.int32)
    for row, state in enumerate(states):
        state.fill(packed[row])
    return packed


def allowed_rows(packed: np.ndarray, vocab_size: int) -> np.ndarray:
    """(R, words) packed int32 masks -> (R, vocab_size) bool: which tokens each row may take."""
    bits = np.unpackbits(np.ascontiguousarray(packed).view(np.uint8), axis=-1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)
