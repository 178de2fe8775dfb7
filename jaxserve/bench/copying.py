"""An input-copying trace: quote, edit and list tasks whose answers repeat spans of the prompt.

This is where n-gram (prompt lookup) speculation pays: code edits, quotations and
reformatting make an output that is mostly a copy of the input. Prompts are chat-formatted
instructions over text built from a seeded generator (sentences, Python functions,
records), so the trace is reproducible without shipping a data set.
"""

from __future__ import annotations

import numpy as np

from jaxserve.bench.workloads import TraceRequest, arrivals

_SUBJECTS = ["The river", "Our team", "The old library", "A small robot", "The committee",
             "The city council", "My neighbour", "The orchestra", "The weather station",
             "The bakery on the corner"]
_VERBS = ["opened", "repaired", "described", "announced", "measured", "painted", "visited",
          "recorded", "finished", "organised"]
_OBJECTS = ["a new bridge across the valley", "the clock in the main hall",
            "the results of the spring survey", "a garden full of tomatoes",
            "the schedule for next week", "three letters from the archive",
            "the rainfall of the last month", "a concert in the park",
            "the roof of the school", "a map of the northern coast"]
_TAILS = ["before the sun went down.", "with great care.", "after a long discussion.",
          "for the first time in years.", "while everyone watched.", "in less than an hour.",
          "despite the cold wind.", "as planned.", "to general surprise.", "on Tuesday."]
_NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan",
          "Julia"]
_CITIES = ["Lisbon", "Osaka", "Nairobi", "Quito", "Oslo", "Hanoi", "Dakar", "Perth"]


def _paragraph(rng: np.random.Generator, num_sentences: int) -> str:
    return " ".join(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                    f"{rng.choice(_TAILS)}" for _ in range(num_sentences))


def _function(rng: np.random.Generator, name: str) -> str:
    a, b, c = (int(x) for x in rng.integers(2, 20, 3))
    var = str(rng.choice(["total", "count", "value", "score", "acc"]))
    return (f"def {name}(items, limit={a}):\n"
            f"    {var} = 0\n"
            f"    for i, item in enumerate(items):\n"
            f"        if i >= limit:\n"
            f"            break\n"
            f"        {var} += item * {b} - {c}\n"
            f"    return {var}\n")


def _records(rng: np.random.Generator, n: int) -> str:
    return "\n".join(f"{rng.choice(_NAMES)}, {int(rng.integers(18, 80))}, "
                     f"{rng.choice(_CITIES)}" for _ in range(n))


def copying_task(rng: np.random.Generator) -> tuple[str, str]:
    """(instruction, the span a faithful answer copies) of one random task."""
    kind = int(rng.integers(3))
    if kind == 0:
        text = _paragraph(rng, int(rng.integers(3, 7)))
        return f"{text}\n\nQuote the paragraph above word for word.", text
    if kind == 1:
        old, new = rng.choice(["process", "compute", "handle", "collect"], 2, replace=False)
        code = _function(rng, str(old))
        return (f"{code}\nRewrite this Python function with the name `{new}` instead of "
                f"`{old}`. Keep everything else exactly the same.", code)
    rows = _records(rng, int(rng.integers(4, 9)))
    return (f"{rows}\n\nEach line above is name, age, city. Write the same lines again, "
            "in the same order, with ' | ' instead of ', ' between the fields.", rows)


def copying_trace(tokenizer, n: int = 32, *, rate: float | None = None, seed: int = 0,
                  extra_output: int = 8) -> list[TraceRequest]:
    """`n` chat-formatted copying tasks with concrete prompt ids.

    Args:
        tokenizer: Chat tokenizer of the served model (its template formats the prompts).
        n: Requests.
        rate: Poisson arrivals per second (None: all at once).
        seed: Seeds the tasks and the arrivals.
        extra_output: Output tokens beyond the copied span's length.

    Returns:
        Requests whose `prompt_ids` hold the prompt and whose `output_len` is the copied
        span's token count plus `extra_output`.
    """
    rng = np.random.default_rng(seed)
    out = []
    tasks = [copying_task(rng) for _ in range(n)]
    times = arrivals(rng, n, rate)  # NOTE: drawn last, so a rate leaves the prompts alone
    for i, (instruction, span) in enumerate(tasks):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": instruction}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        ids = [int(t) for t in ids]
        out.append(TraceRequest(len(ids), len(tokenizer(span).input_ids) + extra_output,
                                float(times[i]), prompt_ids=tuple(ids)))
    return out
