"""Accounts for the host memory (RSS) of the engine `jaxserve serve` builds, phase by phase.

Builds that engine (default settings, the embedded SmolLM2 GGUF unless --model says
otherwise; `--quantization gguf` for the blocks served in place) one phase at a time, as
`jaxserve serve` does (`serving_model`: load and pack the weights; the tokenizer; the
engine and its KV pool; warm-up; one batch), and prints after each phase the resident
memory (VmRSS) split into anonymous and file-backed pages, the GGUF file's own mapped
pages, the bytes of live JAX arrays (the device buffers: weights, KV pool), and the peak
(VmHWM). With --per-bucket, warm-up runs bucket by bucket (one compile thread) so each
bucket's programs show as their own growth; the compiled programs' temporaries
(`memory_analysis`) of the smallest and largest bucket follow the table. With
--per-program, warm-up runs one kind of program at a time over every bucket (the model
steps, prompt logprobs, each sampler variant), the C heap trimmed before each reading.

Usage:
    python -m scripts.benchmarks.rss_accounting [--model PATH] [--quantization gguf] [--no-warmup]
        [--per-bucket | --per-program] [--prompts N]
"""

from __future__ import annotations

import argparse
import gc
import os
import time

from scripts.benchmarks.rss_vs_llama import memory_mb


class Ledger:
    """Rows of (phase, seconds, memory) as phases end."""

    def __init__(self, model_path: str | None = None):
        self.model_path = model_path or "-"
        self.rows: list[tuple[str, float, dict, float]] = []
        self._last = memory_mb(os.getpid(), self.model_path)["VmRSS"]
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        gc.collect()
        m = memory_mb(os.getpid(), self.model_path)
        m["load"] = os.getloadavg()[0]
        t = time.perf_counter()
        live = _live_mb()
        self.rows.append((phase, t - self._t, m, live))
        print(f"[rss] {phase}: {m['VmRSS']:.0f} MB (+{m['VmRSS'] - self._last:.0f}), "
              f"live arrays {live:.0f} MB, peak {m['VmHWM']:.0f}", flush=True)
        self._last, self._t = m["VmRSS"], t

    def table(self) -> str:
        lines = ["| phase | s | load avg | RSS MB | added MB | anon MB | file MB | GGUF mapped "
                 "MB | live JAX arrays MB | peak MB |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        last = None
        for phase, s, m, live in self.rows:
            added = m["VmRSS"] - (last if last is not None else m["VmRSS"])
            lines.append(f"| {phase} | {s:.1f} | {m.get('load', 0):.2f} | {m['VmRSS']:.0f} | "
                         f"{added:+.0f} | {m['RssAnon']:.0f} | {m['RssFile']:.0f} | "
                         f"{m['model_map']:.0f} | {live:.0f} | {m['VmHWM']:.0f} |")
            last = m["VmRSS"]
        return "\n".join(lines)


def _live_mb() -> float:
    import sys

    if "jax" not in sys.modules:
        return 0.0
    import jax

    return sum(x.nbytes for x in jax.live_arrays()) / 1e6


def program_sizes(runner, dummy, num_tokens: int) -> list[str]:
    """Table rows of the compiled programs of one bucket: temporaries and arguments (MB;
    XLA:CPU reports no code size)."""
    from jaxserve.runner.warmup import lower_bucket

    lowered = lower_bucket(runner, num_tokens, dummy)
    labels = (["model step", "decode step"][:len(lowered) - 4]
              + ["prompt logprobs", "sampler greedy", "sampler sample", "sampler full"])
    rows = []
    for label, program in zip(labels, lowered, strict=True):
        a = program.compile().memory_analysis()
        rows.append(f"| {num_tokens} | {label} | {a.temp_size_in_bytes / 1e6:.1f} | "
                    f"{a.argument_size_in_bytes / 1e6:.1f} |")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="weights (default: embedded SmolLM2)")
    parser.add_argument("--quantization", default=None, help="as `jaxserve serve`'s flag")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up phase")
    parser.add_argument("--per-program", action="store_true",
                        help="warm up one kind of program at a time, a row each")
    parser.add_argument("--per-bucket", action="store_true",
                        help="warm up bucket by bucket, one compile thread, a row each")
    parser.add_argument("--prompts", type=int, default=16, help="requests in the batch")
    args = parser.parse_args(argv)

    ledger = Ledger()
    ledger.mark("python interpreter")
    import jax

    import jaxserve.entrypoints.openai.api_server  # noqa: F401 - what `serve` imports
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.runner.sampler_variants import VARIANTS
    from jaxserve.runner.serving import release_loader_memory, serving_model
    from jaxserve.utils import trim_memory
    from models.default_model import default_model_path
    from models.loaders import load_tokenizer

    ledger.model_path = args.model or default_model_path()
    ledger.mark("imports (jax, jaxserve, transformers, the server)")
    jax.devices()
    ledger.mark("JAX CPU backend")
    config = EngineConfig.from_kwargs(model=args.model, quantization=args.quantization)
    model, _ = serving_model(config, None)
    jax.block_until_ready(model.params)
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params)) / 1e6
    ledger.mark(f"weights loaded and packed ({weights:.0f} MB of arrays, "
                f"{model.quant.name or 'float32'})")
    tokenizer = load_tokenizer(args.model)
    ledger.mark("tokenizer")
    release_loader_memory(ledger.model_path)
    ledger.mark("loader memory released (GGUF reader, C heap)")
    llm = LLM(model, tokenizer=tokenizer, quantization=args.quantization, warmup=False)
    del model
    engine, runner = llm.engine, llm.engine.runner
    jax.block_until_ready(runner.kv_pages)
    ledger.mark(f"engine (KV pool {runner.kv_pages.nbytes / 1e6:.0f} MB, "
                f"{runner.kv_pages.dtype})")
    dummy = _dummy_sampling(engine)
    if args.per_bucket:
        from jaxserve.runner import warmup as w

        for num_tokens in runner.buckets:
            w.run_bucket(runner, num_tokens, dummy)
            ledger.mark(f"warm-up: bucket {num_tokens}")
        runner.execute_plans(w.plan_warmup(0))
        ledger.mark("warm-up: KV plan programs")
    elif args.per_program:
        outputs = {}  # bucket -> (logits, hidden) of its model step
        for kind in ("model", "prompt logprobs", *VARIANTS):
            warm_up_kind(runner, dummy, kind, outputs)
            trim_memory()
            ledger.mark(f"warm-up: {kind} programs, every bucket")
    elif not args.no_warmup:
        engine.warmup()
        ledger.mark(f"warm-up ({len(runner.buckets)} buckets {list(runner.buckets)})")
    prompts = [f"Request {i}: write a short story about the number {i}."
               for i in range(args.prompts)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    ledger.mark(f"serving {args.prompts} requests")
    print(ledger.table())
    if args.per_bucket:
        print("\n| bucket | program | temporaries MB | arguments MB |")
        print("|---:|---|---:|---:|")
        for num_tokens in (runner.buckets[0], runner.buckets[-1]):
            print("\n".join(program_sizes(runner, dummy, num_tokens)), flush=True)


def warm_up_kind(runner, dummy, kind: str, outputs: dict) -> None:
    """Compiles and runs one kind of warm-up program for every bucket: "model" (the model
    step and the decode step), "prompt logprobs", or a sampler variant (the model's
    outputs of the "model" pass are kept in `outputs` for the later kinds)."""
    import jax
    import numpy as np

    from jaxserve.runner.warmup import dummy_steps

    for n in runner.buckets:
        (out, decode_only), *decodes = dummy_steps(runner, n)
        if kind == "model":
            logits, hidden = runner.run_model_step(runner.prepare_model_step(out, decode_only))
            outputs[n] = (logits, hidden)
            for step, _ in decodes:
                runner.execute(step, dummy(runner.sample_rows(n)), "greedy")
        elif kind == "prompt logprobs":
            jax.block_until_ready(runner.programs.prompt_logprobs()(
                runner.params, outputs[n][1], runner.to_device(np.zeros(n, np.int32))))
        else:
            buf, layout = runner.sampling_inputs(dummy(runner.sample_rows(n)), kind)
            jax.block_until_ready(runner.programs.sampler(layout)(outputs[n][0],
                                                                  runner.to_device(buf)))


def _dummy_sampling(engine):
    """`num_rows -> SamplingMetadata` of greedy padding rows (as `LLMEngine.warmup`)."""
    from jaxserve.sample.metadata import RowSpec, build_sampling_metadata
    from jaxserve.sampling_params import SamplingParams

    def dummy(num_rows):
        return build_sampling_metadata([RowSpec(SamplingParams(temperature=0.0), (), (), 0,
                                                0)], num_rows, engine.model.cfg.vocab_size)
    return dummy


if __name__ == "__main__":
    main()
