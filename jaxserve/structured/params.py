"""`StructuredOutputsParams`: the constraint a request's output must follow (vLLM's shape)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.utils import settings_dict

# The constraint kinds, exactly one of which a StructuredOutputsParams sets.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint, checked on construction.

    Exactly one of `json`, `regex`, `choice`, `grammar` or `json_object` is set, as in
    vLLM's `StructuredOutputsParams`.

    Attributes:
        json: A JSON schema (a dict, or its JSON text) the output must validate against.
        regex: A regular expression the whole output must match.
        choice: The output is exactly one of these strings.
        grammar: A Lark grammar (llguidance's dialect) or a GBNF/EBNF grammar (rules
            written `name ::= ...`, as llama.cpp and xgrammar take them).
        json_object: True: the output is any JSON object.
        disable_any_whitespace: JSON without whitespace between tokens (compact).
        disable_additional_properties: Objects of the schema accept no properties beyond
            the ones it lists (unless the schema says otherwise). None (the default) is
            True, as vLLM's default backend behaves; False allows unlisted properties (the
            JSON Schema reading, which a small model wanders into).
        whitespace_pattern: A regex for the whitespace allowed between JSON tokens
            (default `grammar.WHITESPACE`: one space, or a newline and an indent of up to
            24 spaces or 6 tabs; or none).

    Raises:
        ValueError: No constraint, more than one, or a value of the wrong type; the
            message names the field.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(schema).__name__}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got "
                                 f"{value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) \
                    or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got "
                             f"{self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (
                    value is None and name == "disable_additional_properties"):
                raise ValueError(f"structured_outputs.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams:
        """A StructuredOutputsParams from itself or from a dict of its fields.

        Raises:
            ValueError: Unknown keys or invalid values.
        """
        if isinstance(value, cls):
            return value
        value = settings_dict(value, "structured_outputs",
                              [f.name for f in dataclasses.fields(cls)], allow_json=False)
        return cls(**value)

    @property
    def closes_objects(self) -> bool:
        """Whether objects take only the properties their schema lists (unless it says
        otherwise): `disable_additional_properties`, True unless set False."""
        return self.disable_additional_properties is not False

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """A string that identifies the compiled grammar (the LRU cache's key)."""
        value = getattr(self, self.kind)
        if self.kind == "json":  # a schema as a dict or as its JSON text: one grammar
            value = json.dumps(json.loads(value) if isinstance(value, str) else value,
                               sort_keys=True)
        return json.dumps([self.kind, value if not isinstance(value, tuple) else list(value),
                           self.disable_any_whitespace, self.closes_objects,
                           self.whitespace_pattern])
