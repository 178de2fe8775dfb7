"""Host cost per streamed token of reading a chat reply (issue 48 item 7): a reply holding one
long tool call, streamed a few characters at a time through the reasoning split
(`ReasoningStream`) and each tool-call parser's `ToolCallStream`, beside the same reply
streamed with no parser (the baseline, measured in the same run). Linear if the cost per
token stays put as the reply grows."""

from __future__ import annotations

import argparse
import json
import time

from jaxserve.entrypoints.openai.harmony_chat import HarmonyReplyStream
from jaxserve.entrypoints.openai.reasoning import get_reasoning_parser
from jaxserve.entrypoints.openai.tool_calls import ToolCallStream
from jaxserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser


def replies(words: int) -> dict[str, str]:
    """One call of `f(text=...)` with a `words`-word argument, in each parser's format."""
    value = "lorem ipsum " * (words // 2)
    args = json.dumps({"text": value})
    return {
        "hermes": f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>',
        "llama3_json": f'{{"name": "f", "parameters": {args}}}',
        "mistral": f'[TOOL_CALLS] [{{"name": "f", "arguments": {args}}}]',
        "openai": f"<|channel|>commentary to=functions.f <|constrain|>json<|message|>{args}"
                  "<|call|>",
        "pythonic": f"[f(text={value!r})]",
        "qwen3_coder": f"<tool_call><function=f><parameter=text>{value}</parameter>"
                       "</function></tool_call>",
    }


def per_token_us(text: str, parser: str | None, size: int, rounds: int) -> float:
    """Best-of-`rounds` microseconds per piece of `size` characters."""
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    best = float("inf")
    for _ in range(rounds):
        harmony = parser is not None and get_tool_parser(parser).harmony
        split = get_reasoning_parser("qwen3").stream() if parser and not harmony else None
        # gpt-oss replies are read as the server reads them: one harmony parse for both
        stream = HarmonyReplyStream(True, True) if harmony else \
            ToolCallStream("auto" if parser else None, "auto", parser)
        start = time.perf_counter()
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            if split is not None:
                parts = split.feed(piece) + (split.flush() if last else [])
                piece = "".join(t for kind, t in parts if kind == "content")
            stream.feed(piece, "stop" if last else None)
        best = min(best, (time.perf_counter() - start) / len(pieces))
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--words", type=int, nargs="+", default=[1600, 6400],
                   help="argument lengths in words (default 1600 6400)")
    p.add_argument("--chars-per-token", type=int, default=4, help="(default 4)")
    p.add_argument("--rounds", type=int, default=3, help="best of (default 3)")
    args = p.parse_args()
    print("| parser | words | tokens | us/token | vs no parser |")
    print("|---|---|---|---|---|")
    for words in args.words:
        for name, text in replies(words).items():
            assert name in TOOL_PARSERS
            base = per_token_us(text, None, args.chars_per_token, args.rounds)
            cost = per_token_us(text, name, args.chars_per_token, args.rounds)
            tokens = -(-len(text) // args.chars_per_token)
            print(f"| {name} | {words} | {tokens} | {cost:.1f} | {cost / base:.1f}x |")


if __name__ == "__main__":
    main()
