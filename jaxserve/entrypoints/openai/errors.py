"""OpenAI-style errors: the exception, its JSON body, and request-body parsing that only ever
fails with a 400 naming the field (bad JSON, deep nesting, lone surrogates, wrong types)."""

from __future__ import annotations

import json
import re

from pydantic import BaseModel, ValidationError

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}
# Dotted module paths in exception texts (`transformers.tokenization_utils_base.X`) say
# nothing to a client and reveal internals: only the last name is kept.
_QUALIFIED = re.compile(r"\b(?:[A-Za-z_]\w*\.){2,}([A-Za-z_]\w*)")


class OpenAIError(Exception):
    """An error answered with an OpenAI-style body.

    Args:
        status: HTTP status code.
        message: Human-readable message.
        param: The request field at fault, if any.
    """

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, clean_message(message), param

    def body(self) -> dict:
        """The JSON error body (`message` was cleaned when the error was made)."""
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


def clean_message(message: str) -> str:
    """`message` without qualified internal names, and at most 1,000 characters."""
    message = _QUALIFIED.sub(r"\1", str(message))
    return message if len(message) <= 1000 else message[:997] + "..."


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": clean_message(message), "type": ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


# pydantic adds the tried member of a union to an error's location (`stop.str`).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


# What a validation error's message reports, as vLLM's handler bounds it.
_MAX_REPORTED_ERRORS, _MAX_INPUT_CHARS = 10, 200


def _field_path(loc) -> str:
    """The dotted field of a pydantic error location, without union-member tags."""
    return ".".join(str(p) for p in loc
                    if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p)))


def _shown_input(value: object) -> object:
    """A validation error's `input` as vLLM's message shows it: strings cut at 200
    characters, containers described, anything else as text."""
    if isinstance(value, str):
        return value if len(value) <= _MAX_INPUT_CHARS else value[:_MAX_INPUT_CHARS] + \
            "...[truncated]"
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= _MAX_INPUT_CHARS else text[:_MAX_INPUT_CHARS] + "...[truncated]"


def from_validation_error(e: ValidationError) -> OpenAIError:
    """A 400 for a pydantic validation error: `param` names the first bad field; the message
    is vLLM's (`1 validation error:` then each error's `type`, `loc`, `msg`, `input` and
    `ctx`, e.g. `'type': 'less_than_equal'`), so clients matching pydantic's codes and
    wording find them."""
    errors = e.errors(include_url=False)
    lines = []
    for err in errors[:_MAX_REPORTED_ERRORS]:
        shown = {**err, "loc": ".".join(["body", _field_path(err.get("loc", ()))]).rstrip(".")}
        if "input" in shown:
            shown["input"] = _shown_input(shown["input"])
        lines.append(f"  {shown}")
    count = len(errors)
    label = "error" if count == 1 else "errors"
    if count > _MAX_REPORTED_ERRORS:
        lines.append(f"  ...and {count - _MAX_REPORTED_ERRORS} more {label}")
    loc = _field_path(errors[0].get("loc", ())) if errors else ""
    error = OpenAIError(400, "", loc or None)
    # NOTE: not `clean_message`, which would shorten a dotted `loc` such as
    # `body.stream_options.include_usage` (pydantic's texts name no internal modules).
    message = "\n".join([f"{count} validation {label}:", *lines])
    error.message = message if len(message) <= 1000 else message[:997] + "..."
    return error


def from_value_error(e: Exception, fields: set[str], renames: dict[str, str] | None = None
                     ) -> OpenAIError:
    """A 400 for a ValueError whose message starts with a field name (SamplingParams'), or
    a `ParameterError` carrying it.

    Args:
        e: The error.
        fields: Names that may be reported as `param`.
        renames: Engine names to report under the request's own name (e.g. `max_tokens`
            given as `max_completion_tokens`); the message is rewritten too.
    """
    message = str(e)
    named = getattr(e, "parameter", None)  # a `ParameterError`: its message names no field
    if named is not None:
        param = named if named in fields else None
        return OpenAIError(400, message, (renames or {}).get(param, param))
    first = re.match(r"[A-Za-z_]\w*", message)
    param = first[0] if first and first[0] in fields else None
    if renames and param in renames:
        message = renames[param] + message[len(param):]
        param = renames[param]
    return OpenAIError(400, message, param)


def _find_surrogate(data, path: str = "") -> str | None:
    """The dotted path of the first string holding a lone surrogate, or None."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            return path or None
        return None
    items = data.items() if isinstance(data, dict) else enumerate(data) \
        if isinstance(data, list) else ()
    for key, value in items:
        found = _find_surrogate(value, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def loads_body(data: bytes | str) -> object:
    """A JSON request body decoded, or a 400 (bad JSON, too deep, lone surrogates).

    Raises:
        OpenAIError: 400 naming the problem (and the field of a lone surrogate).
    """
    try:
        value = json.loads(data)
    except RecursionError:
        raise OpenAIError(400, "request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"request body is not valid JSON: {e}") from None
    if _may_hide_trouble(data):
        check_value(value)
    return value


# Brackets a body may open before `check_value` re-encodes it to look for deep nesting.
_SHALLOW_BRACKETS = 200


def _may_hide_trouble(data: bytes | str) -> bool:
    """Whether a decoded body may hold lone surrogates (only a `\\u` escape or raw
    surrogate bytes, which `json.loads` lets through, can make one) or nesting deep enough to
    break later encoders. Most bodies cannot: skipping the re-encoding halves the time a
    multi-megabyte body holds the interpreter."""
    if isinstance(data, str):
        return True  # already decoded text: rare (tests, SDK callers), always checked
    if json.detect_encoding(data) != "utf-8" or b"\xed" in data:
        return True
    if data.find(b"\\") >= 0 and b"\\u" in data:  # memchr first: most bodies have none
        return True
    return _more_than(data, b"[", _SHALLOW_BRACKETS // 2) or _more_than(
        data, b"{", _SHALLOW_BRACKETS // 2)


def _more_than(data: bytes, byte: bytes, n: int) -> bool:
    """Whether `byte` occurs more than `n` times (a few `find`s, each a memchr, where
    `bytes.count` walks the whole body byte by byte)."""
    pos = -1
    for _ in range(n + 1):
        pos = data.find(byte, pos + 1)
        if pos < 0:
            return False
    return True


def check_value(value: object) -> None:
    """Raises a 400 for a decoded body that is nested too deeply or holds lone surrogates."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise OpenAIError(400, "request body is nested too deeply") from None
    except UnicodeEncodeError:
        where = _find_surrogate(value)
        raise OpenAIError(400, f"{where or 'body'}: text holds a lone surrogate (not valid "
                               "Unicode)", where) from None


def parse_body(data: bytes | str | dict, model: type[BaseModel]) -> BaseModel:
    """Parses a JSON body (bytes or an already decoded dict) into `model`, or a 400."""
    if isinstance(data, (bytes, str)):
        data = loads_body(data)
    else:
        check_value(data)  # the same checks for bodies given already decoded
    if not isinstance(data, dict):
        raise OpenAIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None
    except RecursionError:
        raise OpenAIError(400, "request body is nested too deeply") from None
