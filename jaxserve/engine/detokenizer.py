"""Incremental detokenization with stop strings: one host-side instance per request.

Text grows one token at a time. A token may carry only part of a UTF-8 character
(byte-level BPE splits emojis and CJK across tokens) and a token's text may depend on its
predecessors, so each step decodes a short window of tokens and keeps the difference
(the prefix-offset / read-offset technique), holding back text that still ends in an
incomplete character. With a `tokenizers`-backed tokenizer the same is done in Rust by
`tokenizers.decoders.DecodeStream`.

Engine contract (one `IncrementalDetokenizer` per sequence):

    det = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                 skip_special_tokens=sp.skip_special_tokens,
                                 spaces_between_special_tokens=sp.spaces_between_special_tokens,
                                 stop=sp.stop,
                                 include_stop_str_in_output=sp.include_stop_str_in_output,
                                 min_tokens=sp.min_tokens)
    # each step, after appending the step's new token(s) to the request:
    reason = check_stop(...)                       # stop_checker: EOS, stop ids, length
    stop_str = det.update(new_ids, stop_terminated=reason is a stop token)
    if stop_str is not None:                       # overrides `reason`
        finish with finish_reason "stop", stop_reason stop_str
    text = det.get_next_output_text(finished, delta)   # streaming or final text

`output_text` then equals `tokenizer.decode(output_token_ids, skip_special_tokens=...)`
when no stop string or stop token cut it (and, for a decoder that strips the first
token's leading space, such as SentencePiece's, it keeps that space, since the window
starts in the prompt). A stop token's own text is left out unless
`include_stop_str_in_output`, like vLLM.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

from jaxserve.core.stop_checker import (
    check_stop,
    check_stop_strings,
    normalize_stop,
    stop_buffer_length,
)

try:  # tokenizers >= 0.21
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a dependency
    _RustTokenizer = DecodeStream = None

__all__ = ["IncrementalDetokenizer", "check_stop", "check_stop_strings"]

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context: the shortest suffix of at least _MIN_CONTEXT
# tokens (at most _MAX_CONTEXT) whose text holds no U+FFFD, i.e. starts on a character
# boundary; none when there is no such suffix (for example a prompt cut mid-character).
_MIN_CONTEXT, _MAX_CONTEXT = 5, 24
_INVALID_PREFIX = "Invalid prefix"


def _token_ids(name: str, ids: Sequence[int]) -> list[int]:
    try:
        out = [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {ids!r}") from None
    if any(t < 0 for t in out):
        raise ValueError(f"{name} must be non-negative token ids, got {out}")
    return out


class _Decoder:
    """Turns token ids into text deltas; holds back tokens that end mid-character.

    `_ids[_prefix:_read]` decodes to text already returned and `_ids[_read:]` to text not
    yet returned; `_prefix` always sits on a character boundary. With `stream` set the
    deltas come from `DecodeStream` (same emission rule); otherwise from two window decodes.
    """

    def __init__(self, decode: Callable[[list[int]], str], context: list[int],
                 backend=None, skip_special_tokens: bool = True):
        self._decode = decode
        self._ids = list(context)
        self._prefix, self._read = 0, len(context)
        self._backend = backend
        self._stream = None
        if backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for t in context:  # primes the stream's prefix with the prompt's tail
                self._stream.step(backend, t)

    @property
    def streaming(self) -> bool:
        """Whether deltas come from `DecodeStream` (False: window decodes)."""
        return self._stream is not None

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id)
            except Exception as e:
                # DecodeStream refuses a decoder whose output is not prefix-monotone;
                # the window decode below copes, so switch to it for good.
                if _INVALID_PREFIX not in str(e):
                    raise
                self._stream = None
            else:
                if text is None:
                    return ""
                self._advance()
                return text
        return self._window(final=False)

    def flush(self) -> str:
        """Text of the held-back tokens as a full decode renders it (with U+FFFD)."""
        return self._window(final=True) if self._read < len(self._ids) else ""

    def _window(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or (not final and new_text[-1] == _REPLACEMENT):
            return ""
        self._advance()
        return new_text[len(prefix_text):]

    def _advance(self) -> None:
        read = len(self._ids)
        del self._ids[:self._read]  # the old read offset becomes the new prefix offset
        self._prefix, self._read = 0, read - self._read


class IncrementalDetokenizer:
    """Keeps the decoded output text of one sequence and finds stop strings in it.

    Args:
        tokenizer: A transformers tokenizer or a `tokenizers.Tokenizer`.
        prompt_token_ids: The prompt; its last few tokens give the decoding context. Stop
            strings are searched in the output only, never in the prompt.
        skip_special_tokens: Drop special tokens from the text (as `tokenizer.decode`).
        spaces_between_special_tokens: Passed to `tokenizer.decode` when False (only
            Python "slow" tokenizers use it; `tokenizers`-backed ones ignore it).
        stop: Stop strings (a single string is one stop string).
        include_stop_str_in_output: Keep the matched stop string (and a stop token's text).
        min_tokens: Stop strings ending in the text of the first `min_tokens` output tokens
            are ignored.
        fast: Use `DecodeStream`; None picks it whenever the tokenizer allows (a
            `tokenizers` backend and no `clean_up_tokenization_spaces`).

    Raises:
        ValueError: A bad argument; the message names it.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop: str | Sequence[str] | None = (), include_stop_str_in_output: bool = False,
                 min_tokens: int = 0, fast: bool | None = None):
        if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"tokenizer must have a decode method, got {tokenizer!r}")
        for name, value in (("skip_special_tokens", skip_special_tokens),
                            ("spaces_between_special_tokens", spaces_between_special_tokens),
                            ("include_stop_str_in_output", include_stop_str_in_output)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative int, got {min_tokens!r}")
        prompt = _token_ids("prompt_token_ids", prompt_token_ids)
        self.stop: list[str] = normalize_stop(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.stop_buffer_length = stop_buffer_length(self.stop, include_stop_str_in_output)

        kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        decode = functools.partial(tokenizer.decode, **kwargs)
        backend = self._fast_backend(tokenizer, fast)
        self._decoder = _Decoder(decode, _context(prompt, decode), backend, skip_special_tokens)

        self.output_text = ""
        self.output_token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that ended the text
        self.finished = False
        self._sent = 0  # characters already returned by get_next_output_text(delta=True)

    @staticmethod
    def _fast_backend(tokenizer, fast: bool | None):
        if fast is False:
            return None
        if DecodeStream is None:
            if fast:
                raise ValueError("fast=True needs tokenizers.decoders.DecodeStream")
            return None
        if isinstance(tokenizer, _RustTokenizer):
            return tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(backend, _RustTokenizer) and not getattr(
                tokenizer, "clean_up_tokenization_spaces", False):
            return backend
        if fast:
            raise ValueError("fast=True needs a tokenizers-backed tokenizer without "
                             f"clean_up_tokenization_spaces, got {type(tokenizer).__name__}")
        return None

    @property
    def is_fast(self) -> bool:
        """Whether deltas currently come from `DecodeStream`."""
        return self._decoder.streaming

    def update(self, new_token_ids: Sequence[int], *, stop_terminated: bool = False
               ) -> str | None:
        """Appends a step's tokens; returns the stop string that now ends the text, if any.

        On a match `output_text` is cut right before the stop string (right after it with
        `include_stop_str_in_output`), `stop_reason` is set and the sequence is finished.

        Args:
            new_token_ids: The token(s) the step generated, oldest first.
            stop_terminated: The last of them is a stop token (EOS or a stop token id): its
                text is left out unless `include_stop_str_in_output`.

        Raises:
            ValueError: A bad token id.
            RuntimeError: The sequence already finished.
        """
        if self.finished:
            raise RuntimeError("update() after the sequence finished "
                               f"(stop_reason={self.stop_reason!r})")
        ids = _token_ids("new_token_ids", new_token_ids)
        if not ids:
            return None
        skipped = ids.pop() if stop_terminated and not self.include_stop_str_in_output else None
        check_from = len(self.output_text)
        for t in ids:
            self.output_token_ids.append(t)
            self.output_text += self._decoder.step(t)
            if len(self.output_token_ids) <= self.min_tokens:
                check_from = len(self.output_text)
        if skipped is not None:
            self.output_token_ids.append(skipped)
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None
        hit = check_stop_strings(self.output_text, len(self.output_text) - check_from,
                                 self.stop, self.include_stop_str_in_output)
        if hit is None:
            return None
        self.stop_reason, cut = hit
        self.output_text = self.output_text[:cut]
        self.finished = True
        return self.stop_reason

    def finish(self) -> None:
        """Marks the sequence finished; text still held back for an incomplete character
        is appended as `tokenizer.decode` renders it (U+FFFD), unless a stop string ended
        the text. Idempotent."""
        if not self.finished:
            self.output_text += self._decoder.flush()
            self.finished = True

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: everything so far, or (`delta`) only what is new since
        the last delta call.

        While not finished, the last `stop_buffer_length` characters are held back, so a
        stream never shows text a stop string later cuts. `finished=True` calls `finish()`.
        """
        if finished:
            self.finish()
        hold = 0 if self.finished else self.stop_buffer_length
        end = max(0, len(self.output_text) - hold)
        if not delta:
            return self.output_text[:end]
        if end <= self._sent:
            return ""
        start, self._sent = self._sent, end
        return self.output_text[start:end]


def _context(prompt: list[int], decode: Callable[[list[int]], str]) -> list[int]:
    if not prompt:
        return []
    for n in range(min(_MIN_CONTEXT, len(prompt)), min(len(prompt), _MAX_CONTEXT) + 1):
        if _REPLACEMENT not in decode(prompt[-n:]):
            return prompt[-n:]
    return []
