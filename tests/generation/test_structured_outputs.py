"""Structured outputs on the engine (llguidance): every answer to a generated JSON schema parses and
validates against it, finishing "stop" when the grammar completes; max_tokens reached first ends it
"length" with the JSON cut; a row's mask leaves the other rows of the batch alone; a schema
llguidance cannot follow is refused by name."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcache
from kvcache.engine import Engine, RequestError, SamplingParams
from kvcache.generation.sampling import choose_tokens
from kvcache.generation.structured import StructuredOutput

pytestmark = pytest.mark.kernels  # (runs the tiny model's engine)

NAMES = st.sampled_from(["a", "b", "name", "id", "x_1", "long key"])
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-50, 50).flatmap(lambda low: st.integers(low, low + 1000).map(
        lambda high: {"type": "integer", "minimum": low, "maximum": high})),
    st.integers(0, 6).map(lambda most: {"type": "string", "maxLength": most}),
    st.lists(st.text("abc xyz", max_size=4), min_size=1, max_size=3, unique=True).map(lambda e: {"enum": e}),
)


def _objects(children):
    def build(properties: dict, required: list) -> dict:
        return {"type": "object", "properties": properties, "additionalProperties": False,
                "required": [name for name in properties if name in required]}
    return st.builds(build, st.dictionaries(NAMES, children, min_size=1, max_size=3),
                     st.lists(NAMES, max_size=3))


SCHEMAS = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        _objects(children),
        st.builds(lambda items, most: {"type": "array", "items": items, "maxItems": most},
                  children, st.integers(0, 2)),
    ),
    max_leaves=5,
)


@pytest.fixture(scope="module")
def engine():
    engine = Engine(kvcache.load_model(), kvcache.load_tokenizer(), num_blocks=4096, block_size=8,
                    max_running=100, token_budget=512)
    yield engine
    engine.close()


def _canonical(schema) -> str:
    return json.dumps(schema, sort_keys=True)


def structured(schema) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


# 3 lists of 100 different schemas (290 different in all), each list's requests batched at once
@settings(max_examples=3, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(SCHEMAS, min_size=100, max_size=100, unique_by=_canonical))
def test_every_answer_to_a_generated_schema_parses_and_validates(engine, schemas):
    params = [SamplingParams(max_tokens=400, temperature=1.0, seed=seed, structured=structured(schema))
              for seed, schema in enumerate(schemas)]
    handles = [engine.submit("Answer in JSON:", p) for p in params]
    for schema, handle in zip(schemas, handles):
        completion = handle.result()
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_answers_are_json_objects_greedy_and_sampled(engine):
    output = StructuredOutput("json_object")
    for temperature in (0.0, 1.0):
        completion = engine.submit("Say it in JSON:", SamplingParams(
            max_tokens=300, temperature=temperature, seed=3, structured=output)).result()
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:  # an open object may run on: what was made is still an object's start
            assert completion.finish_reason == "length" and completion.text.startswith("{")


def test_max_tokens_first_ends_the_answer_length_with_the_json_cut(engine):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
              "required": ["name"], "additionalProperties": False}
    completion = engine.submit("x", SamplingParams(max_tokens=3, structured=structured(schema))).result()
    assert completion.finish_reason == "length" and len(completion.tokens) == 3
    assert completion.text.startswith('{"name"'[: len(completion.text)])
    with pytest.raises(ValueError):
        json.loads(completion.text)


def test_a_schema_llguidance_cannot_follow_is_refused_naming_the_field():
    with pytest.raises(RequestError, match="response_format.*Invalid type: frog"):
        StructuredOutput("json_schema", json.dumps({"type": "frog"}))
    with pytest.raises(RequestError, match="my_field"):
        StructuredOutput("regex", "(unclosed", field="my_field")
    with pytest.raises(RequestError, match="kind must be one of"):
        StructuredOutput("yaml", "")


def test_a_mask_keeps_its_row_inside_it_and_leaves_the_other_rows_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams()]
    allowed = torch.zeros(50, dtype=torch.bool)
    allowed[[7, 11]] = True
    plain = choose_tokens(logits, params, shared=torch.Generator().manual_seed(1))
    masked = choose_tokens(logits, params, shared=torch.Generator().manual_seed(1),
                           allowed=[None, None, allowed.numpy()])
    assert masked[:2].tolist() == plain[:2].tolist() and masked[2].item() in (7, 11)
    assert masked[2].item() == (7 if logits[2, 7] >= logits[2, 11] else 11)  # greedy inside the mask
