"""`eval json-schema` without a model run: its schemas are valid JSON schemas that compile strict,
and its CLI parses (the run itself is the documented command: docs/serving.md)."""
from __future__ import annotations

import jsonschema

from oasiskv.engine.structured_output import Grammars
from oasiskv.entrypoints.cli import main
from oasiskv.eval.json_schema import SCHEMAS, SUBJECTS
from oasiskv.models.loader import resolve_model
from oasiskv.models.tokenizer import load_tokenizer
from oasiskv.sampling_params import StructuredOutput


def test_fifty_prompts_of_strict_schemas_that_compile():
    assert len(SCHEMAS) * len(SUBJECTS) == 50
    source = resolve_model(None)
    grammars = Grammars(load_tokenizer(source), source.config.vocab_size, source.config.eos_token_ids)
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)
        grammars.check(StructuredOutput("json_schema", schema, strict=True))


def test_cli_help(capsys):
    try:
        main(["eval", "json-schema", "--help"])
    except SystemExit:
        pass
    assert "--no-tool-loop" in capsys.readouterr().out
