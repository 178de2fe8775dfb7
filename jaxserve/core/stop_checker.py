"""Stop conditions: stop strings in the detokenized text, and stop tokens / length.

Both are pure functions; the engine owns the request state and calls them once per step.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def normalize_stop(stop: str | Sequence[str] | None) -> list[str]:
    """`stop` as a list of non-empty strings (a single string becomes a one-item list).

    Raises:
        ValueError: An item is not a string, or is empty (the message names `stop`).
    """
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    for s in items:
        if not isinstance(s, str):
            raise ValueError(f"stop must hold strings, got {s!r} in stop={stop!r}")
        if not s:
            raise ValueError(f"stop cannot contain an empty string, got stop={stop!r}")
    return items


def stop_buffer_length(stop: Sequence[str], include_stop_str_in_output: bool) -> int:
    """Characters a stream holds back so that it never emits text a stop string later cuts.

    A match ends in the newest text, so when the stop string is cut out (not included) the
    cut can reach at most `len(stop_str) - 1` characters into text already decoded; when it
    is kept, only text after the match (all of it new) is dropped and nothing is held.
    """
    if not stop or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stop) - 1


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """Finds a stop string that ends in the last `new_char_count` characters of the text.

    Only matches ending in the new text are considered, so earlier text (searched by an
    earlier call, or excluded on purpose, such as the prompt or text before `min_tokens`)
    never triggers. Among the matches, the one that ends first wins; on a tie, the one that
    starts first (the longer string). This is the stop a character-by-character stream
    would have seen first, so the outcome does not depend on how tokens are batched.

    Returns:
        None, or `(stop_str, truncate_to)`: the output text must be cut to
        `output_text[:truncate_to]` (the start of the match, or its end when
        `include_in_output`).
    """
    if new_char_count <= 0 or not stop:
        return None
    n = len(output_text)
    best: tuple[int, int, str] | None = None
    for s in stop:
        start = output_text.find(s, max(0, n - new_char_count - len(s) + 1))
        if start < 0:
            continue
        end = start + len(s)
        if best is None or (end, start) < best[:2]:
            best = (end, start, s)
    if best is None:
        return None
    end, start, s = best
    return s, (end if include_in_output else start)


def check_stop(output_token_ids: Sequence[int], *, num_prompt_tokens: int,
               max_tokens: int | None, max_model_len: int,
               eos_token_ids: Collection[int] = (), ignore_eos: bool = False,
               stop_token_ids: Collection[int] = (), min_tokens: int = 0,
               ) -> tuple[str, int | None] | None:
    """Token-level stop check for the engine, after a step appended its token(s).

    Looks at the last output token: an EOS id (unless `ignore_eos`) finishes with
    `("stop", None)`, a `stop_token_ids` member with `("stop", token_id)`, both only once
    more than `min_tokens` tokens exist (the sampler is expected to mask them before that).
    Then the length caps: `max_tokens` outputs or `max_model_len` tokens in all give
    `("length", None)`. Returns None while the request goes on. Stop strings are the
    detokenizer's job (`IncrementalDetokenizer.update`), and a stop string found in the
    same step overrides this result's stop reason.
    """
    n = len(output_token_ids)
    if n == 0:
        return None
    if n > min_tokens:
        last = output_token_ids[-1]
        if not ignore_eos and last in eos_token_ids:
            return "stop", None
        if last in stop_token_ids:
            return "stop", int(last)
    if (max_tokens is not None and n >= max_tokens) or num_prompt_tokens + n >= max_model_len:
        return "length", None
    return None
