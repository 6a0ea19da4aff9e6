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
    model's logits), with `eos_ids` the ids that end a reply."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of one packed mask
        self.llg = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                          eos_token=list(eos_ids))


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
