"""Tool calls in chat replies: the hermes parser (`<tool_call>{json}</tool_call>`), the
`tool_calls` of forced calls, and their streamed deltas."""

from __future__ import annotations

import json
import re
import uuid

TOOL_CALL_PARSERS = ("hermes",)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def call_json(name: str, arguments: str) -> dict:
    """One OpenAI tool call object (a new `call_...` id)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def hermes_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content before the first call, calls) of a hermes-style reply.

    Each `<tool_call>` block holds `{"name": ..., "arguments": {...}}`; a last block that
    the model ended without `</tool_call>` counts too. A reply with a block that is not
    such JSON is returned as plain content, with no calls.
    """
    start = text.find(_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in _BLOCK.findall(text[start:]):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        args = call.get("arguments", call.get("parameters", {}))
        calls.append(call_json(call["name"], args if isinstance(args, str)
                               else json.dumps(args, ensure_ascii=False)))
    content = text[:start].strip()
    return content or None, calls


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


def reply_message(mode: str | None, text: str, tool_choice, finish_reason: str | None
                  ) -> tuple[dict, str | None]:
    """(assistant message, finish_reason) of a whole reply under `mode`, with the keys of
    vLLM's `ChatMessage` (`tool_calls` always a list; a forced call's content `""`)."""
    calls: list[dict] = []
    content: str | None = text
    if mode == "named":  # as vLLM: the call, even when cut short (finish_reason says so)
        content, calls = "", [call_json(tool_choice["function"]["name"], text)]
    elif mode == "required":
        try:
            content, calls = "", required_calls(text)
        except (ValueError, KeyError, TypeError):  # cut short (a stop string, max_tokens)
            content, calls = text, []
    elif mode == "auto":
        content, calls = hermes_calls(text)
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
               "audio": None, "function_call": None, "tool_calls": calls, "reasoning": None}
    # NOTE: OpenAI ends a forced (named) call with "stop", a chosen one "tool_calls".
    if calls and mode != "named" and finish_reason == "stop":
        finish_reason = "tool_calls"
    return message, finish_reason


class ToolCallStream:
    """Turns one choice's streamed text into content and tool-call deltas.

    Named calls stream their arguments as they come; `required` and `auto` replies stream
    content until a call may begin (text that could start `<tool_call>` is held back), and
    their calls are sent whole once the reply ends.

    Args:
        mode: `tool_mode(...)`.
        tool_choice: The request's tool_choice (the name of a named call).
    """

    def __init__(self, mode: str | None, tool_choice):
        self.mode, self.tool_choice = mode, tool_choice
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
            message, finish_reason = reply_message(self.mode, self.text, self.tool_choice,
                                                   finish_reason)
            out = {}
            end = self.text.find(_OPEN) if message.get("tool_calls") else len(self.text)
            rest = self.text[self.sent:max(end, self.sent)].rstrip() \
                if message.get("tool_calls") else self.text[self.sent:]
            if rest:
                out["content"] = rest
            if message.get("tool_calls"):
                out["tool_calls"] = [{"index": i, **c}
                                     for i, c in enumerate(message["tool_calls"])]
            return out, finish_reason
        if self.mode == "required":
            return {}, None
        # auto: hold back whatever could be the start of a call
        start = self.text.find(_OPEN, self.sent)
        end = start if start >= 0 else len(self.text)
        if start < 0:
            for k in range(min(len(_OPEN) - 1, len(self.text)), 0, -1):
                if _OPEN.startswith(self.text[-k:]):
                    end = len(self.text) - k
                    break
        new, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return ({"content": new} if new else {}), None
