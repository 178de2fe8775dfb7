"""KV cache waste of a contiguous max_model_len reservation per request vs paged allocation.

The KV-waste exercise: for a trace of N requests (default 1000, prompts uniform
in [100, 1000] tokens, outputs normal with mean 1500 and sd 600, clipped to at least one
token and to max_model_len), how much KV memory does (a) reserving max_model_len (8192)
contiguous slots per request waste, against (b) pages of 16 slots (internal
fragmentation only)? The paged figures come from the real KVCacheManager: every request
is prefilled and then decoded token by token through `allocate_slots`.

Two views: at completion (all requests resident at their final length) and averaged over
each request's lifetime (the memory-time integral over its prefill and decode steps).
Bytes are SmolLM2-135M's: 30 layers x 2 (K, V) x 3 KV heads x 64 head_dim x 4 bytes.

Usage:
    python -m scripts.benchmarks.kv_waste [--num-requests N] [--prompt-min A] [--prompt-max B]
                               [--output-mean M] [--output-std S] [--max-model-len L]
                               [--page-size P] [--seed S]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxserve.core import KVCacheManager
from jaxserve.request import Request
from jaxserve.utils import cdiv

# SmolLM2-135M: 30 layers, K and V, 3 KV heads, head_dim 64, float32.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def make_trace(num_requests: int, prompt_min: int, prompt_max: int, output_mean: float,
               output_std: float, max_model_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths; outputs clipped to [1, max_model_len - prompt]."""
    if not 1 <= prompt_min <= prompt_max < max_model_len:
        raise ValueError(f"need 1 <= prompt_min <= prompt_max < max_model_len, got "
                         f"{prompt_min}, {prompt_max}, {max_model_len}")
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_min, prompt_max + 1, size=num_requests)
    output_lens = np.rint(rng.normal(output_mean, output_std, size=num_requests)).astype(int)
    output_lens = np.clip(output_lens, 1, max_model_len - prompt_lens)
    return prompt_lens, output_lens


def run_paged(prompt_lens: np.ndarray, output_lens: np.ndarray, page_size: int,
              max_model_len: int) -> dict[str, float]:
    """Allocates every request through KVCacheManager; returns slot counts for both views."""
    final_lens = prompt_lens + output_lens
    num_pages = int(np.sum(cdiv(final_lens, page_size))) + 1  # exactly enough, + null page
    manager = KVCacheManager(num_pages, page_size, enable_prefix_caching=False,
                             watermark=0.0, max_model_len=max_model_len)
    lifetime_slots = lifetime_tokens = 0
    for index, (prompt_len, output_len) in enumerate(zip(prompt_lens, output_lens, strict=True)):
        request = Request(f"req-{index}", np.zeros(int(prompt_len), dtype=np.int64))
        num_pages_held = len(manager.allocate_slots(request, int(prompt_len)))
        request.num_computed_tokens = int(prompt_len)
        lifetime_slots += num_pages_held * page_size
        lifetime_tokens += request.num_computed_tokens
        for _ in range(int(output_len)):
            request.append_output_token_ids(0)
            new_page_ids = manager.allocate_slots(request, 1)
            if new_page_ids is None:
                raise RuntimeError("pool sized exactly for the trace ran out of pages")
            num_pages_held += len(new_page_ids)
            request.num_computed_tokens += 1
            lifetime_slots += num_pages_held * page_size
            lifetime_tokens += request.num_computed_tokens
    stats = manager.stats()
    return {"final_slots": stats.num_allocated_slots, "final_tokens": stats.num_token_slots,
            "fragmentation": stats.internal_fragmentation, "num_pages": stats.num_used_pages,
            "lifetime_slots": lifetime_slots, "lifetime_tokens": lifetime_tokens}


def contiguous_lifetime(prompt_lens: np.ndarray, output_lens: np.ndarray,
                        max_model_len: int) -> tuple[int, int]:
    """(slot-steps reserved, token-steps held) with max_model_len reserved at admission."""
    num_steps = output_lens + 1  # the prefill, then one step per output token
    # Tokens held over steps prompt, prompt + 1, ..., prompt + output: an arithmetic sum.
    tokens = np.sum(num_steps * prompt_lens + output_lens * (output_lens + 1) // 2)
    return int(np.sum(num_steps) * max_model_len), int(tokens)


def table(title: str, contiguous: tuple[float, float], paged: tuple[float, float],
          unit: str, bytes_unit: str) -> str:
    """Reserved / holding tokens / wasted rows for both layouts, in slots and bytes."""
    scale = KV_BYTES_PER_TOKEN / {"GiB": 2**30, "MiB": 2**20}[bytes_unit]
    (c_res, c_tok), (p_res, p_tok) = contiguous, paged
    rows = [title, f"  {'':26s}{'contiguous':>16s}{'paged':>16s}{'contig/paged':>14s}"]
    for name, c, p in [("reserved", c_res, p_res), ("holding tokens", c_tok, p_tok),
                       ("wasted", c_res - c_tok, p_res - p_tok)]:
        rows.append(f"  {f'{name} ({unit})':26s}{c:>16,.0f}{p:>16,.0f}{c / p:>13,.1f}x")
        rows.append(f"  {f'{name} ({bytes_unit})':26s}{c * scale:>16,.2f}{p * scale:>16,.2f}")
    c_frac, p_frac = 1 - c_tok / c_res, 1 - p_tok / p_res
    rows.append(f"  {'waste fraction':26s}{c_frac:>16.2%}{p_frac:>16.3%}"
                f"{c_frac / p_frac:>13,.0f}x")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--prompt-min", type=int, default=100)
    parser.add_argument("--prompt-max", type=int, default=1000)
    parser.add_argument("--output-mean", type=float, default=1500.0)
    parser.add_argument("--output-std", type=float, default=600.0)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    start = time.perf_counter()
    prompt_lens, output_lens = make_trace(args.num_requests, args.prompt_min, args.prompt_max,
                                          args.output_mean, args.output_std,
                                          args.max_model_len, args.seed)
    paged = run_paged(prompt_lens, output_lens, args.page_size, args.max_model_len)
    final_lens = prompt_lens + output_lens
    print(f"trace: {args.num_requests} requests, seed {args.seed}; prompt uniform "
          f"[{args.prompt_min}, {args.prompt_max}] (mean {prompt_lens.mean():.0f}); output "
          f"normal({args.output_mean:g}, {args.output_std:g}) clipped (mean "
          f"{output_lens.mean():.0f}, min {output_lens.min()}, max {output_lens.max()})")
    print(f"max_model_len {args.max_model_len}, page size {args.page_size}, KV "
          f"{KV_BYTES_PER_TOKEN} bytes/token (SmolLM2 fp32), {paged['num_pages']:,} pages "
          f"allocated by KVCacheManager")
    print()
    print(table(f"At completion (all {args.num_requests} requests resident at their final "
                "length):", (args.num_requests * args.max_model_len, int(final_lens.sum())),
                (paged["final_slots"], paged["final_tokens"]), "slots", "GiB"))
    print(f"  (KVCacheManager.stats().internal_fragmentation = {paged['fragmentation']:.3%})")
    print()
    # NOTE: per request-step means, i.e. the KV an average running request occupies.
    num_steps = int(np.sum(output_lens + 1))
    c_res, c_tok = contiguous_lifetime(prompt_lens, output_lens, args.max_model_len)
    print(table("Over each request's lifetime (mean per running request per step, prefill "
                "and every decode step):", (c_res / num_steps, c_tok / num_steps),
                (paged["lifetime_slots"] / num_steps, paged["lifetime_tokens"] / num_steps),
                "slots", "MiB"))
    print(f"\n({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
