"""The scheduler reader: which of the three mechanisms limits a serving config, and what to change.

The three mechanisms that bound a continuous-batching engine:

- "kv": KV pages. The pool holds too few tokens for the batch the config asks for, so
  requests are preempted (recomputed or swapped) or wait while sequence slots are free.
- "batch": the token budget and batch size. Every sequence slot is busy and requests
  queue, or the per-step token budget is too small to admit prompts quickly.
- "chunk": chunk size and latency tails. Whole prompts (no chunking) or large chunks
  share steps with decodes, so inter-token latency has spikes far above its median; or
  chunks so small that long prompts take many steps to their first token.

Evidence comes from the config alone (capacity arithmetic), and, when given, from a
metrics snapshot (`get_metrics()` JSON or a Prometheus `/metrics` dump) and a benchmark
or simulator result (the `summarize` fields plus step means).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MECHANISMS = {"kv": "KV cache pages (capacity, preemptions)",
              "batch": "token budget and batch size (max_num_batched_tokens, max_num_seqs)",
              "chunk": "chunk size and TTFT/ITL tails (chunked prefill)"}
# SmolLM2-135M's KV bytes a token by kv_cache_dtype: 30 layers x 2 x 3 KV heads x 64
# elements (8-bit pages: + 4 scale bytes a row); "auto" serves its GGUF's blocks on the CPU
# with float16 pages (`Model.kv_dtype`).
KV_BYTES_PER_TOKEN = {"float32": 46080, "auto": 23040, "float16": 23040, "bfloat16": 23040,
                      "int8": 12240, "fp8": 12240, "fp8_e4m3": 12240, "fp8_e5m2": 12240}
DEFAULT_KV_BYTES_PER_TOKEN = KV_BYTES_PER_TOKEN["auto"]
# The engine's default max_model_len for SmolLM2-135M: its context length (the GGUF
# file's `context_length`), which its 1 GiB CPU pool holds.
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class Finding:
    """One mechanism's verdict: a score (>= 1 means it limits the run), figures, advice."""

    mechanism: str
    score: float = 0.0
    figures: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)


def load_observations(metrics_text: str | None = None, result: dict | None = None,
                      mode: str | None = None) -> dict:
    """One flat dict of observed figures from a metrics snapshot and/or a result.

    Args:
        metrics_text: `get_metrics()` as JSON, or Prometheus exposition text.
        result: A summary dict, or a `bench throughput` JSON (its run in `mode`, else
            its continuous+chunked run, else its first run, is used).
        mode: The scheduling mode whose run to read from a `bench throughput` JSON.
    """
    obs: dict = {}
    if metrics_text:
        text = metrics_text.strip()
        if text.startswith("{"):
            raw = json.loads(text)
        else:
            from prometheus_client.parser import text_string_to_metric_families

            raw = {}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if set(s.labels) <= {"model_name"}:
                        raw[s.name.removesuffix("_total")] = s.value
        for key, value in raw.items():
            if isinstance(value, (int, float)):
                obs[key.removeprefix("jaxserve:")] = float(value)
    if result:
        if "results" in result:
            runs = result["results"]
            result = runs.get(mode) or runs.get("continuous+chunked") \
                or next(iter(runs.values()))
        obs.update({k: v for k, v in result.get("summary", result).items()
                    if isinstance(v, (int, float))})
    return obs


def _config_value(config: dict, key: str, default):
    value = config.get(key)
    return default if value is None else value


@dataclass(frozen=True)
class _Setting:
    """The config's sizes and the workload's mean lengths, resolved to numbers."""

    seqs: int  # max_num_seqs
    page_size: int
    max_model_len: int
    chunked: bool
    budget: int  # max_num_batched_tokens
    threshold: int  # long_prefill_token_threshold (0: none)
    pages: int  # usable KV pages
    mean_prompt_len: float
    seq_len: float  # mean prompt + output tokens
    fits: float  # requests of mean length the pool holds


def diagnose(config: dict, obs: dict | None = None, *, mean_prompt_len: float | None = None,
             mean_output_len: float | None = None,
             kv_bytes_per_token: int | None = None) -> dict:
    """Names the bottleneck mechanism with its figures and what to change.

    Args:
        config: Engine arguments (vLLM names: max_num_seqs, max_num_batched_tokens,
            num_kv_blocks or kv_cache_memory_gib, block_size, max_model_len,
            enable_chunked_prefill, scheduling_mode, long_prefill_token_threshold).
        obs: Observed figures (`load_observations`), or None for the config alone.
        mean_prompt_len, mean_output_len: The workload's mean lengths (default: from the
            observations, else 512 / 128).
        kv_bytes_per_token: To size the pool from `kv_cache_memory_gib` (default:
            SmolLM2-135M's at the config's `kv_cache_dtype`, `KV_BYTES_PER_TOKEN`).

    Returns:
        {"bottleneck": mechanism or "none", "findings": [Finding as dict, by score],
         "summary": one line}.
    """
    obs = obs or {}
    if kv_bytes_per_token is None:
        kv = _config_value(config, "kv_cache_dtype", "auto")
        kv_bytes_per_token = KV_BYTES_PER_TOKEN.get(kv, DEFAULT_KV_BYTES_PER_TOKEN)
    setting = _resolve(config, obs, mean_prompt_len, mean_output_len, kv_bytes_per_token)
    assumptions = _assumptions(config, obs, mean_prompt_len, mean_output_len,
                               kv_bytes_per_token)
    findings = sorted([_kv_finding(setting, obs), _batch_finding(setting, obs),
                       _chunk_finding(setting, obs)], key=lambda f: f.score, reverse=True)
    top = findings[0]
    bottleneck = top.mechanism if top.score >= 1.0 else "none"
    summary = (f"bottleneck: {bottleneck} - {MECHANISMS[bottleneck]}" if bottleneck != "none"
               else "no mechanism is clearly limiting; the model step itself sets the pace")
    return {"bottleneck": bottleneck, "summary": summary, "assumptions": assumptions,
            "findings": [f.__dict__ for f in findings]}


def _assumptions(config: dict, obs: dict, mean_prompt_len: float | None,
                 mean_output_len: float | None, kv_bytes_per_token: int) -> list[str]:
    """What the diagnosis assumed because neither the config nor the observations said."""
    out = []
    completed = _num_completed(obs)
    if mean_prompt_len is None and not (completed and obs.get("total_input_tokens")):
        out.append("mean prompt of 512 tokens (give --mean-prompt-len or --result)")
    if mean_output_len is None and not (completed and obs.get("total_output_tokens")):
        out.append("mean output of 128 tokens (give --mean-output-len or --result)")
    if not config.get("num_kv_blocks"):
        gib = _config_value(config, "kv_cache_memory_gib", 1.0)
        out.append(f"KV pool sized from kv_cache_memory_gib={gib} at {kv_bytes_per_token} "
                   "bytes per token (SmolLM2-135M at its kv_cache_dtype; give "
                   "--num-kv-blocks for another model)")
    defaults = {"max_num_seqs": 64, "block_size": 16, "max_model_len": DEFAULT_MAX_MODEL_LEN,
                "scheduling_mode": "continuous+chunked"}
    unset = [f"{k}={v}" for k, v in defaults.items() if config.get(k) is None]
    if unset:
        out.append(f"engine defaults for {', '.join(unset)}")
    if not obs:
        out.append("no observations (--metrics/--result): capacity arithmetic only")
    return out


def _resolve(config: dict, obs: dict, mean_prompt_len: float | None,
             mean_output_len: float | None, kv_bytes_per_token: int) -> _Setting:
    """Fills in engine defaults and the workload's lengths (see `diagnose`)."""
    completed = _num_completed(obs)
    if mean_prompt_len is None:
        mean_prompt_len = (obs["total_input_tokens"] / completed
                           if completed and obs.get("total_input_tokens") else 512)
    if mean_output_len is None:
        mean_output_len = (obs["total_output_tokens"] / completed
                           if completed and obs.get("total_output_tokens") else 128)
    seqs = _config_value(config, "max_num_seqs", 64)
    page_size = _config_value(config, "block_size", 16)
    mml = _config_value(config, "max_model_len", DEFAULT_MAX_MODEL_LEN)
    mode = _config_value(config, "scheduling_mode", "continuous+chunked")
    chunked = _config_value(config, "enable_chunked_prefill", True) \
        and mode == "continuous+chunked"
    budget = _config_value(config, "max_num_batched_tokens",
                           max(512, seqs) if chunked else max(mml, seqs))
    if config.get("num_kv_blocks"):
        pages = config["num_kv_blocks"] - 1
    else:
        gib = _config_value(config, "kv_cache_memory_gib", 1.0)
        pages = int(gib * 2**30 // (kv_bytes_per_token * page_size))
    seq_len = mean_prompt_len + mean_output_len
    # Requests of mean length the pool holds (half a page of each is left empty).
    fits = pages * page_size / (seq_len + page_size / 2)
    return _Setting(seqs, page_size, mml, chunked, budget,
                    _config_value(config, "long_prefill_token_threshold", 0), pages,
                    mean_prompt_len, seq_len, fits)


def _num_completed(obs: dict) -> float:
    return obs.get("completed") or obs.get("request_success") or 0


def _kv_finding(s: _Setting, obs: dict) -> Finding:
    """KV pages: the pool's capacity against the batch, preemptions, peak usage."""
    kv = Finding("kv")
    kv.figures.append(f"pool {s.pages} pages x {s.page_size} = {s.pages * s.page_size} tokens "
                      f"holds ~{s.fits:.0f} requests of {s.seq_len:.0f} tokens; "
                      f"max_num_seqs={s.seqs}")
    kv.score = max(kv.score, 0.9 * s.seqs / s.fits if s.fits < s.seqs else 0.0)
    preempt = obs.get("num_preemptions", 0)
    if preempt:
        completed = _num_completed(obs)
        per_req = preempt / completed if completed else preempt
        kv.figures.append(f"{preempt:.0f} preemptions ({per_req:.2f} per completed request)")
        kv.score = max(kv.score, 1.0 + min(per_req, 5.0))
    usage = obs.get("max_kv_usage", obs.get("kv_cache_usage_perc"))
    if usage is not None:
        kind = "peak KV usage" if "max_kv_usage" in obs else "KV usage at the snapshot"
        kv.figures.append(f"{kind} {100 * usage:.0f}%")
        if usage >= 0.95:
            kv.score = max(kv.score, 1.0)
    # NOTE: advice only where it points the right way (more pages than the pool has, a
    # max_num_seqs below the current one).
    pages_needed = s.seqs * (s.seq_len + s.page_size) / s.page_size
    if pages_needed > s.pages:
        kv.advice.append(f"give the pool more pages (num_kv_blocks / kv_cache_memory_gib / "
                         f"gpu_memory_utilization): ~{pages_needed:.0f} pages (now {s.pages}) "
                         f"hold max_num_seqs={s.seqs} requests of {s.seq_len:.0f} tokens")
    if int(s.fits) < s.seqs:
        kv.advice.append(f"or lower max_num_seqs to ~{max(1, int(s.fits))} (now {s.seqs}) so "
                         "admitted requests are not preempted and recomputed")
    kv.advice.append("preemption_mode=swap keeps computed KV on the host instead of "
                     "recomputing; prefix caching and a shorter max_model_len also save pages")
    return kv


def _batch_finding(s: _Setting, obs: dict) -> Finding:
    """Token budget and batch size: full batches with a queue, a starved budget."""
    batch = Finding("batch")
    seqs, budget, fits = s.seqs, s.budget, s.fits
    preempt = obs.get("num_preemptions", 0)
    mean_batch = obs.get("mean_batch_size")
    waiting = obs.get("max_num_waiting", obs.get("num_requests_waiting", 0))
    if mean_batch is not None:
        batch.figures.append(f"mean batch {mean_batch:.1f} of max_num_seqs={seqs}; "
                             f"up to {waiting:.0f} requests waiting")
        if mean_batch >= 0.85 * seqs and waiting > 0 and not preempt:
            batch.score = max(batch.score, 1.0 + min(waiting / seqs, 3.0))
    if budget < seqs:
        batch.figures.append(f"max_num_batched_tokens={budget} < max_num_seqs={seqs}")
        batch.score = max(batch.score, 1.5)
    tokens = obs.get("mean_tokens_per_step")
    if tokens is not None and mean_batch is not None:
        batch.figures.append(f"mean {tokens:.0f} tokens per step of a {budget}-token budget")
        prefill_room = budget - mean_batch
        if tokens >= 0.9 * budget and prefill_room < s.mean_prompt_len and waiting > 0:
            batch.score = max(batch.score, 1.2)
    if fits >= seqs and seqs * 4 <= fits and mean_batch is None:
        batch.figures.append(f"the pool would hold ~{fits:.0f} requests but max_num_seqs={seqs}")
        batch.score = max(batch.score, 0.5)
    if int(fits) > seqs:
        batch.advice.append(f"raise max_num_seqs (now {seqs}; the pool holds ~{fits:.0f} "
                            "requests of this length)")
    batch.advice.append(f"raise max_num_batched_tokens above max_num_seqs + a prompt chunk "
                        f"(now {budget}) so admissions are not starved by decodes")
    return batch


def _chunk_finding(s: _Setting, obs: dict) -> Finding:
    """Chunk size and latency tails: whole prompts or large chunks beside decodes."""
    chunk = Finding("chunk")
    budget, chunked, mml = s.budget, s.chunked, s.max_model_len
    p99, med = obs.get("p99_itl_ms"), obs.get("median_itl_ms")
    biggest = budget if chunked else max(budget, mml)
    if not chunked:
        chunk.figures.append(f"chunked prefill off: a step may carry a whole {mml}-token prompt "
                             "beside the decodes")
        chunk.score = max(chunk.score, 0.6)
    if p99 and med:
        ratio = p99 / med
        chunk.figures.append(f"P99 ITL {p99:.0f} ms = {ratio:.1f}x median {med:.0f} ms")
        # NOTE: any step carrying prompt tokens is slower than a pure decode step, so some
        # tail is inherent; with chunking the budget bounds it (flag only a 6x tail),
        # without chunking a whole prompt does not (flag 3x).
        chunk.score = max(chunk.score, ratio / 6.0 if chunked else ratio / 3.0 + 0.5)
    p99_ttft = obs.get("p99_ttft_ms")
    if chunked and p99_ttft and med and s.mean_prompt_len > 2 * budget:
        chunk.figures.append(f"prompts of ~{s.mean_prompt_len:.0f} tokens take "
                             f"{s.mean_prompt_len / budget:.1f} steps at budget {budget}; "
                             f"P99 TTFT {p99_ttft:.0f} ms")
        chunk.score = max(chunk.score, 0.8)
    target = max(s.seqs + 64, min(512, biggest // 4)) if biggest > 128 else biggest
    chunk.advice = (["enable chunked prefill (scheduling_mode=continuous+chunked)"]
                    if not chunked else [])
    chunk.advice += [f"cap the step at ~{target} tokens (max_num_batched_tokens, or "
                     f"long_prefill_token_threshold={s.threshold or target} for long prompts) so "
                     "no step carries a long prompt beside the decodes",
                     "if TTFT of long prompts is the complaint instead, raise the budget: "
                     "fewer, larger chunks"]
    return chunk


def format_diagnosis(d: dict) -> str:
    """The diagnosis as text: summary, assumptions, then each finding (advice if limiting)."""
    lines = [d["summary"].capitalize()]
    if d.get("assumptions"):
        lines.append("Assumed: " + "; ".join(d["assumptions"]))
    for f in d["findings"]:
        lines.append(f"\n[{f['mechanism']}] {MECHANISMS[f['mechanism']]}  (score "
                     f"{f['score']:.2f})")
        lines += [f"  - {x}" for x in f["figures"]]
        if f["score"] >= 1.0:
            lines += [f"  -> {x}" for x in f["advice"]]
    return "\n".join(lines)
