"""Structured-output costs: host time to build a step's token bitmasks at 1..256 constrained
rows, and the throughput of a batch all constrained vs none (interleaved, same run)."""

from __future__ import annotations

import os
import time

import numpy as np

# A schema of the kind programs ask for: nested object, enum, bounded array and strings.
# A schema with an object inside an object, an enum, bounded strings and an array, and no
# `additionalProperties` anywhere: what the strict default closes (`scripts/bench_json_strict.py`,
# the slow strict-schema test).
NESTED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"enum": ["France", "Spain", "Italy", "Germany"]}},
        "required": ["city", "country"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "address", "tags", "age"]}
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
    """Host milliseconds per step to build the masks of R constrained rows along random
    paths the grammar allows: the engine's way (`fill_bitmasks`: each matcher takes its
    previous token, then llguidance's thread pool fills every mask) and one row at a
    time (`RequestGrammar.bitmask`), each on its own matchers (llguidance caches a mask
    per state, so timing both on one set would time the cache).

    Returns:
        One row per R: median ms per step of both ways, and microseconds per row.
    """
    from jaxserve.structured import GrammarCompiler, StructuredOutputsParams, fill_bitmasks

    compiler = GrammarCompiler(tokenizer, vocab_size)
    params = StructuredOutputsParams(json=SCHEMA)
    compiler.compile(params)
    out = []
    for r in rows:
        rng = np.random.default_rng(seed + r)
        batched = [compiler.matcher(params) for _ in range(r)]
        single = [compiler.matcher(params) for _ in range(r)]
        tokens: list[list[int]] = [[] for _ in range(r)]
        times_batched, times_single = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            masks, errors = fill_bitmasks([(g, toks, [], 1) for g, toks in
                                           zip(batched, tokens, strict=True)], vocab_size)
            times_batched.append(time.perf_counter() - t0)
            assert not errors, errors
            t0 = time.perf_counter()
            for g, toks in zip(single, tokens, strict=True):
                g.bitmask(toks)
            times_single.append(time.perf_counter() - t0)
            for i, mask in enumerate(masks):
                ok = np.nonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))[0]
                if batched[i].is_stopped or not len(ok):
                    batched[i], single[i] = compiler.matcher(params), compiler.matcher(params)
                    tokens[i] = []
                else:
                    tokens[i].append(int(rng.choice(ok)))
        ms = 1e3 * float(np.median(times_batched))
        out.append({"rows": r, "batched_ms": ms, "us_per_row": 1e3 * ms / r,
                    "single_ms": 1e3 * float(np.median(times_single)),
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
