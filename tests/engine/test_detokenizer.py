"""Incremental detokenization and stop strings against SmolLM2's byte-level BPE tokenizer.

The oracle is `tokenizer.decode(output_ids, skip_special_tokens=...)` of the whole output.
Both decoding paths run: `DecodeStream` (fast) and the prefix/read-offset window (slow).
"""

from __future__ import annotations

import random

import pytest

from jaxserve.core.stop_checker import check_stop, check_stop_strings, stop_buffer_length
from jaxserve.engine import detokenizer as detok_module
from jaxserve.engine.detokenizer import IncrementalDetokenizer

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45 p.m., isn't it?",
    "code": "def f(x):\n\tif x  >  0:\n        return [x ,  x]\n\n\n    # done  \r\n}",
    "emoji": "Hi 😀👍🏽 family 👨‍👩‍👧‍👦, flag 🇫🇷 and ✨✨!",
    "cjk": "世界你好，こんにちは。한국어 텍스트 and 中文 mixed in.",
    "special": "<|im_start|>user\nhi 😀<|im_end|>\n<|im_start|>assistant\n<|im_end|><|endoftext|>",
}
PATHS = [pytest.param(True, id="fast"), pytest.param(False, id="window")]
SENTENCE = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def feed(det, ids, chunk=1, stream=None):
    """Updates `det` with `ids` in chunks; returns the first stop string (stops feeding)."""
    for k in range(0, len(ids), chunk):
        hit = det.update(ids[k:k + chunk])
        if stream is not None:
            stream.append(det.get_next_output_text(finished=hit is not None, delta=True))
        if hit is not None:
            return hit
    return None


def reference_cut(text, stop, include):
    """(stop_str, cut text) the rules give for the finished text: earliest end wins."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stop if s in text]
    if not hits:
        return None, text
    end, start, s = min(hits)
    return s, text[:end if include else start]


# ---------------------------------------------------------------- incremental text


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize("name", list(TEXTS))
def test_incremental_text_equals_full_decode(tok, name, chunk, skip, fast):
    ids = enc(tok, TEXTS[name])
    det = IncrementalDetokenizer(tok, enc(tok, "A prompt: "), skip_special_tokens=skip,
                                 fast=fast)
    assert det.is_fast == fast
    for k in range(0, len(ids), chunk):
        assert det.update(ids[k:k + chunk]) is None
        assert "\ufffd" not in det.output_text  # incomplete characters are held back
        assert tok.decode(ids[:k + chunk], skip_special_tokens=skip).startswith(det.output_text)
    assert det.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert det.output_token_ids == ids
    det.finish()
    assert det.output_text == tok.decode(ids, skip_special_tokens=skip)


def test_special_tokens_skipped_or_kept(tok):
    ids = enc(tok, TEXTS["special"])
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    feed(kept, ids), feed(skipped, ids)
    assert "<|im_end|>" in kept.output_text
    assert "<|im" not in skipped.output_text and "hi 😀" in skipped.output_text
    # Only Python ("slow") tokenizers honour spaces_between_special_tokens; this one ignores it.
    for fast in (True, False):
        det = IncrementalDetokenizer(tok, [], skip_special_tokens=False,
                                     spaces_between_special_tokens=False, fast=fast)
        feed(det, ids)
        assert det.output_text == kept.output_text == tok.decode(ids)


@pytest.mark.parametrize("fast", PATHS)
def test_random_token_ids_match_decode(tok, fast):
    """Arbitrary ids (invalid UTF-8, stray special tokens) still equal the full decode."""
    rng = random.Random(1234)
    for _ in range(60):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))]
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
        skip = rng.random() < 0.5
        det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, fast=fast)
        feed(det, ids, chunk=rng.randrange(1, 5))
        det.finish()
        assert det.output_text == tok.decode(ids, skip_special_tokens=skip), (prompt, ids)


@pytest.mark.parametrize("fast", PATHS)
def test_emoji_split_across_tokens_is_held_back(tok, fast):
    ids = enc(tok, "a😀b")
    assert len(ids) >= 3  # the emoji's 4 bytes span tokens
    det = IncrementalDetokenizer(tok, [], fast=fast)
    seen = []
    for t in ids:
        det.update([t])
        seen.append(det.output_text)
    assert seen[-1] == "a😀b"
    assert all(s in ("a", "a😀", "a😀b") for s in seen)


@pytest.mark.parametrize("fast", PATHS)
def test_cut_character_flushed_on_finish(tok, fast):
    """A character the output never completes appears (as decode renders it) at finish."""
    ids = enc(tok, "ok 😀")[:-1]
    det = IncrementalDetokenizer(tok, [], fast=fast)
    feed(det, ids)
    assert det.output_text == "ok"
    assert det.get_next_output_text(finished=False, delta=True) == "ok"
    assert det.get_next_output_text(finished=True, delta=True) == tok.decode(ids)[2:]
    assert det.output_text == tok.decode(ids) and det.output_text.endswith("\ufffd")
    with pytest.raises(RuntimeError):
        det.update([100])


@pytest.mark.parametrize("fast", PATHS)
def test_prompt_cut_mid_character(tok, fast):
    """The output's first tokens finish a character the prompt began: decoded alone."""
    ids = enc(tok, "x 😀 y")
    for k in range(1, len(ids)):
        det = IncrementalDetokenizer(tok, ids[:k], fast=fast)
        feed(det, ids[k:])
        det.finish()
        assert det.output_text == tok.decode(ids[k:])


def test_tokenizers_tokenizer_and_duck_typed_tokenizer(tok):
    ids = enc(tok, TEXTS["emoji"] + TEXTS["cjk"])

    class Plain:  # only `decode`: the window path
        def decode(self, token_ids, skip_special_tokens=False):
            return tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    raw = IncrementalDetokenizer(tok.backend_tokenizer, [1, 2])
    plain = IncrementalDetokenizer(Plain(), [1, 2])
    assert raw.is_fast and not plain.is_fast
    feed(raw, ids), feed(plain, ids, chunk=2)
    assert raw.output_text == plain.output_text == tok.decode(ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="fast"):
        IncrementalDetokenizer(Plain(), [], fast=True)


def test_invalid_prefix_falls_back_to_window(tok, monkeypatch):
    """DecodeStream's 'Invalid prefix' error switches to the window path, losing nothing."""
    real = detok_module.DecodeStream

    class Failing:
        def __init__(self, skip_special_tokens):
            self.inner, self.steps = real(skip_special_tokens=skip_special_tokens), 0

        def step(self, backend, token_id):
            self.steps += 1
            if self.steps == 8:
                raise Exception("Invalid prefix encountered")
            return self.inner.step(backend, token_id)

    monkeypatch.setattr(detok_module, "DecodeStream", Failing)
    ids = enc(tok, TEXTS["emoji"])
    det = IncrementalDetokenizer(tok, [])
    assert det.is_fast
    feed(det, ids)
    assert not det.is_fast
    assert det.output_text == tok.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- stop strings

STOP_CASES = {
    "single_token": [" fox"],
    "two_tokens": ["brown fox"],
    "three_tokens": [" brown fox j"],
    "mid_token": ["uic"],
    "earliest_wins": [" lazy", "jumps", " quick brown"],
    "earliest_end_wins": [" brown fox", "own"],
    "at_end": ["dog."],
    "absent": ["cat", "Fox"],
}


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 2, 100])
@pytest.mark.parametrize("case", list(STOP_CASES))
def test_stop_strings_cut_exactly(tok, case, chunk, include, fast):
    stop = STOP_CASES[case]
    ids = enc(tok, SENTENCE)
    expected_stop, expected_text = reference_cut(SENTENCE, stop, include)
    det = IncrementalDetokenizer(tok, enc(tok, "Once: "), stop=stop,
                                 include_stop_str_in_output=include, fast=fast)
    stream = []
    hit = feed(det, ids, chunk, stream)
    assert hit == expected_stop == det.stop_reason
    if hit is None:
        stream.append(det.get_next_output_text(finished=True, delta=True))
    assert det.output_text == expected_text
    assert "".join(stream) == expected_text
    assert det.get_next_output_text(finished=True, delta=False) == expected_text


def test_stop_case_shapes(tok):
    """The cases cover what their names say (token boundaries of SENTENCE)."""
    pieces = [tok.decode([t]) for t in enc(tok, SENTENCE)]
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces) + 1)]

    def spanned(s):
        a = SENTENCE.find(s)
        return sum(1 for i in range(len(pieces)) if starts[i] < a + len(s) and starts[i + 1] > a)

    assert " fox" in pieces
    assert spanned("brown fox") == 2 and spanned(" brown fox j") == 3
    assert spanned("uic") == 1 and "uic" not in pieces


@pytest.mark.parametrize("include", [False, True])
def test_stop_in_prompt_or_across_prompt_boundary_does_not_trigger(tok, include):
    det = IncrementalDetokenizer(tok, enc(tok, "Say fox, then fo"), stop=["fox"],
                                 include_stop_str_in_output=include)
    assert feed(det, enc(tok, "x marks the spot")) is None
    assert det.output_text == "x marks the spot"
    det = IncrementalDetokenizer(tok, enc(tok, "Say fox"), stop=["fox"],
                                 include_stop_str_in_output=include)
    assert feed(det, enc(tok, " a fox! fox")) == "fox"
    assert det.output_text == (" a fox" if include else " a ")


@pytest.mark.parametrize("chunk", [1, 3, 50])
@pytest.mark.parametrize("include", [False, True])
def test_streaming_never_shows_text_beyond_the_cut(tok, chunk, include):
    text = "alpha beta 😀 gamma STOP-HERE delta epsilon"
    stop = ["STOP-HERE", "zeta"]
    det = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    assert det.stop_buffer_length == (0 if include else len("STOP-HERE") - 1)
    ids, stream = enc(tok, text), []
    for k in range(0, len(ids), chunk):
        hit = det.update(ids[k:k + chunk])
        stream.append(det.get_next_output_text(finished=hit is not None, delta=True))
        full = det.get_next_output_text(finished=hit is not None, delta=False)
        assert "".join(stream) == full  # whole and delta modes agree
        assert "STOP" not in full or include
        if hit is None:
            assert len(full) == max(0, len(det.output_text) - det.stop_buffer_length)
        else:
            break
    final = "alpha beta 😀 gamma " + ("STOP-HERE" if include else "")
    assert hit == "STOP-HERE" and det.output_text == final and "".join(stream) == final


def test_min_tokens_ignores_early_stop_strings(tok):
    ids = enc(tok, " fox fox fox")
    assert len(ids) == 3
    det = IncrementalDetokenizer(tok, [], stop=["fox"], min_tokens=2)
    assert det.update(ids[:2]) is None
    assert det.update(ids[2:]) == "fox" and det.output_text == " fox fox "
    det = IncrementalDetokenizer(tok, [], stop=["fox"], min_tokens=1)
    assert det.update(ids) == "fox" and det.output_text == " fox "


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_left_out_unless_included(tok, include):
    ids = enc(tok, "Done.") + [tok.eos_token_id]
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=False,
                                 include_stop_str_in_output=include)
    assert det.update(ids[:-1]) is None
    assert det.update(ids[-1:], stop_terminated=True) is None
    assert det.output_token_ids == ids
    assert det.get_next_output_text(finished=True, delta=False) == (
        "Done.<|im_end|>" if include else "Done.")


def test_update_edge_cases(tok):
    det = IncrementalDetokenizer(tok, [], stop="fox")
    assert det.stop == ["fox"]
    assert det.update([]) is None
    assert det.update(enc(tok, "the fox")) == "fox"
    with pytest.raises(RuntimeError, match="finished"):
        det.update([100])


@pytest.mark.parametrize("kwargs, field", [
    ({"stop": [""]}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ({"prompt_token_ids": [1, -2]}, "prompt_token_ids"),
    ({"prompt_token_ids": ["a"]}, "prompt_token_ids"),
    ({"tokenizer": None}, "tokenizer"),
])
def test_invalid_arguments_name_the_field(tok, kwargs, field):
    args = {"tokenizer": tok, "prompt_token_ids": [], **kwargs}
    with pytest.raises(ValueError, match=field):
        IncrementalDetokenizer(args.pop("tokenizer"), args.pop("prompt_token_ids"), **args)


@pytest.mark.parametrize("bad", [[-1], [1.5], "ab", 7])
def test_invalid_new_token_ids(tok, bad):
    with pytest.raises(ValueError, match="new_token_ids"):
        IncrementalDetokenizer(tok, []).update(bad)


# ---------------------------------------------------------------- pure stop checks


def test_check_stop_strings_only_searches_new_text():
    assert check_stop_strings("abcSTOPxy", 2, ["STOP"], False) is None  # ended before "xy"
    assert check_stop_strings("abcSTOPxy", 3, ["STOP"], False) == ("STOP", 3)  # "P" is new
    assert check_stop_strings("abcSTOPxy", 3, ["STOP"], True) == ("STOP", 7)
    assert check_stop_strings("abcSTOP", 1, ["STOP", "P"], True) == ("STOP", 7)
    assert check_stop_strings("abcd", 4, ["abcd", "bc"], False) == ("bc", 1)
    assert check_stop_strings("abc", 0, ["a"], False) is None
    assert stop_buffer_length(["ab", "abcd"], False) == 3
    assert stop_buffer_length(["ab", "abcd"], True) == stop_buffer_length([], False) == 0


def test_check_stop_tokens_and_length():
    common = {"num_prompt_tokens": 4, "max_tokens": 5, "max_model_len": 100,
              "eos_token_ids": {2}, "stop_token_ids": {7}}
    assert check_stop([], **common) is None
    assert check_stop([9, 2], **common) == ("stop", None)
    assert check_stop([9, 2], **common, ignore_eos=True) is None
    assert check_stop([9, 7], **common) == ("stop", 7)
    assert check_stop([9, 7], **common, min_tokens=2) is None
    assert check_stop([9, 9, 7], **common, min_tokens=2) == ("stop", 7)
    assert check_stop([9] * 5, **common) == ("length", None)
    assert check_stop([9] * 4 + [2], **common) == ("stop", None)
    assert check_stop([9] * 3, **{**common, "max_model_len": 7}) == ("length", None)
    assert check_stop([9] * 9, **{**common, "max_tokens": None}) is None
