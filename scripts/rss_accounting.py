"""Accounts for the host memory (RSS) of a default engine, phase by phase.

Builds the engine `jaxserve serve` builds (default settings, the embedded SmolLM2 GGUF
unless --model says otherwise) one phase at a time and prints, after each phase, the
process's resident memory now (VmRSS) and its peak so far (VmHWM), with the growth each
phase added. The phases: Python + imports, JAX's CPU backend, reading and dequantizing
the weights, the tokenizer, the engine (KV pool, scheduler), warm-up (compiled
programs), and serving one batch.

Usage:
    python scripts/rss_accounting.py [--model PATH] [--no-warmup] [--prompts N]
"""

from __future__ import annotations

import argparse
import gc
import time


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Ledger:
    """Rows of (phase, seconds, RSS now, growth, peak) as phases end."""

    def __init__(self):
        self.rows: list[tuple[str, float, float, float, float]] = []
        self._last = _status_mib("VmRSS")
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        gc.collect()
        now, peak = _status_mib("VmRSS"), _status_mib("VmHWM")
        t = time.perf_counter()
        self.rows.append((phase, t - self._t, now, now - self._last, peak))
        self._last, self._t = now, t
        print(f"[rss] {phase}: {now:.0f} MiB (+{self.rows[-1][3]:.0f}), peak {peak:.0f}",
              flush=True)

    def table(self) -> str:
        lines = ["| phase | s | RSS MiB | added MiB | peak MiB |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {p} | {s:.1f} | {r:.0f} | {d:+.0f} | {k:.0f} |"
                  for p, s, r, d, k in self.rows]
        return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="weights (default: embedded SmolLM2)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up phase")
    parser.add_argument("--prompts", type=int, default=16, help="requests in the batch")
    args = parser.parse_args(argv)

    ledger = Ledger()
    ledger.mark("python interpreter")
    import jax  # noqa: F401

    import jaxserve  # noqa: F401
    from jaxserve import LLM, SamplingParams
    from models.default_model import default_model_path
    from models.loaders import load_model, load_tokenizer

    ledger.mark("imports (jax, jaxserve, transformers)")
    jax.devices()
    ledger.mark("JAX CPU backend")
    path = args.model or default_model_path()
    model = load_model(path, "float32")
    jax.block_until_ready(model.params)
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params)) / 2**20
    ledger.mark(f"weights ({weights:.0f} MiB of float32 arrays)")
    tokenizer = load_tokenizer(path)
    ledger.mark("tokenizer")
    llm = LLM(model, tokenizer=tokenizer, warmup=False)
    kv = llm.engine.runner.kv_pages
    jax.block_until_ready(kv)
    ledger.mark(f"engine (KV pool {kv.nbytes / 2**20:.0f} MiB)")
    if not args.no_warmup:
        llm.engine.warmup()
        ledger.mark(f"warm-up ({len(llm.engine.runner.buckets)} buckets)")
    prompts = [f"Request {i}: write a short story about the number {i}."
               for i in range(args.prompts)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    ledger.mark(f"serving {args.prompts} requests")
    print(ledger.table())


if __name__ == "__main__":
    main()
