"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a reply's `<think>...</think>`
block (or gpt-oss's harmony `analysis` channel) split off as `reasoning`, whole and streamed."""

from __future__ import annotations

from jaxserve.entrypoints.openai.harmony_chat import HarmonyReply, split_reply
from jaxserve.utils import named_choice

START, END = "<think>", "</think>"


class ReasoningParser:
    """Splits `<think>...</think>` from a reply: the text inside goes to `reasoning`, the rest
    to `content`.

    Subclasses set `thinking_first`: whether the reply starts inside the think block (the
    chat template opened it, so the model may write only `</think>`).
    """

    name = ""
    thinking_first = False
    harmony = False  # the reply is harmony (its special tokens kept in the text)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply, as the stream of it would send them.

        Content is None when empty beside reasoning; reasoning None when the reply has none.
        """
        stream = self.stream()
        parts = stream.feed(text) + stream.flush()
        reasoning = "".join(t for kind, t in parts if kind == "reasoning")
        content = "".join(t for kind, t in parts if kind == "content")
        if not stream.entered:
            return None, content
        return reasoning, content or None

    def stream(self) -> ReasoningStream:
        """A new streaming split of one reply."""
        return ReasoningStream(self.thinking_first)


class Qwen3ReasoningParser(ReasoningParser):
    """vLLM's `qwen3`: only a reply that writes `<think>` has reasoning (text before it is
    content); without it the whole reply is content (`enable_thinking=False` templates)."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """vLLM's `deepseek_r1`: the template opens the think block, so everything up to
    `</think>` is reasoning (a `<think>` the model writes anyway is dropped); a reply without
    `</think>` is all reasoning."""

    name = "deepseek_r1"
    thinking_first = True


class GptOssReasoningParser(ReasoningParser):
    """vLLM's `openai_gptoss`: a harmony reply (gpt-oss) whose `analysis` messages are the
    reasoning and whose `final` messages and `commentary` preambles are the content; its
    function calls are left out (`--tool-call-parser openai` reads them). The reply's
    special tokens must be kept in its text (`harmony`)."""

    name = "openai_gptoss"
    harmony = True

    def split(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content, _ = split_reply(text, calls=False)
        return reasoning, content

    def stream(self) -> HarmonyReasoningStream:
        return HarmonyReasoningStream()


class HarmonyReasoningStream:
    """`ReasoningStream`'s interface over a harmony reply (its calls dropped)."""

    def __init__(self):
        self.reply = HarmonyReply(calls=False)

    def feed(self, delta: str) -> list[tuple[str, str]]:
        """The pieces `delta` completes."""
        return self._pieces(self.reply.feed(delta))

    def flush(self) -> list[tuple[str, str]]:
        """The held-back text, once the reply has ended."""
        return self._pieces(self.reply.feed("", finished=True))

    @staticmethod
    def _pieces(parts: dict) -> list[tuple[str, str]]:
        return [(k, parts[k]) for k in ("reasoning", "content") if parts.get(k)]


class ReasoningStream:
    """One reply's split as its text arrives: `feed` gives `[(kind, text)]` pieces, kind
    "reasoning" or "content", holding back text that may be the start of a tag.

    Args:
        thinking_first: The reply starts inside the think block.
    """

    def __init__(self, thinking_first: bool):
        self.state = "think" if thinking_first else "before"
        self.entered = thinking_first  # a think block was opened
        self.opened = False  # `<think>` seen (dropped once inside a block opened for it)
        self.held = ""

    def feed(self, delta: str) -> list[tuple[str, str]]:
        """The pieces `delta` completes."""
        text, self.held, out = self.held + delta, "", []
        while text:
            if self.state == "after" or "<" not in text:  # no tag can begin in it
                out.append((self._kind(), text))
                break
            tags = (START,) if self.state == "before" else \
                (END,) if self.opened else (START, END)
            at = min(((text.find(t), t) for t in tags if t in text), default=None)
            if at is None:
                keep = max((_partial(text, t) for t in tags), default=0)
                if len(text) > keep:
                    out.append((self._kind(), text[:len(text) - keep]))
                self.held = text[len(text) - keep:]
                break
            index, tag = at
            if index:
                out.append((self._kind(), text[:index]))
            text = text[index + len(tag):]
            if tag == START:
                self.opened = self.entered = True
                self.state = "think"
            else:
                self.state = "after"
        return [(k, t) for k, t in out if t]

    def flush(self) -> list[tuple[str, str]]:
        """The held-back text, once the reply has ended."""
        text, self.held = self.held, ""
        return [(self._kind(), text)] if text else []

    def _kind(self) -> str:
        return "reasoning" if self.state == "think" else "content"


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The reasoning parser named `name` (vLLM's names).

    Raises:
        ValueError: An unknown name, naming the choices.
    """
    return named_choice(REASONING_PARSERS, name, "reasoning parser")()


def thinking_disabled(template_kwargs: dict | None) -> bool:
    """Whether `chat_template_kwargs` turned thinking off (`enable_thinking` or `thinking`
    false, as Qwen3's and DeepSeek's templates read them): then no reasoning is split."""
    kwargs = template_kwargs or {}
    return any(k in kwargs and kwargs[k] is False for k in ("enable_thinking", "thinking"))
