"""gpt-oss replies as chat replies (`--reasoning-parser openai_gptoss`, `--tool-call-parser
openai`): harmony messages split into reasoning, content and tool calls, whole and streamed,
as vLLM serves gpt-oss."""

from __future__ import annotations

from jaxserve.entrypoints.openai.harmony import HarmonyMessage, HarmonyStream, split_messages
from jaxserve.entrypoints.openai.tool_parsers import call_json


def split_reply(text: str, reasoning: bool = True, calls: bool = True
                ) -> tuple[str | None, str | None, list[dict]]:
    """(reasoning, content, tool calls) of a whole harmony reply (`split_messages`), the
    calls OpenAI tool call objects."""
    thought, content, found = split_messages(text, reasoning, calls)
    return thought, content, [call_json(name, arguments) for name, arguments in found]


class HarmonyReply:
    """One harmony reply as it streams: `feed` gives the reasoning, content and tool-call
    deltas the new text completes.

    Joined, the deltas give what `split_reply` gives the whole reply (the same newline
    between two messages of one kind), except call arguments, which stream as written and
    are re-dumped whole.

    Args:
        reasoning: Send the reasoning (else drop the analysis).
        calls: Send the function calls (else drop them).
    """

    def __init__(self, reasoning: bool = True, calls: bool = True):
        self.reasoning, self.calls = reasoning, calls
        self.stream = HarmonyStream()
        self.num_calls = 0
        self.index: dict[int, int] = {}  # id(message) of each call: its tool call index
        self.has_text = {"reasoning": False, "content": False}  # a message of the kind had text
        self.started: set[int] = set()  # id(message) of messages whose text began

    def feed(self, delta: str, finished: bool = False) -> dict:
        """`{"reasoning": str, "content": str, "tool_calls": [...]}`, the keys with something
        new; `finished` ends the reply (held-back text is sent)."""
        events = self.stream.feed(delta) + (self.stream.finish() if finished else [])
        out: dict = {}
        for message, text in events:
            kind = message.kind
            if kind == "call" and self.calls:
                self._call(out, message, text)
            elif kind in self.has_text and (kind == "content" or self.reasoning) and text:
                if id(message) not in self.started:
                    self.started.add(id(message))
                    text = ("\n" if self.has_text[kind] else "") + text
                    self.has_text[kind] = True
                out[kind] = out.get(kind, "") + text
        return out

    def _call(self, out: dict, message: HarmonyMessage, text: str) -> None:
        """A call's delta: its id and name when its header is complete, then its arguments
        (merged into this delta's entry for the call, if it has one)."""
        deltas = out.setdefault("tool_calls", [])
        if id(message) not in self.index:
            self.index[id(message)] = self.num_calls
            self.num_calls += 1
            call = call_json(message.function_name, "")
            deltas.append({"index": self.index[id(message)], **call})
        index = self.index[id(message)]
        if not text:
            return
        entry = next((d for d in deltas if d["index"] == index), None)
        if entry is None:
            deltas.append({"index": index, "function": {"arguments": text}})
        else:
            entry["function"]["arguments"] += text


class HarmonyReplyStream:
    """One choice's streamed harmony reply as chat deltas, with `ReplyStream`'s interface
    and keys (`reasoning` and vLLM's older `reasoning_content` on every delta).

    Args:
        reasoning: Split the reasoning off (`--reasoning-parser openai_gptoss`).
        calls: Read function calls (`--tool-call-parser openai` and `tool_choice` auto).
        include_reasoning: Send the reasoning (vLLM's `include_reasoning`).
    """

    def __init__(self, reasoning: bool, calls: bool, include_reasoning: bool = True):
        self.reply = HarmonyReply(reasoning and include_reasoning, calls)

    def feed(self, delta: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta object for new text `delta`, and the finish_reason to report
        ("tool_calls" for a reply that stopped after calls, as vLLM)."""
        parts = self.reply.feed(delta, finished=finish_reason is not None)
        out = {k: parts[k] for k in ("content", "tool_calls") if k in parts}
        if finish_reason == "stop" and self.reply.num_calls:
            finish_reason = "tool_calls"
        thought = parts.get("reasoning")
        if thought:
            return {"reasoning": thought, **out, "reasoning_content": thought}, finish_reason
        return {**out, "reasoning_content": None}, finish_reason
