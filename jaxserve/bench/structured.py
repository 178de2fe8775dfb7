"""Structured-output costs: host time to build a step's token bitmasks at 1..256 constrained
rows, and the throughput of a batch all constrained vs none (interleaved, same run)."""

from __future__ import annotations

import os
import time

import numpy as np

# A schema of the kind programs ask for: nested object, enum, bounded array and strings.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                   "minItems": 1, "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "skills", "address"],
}
PROMPT = "Describe a fictional person as JSON with name, age, role, skills and address."


def mask_times(tokenizer, vocab_size: int, rows: list[int], steps: int = 32,
               seed: int = 0) -> list[dict]:
    """Host milliseconds per step to build the masks of R constrained rows, as the engine
    does (each row's matcher takes its previous token, then fills its mask), along random
    paths the grammar allows; and llguidance's parallel fill of the same masks.

    Returns:
        One row per R: median ms per step (engine path, and parallel fill), per row.
    """
    import llguidance
    import llguidance.numpy as llnp

    from jaxserve.structured import GrammarCompiler, StructuredOutputsParams

    compiler = GrammarCompiler(tokenizer, vocab_size)
    params = StructuredOutputsParams(json=SCHEMA)
    compiler.compile(params)
    executor = llguidance.LLExecutor()
    out = []
    for r in rows:
        rng = np.random.default_rng(seed + r)
        grammars = [compiler.matcher(params) for _ in range(r)]
        tokens: list[list[int]] = [[] for _ in range(r)]
        serial, parallel = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            masks = [g.bitmask(toks) for g, toks in zip(grammars, tokens, strict=True)]
            serial.append(time.perf_counter() - t0)
            buf = llnp.allocate_token_bitmask(r, compiler.lltokenizer.vocab_size)
            t0 = time.perf_counter()
            llnp.fill_next_token_bitmask_par(
                executor, [(g._matcher, i) for i, g in enumerate(grammars)], buf)
            parallel.append(time.perf_counter() - t0)
            for i, mask in enumerate(masks):
                ok = np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0]
                if grammars[i].is_stopped or not len(ok):
                    grammars[i], tokens[i] = compiler.matcher(params), []
                else:
                    tokens[i].append(int(rng.choice(ok)))
        out.append({"rows": r, "serial_ms": 1e3 * float(np.median(serial)),
                    "parallel_ms": 1e3 * float(np.median(parallel)),
                    "serial_us_per_row": 1e6 * float(np.median(serial)) / r,
                    "load": os.getloadavg()[0]})
    return out


def constrained_throughput(llm, batch: int, max_tokens: int, repeats: int = 2) -> list[dict]:
    """Output tok/s of `batch` greedy requests, none vs all constrained by SCHEMA,
    interleaved (none, all, none, all, ...) on one warmed-up engine.

    The free requests ignore EOS and run to `max_tokens`; the constrained ones end when
    their JSON does (or at `max_tokens`), so tokens per second is the figure to compare.
    """
    from jaxserve import SamplingParams, StructuredOutputsParams

    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                     add_generation_prompt=True)
    variants = {
        "none": SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        "all constrained": SamplingParams(
            temperature=0.0, max_tokens=max_tokens,
            structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    }
    rows = []
    llm.generate([prompt], variants["all constrained"], use_tqdm=False)  # compile grammar
    for rep in range(repeats):
        for name, params in variants.items():
            steps0 = llm.engine.counters["num_steps"]
            t0 = time.perf_counter()
            outs = llm.generate([prompt] * batch, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            steps = llm.engine.counters["num_steps"] - steps0
            rows.append({"repeat": rep, "batch": name, "requests": batch, "tokens": n,
                         "wall_s": wall, "tok_s": n / wall, "steps": steps,
                         "ms_per_step": 1e3 * wall / max(steps, 1),
                         "compiles": llm.get_metrics()["jaxserve:num_compilations"],
                         "load": os.getloadavg()[0]})
    return rows
