"""kvcache generate --json-schema FILE and --grammar FILE: the reply matches the schema (and ends
"grammar" once it is complete) or the Lark grammar; a schema llguidance refuses, or a file that
is not JSON, is the command's one error line naming the flag."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvcache.cli import main
from kvcache.defaults import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.kernels  # (runs the tiny model)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def _generate(*extra) -> list[str]:
    return ["generate", "-m", str(DEFAULT_MODEL_DIR), "--prompt", "JSON:", "--json", *extra]


def test_json_schema_and_grammar_flags_hold_the_reply(tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    for extra in ((), ("--temperature", "1.5", "--seed", "4")):
        assert main(_generate("--json-schema", str(schema), "--max-new-tokens", "60", *extra)) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["stop_reason"] == "grammar"
        jsonschema.validate(json.loads(report["text"]), SCHEMA)
    grammar = tmp_path / "answer.lark"
    grammar.write_text('start: "yes" | "no" | "maybe so"\n')
    assert main(_generate("--grammar", str(grammar), "--temperature", "1", "--seed", "2")) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no", "maybe so")


def test_a_schema_it_cannot_follow_is_one_error_line_naming_the_flag(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "frog"}')
    assert main(_generate("--json-schema", str(bad))) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache generate: error: --json-schema") and "frog" in err
    bad.write_text("{not json")
    assert main(_generate("--json-schema", str(bad))) == 2
    assert "is not JSON" in capsys.readouterr().err
    grammar = tmp_path / "bad.lark"
    grammar.write_text("start: (")
    assert main(_generate("--grammar", str(grammar))) == 2
    assert capsys.readouterr().err.startswith("kvcache generate: error: --grammar")
