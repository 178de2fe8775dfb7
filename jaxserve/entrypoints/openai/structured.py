"""The request's output constraint: OpenAI's `response_format`, vLLM's `structured_outputs`
and `guided_*` fields, and the schema that a forced tool call (`tool_choice`) follows."""

from __future__ import annotations

from typing import Any

from jaxserve.structured import StructuredOutputsParams

# vLLM's older request fields, each one constraint kind.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _params(field: str, make) -> StructuredOutputsParams:
    """`make()`, with a ValueError's message led by the request field at fault."""
    try:
        return make()
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None


def response_format_constraint(response_format: dict[str, Any] | None
                               ) -> StructuredOutputsParams | None:
    """The constraint of OpenAI's `response_format` (None for `text`).

    Raises:
        ValueError: An unknown type, or a `json_schema` without a schema object.
    """
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format: a json_schema response format needs "
                             "json_schema.schema, a JSON schema object")
        return _params("response_format", lambda: StructuredOutputsParams(json=spec["schema"]))
    raise ValueError(f"response_format: type must be 'text', 'json_object' or 'json_schema', "
                     f"got {kind!r}")


def tool_call_schema(tools: list[dict], tool_choice) -> dict | None:
    """The JSON schema a forced tool call follows, or None when none is forced.

    A named function (`{"type": "function", "function": {"name": ...}}`): its arguments,
    which are the whole output. `"required"`: a JSON list of one or more
    `{"name": ..., "parameters": {...}}` calls of the given tools.
    """
    def params_of(tool: dict) -> dict:
        schema = tool["function"].get("parameters")
        return schema if isinstance(schema, dict) else {"type": "object"}

    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return params_of(next(t for t in tools if t["function"].get("name") == name))
    if tool_choice == "required":
        calls = [{"type": "object",
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "parameters": params_of(t)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for t in tools]
        return {"type": "array", "minItems": 1,
                "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    return None


def request_constraint(req, tool_schema: dict | None = None
                       ) -> tuple[StructuredOutputsParams | None, str | None]:
    """The one constraint a request asks for, and the field that asked for it.

    Args:
        req: A parsed completion or chat request.
        tool_schema: The schema of a forced tool call (`tool_call_schema`), if any.

    Raises:
        ValueError: A bad constraint (the message starts with its field), or more than one.
    """
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = response_format_constraint(req.response_format)
    if rf is not None:
        found.append(("response_format", rf))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _params(
            "structured_outputs", lambda: StructuredOutputsParams.from_value(
                req.structured_outputs))))
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(req, field)
        if value is not None:
            found.append((field, _params(field, lambda v=value, k=kind:
                                         StructuredOutputsParams(**{k: v}))))
    if tool_schema is not None:
        found.append(("tool_choice", StructuredOutputsParams(json=tool_schema)))
    if len(found) > 1:
        raise ValueError(f"{found[1][0]}: a request takes one output constraint, got "
                         f"{', '.join(name for name, _ in found)}")
    return (found[0][1], found[0][0]) if found else (None, None)
