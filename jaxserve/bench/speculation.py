"""Speculative decoding on vs off: one trace through two engines, runs interleaved, ratios.

Both engines are built first (same model, same settings, one with `speculative_config`),
then the trace runs on each in turn, `repeats` times (off, on, off, on, ...), so that a
shared machine's load falls on both alike. Each run records output tok/s, mean ITL (every
token's gap, 0 for tokens that came in the same step: the mean is the per-token latency),
TPOT, the acceptance rate and the load average.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

from jaxserve.bench.engine_run import make_llm, run_trace
from jaxserve.bench.workloads import TraceRequest, trace_token_ids

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def _row(res, load: float) -> dict:
    s, d = res.summary, res.metrics
    drafts = d.get("jaxserve:spec_decode_num_drafts", 0)
    draft_tokens = d.get("jaxserve:spec_decode_num_draft_tokens", 0)
    accepted = d.get("jaxserve:spec_decode_num_accepted_tokens", 0)
    return {"output_tok_s": s["output_throughput"], "mean_itl_ms": s["mean_itl_ms"],
            "mean_tpot_ms": s["mean_tpot_ms"], "duration_s": s["duration"],
            "num_steps": s.get("num_steps", 0),
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_accepted_len": 1 + accepted / drafts if drafts else 1.0,
            "num_drafts": drafts, "load_avg": load}


def compare_speculation(model, tokenizer, trace: list[TraceRequest], engine_args: dict,
                        spec_config: dict | None = None, repeats: int = 2,
                        log=print) -> dict:
    """Runs `trace` without and with speculation, interleaved; returns runs and ratios.

    Args:
        engine_args: Settings of both engines (`speculative_config` is ignored).
        spec_config: The speculating engine's `speculative_config` (default: n-gram, k=3).
        repeats: Runs per engine.

    Returns:
        `{"off": [run, ...], "on": [...], "spec_config": ..., "ratios": {...}}`; each run
        a dict of figures (see the module docstring); ratios are of the medians (on/off
        for throughput, off/on for ITL and TPOT: above 1 means speculation helps).
    """
    spec_config = spec_config or DEFAULT_SPEC
    args = {k: v for k, v in engine_args.items() if k != "speculative_config"}
    ids = trace_token_ids(trace, model.cfg.vocab_size, avoid=(0, 1, 2))
    engines = {}
    for name, extra in (("off", {}), ("on", {"speculative_config": spec_config})):
        t0 = time.perf_counter()
        engines[name] = make_llm(model, tokenizer, **args, **extra)
        log(f"[{name}] engine ready in {time.perf_counter() - t0:.1f}s")
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for rep in range(repeats):
        for name, llm in engines.items():
            gc.collect()
            load = os.getloadavg()[0]
            res = run_trace(llm.engine, trace, ids, prefix=f"{name}{rep}")
            row = _row(res, load)
            runs[name].append(row)
            log(f"[{name} #{rep + 1}] {row['output_tok_s']:.2f} output tok/s, mean ITL "
                f"{row['mean_itl_ms']:.1f} ms, acceptance {row['acceptance_rate']:.2f}, "
                f"load {load:.1f}")

    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    ratios = {"output_tok_s": med("on", "output_tok_s") / med("off", "output_tok_s"),
              "mean_itl_ms": med("off", "mean_itl_ms") / med("on", "mean_itl_ms"),
              "mean_tpot_ms": med("off", "mean_tpot_ms") / med("on", "mean_tpot_ms")}
    shown = {k: v if isinstance(v, (str, int, float)) else str(getattr(v, "source", v))
             for k, v in spec_config.items()}  # a loaded draft model by its source
    return {"spec_config": shown, "off": runs["off"], "on": runs["on"], "ratios": ratios}


def format_speculation(res: dict) -> str:
    """A table of every run and the ratio line."""
    cols = ("output_tok_s", "mean_itl_ms", "mean_tpot_ms", "acceptance_rate",
            "mean_accepted_len", "num_steps", "load_avg")
    lines = ["run      " + "  ".join(f"{c:>17}" for c in cols)]
    for name in ("off", "on"):
        for i, r in enumerate(res[name], start=1):
            lines.append(f"{name + ' #' + str(i):<8} " + "  ".join(
                f"{r[c]:>17.3f}" if isinstance(r[c], float) else f"{r[c]:>17}" for c in cols))
    q = res["ratios"]
    lines.append(f"speculation {res['spec_config']}: {q['output_tok_s']:.2f}x output tok/s, "
                 f"{q['mean_itl_ms']:.2f}x lower mean ITL, {q['mean_tpot_ms']:.2f}x lower "
                 "TPOT (medians)")
    return "\n".join(lines)
