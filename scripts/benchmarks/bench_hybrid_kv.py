"""KV memory of a Gemma 3-shaped model with and without the hybrid KV cache (issue 44).

Drives the real Scheduler and KVCacheManager (host only: the memory they hand out is
what the device pool holds) over the layout `models.kv_groups` gives a model with
5 sliding-window layers per global one, against the same model with one block table
for every layer (`--disable-hybrid-kv-cache-manager`). Memory is counted in layer-pages
(pages x layers per page), so the two layouts compare in bytes.

1. One 8,192-token prompt plus `--max-tokens` outputs: peak and final layer-pages held.
2. A fixed pool (`--pool-requests` all-global requests' worth of memory) and many 8K
   requests with long outputs: the most running at once, and preemptions.
3. With `--engine`: the same one request served by the engine (a tiny random model of the
   same layer pattern, on this machine's backend), the pool read after every step, with
   and without the hybrid KV cache, beside the step count and wall time.

Usage: python -m scripts.benchmarks.bench_hybrid_kv [--layers 26] [--window 512] [--engine]
"""

from __future__ import annotations

import argparse
import os

from jaxserve.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.utils import cdiv
from models.kv_groups import kv_group_layout


def gemma3_windows(num_layers: int, window: int) -> tuple[int, ...]:
    """Every 6th layer global, the rest sliding (Gemma 3's `sliding_window_pattern` 6)."""
    return tuple(0 if (i + 1) % 6 == 0 else window for i in range(num_layers))


def run(layout, num_pages: int, args, num_requests: int, max_tokens: int) -> dict:
    """Serves `num_requests` 8K requests; returns peak/final layer-pages and concurrency."""
    kv = KVCacheManager(num_pages, args.page_size, watermark=0.0,
                        max_model_len=args.max_model_len, group_windows=layout.windows,
                        max_chunk_tokens=args.budget)
    sched = Scheduler(SchedulerConfig(max_num_seqs=256), kv, args.max_model_len, args.budget)
    for i in range(num_requests):
        prompt = [1000 + i] + [(7 * j + i) % 30000 + 10 for j in range(args.prompt_len - 1)]
        request = Request(f"r{i}", prompt, sampling_params=SamplingParams(
            max_tokens=max_tokens, ignore_eos=True))
        sched.add_request(request)
    peak = final = max_running = steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        held = kv.pool.num_used_pages * layout.num_slots
        peak = max(peak, held)
        max_running = max(max_running, len(sched.running))
        if len(sched.running) == 1 and all(
                r.num_output_tokens == max_tokens - 1 for r in sched.running):
            final = held
        sampled = {s.request_id: [5] * s.num_samples for s in out.scheduled if s.num_samples}
        sched.update_from_output(out, sampled)
    assert kv.pool.num_used_pages == 0
    return {"peak": peak, "final": final, "max_running": max_running,
            "preemptions": sched.num_preemptions, "steps": steps,
            "max_tokens_per_request": kv.max_tokens_per_request}


def engine_run(args, windows, hybrid: bool) -> dict:
    """One request through `LLMEngine` of a tiny random Gemma 3-like model."""
    import time

    import jax.numpy as jnp

    from jaxserve import LLM, SamplingParams
    from models.config import ArchConfig
    from models.default_model import default_model_path
    from models.loaders import load_tokenizer
    from models.model import Model, random_params

    cfg = ArchConfig("Gemma3ForCausalLM", vocab_size=49152, hidden_size=64,
                     intermediate_size=128, num_layers=len(windows), num_heads=2,
                     num_kv_heads=1, head_dim=32, layer_windows=windows,
                     tie_word_embeddings=True, max_position_embeddings=args.max_model_len,
                     eos_token_ids=(2,), hidden_act="gelu_pytorch_tanh", norm_offset=1.0,
                     embed_scale=True, sandwich_norms=True, qk_norm=True,
                     query_pre_attn_scalar=32, local_rope_theta=10000.0)
    model = Model(cfg, random_params(cfg), jnp.float32, "tiny-gemma3")
    llm = LLM(model, tokenizer=load_tokenizer(default_model_path()), warmup=False,
              max_model_len=args.max_model_len, max_num_batched_tokens=args.budget,
              block_size=args.page_size, enable_prefix_caching=False,
              num_kv_blocks=cdiv(args.max_model_len, args.page_size) * len(windows) + 1,
              disable_hybrid_kv_cache_manager=not hybrid)
    engine = llm.engine
    slots = engine.runner.kv_layout.num_slots
    prompt = [(7 * j) % 30000 + 10 for j in range(args.prompt_len)]
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    peak = steps = final = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        held = engine.kv.pool.num_used_pages * slots
        peak = max(peak, held)
        final = held if engine.kv.has_request("r") else final
    return {"peak": peak, "final": final, "steps": steps, "seconds": time.perf_counter() - t0,
            "groups": engine.kv.num_groups, "slots": slots}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=26, help="26: Gemma 3 1B's published config")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--pool-requests", type=int, default=4,
                   help="pool size in all-global 8K requests")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--long-max-tokens", type=int, default=1024,
                   help="outputs per request in the fixed-pool run (long enough that all "
                        "requests overlap)")
    p.add_argument("--engine", action="store_true",
                   help="also serve the one request through the engine (a tiny model)")
    args = p.parse_args()
    args.max_model_len = args.prompt_len + max(args.max_tokens, args.long_max_tokens)
    windows = gemma3_windows(args.layers, args.window)
    layouts = {"all layers global": kv_group_layout((0,) * args.layers),
               "one table, windows masked": kv_group_layout(windows, args.max_model_len,
                                                            enabled=False),
               "hybrid (KV cache groups)": kv_group_layout(windows, args.max_model_len)}
    per_request = cdiv(args.max_model_len, args.page_size) * args.layers  # layer-pages
    memory = args.pool_requests * per_request  # layer-pages in the fixed pool
    print(f"load average {os.getloadavg()[0]:.1f}; {args.layers} layers, window "
          f"{args.window}, page {args.page_size}, step budget {args.budget}; prompt "
          f"{args.prompt_len} + {args.max_tokens} tokens; pool {memory} layer-pages")
    base = None
    for name, layout in layouts.items():
        one = run(layout, per_request // layout.num_slots + 1, args, 1, args.max_tokens)
        many = run(layout, memory // layout.num_slots + 1, args, args.num_requests,
                   args.long_max_tokens)
        base = base or one
        print(f"{name:28s} groups {layout.num_groups} x {layout.num_slots} layers: one "
              f"request peak {one['peak']} ({one['peak'] / base['peak']:.3f}x), end "
              f"{one['final']} ({one['final'] / base['final']:.3f}x); fixed pool: holds "
              f"{memory // one['peak']} such requests at their peak, the scheduler ran "
              f"{many['max_running']} at once ({many['preemptions']} preemptions), "
              f"{args.num_requests} requests in {many['steps']} steps")
    if args.engine:
        args.max_model_len = args.prompt_len + args.max_tokens
        runs = {}
        for hybrid in (False, True, False, True):  # interleaved: the machine is shared
            r = engine_run(args, windows, hybrid)
            runs.setdefault(hybrid, []).append(r)
            base = runs[False][0]
            print(f"engine, hybrid={hybrid}: {r['groups']} groups x {r['slots']} layers; "
                  f"peak {r['peak']} layer-pages ({r['peak'] / base['peak']:.3f}x), last "
                  f"step {r['final']} ({r['final'] / base['final']:.3f}x); {r['steps']} steps "
                  f"in {r['seconds']:.1f} s (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
