"""The harmony parsers of gpt-oss (`openai_gptoss` reasoning, `openai` tool calls) on
hand-written replies tokenized by a tokenizer with harmony's special tokens, whole and
streamed token by token: the deltas add up to the whole split, and no special token leaks."""

from __future__ import annotations

import copy
import json

import pytest

from jaxserve.entrypoints.openai.harmony import SPECIAL_TOKENS, parse_harmony, parse_header
from jaxserve.entrypoints.openai.harmony_chat import HarmonyReplyStream, split_reply
from jaxserve.entrypoints.openai.reasoning import get_reasoning_parser
from jaxserve.entrypoints.openai.serving_base import ServingLimits
from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser, parse_tool_calls

A, F = "<|start|>assistant", "functions"
# (reply as gpt-oss writes it after the prompt's `<|start|>assistant`, reasoning, content,
# [(name, arguments)]): the format of OpenAI's harmony guide.
REPLIES = {
    "answer": ("<|channel|>analysis<|message|>User greets. Reply kindly.<|end|>"
               f"{A}<|channel|>final<|message|>Hello! How can I help?<|return|>",
               "User greets. Reply kindly.", "Hello! How can I help?", []),
    "call": ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
             f"{A}<|channel|>commentary to={F}.get_weather <|constrain|>json<|message|>"
             '{"city":"Paris","days":3}<|call|>',
             "Need the weather tool.", None, [("get_weather", {"city": "Paris", "days": 3})]),
    # a preamble (commentary without recipient) is content; the recipient may come first;
    # two calls; the stop token (<|call|>) left out by the engine
    "preamble_two_calls": (
        "<|channel|>analysis<|message|>Two lookups.<|end|>"
        f"{A}<|channel|>commentary<|message|>Checking both.<|end|>"
        f"{A} to={F}.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Oslo"}<|call|>'
        f"{A}<|channel|>commentary to={F}.get_time <|constrain|>json<|message|>"
        '{"zone": "CET"}',
        "Two lookups.", "Checking both.", [("get_weather", {"city": "Oslo"}),
                                           ("get_time", {"zone": "CET"})]),
    # two analysis messages are joined by a newline (vLLM's parse_chat_output)
    "two_thoughts": ("<|channel|>analysis<|message|>First.<|end|>"
                     f"{A}<|channel|>analysis<|message|>Second.<|end|>"
                     f"{A}<|channel|>final<|message|>Done.",
                     "First.\nSecond.", "Done.", []),
    "cut_in_reasoning": ("<|channel|>analysis<|message|>Still thinking about",
                         "Still thinking about", None, []),
    "plain": ("No harmony at all.", None, "No harmony at all.", []),
}


@pytest.fixture(scope="module")
def harmony_tokenizer(smollm2_tokenizer):
    """The default tokenizer with harmony's special tokens added (a copy: the session's
    tokenizer stays as it is)."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    return tokenizer


def token_deltas(tokenizer, text: str) -> list[str]:
    """`text` tokenized, then the text each token adds, decoded with special tokens kept (as
    the engine's detokenizer streams it for these parsers)."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    texts = [tokenizer.decode(ids[:k], skip_special_tokens=False) for k in range(len(ids) + 1)]
    assert texts[-1] == text
    return [b[len(a):] for a, b in zip(texts, texts[1:], strict=False)]


def named_args(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_whole_reply_splits_as_vllm(name):
    text, reasoning, content, calls = REPLIES[name]
    got_reasoning, got_content, got_calls = split_reply(text)
    assert (got_reasoning, got_content, named_args(got_calls)) == (reasoning, content, calls)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    # each parser alone: the reasoning parser leaves calls out, the tool parser the analysis
    assert get_reasoning_parser("openai_gptoss").split(text) == (reasoning, content)
    parsed_content, parsed_calls = parse_tool_calls("openai", text)
    assert (parsed_content, named_args(parsed_calls)) == (content, calls)


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_streamed_token_by_token_adds_up_to_the_whole(harmony_tokenizer, name):
    text, reasoning, content, calls = REPLIES[name]
    deltas = token_deltas(harmony_tokenizer, text)
    stream = HarmonyReplyStream(reasoning=True, calls=True)
    out = [stream.feed(d, None) for d in deltas[:-1]] + [stream.feed(deltas[-1], "stop")]
    joined = {k: "".join(d.get(k) or "" for d, _ in out) or None
              for k in ("reasoning", "content")}
    assert (joined["reasoning"], joined["content"]) == (reasoning, content)
    assert all(d["reasoning_content"] == d.get("reasoning") for d, _ in out)  # vLLM's copy
    got: dict[int, dict] = {}
    for d, _ in out:
        for tc in d.get("tool_calls", []):
            if "id" in tc:  # a call opens with its id and name, then streams its arguments
                assert tc["index"] not in got and tc["type"] == "function"
                got[tc["index"]] = {"function": dict(tc["function"])}
            else:
                got[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    assert named_args(got[i] for i in sorted(got)) == calls
    assert out[-1][1] == ("tool_calls" if calls else "stop")
    for d, _ in out:
        for key in ("reasoning", "content"):
            assert not any(t in (d.get(key) or "") for t in SPECIAL_TOKENS), d
    # the reasoning parser's own stream (calls left out) gives the same split
    split = get_reasoning_parser("openai_gptoss").stream()
    pieces = [p for d in deltas for p in split.feed(d)] + split.flush()
    assert ("".join(t for k, t in pieces if k == "reasoning") or None,
            "".join(t for k, t in pieces if k == "content") or None) == (reasoning, content)


def test_a_call_opens_as_soon_as_its_header_is_complete():
    stream = HarmonyReplyStream(reasoning=True, calls=True)
    first, _ = stream.feed(f"<|channel|>commentary to={F}.get_time <|constrain|>json<|mess",
                           None)
    assert first == {"reasoning_content": None}  # `<|mess` may be `<|message|>`: held
    opened, _ = stream.feed("age|>{\"zone\"", None)
    (call,) = opened["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone"'}
    assert call["index"] == 0 and call["id"].startswith("call_")
    rest, finish = stream.feed(': "UTC"}<|ca', "stop")
    assert rest["tool_calls"] == [{"index": 0, "function": {"arguments": ': "UTC"}<|ca'}}]
    assert finish == "tool_calls"


def test_headers_in_every_order_harmony_allows():
    assert parse_header(f"assistant to={F}.f<|channel|>commentary json") == parse_header(
        f"<|channel|>commentary to={F}.f <|constrain|>json")
    message = parse_header(f"<|channel|>analysis to={F}.f code")
    assert (message.channel, message.recipient, message.content_type, message.kind) == (
        "analysis", f"{F}.f", "code", "call")  # a call in the analysis channel counts (vLLM)
    assert parse_header("<|channel|>analysis to=python").kind == "reasoning"  # built-in tool
    assert parse_header(f"{F}.f to=assistant<|channel|>commentary").kind == "ignored"


def test_bad_calls_pass_through_as_vllm():
    # arguments that are not JSON are passed on as written; a function the request did not
    # declare is called all the same (vLLM's openai parser checks neither)
    text = (f"<|channel|>commentary to={F}.nowhere <|constrain|>json<|message|>"
            "{city: Paris<|call|>")
    content, calls = parse_tool_calls("openai", text, tools=[])
    assert content is None and [(c["function"]["name"], c["function"]["arguments"])
                                for c in calls] == [("nowhere", "{city: Paris")]
    # a non-JSON content type is kept as written too
    (message,) = parse_harmony(f"<|channel|>commentary to={F}.run code<|message|>print( 1 )")
    assert message.content_type == "code" and not message.done
    assert split_reply(f"<|channel|>commentary to={F}.run code<|message|>print( 1 )")[2][0][
        "function"]["arguments"] == "print( 1 )"


def test_without_the_other_parser_the_other_part_is_dropped():
    text = REPLIES["preamble_two_calls"][0]
    assert split_reply(text, reasoning=False, calls=False) == (None, "Checking both.", [])
    stream = HarmonyReplyStream(reasoning=True, calls=False, include_reasoning=False)
    delta, finish = stream.feed(text, "stop")
    assert (delta, finish) == ({"content": "Checking both.", "reasoning_content": None}, "stop")


def test_parser_names_and_keep_special_tokens():
    assert get_tool_parser("openai").keep_special_tokens and get_tool_parser("openai").harmony
    assert get_reasoning_parser("openai_gptoss").harmony
    ServingLimits(tool_call_parser="openai", reasoning_parser="openai_gptoss")
    with pytest.raises(ValueError, match=r"reasoning parser 'gptoss'.*openai_gptoss"):
        ServingLimits(reasoning_parser="gptoss")
    with pytest.raises(ValueError, match=r"tool call parser 'harmony'.*openai"):
        ServingLimits(tool_call_parser="harmony")
