"""Cost of scale: throughput and peak host memory vs concurrency and context; warm-up time.

Peak resident memory is the kernel's high-water mark (`VmHWM`), reset before each level
through `/proc/self/clear_refs` where Linux allows it. Warm-up is measured in fresh
processes: once with an empty persistent compilation cache ("cold") and once more with
the cache the first run filled ("warm").
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time

from jaxserve.bench.engine_run import make_llm, run_trace
from jaxserve.bench.workloads import TraceRequest
from jaxserve.utils import cdiv


def reset_peak_rss() -> bool:
    """Resets this process's peak RSS counter (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_mib(field: str) -> float | None:
    """A `/proc/self/status` memory field (`VmHWM`, `VmRSS`), MiB; None where unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """Peak resident set size since start (or the last reset), MiB."""
    peak = _status_mib("VmHWM")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """Resident set size now, MiB (NaN where /proc is unreadable)."""
    now = _status_mib("VmRSS")
    return float("nan") if now is None else now


def concurrency_sweep(model, tokenizer, levels: list[int], engine_args: dict, *,
                      prompt_len: int = 32, output_len: int = 16, log=print) -> list[dict]:
    """For each N: N identical-shape requests at once with max_num_seqs=N."""
    rows = []
    for n in levels:
        pages = n * cdiv(prompt_len + output_len, 16) + 64
        args = {**engine_args, "max_num_seqs": n,
                "max_num_batched_tokens": max(engine_args.get("max_num_batched_tokens", 256), n),
                "num_kv_blocks": max(engine_args.get("num_kv_blocks", 0), pages)}
        t0 = time.perf_counter()
        llm = make_llm(model, tokenizer, **args)
        warm = time.perf_counter() - t0
        gc.collect()
        reset_peak_rss()
        trace = [TraceRequest(prompt_len, output_len)] * n
        res = run_trace(llm.engine, trace, prefix=f"c{n}")
        s = res.summary
        rows.append({"concurrency": n, "output_throughput": s["output_throughput"],
                     "total_token_throughput": s["total_token_throughput"],
                     "mean_ttft_ms": s["mean_ttft_ms"], "mean_tpot_ms": s["mean_tpot_ms"],
                     "mean_step_ms": s["mean_step_ms"], "duration": s["duration"],
                     "peak_rss_mib": peak_rss_mib(), "warmup_s": warm,
                     "kv_pool_mib": llm.engine.limits.bytes_per_page
                     * llm.engine.limits.num_pages / 2**20})
        log(f"[concurrency {n}] {s['output_throughput']:.1f} output tok/s, peak RSS "
            f"{rows[-1]['peak_rss_mib']:.0f} MiB")
        del llm, res
        gc.collect()
    return rows


def context_sweep(model, tokenizer, contexts: list[int], engine_args: dict, *,
                  batch: int = 4, output_len: int = 16, log=print) -> list[dict]:
    """For each context length: `batch` requests of that prompt length, one engine."""
    mml = max(contexts) + output_len + 1
    pages = batch * cdiv(mml, 16) + 64
    args = {**engine_args, "max_model_len": mml, "max_num_seqs": max(batch, 8),
            "num_kv_blocks": max(engine_args.get("num_kv_blocks", 0), pages)}
    llm = make_llm(model, tokenizer, **args)
    rows = []
    for ctx in contexts:
        gc.collect()
        reset_peak_rss()
        trace = [TraceRequest(ctx, output_len)] * batch
        res = run_trace(llm.engine, trace, prefix=f"ctx{ctx}")
        s = res.summary
        dec = [st.seconds for st in res.steps if not st.num_prefill_tokens]
        rows.append({"context": ctx, "batch": batch,
                     "output_throughput": s["output_throughput"],
                     "mean_ttft_ms": s["mean_ttft_ms"], "mean_tpot_ms": s["mean_tpot_ms"],
                     "decode_step_ms": 1000 * sum(dec) / len(dec) if dec else float("nan"),
                     "duration": s["duration"], "peak_rss_mib": peak_rss_mib()})
        log(f"[context {ctx}] TTFT {s['mean_ttft_ms']:.0f} ms, TPOT {s['mean_tpot_ms']:.0f} ms")
    del llm
    gc.collect()
    return rows


def warmup_probe(cache_dir: str, engine_args: dict, model: str | None) -> dict:
    """In this process: load, then build an engine with `cache_dir` (over any cache
    directory in `engine_args`: cold and warm are this probe's own); seconds of each."""
    t0 = time.perf_counter()
    from jaxserve.engine.llm import LLM

    llm = LLM(model, **{**engine_args, "compilation_cache_dir": cache_dir})
    total = time.perf_counter() - t0
    return {"warmup_s": llm.engine.runner.warmup_seconds, "engine_s": total,
            "num_buckets": len(llm.engine.runner.buckets)}


def warmup_times(engine_args: dict, model: str | None = None) -> dict:
    """Warm-up seconds cold (fresh temp cache dir) and warm (same dir), in fresh processes."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="jaxserve-cold-cache-") as cache:
        for label in ("cold", "warm"):
            cmd = [sys.executable, "-m", "jaxserve.bench.scale", cache, json.dumps(engine_args),
                   model or ""]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                  env={**os.environ, "TQDM_DISABLE": "1"})
            out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


if __name__ == "__main__":  # the warm-up probe, run by `warmup_times` in a fresh process
    result = warmup_probe(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] or None)
    print(json.dumps(result))
