"""Host time per step: scheduling, input preparation and output processing, at scale.

Two measurements, both at a steady decode state with N running requests:

- `component_overhead`: no model at all. The real `Scheduler` + `KVCacheManager`
  (schedule, update_from_output), the runner's input builders called directly
  (`build_step_arrays` over the runner's kept block tables + `transfer.pack`), and the
  sampling arrays (the runner's kept rows, `SamplingRows.gather`, + `promote` + `pack`).
- `engine_overhead`: a real `LLMEngine` over a tiny random-weight model (SmolLM2's
  vocabulary and tokenizer, so detokenizing is real) whose device step is cheap; each
  phase of `engine.step()` is timed by wrapping the engine's methods and the runner's
  module-level helpers for the duration of the measurement.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from jaxserve.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.utils import cdiv


def _steady_scheduler(num_running: int, prompt_len: int, max_tokens: int, page_size: int = 16):
    """A scheduler with `num_running` requests all past their prompts (decoding)."""
    max_model_len = prompt_len + max_tokens + 1
    pages = num_running * cdiv(max_model_len, page_size) + 16
    kv = KVCacheManager(pages, page_size, enable_prefix_caching=True,
                        max_model_len=max_model_len)
    budget = max(num_running, 2048)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=budget),
                      kv, max_model_len, budget)
    rng = np.random.default_rng(0)
    for i in range(num_running):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        sched.add_request(Request(f"r{i}", rng.integers(3, 30000, prompt_len).tolist(),
                                  sampling_params=params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()) \
            or len(sched.running) < num_running:
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError("requests finished before all were running; raise max_tokens")
        sched.update_from_output(out, {s.request_id: [7] for s in out.scheduled
                                       if s.num_samples})
    return sched, budget


def component_overhead(num_running: int, *, prompt_len: int = 64, num_steps: int = 20,
                       page_size: int = 16) -> dict:
    """Milliseconds per decode step of each host component with `num_running` requests."""
    from jaxserve.runner.block_table_rows import BlockTableRows
    from jaxserve.runner.buckets import pick_bucket, rows_for_bucket, token_buckets
    from jaxserve.runner.sampler_variants import promote, variant_of
    from jaxserve.runner.sampling_rows import SamplingRows
    from jaxserve.runner.step_input import build_step_arrays
    from jaxserve.runner.transfer import pack

    # Outputs long enough that the first admitted are still running when the last start.
    max_tokens = num_steps + 8 + num_running * prompt_len // 2048
    sched, budget = _steady_scheduler(num_running, prompt_len, max_tokens, page_size)
    buckets = token_buckets(budget)
    max_pages = cdiv(prompt_len + max_tokens + 1, page_size)
    # NOTE: the runner's kept tables, which the steps before this loop never sent to:
    # each request sends its whole table once here (a decode step's deltas thereafter).
    kept = BlockTableRows(max_pages, num_running)
    sampling_rows = SamplingRows(49152, None, num_running)
    for request in sched.running:
        sched.kv.resend_pages(request.request_id)
    times = {k: [] for k in ("schedule", "update", "step_arrays", "pack_inputs",
                             "sampling_metadata", "pack_sampling")}

    def timed(key, fn, *a, **kw):
        t0 = time.perf_counter()
        res = fn(*a, **kw)
        times[key].append(time.perf_counter() - t0)
        return res

    for _ in range(num_steps):
        out = timed("schedule", sched.schedule)
        num_tokens = pick_bucket(buckets, max(out.total_num_scheduled_tokens, out.num_rows))
        num_rows = rows_for_bucket(num_tokens, num_running)
        kept.release(out.released_request_ids)
        arrays = timed("step_arrays", build_step_arrays, out, num_tokens, num_rows, page_size,
                       max_pages, tables=kept)
        timed("pack_inputs", pack, arrays.device_tree())
        t0 = time.perf_counter()
        md, _ = sampling_rows.gather(out, num_rows, lambda req: req.sampling_params)
        md = promote(md, variant_of(md), 49152, 1024, 16)
        times["sampling_metadata"].append(time.perf_counter() - t0)
        timed("pack_sampling", pack, md)
        timed("update", sched.update_from_output, out,
              {s.request_id: [7] for s in out.scheduled if s.num_samples})
    ms = {k: 1000 * float(np.median(v)) for k, v in times.items()}
    ms["scheduling"] = ms["schedule"] + ms["update"]
    ms["input_preparation"] = (ms["step_arrays"] + ms["pack_inputs"] + ms["sampling_metadata"]
                               + ms["pack_sampling"])
    ms["total"] = ms["scheduling"] + ms["input_preparation"]
    return {"num_running": num_running, **ms}


def tiny_model(vocab_size: int = 49152, max_position_embeddings: int = 4096):
    """A 1-layer random-weight Llama with SmolLM2's vocabulary (cheap device steps)."""
    import jax.numpy as jnp

    from models.config import ArchConfig
    from models.linear import ServingChoice
    from models.model import Model, random_params

    cfg = ArchConfig("LlamaForCausalLM", vocab_size=vocab_size, hidden_size=64,
                     intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=32, layer_windows=(0,), tie_word_embeddings=True,
                     max_position_embeddings=max_position_embeddings, eos_token_ids=(2,))
    return Model(cfg, random_params(cfg), jnp.float32, "tiny-random",
                 serving=ServingChoice("xla"))


@contextlib.contextmanager
def _patched(module, names: list[str], acc: dict):
    """Times module-level functions or an object's methods (as the engine and runner call
    them) into `acc`."""
    saved = {n: getattr(module, n) for n in names}

    def wrap(name, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            res = fn(*a, **kw)
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
            return res
        return timed

    for n in names:
        setattr(module, n, wrap(n, saved[n]))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


def engine_overhead(llm, num_running: int, *, prompt_len: int = 32, num_steps: int = 10,
                    output_kind: str = "CUMULATIVE") -> dict:
    """Per-phase ms of `engine.step()` at a steady decode state of `num_running` requests.

    Args:
        llm: An `LLM` whose `max_num_seqs` >= num_running (a tiny model keeps it cheap).
        output_kind: The requests' `RequestOutputKind` name: CUMULATIVE (an output per
            step, as a stream reads it) or FINAL_ONLY (as `LLM.generate` runs them).
    """
    import jaxserve.runner.model_runner as mr
    import jaxserve.runner.step_packing as packing
    from jaxserve.bench.engine_run import StepProbe
    from jaxserve.sampling_params import RequestOutputKind

    eng = llm.engine
    rng = np.random.default_rng(num_running)
    for i in range(num_running):
        eng.add_request(f"ov{num_running}-{i}",
                        {"prompt_token_ids": rng.integers(3, 30000, prompt_len).tolist()},
                        # NOTE: long enough that none ends before the last is admitted
                        SamplingParams(max_tokens=eng.limits.max_model_len - prompt_len - 1,
                                       ignore_eos=True, temperature=0.0,
                                       output_kind=RequestOutputKind[output_kind]))
    sched = eng.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()) \
            or len(sched.running) < num_running:
        if not eng.has_unfinished_requests():
            raise RuntimeError(f"requests finished before {num_running} ran together")
        eng.step()
    acc: dict[str, float] = {}
    rows = []
    with StepProbe(eng) as probe, _patched(eng.sampling_inputs, ["build"], acc), \
            _patched(packing, ["build_step_arrays"], acc), _patched(mr, ["pack", "promote"], acc):
        for _ in range(num_steps):
            acc.clear()
            _, rec = probe.step(time.perf_counter())
            rows.append((rec, dict(acc)))
    eng.abort_request(list(eng.states))
    med = lambda xs: 1000 * float(np.median(xs))
    res = {"num_running": num_running, "output_kind": output_kind.lower(),
           "step": med([r.seconds for r, _ in rows]),
           "schedule": med([r.schedule_s for r, _ in rows]),
           "update": med([r.update_s for r, _ in rows]),
           "sampling_metadata": med([a.get("build", 0) for _, a in rows]),
           "step_arrays": med([a.get("build_step_arrays", 0) for _, a in rows]),
           "pack_promote": med([a.get("pack", 0) + a.get("promote", 0) for _, a in rows]),
           "device": med([r.execute_s - a.get("build_step_arrays", 0) - a.get("pack", 0)
                          - a.get("promote", 0) for r, a in rows]),
           "output_processing": med([r.seconds - r.schedule_s - r.update_s - r.execute_s
                                     - a.get("build", 0)
                                     for r, a in rows])}
    res["scheduling"] = res["schedule"] + res["update"]
    res["input_preparation"] = res["sampling_metadata"] + res["step_arrays"] + res["pack_promote"]
    res["host"] = res["scheduling"] + res["input_preparation"] + res["output_processing"]
    res["host_share"] = res["host"] / res["step"] if res["step"] else 0.0
    return res


def gpu_step_ms(num_running: int) -> float:
    """Decode step of `num_running` requests under the simulator's illustrative gpu-8b cost."""
    from jaxserve.bench.simulator import PRESETS

    return 1000 * PRESETS["gpu-8b"].step_seconds(num_running, num_running, num_running * 512)
