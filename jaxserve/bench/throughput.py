"""Offline throughput: the engine's scheduling modes and transformers' static batches, one run.

`compare_modes` runs one trace through the engine in each scheduling mode (naive,
static, continuous, continuous+chunked) over the same loaded weights, and through
transformers' padded-batch `generate` as the external baseline, then reports
throughput, latency and ratios, and splits each run's time into prefill-carrying and
pure-decode steps to show where the gaps come from. `compare_prefix_caching` runs a
shared-prompt trace with and without prefix caching.
"""

from __future__ import annotations

import gc
import time

from jaxserve.bench.engine_run import RunResult, StepRecord, make_llm, run_trace
from jaxserve.bench.report import table
from jaxserve.bench.workloads import TraceRequest, trace_token_ids
from jaxserve.config import SCHEDULING_MODES

BASELINE = "transformers-static"


def breakdown(steps: list[StepRecord]) -> dict:
    """Where a run's time went: prefill-carrying steps vs pure-decode steps.

    Returns:
        prefill_time_s, decode_time_s, prefill_tok_per_s (prompt tokens per second of
        prefill-carrying steps), decode_batch (mean requests in a pure-decode step),
        decode_tok_per_s (tokens per second of pure-decode steps), max_step_ms.
    """
    pre = [s for s in steps if s.num_prefill_tokens]
    dec = [s for s in steps if not s.num_prefill_tokens]
    pt, dt = sum(s.seconds for s in pre), sum(s.seconds for s in dec)
    return {
        "prefill_steps": len(pre), "decode_steps": len(dec),
        "prefill_time_s": pt, "decode_time_s": dt,
        "prefill_tok_per_s": sum(s.num_prefill_tokens for s in pre) / pt if pt else 0.0,
        "decode_batch": sum(s.num_seqs for s in dec) / len(dec) if dec else 0.0,
        "decode_tok_per_s": sum(s.num_tokens for s in dec) / dt if dt else 0.0,
        "max_step_ms": 1000 * max((s.seconds for s in steps), default=0.0),
    }


def compare_modes(model, tokenizer, trace: list[TraceRequest], modes: list[str],
                  engine_args: dict, *, hf_model=None, hf_batch_size: int = 16,
                  peer: tuple[str, str] | None = None, sampling: dict | None = None,
                  log=print) -> dict:
    """Runs `trace` in every mode (and the transformers baseline); returns results by name.

    Args:
        peer: `(name, base URL)` of another OpenAI-compatible server (say llama.cpp's
            `llama-server`) serving the same model: the same prompt ids are streamed to
            its `/v1/completions` after the engine modes (`serve_client`), as one more
            row.
        sampling: `SamplingParams` fields for every request (temperature, top_p, top_k);
            default greedy. The transformers baseline samples with the same settings.

    Each entry: `summary` (the `summarize` fields + step means), `breakdown`,
    `warmup_s` and, for engine modes, `run` (the JSON of the run for plots).
    """
    ids = trace_token_ids(trace, model.cfg.vocab_size, avoid=(0, 1, 2))
    results: dict[str, dict] = {}
    for mode in modes:
        t0 = time.perf_counter()
        llm = make_llm(model, tokenizer, mode, **engine_args)
        warm = time.perf_counter() - t0
        log(f"[{mode}] engine ready in {warm:.1f}s (buckets {llm.engine.runner.buckets}); "
            f"running {len(trace)} requests")
        res: RunResult = run_trace(llm.engine, trace, ids, prefix=mode, sampling=sampling)
        results[mode] = {"summary": res.summary, "breakdown": breakdown(res.steps),
                         "warmup_s": warm, "run": res.to_json()}
        log(f"[{mode}] {res.summary['output_throughput']:.2f} output tok/s in "
            f"{res.summary['duration']:.1f}s")
        del llm, res
        gc.collect()
    if hf_model is not None:
        from jaxserve.bench.hf_baseline import run_hf_static

        log(f"[{BASELINE}] batches of {hf_batch_size}")
        summ = run_hf_static(hf_model, trace, ids, batch_size=hf_batch_size,
                             sampling=sampling)
        results[BASELINE] = {"summary": summ, "breakdown": {}, "warmup_s": 0.0}
        log(f"[{BASELINE}] {summ['output_throughput']:.2f} output tok/s in "
            f"{summ['duration']:.1f}s")
    if peer is not None:
        results[peer[0]] = run_peer(peer[1], trace, ids, log)
    return results


def run_peer(url: str, trace: list[TraceRequest], ids: list[list[int]], log=print) -> dict:
    """The trace streamed to another OpenAI-compatible server; a results entry.

    Raises:
        RuntimeError: The server cannot be reached, some request failed (the first errors
            are named), or it generated other lengths than the trace asks.
    """
    import asyncio

    import httpx

    from jaxserve.bench.serve_client import run_serve_benchmark

    log(f"[peer] {len(trace)} requests to {url}")
    try:
        res = asyncio.run(run_serve_benchmark(url, trace, ids, timeout_s=1800.0))
    except (httpx.HTTPError, OSError) as e:
        raise RuntimeError(f"peer {url}: cannot reach it ({type(e).__name__}: {e})") from e
    if res["failed"]:
        raise RuntimeError(f"peer {url}: {res['failed']} of {len(trace)} requests failed: "
                           f"{res['errors'][:3]}")
    got, want = sum(res["output_lens"]), sum(r.output_len for r in trace)
    if got != want:  # the peer must generate exactly the trace's lengths (ignore_eos)
        raise RuntimeError(f"peer {url} generated {got} tokens, the trace asks {want}")
    summary = {k: v for k, v in res.items()
               if not isinstance(v, list) and k not in ("model_id", "errors")}
    log(f"[peer] {summary['output_throughput']:.2f} output tok/s in "
        f"{summary['duration']:.1f}s")
    return {"summary": summary, "breakdown": {}, "warmup_s": 0.0}


def mode_rows(results: dict, reference: str = "static") -> list[dict]:
    """One table row per run with ratios to `reference` and to the transformers baseline."""
    rows = []
    ref = results.get(reference, {}).get("summary", {}).get("output_throughput")
    base = results.get(BASELINE, {}).get("summary", {}).get("output_throughput")
    for name, r in results.items():
        s = r["summary"]
        out = s["output_throughput"]
        rows.append({"name": name, **s, **r.get("breakdown", {}),
                     "x_ref": out / ref if ref else None,
                     "x_base": out / base if base else None})
    return rows


def format_modes(results: dict, reference: str = "static") -> str:
    """The throughput table and the where-the-gap-comes-from table."""
    rows = mode_rows(results, reference)
    t1 = table(rows, [
        ("name", "run", "s"), ("request_throughput", "req/s", ".3f"),
        ("total_token_throughput", "total tok/s", ".1f"),
        ("output_throughput", "output tok/s", ".2f"), ("x_ref", f"x {reference}", ".2f"),
        ("x_base", "x transformers", ".2f"), ("mean_ttft_ms", "mean TTFT ms", ".0f"),
        ("p99_itl_ms", "P99 ITL ms", ".0f"), ("median_itl_ms", "median ITL ms", ".0f"),
        ("duration", "wall s", ".1f")])
    eng = [r for r in rows if r["name"] in SCHEDULING_MODES]
    peers = [r for r in rows if r["name"] != BASELINE and r["name"] not in SCHEDULING_MODES]
    t2 = table(eng, [
        ("name", "mode", "s"), ("num_steps", "steps", "d"),
        ("prefill_steps", "prefill steps", "d"), ("prefill_time_s", "prefill s", ".1f"),
        ("prefill_tok_per_s", "prefill tok/s", ".0f"), ("decode_steps", "decode steps", "d"),
        ("decode_time_s", "decode s", ".1f"), ("decode_batch", "decode batch", ".1f"),
        ("decode_tok_per_s", "decode tok/s", ".1f"), ("max_step_ms", "max step ms", ".0f"),
        ("padding_waste_ratio", "pad waste", ".2f")])
    text = t1 + "\n\nWhere the time goes (engine steps that carry prompt tokens vs pure " \
                "decode steps):\n\n" + t2
    for peer in peers:
        ratios = [f"{r['name']} / {peer['name']}: "
                  f"{r['output_throughput'] / peer['output_throughput']:.2f}x" for r in eng]
        text += "\n\nOutput tok/s against the peer: " + "; ".join(ratios)
    if BASELINE in results:
        s = results[BASELINE]["summary"]
        useful = s["total_input_tokens"]
        text += (f"\n\n{BASELINE}: batches of {s['batch_size']}; prompt tokens computed "
                 f"{s['padded_prompt_tokens']} for {useful} real "
                 f"({s['padded_prompt_tokens'] / max(useful, 1):.2f}x); tokens generated "
                 f"{s['generated_tokens']} for {s['total_output_tokens']} useful "
                 f"({s['generated_tokens'] / max(s['total_output_tokens'], 1):.2f}x).")
    return text


def compare_prefix_caching(model, tokenizer, trace: list[TraceRequest], engine_args: dict,
                           *, log=print) -> dict:
    """The shared-prompt trace with prefix caching off and on (continuous+chunked)."""
    ids = trace_token_ids(trace, model.cfg.vocab_size, avoid=(0, 1, 2))
    results = {}
    for on in (False, True):
        name = "prefix caching on" if on else "prefix caching off"
        llm = make_llm(model, tokenizer, **{**engine_args, "enable_prefix_caching": on})
        res = run_trace(llm.engine, trace, ids, prefix=name.replace(" ", "-"))
        results[name] = {"summary": res.summary, "breakdown": breakdown(res.steps)}
        log(f"[{name}] mean TTFT {res.summary['mean_ttft_ms']:.0f} ms, hit rate "
            f"{res.summary['prefix_cache_hit_rate']:.3f}")
        del llm, res
        gc.collect()
    return results


def format_prefix(results: dict) -> str:
    off = results["prefix caching off"]["summary"]
    rows = []
    for name, r in results.items():
        s = r["summary"]
        rows.append({"name": name, **s, **r["breakdown"],
                     "ttft_x": off["mean_ttft_ms"] / s["mean_ttft_ms"],
                     "out_x": s["output_throughput"] / off["output_throughput"]})
    return table(rows, [
        ("name", "run", "s"), ("prefix_cache_hit_rate", "hit rate", ".3f"),
        ("mean_ttft_ms", "mean TTFT ms", ".0f"), ("median_ttft_ms", "median TTFT ms", ".0f"),
        ("p99_ttft_ms", "P99 TTFT ms", ".0f"), ("ttft_x", "TTFT gain (x off)", ".2f"),
        ("output_throughput", "output tok/s", ".2f"), ("out_x", "x off", ".2f"),
        ("prefill_time_s", "prefill-step s", ".1f"), ("duration", "wall s", ".1f")])
