"""The request fields that constrain the output, read into one `StructuredOutput`: OpenAI's
`response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
"schema", "strict"}}) and vLLM's `guided_json`, `guided_regex`, `guided_choice`. At most one
may be given; a malformed one is a 400 naming the field and what is wrong with it."""
from __future__ import annotations

import json

from oasiskv.entrypoints.openai.protocol import APIError, _SamplingFields
from oasiskv.sampling_params import StructuredOutput

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"`{param}` {message}", param=param, code="invalid_value")


def structured_output(req: _SamplingFields) -> StructuredOutput | None:
    given = [f for f in FIELDS if getattr(req, f) is not None]
    if len(given) > 1:
        raise APIError(400, f"give at most one of {', '.join(f'`{f}`' for f in given)}", param=given[1])
    if not given:
        return None
    name, value = given[0], getattr(req, given[0])
    if name == "response_format":
        return _response_format(value)
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise _bad(name, f"is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise _bad(name, "must be a JSON schema (an object)")
        return StructuredOutput("json_schema", value)
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise _bad(name, "must be a non-empty string")
        return StructuredOutput("regex", value)
    if not isinstance(value, list) or not value or any(not isinstance(c, str) or not c for c in value):
        raise _bad(name, "must be a non-empty list of non-empty strings")
    return StructuredOutput("choice", value)


def _response_format(value) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad(param, 'must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                          '"json_schema": {...}}')
    kind = value["type"]
    extra = sorted(set(value) - {"type"} - ({"json_schema"} if kind == "json_schema" else set()))
    if extra:
        raise _bad(param, f"has fields that type {kind!r} does not take: {', '.join(extra)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad(param, 'of type "json_schema" needs a `json_schema` object {"name", "schema", "strict"}')
    unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if unknown:
        raise _bad(param, f"`json_schema` has unknown fields: {', '.join(unknown)}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _bad(param, "`json_schema.name` must be a non-empty string")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise _bad(param, "`json_schema.schema` must be a JSON schema (an object)")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(param, "`json_schema.strict` must be a boolean")
    return StructuredOutput("json_schema", schema, strict=bool(strict))
