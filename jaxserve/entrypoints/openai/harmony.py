"""The harmony format of gpt-oss: a reply's messages read out of its text (special tokens
kept), whole or as the text streams in.

A reply continues the prompt's `<|start|>assistant`, so it opens inside the first header:

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.F <|constrain|>json<|message|>{}<|call|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>

A header is the author (`assistant`, or a tool such as `functions.NAME`), `<|channel|>` and
the channel name, the recipient (`to=...`, before or after the channel) and the content type
(`<|constrain|>json`, or a bare `json`). A body ends at `<|end|>`, `<|return|>`, `<|call|>` (or
a `<|start|>` that opens the next message); the engine drops the stop token itself, so the
last body may end with the text.
"""

from __future__ import annotations

import dataclasses
import json

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN, RETURN, CALL = "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"
SPECIAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_BODY_ENDS = (END, RETURN, CALL, START)
_NEXT = (START, CHANNEL)  # what opens the next message after a body ended


@dataclasses.dataclass
class HarmonyMessage:
    """One message of a reply.

    Attributes:
        author: Who wrote it (`assistant` for the model's own messages).
        channel: `analysis`, `commentary`, `final` (None: no channel given).
        recipient: `functions.NAME` for a function call, another tool's name, or None.
        content_type: `json` and the like (None: not given).
        text: The body so far.
        done: The body ended with its end token (False: the reply stopped inside it).
    """

    author: str = "assistant"
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    text: str = ""
    done: bool = False

    @property
    def kind(self) -> str:
        """What the message is to a chat reply, as vLLM reads gpt-oss: "call" (a function
        call, in any channel), "reasoning" (the analysis channel, and calls to built-in
        tools such as `browser` or `python`, which the client does not run), "content"
        (`final`, a `commentary` preamble, a message with no channel) or "ignored" (not
        the assistant's)."""
        if self.author != "assistant":
            return "ignored"
        if self.recipient and self.recipient.startswith("functions."):
            return "call"
        if self.recipient and self.recipient != "all" or self.channel == "analysis":
            return "reasoning"
        return "content"

    @property
    def function_name(self) -> str:
        """The called function's name (`functions.NAME` gives NAME)."""
        return (self.recipient or "").removeprefix("functions.")


def parse_header(header: str) -> HarmonyMessage:
    """The message a header opens: `author[ to=R]<|channel|>channel[ to=R][ <|constrain|>T]`
    (the text between the message's `<|start|>` and `<|message|>`)."""
    author_part, _, channel_part = header.partition(CHANNEL)
    message = HarmonyMessage()
    words = author_part.split()
    for word in words:
        if word.startswith("to="):
            message.recipient = word[3:]
    author = next((w for w in words if not w.startswith("to=")), None)
    if author is not None:
        message.author = author
    rest = []
    for word in channel_part.replace(CONSTRAIN, " ").split():
        if word.startswith("to="):
            message.recipient = word[3:]
        else:
            rest.append(word)
    if rest:
        message.channel = rest[0]
    if len(rest) > 1:
        message.content_type = rest[1]
    return message


def _partial(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `tags`."""
    for k in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-k:]) for tag in tags):
            return k
    return 0


class HarmonyStream:
    """A reply's messages as its text arrives: `feed` gives `(message, new text)` events, one
    with empty text when a message's header is complete (a call's name is known), then its
    body as it comes, holding back any end that may be the start of a special token.

    A reply with no harmony markup at all (a model that does not speak harmony) is one
    content message, sent when the reply ends.
    """

    def __init__(self):
        self.messages: list[HarmonyMessage] = []
        self.state = "header"  # "header", "body" or "between" (after a body's end)
        self.header = ""
        self.held = ""

    @property
    def current(self) -> HarmonyMessage | None:
        """The message being read (None before the first header is complete)."""
        return self.messages[-1] if self.messages and self.state == "body" else None

    def feed(self, delta: str) -> list[tuple[HarmonyMessage, str]]:
        """The events `delta` completes."""
        text, self.held, events = self.held + delta, "", []
        while text:
            if self.state == "header":
                # NOTE: searched from where the tag could begin: a long header (a reply
                # with no markup) costs O(1) per token.
                start = max(0, len(self.header) - len(MESSAGE) + 1)
                self.header += text
                at = self.header.find(MESSAGE, start)
                if at < 0:
                    break
                text = self.header[at + len(MESSAGE):]
                self.messages.append(parse_header(self.header[:at]))
                self.header, self.state = "", "body"
                events.append((self.messages[-1], ""))
            elif self.state == "body":
                found = [(i, tag) for tag in _BODY_ENDS if (i := text.find(tag)) >= 0]
                if not found:
                    keep = _partial(text, _BODY_ENDS)
                    body, self.held = text[:len(text) - keep], text[len(text) - keep:]
                    text = ""
                else:
                    at, tag = min(found)
                    body, text = text[:at], text[at + len(tag):]
                    self.messages[-1].done = True
                    # NOTE: a `<|start|>` with no `<|end|>` before it still opens a message.
                    self.state = "header" if tag == START else "between"
                if body:
                    self.messages[-1].text += body
                    events.append((self.messages[-1], body))
            else:  # between messages: anything but the next header is dropped
                found = [(i, tag) for tag in _NEXT if (i := text.find(tag)) >= 0]
                if not found:
                    keep = _partial(text, _NEXT)
                    self.held = text[len(text) - keep:]
                    break
                at, tag = min(found)
                # `<|channel|>` with no `<|start|>`: the assistant's next message
                text = text[at + len(START):] if tag == START else text[at:]
                self.state = "header"
        return events

    def finish(self) -> list[tuple[HarmonyMessage, str]]:
        """The events of the held-back text, once the reply has ended."""
        text, self.held = self.held, ""
        if self.state == "body" and text:
            self.messages[-1].text += text
            return [(self.messages[-1], text)]
        if self.state == "header" and not self.messages and self.header \
                and "<|" not in self.header:
            plain = HarmonyMessage(text=self.header)
            self.messages.append(plain)
            return [(plain, ""), (plain, plain.text)]
        return []


def parse_harmony(text: str) -> list[HarmonyMessage]:
    """The messages of a whole reply (the last one unfinished when the reply stopped in it)."""
    stream = HarmonyStream()
    stream.feed(text)
    stream.finish()
    return stream.messages


def call_arguments(message: HarmonyMessage) -> str:
    """A call's `arguments`: its JSON re-dumped (tidied, as vLLM) when the content type is
    JSON or not given; text that is not JSON is passed on as written (vLLM logs it)."""
    if message.content_type and "json" not in message.content_type:
        return message.text
    try:
        return json.dumps(json.loads(message.text), ensure_ascii=False)
    except ValueError:
        return message.text


def split_messages(text: str, reasoning: bool = True, calls: bool = True
                   ) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(reasoning, content, [(function name, arguments)]) of a whole harmony reply.

    Messages of one kind are joined by a newline (vLLM's `parse_chat_output`). Without
    `reasoning` the analysis is dropped (not content); without `calls` the calls are.

    Args:
        text: The reply, special tokens kept.
        reasoning: Split the reasoning off (else None).
        calls: Read the function calls (else none).
    """
    messages = parse_harmony(text)
    joined = {kind: "\n".join(m.text for m in messages if m.kind == kind and m.text) or None
              for kind in ("reasoning", "content")}
    found = [(m.function_name, call_arguments(m)) for m in messages if m.kind == "call"] \
        if calls else []
    return joined["reasoning"] if reasoning else None, joined["content"], found
