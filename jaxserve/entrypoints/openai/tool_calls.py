"""Tool calls in chat replies: the `tool_calls` of a reply read by a tool-call parser
(`tool_parsers.py`), of forced calls, and their streamed deltas."""

from __future__ import annotations

import json

from jaxserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    call_json,
    get_tool_parser,
)

TOOL_CALL_PARSERS = tuple(TOOL_PARSERS)


def hermes_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content before the first call, calls) of a hermes-style reply (`HermesToolParser`)."""
    return HermesToolParser().parse(text)


def required_calls(text: str) -> list[dict]:
    """The calls of a `tool_choice="required"` reply: a JSON list of
    `{"name": ..., "parameters": {...}}` (the constraint's schema)."""
    return [call_json(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in json.loads(text)]


def tool_mode(tools: list[dict] | None, tool_choice) -> str | None:
    """"named", "required", "auto" (parse the reply) or None (no tool calls)."""
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        return "named"
    return "required" if tool_choice == "required" else "auto"


def reply_message(mode: str | None, text: str | None, tool_choice, finish_reason: str | None,
                  parser: str | None = "hermes", tools: list[dict] | None = None,
                  reasoning: str | None = None) -> tuple[dict, str | None]:
    """(assistant message, finish_reason) of a whole reply under `mode`, with the keys of
    vLLM's `ChatMessage` (`tool_calls` always a list; a forced call's content `""`).

    Args:
        mode: `tool_mode(...)`.
        text: The reply, its reasoning taken out (None: nothing but reasoning).
        tool_choice: The request's tool_choice (the name of a named call).
        finish_reason: The engine's.
        parser: The tool-call parser of `auto` replies (`TOOL_PARSERS`; None: none).
        tools: The request's tools (some parsers type arguments by their schemas).
        reasoning: The reply's reasoning (`reasoning`, and vLLM's older `reasoning_content`).
    """
    calls: list[dict] = []
    content: str | None = text
    if mode == "named":  # as vLLM: the call, even when cut short (finish_reason says so)
        content, calls = "", [call_json(tool_choice["function"]["name"], text or "")]
    elif mode == "required":
        try:
            content, calls = "", required_calls(text or "")
        except (ValueError, KeyError, TypeError):  # cut short (a stop string, max_tokens)
            content, calls = text, []
    elif mode == "auto" and parser is not None and text:
        content, calls = get_tool_parser(parser).parse(text, tools)
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
               "audio": None, "function_call": None, "tool_calls": calls,
               "reasoning": reasoning, "reasoning_content": reasoning}
    # NOTE: OpenAI ends a forced (named) call with "stop", a chosen one "tool_calls".
    if calls and mode != "named" and finish_reason == "stop":
        finish_reason = "tool_calls"
    return message, finish_reason


class ToolCallStream:
    """Turns one choice's streamed text (its reasoning taken out) into content and tool-call
    deltas.

    Named calls stream their arguments as they come; `required` and `auto` replies stream
    content until a call may begin (from the parser's first marker on, and any end of the
    text that may begin one, text is held back), and their calls are sent whole, each with
    its `index`, once the reply ends. Held-back text that holds no call is sent as content.

    Args:
        mode: `tool_mode(...)`.
        tool_choice: The request's tool_choice (the name of a named call).
        parser: The tool-call parser of `auto` replies (None: the reply is content).
        tools: The request's tools.
    """

    def __init__(self, mode: str | None, tool_choice, parser: str | None = "hermes",
                 tools: list[dict] | None = None):
        if mode == "auto" and parser is None:
            mode = None
        self.mode, self.tool_choice, self.tools = mode, tool_choice, tools
        self.parser = get_tool_parser(parser) if mode == "auto" else None
        self.text = ""  # the reply so far
        self.sent = 0  # characters of it sent as content
        self.call_id: str | None = None

    def feed(self, delta: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta object for new text `delta`, and the finish_reason to report."""
        self.text += delta
        if self.mode == "named":
            out: dict = {}
            if self.call_id is None:
                call = call_json(self.tool_choice["function"]["name"], delta)
                self.call_id = call["id"]
                out = {"tool_calls": [{"index": 0, **call}]}
            elif delta:
                out = {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}
            return out, finish_reason
        if self.mode is None:
            return ({"content": delta} if delta else {}), finish_reason
        if finish_reason is not None:
            return self._finish(finish_reason)
        if self.mode == "required":
            return {}, None
        end = max(self.parser.hold_from(self.text, self.sent), self.sent)
        new, self.sent = self.text[self.sent:end], end
        return ({"content": new} if new else {}), None

    def _finish(self, finish_reason: str) -> tuple[dict, str | None]:
        """The last delta: the held-back text read for calls (the content sent so far is
        content whatever follows)."""
        rest = self.text[self.sent:]
        if self.mode == "required":
            message, finish_reason = reply_message("required", rest, self.tool_choice,
                                                   finish_reason)
            content, calls = message["content"], message["tool_calls"]
        else:
            content, calls = self.parser.parse(rest, self.tools) if rest else (rest, [])
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        out: dict = {}
        if calls:
            content = (content or "").rstrip() if self.sent else (content or "").strip()
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        return out, finish_reason
