"""Tool-call parsers (`--tool-call-parser`, vLLM's names): a chat reply's tool calls read out of
its text, each parser the format one model family writes.

`parse_tool_calls(name, text, tools)` is the entry point; `get_tool_parser(name)` gives the
parser itself (its markers tell a stream what to hold back). A reply that looks like a call
but does not parse stays content, with no calls, as vLLM.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid

from jaxserve.entrypoints.openai.harmony import split_messages
from jaxserve.utils import named_choice


def call_json(name: str, arguments: str, call_id: str | None = None) -> dict:
    """One OpenAI tool call object (a new `call_...` id unless `call_id`)."""
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def dumps(value) -> str:
    """Arguments as the JSON string OpenAI's `function.arguments` holds."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolParser:
    """A tool-call format: `parse` reads a whole reply; `markers` are the strings a call
    begins with (a stream holds back text from the first one, and any end of the text that
    may begin one). With `at_start`, a reply holds calls only when it begins with a marker
    (after white space): a stream that began otherwise is content to its end.
    """

    name = ""
    markers: tuple[str, ...] = ()
    at_start = False
    # The marker is a special token the detokenizer would drop (vLLM's `adjust_request`).
    keep_special_tokens = False
    harmony = False  # the reply is harmony, read by `harmony_chat` (gpt-oss)

    def parse(self, text: str, tools: list[dict] | None = None
              ) -> tuple[str | None, list[dict]]:
        """(content, calls) of a whole reply; `(text, [])` when it holds no call that
        parses. `tools` are the request's tools (some formats type arguments by them)."""
        raise NotImplementedError

    def hold_from(self, text: str, sent: int) -> int:
        """Where a stream that has sent `text[:sent]` as content must stop sending now."""
        if self.at_start:
            if sent:
                return len(text)
            start = _SPACE.match(text).end()  # the head only: O(1) per token of a long call
            head = text[start:start + max(map(len, self.markers))]
            may_call = not head or any(head.startswith(m) or m.startswith(head)
                                       for m in self.markers)
            return 0 if may_call else len(text)
        found = [i for m in self.markers if (i := text.find(m, sent)) >= 0]
        if found:
            return min(found)
        return max(sent, len(text) - max(_partial(text, m) for m in self.markers))


_SPACE = re.compile(r"\s*")


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5,
    Qwen3); text before the first block is the content. A last block the model ended without
    `</tool_call>` counts too."""

    name = "hermes"
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text, tools=None):
        start = text.find(self.markers[0])
        if start < 0:
            return text, []
        calls = []
        for block in self._BLOCK.findall(text[start:]):
            try:
                call = json.loads(block)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            calls.append(call_json(call["name"], dumps(call.get("arguments",
                                                                call.get("parameters", {})))))
        return text[:start].strip() or None, calls


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x's JSON calls: an optional `<|python_tag|>`, then `{"name": ...,
    "parameters": {...}}` objects (or `"arguments"`), several separated by `;`. As vLLM, every
    JSON object in the reply is read and the text around them dropped (content null); an
    object that is not such a call leaves the whole reply as content."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start = True

    def parse(self, text, tools=None):
        if "{" not in text:
            return text, []
        decoder, calls, end = json.JSONDecoder(), [], -1
        for match in re.finditer(r"\{", text):
            if match.start() <= end:
                continue  # inside an object already read
            try:
                obj, length = decoder.raw_decode(text[match.start():])
            except json.JSONDecodeError:
                return text, []
            end = match.start() + length
            args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) \
                else None
            if args is None or not isinstance(obj.get("name"), str):
                return text, []
            calls.append(call_json(obj["name"], dumps(args)))
        return (None, calls) if calls else (text, [])


_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A Mistral tool call id: 9 letters and digits (what Mistral's templates accept)."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


class MistralToolParser(ToolParser):
    """Mistral's `[TOOL_CALLS]` token, then a JSON list of `{"name", "arguments"}` (v0.3
    tokenizers) or, from tokenizer v11 on, `[TOOL_CALLS]name{arguments}` per call; text before
    the first marker is the content. Ids are 9 alphanumerics, as Mistral's templates need.
    The marker is a special token: such requests keep special tokens in the text."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    keep_special_tokens = True
    _LIST = re.compile(r"\[\s*\{.*\}\s*\]", re.DOTALL)

    def parse(self, text, tools=None):
        if self.markers[0] not in text:
            return text, []
        content, *raws = text.split(self.markers[0])
        if raws[0].lstrip().startswith("["):  # [TOOL_CALLS] [{...}, ...]
            if len(raws) > 1:
                return text, []
            calls = self._json_list(raws[0].strip())
        else:  # [TOOL_CALLS]name{...}[TOOL_CALLS]name{...}
            calls = [(raw[:raw.find("{")].strip(), raw[raw.find("{"):].strip())
                     for raw in raws if "{" in raw]
        if not calls or not all(name for name, _ in calls):
            return text, []
        return content or None, [call_json(n, a, mistral_call_id()) for n, a in calls]

    def _json_list(self, raw: str) -> list[tuple[str, str]]:
        try:
            items = json.loads(raw)
        except json.JSONDecodeError:
            found = self._LIST.search(raw)  # as vLLM: the list among other text
            try:
                items = json.loads(found.group(0)) if found else None
            except json.JSONDecodeError:
                items = None
        if not isinstance(items, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c
                for c in items):
            return []
        return [(c["name"], dumps(c["arguments"])) for c in items]


class PythonicToolParser(ToolParser):
    """A Python list of calls with keyword arguments of literal values, the whole reply:
    `[get_weather(city="Paris", days=3), get_time()]` (Llama 3.2, Llama 4, ToolACE). Anything
    else (positional arguments, names, expressions, text around the list) is content."""

    name = "pythonic"
    markers = ("[",)
    at_start = True

    def parse(self, text, tools=None):
        body = text.strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) \
                    or node.args or any(k.arg is None for k in node.keywords):
                return text, []
            try:
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                calls.append(call_json(node.func.id, json.dumps(args, ensure_ascii=False)))
            except (ValueError, TypeError, SyntaxError, RecursionError):  # not a JSON literal
                return text, []
        return None, calls


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder's XML calls: `<tool_call><function=name><parameter=p>value</parameter>
    ...</function></tool_call>`, one value per parameter, typed by the tool's JSON schema
    (integers, numbers, booleans, objects and arrays read as JSON, else kept as text; a
    parameter the schema does not name stays text; `null` is null). As vLLM, the
    `<tool_call>` wrapper may be missing and a last call may be left open; text before the
    first call is the content."""

    name = "qwen3_coder"
    markers = ("<tool_call>", "<function=")
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
    _FUNCTION = re.compile(r"<function=(.*?)(?:</function>|$)", re.DOTALL)
    _PARAMETER = re.compile(
        r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)

    def parse(self, text, tools=None):
        if "<function=" not in text:
            return text, []
        blocks = self._CALL.findall(text) or [text]
        functions = [f for block in blocks for f in self._FUNCTION.findall(block)]
        calls = []
        for function in functions:
            name, sep, body = function.partition(">")
            if not sep or not name.strip():
                return text, []
            schema = _properties(tools, name.strip())
            args = {}
            for param in self._PARAMETER.findall(body):
                key, sep, value = param.partition(">")
                if not sep:
                    return text, []
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                args[key] = _typed(value, schema.get(key))
            calls.append(call_json(name.strip(), json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        starts = [i for m in self.markers if (i := text.find(m)) >= 0]
        return text[:min(starts)] or None, calls


def _properties(tools: list[dict] | None, name: str) -> dict:
    """The `properties` of tool `name`'s parameter schema (empty if unknown)."""
    for tool in tools or []:
        function = tool.get("function") or {}
        if function.get("name") == name:
            params = function.get("parameters") or {}
            props = params.get("properties", {}) if isinstance(params, dict) else {}
            return props if isinstance(props, dict) else {}
    return {}


def _typed(value: str, schema) -> object:
    """A qwen3_coder parameter's text as its schema's type says (text when it does not
    parse as that type, as vLLM)."""
    if value.lower() == "null":
        return None
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):  # ["integer", "null"]: the first non-null type
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).strip().lower()
    if schema is None or kind in ("string", "str", "text", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return value


class OpenAIToolParser(ToolParser):
    """vLLM's `openai`, for gpt-oss: harmony messages to `functions.NAME` (in the commentary
    channel, or the analysis one) are the calls, their bodies the arguments (JSON re-dumped;
    text that is not JSON passed on as written, and a function the request did not declare
    called all the same, as vLLM); `final` messages and `commentary` preambles are the
    content, and the analysis is left out. The harmony markers are special tokens: such
    requests keep them in the text (`harmony`: serving_chat reads these replies with
    `harmony_chat`, which also streams the calls' arguments)."""

    name = "openai"
    markers = ("<|channel|>", "<|start|>")
    keep_special_tokens = True
    harmony = True

    def parse(self, text, tools=None):
        _, content, calls = split_messages(text, reasoning=False)
        return content, [call_json(name, arguments) for name, arguments in calls]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "openai": OpenAIToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The tool-call parser named `name` (vLLM's names).

    Raises:
        ValueError: An unknown name, naming the choices.
    """
    return named_choice(TOOL_PARSERS, name, "tool call parser")()


def parse_tool_calls(parser_name: str, text: str, tools: list[dict] | None = None
                     ) -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole reply read by the parser `parser_name`.

    Args:
        parser_name: One of `TOOL_PARSERS`.
        text: The model's reply (reasoning already taken out).
        tools: The request's tools (OpenAI's `{"type": "function", "function": {...}}`).

    Returns:
        The content (None when only calls remain) and the calls, OpenAI tool call objects
        (`id`, `type: "function"`, `function.name`, `function.arguments` a JSON string).

    Raises:
        ValueError: An unknown parser name.
    """
    return get_tool_parser(parser_name).parse(text, tools)
