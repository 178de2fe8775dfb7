"""`jaxserve bench roofline|scale|overhead`: sweeps over batch size, concurrency, context and
running requests, printed as tables."""

from __future__ import annotations

import numpy as np

from jaxserve.bench.report import dump_json, table
from jaxserve.entrypoints.cli.bench_common import (
    add_engine_group,
    bench_engine_args,
    load_model_and_tokenizer,
    plot,
)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def cmd_roofline(args) -> int:
    from jaxserve.bench.engine_run import make_llm
    from jaxserve.bench.roofline import measure_peaks, roofline_rows

    batches = _ints(args.batch_sizes)
    model, tok, _ = load_model_and_tokenizer(args)
    eargs = bench_engine_args(args)
    eargs["max_num_seqs"] = max(eargs["max_num_seqs"], max(batches))
    eargs["max_num_batched_tokens"] = max(eargs["max_num_batched_tokens"], max(batches))
    peaks = measure_peaks(np.dtype(model.dtype).name)  # the loaded weights' ("auto" resolved)
    print(f"device {peaks['device']}, jax {peaks['jax']}: peak matmul "
          f"{peaks['flops'] / 1e9:.1f} GFLOP/s, memory {peaks['bytes_per_s'] / 1e9:.1f} GB/s "
          f"(measured now, {np.dtype(model.dtype).name})")
    llm = make_llm(model, tok, **eargs)
    rows = roofline_rows(llm.engine, batches, args.context_len, peaks, args.num_steps)
    print(table(rows, [
        ("batch", "batch", "d"), ("context", "context", "d"), ("step_ms", "step ms", ".1f"),
        ("execute_ms", "runner ms", ".1f"), ("tok_per_s", "decode tok/s", ".1f"),
        ("gflop_per_step", "GFLOP/step", ".2f"), ("mb_per_step", "MB/step", ".0f"),
        ("intensity", "FLOP/byte", ".1f"), ("mfu", "MFU", ".1%"), ("bw_util", "BW util", ".1%"),
        ("roofline_ms", "roofline ms", ".1f"), ("bound", "roofline bound", "s")]))
    dump_json(args.output_json, {"engine_args": eargs, "peaks": peaks, "rows": rows})
    return 0


def cmd_scale(args) -> int:
    from jaxserve.bench import plots
    from jaxserve.bench.scale import concurrency_sweep, context_sweep, warmup_times

    eargs = bench_engine_args(args)
    out = {"engine_args": eargs}
    if args.warmup_only or not args.skip_warmup:
        w = warmup_times(eargs, args.model)
        out["warmup"] = w
        print(table([{"run": k, **v} for k, v in w.items()], [
            ("run", "compilation cache", "s"), ("num_buckets", "buckets", "d"),
            ("warmup_s", "warm-up s", ".1f"), ("engine_s", "load + warm-up s", ".1f")]))
        print(f"warm / cold warm-up: {w['warm']['warmup_s'] / w['cold']['warmup_s']:.2f}x")
    if not args.warmup_only:
        model, tok, _ = load_model_and_tokenizer(args)
        conc = concurrency_sweep(model, tok, _ints(args.concurrency), eargs,
                                 prompt_len=args.input_len, output_len=args.output_len)
        out["concurrency"] = conc
        print(table(conc, [
            ("concurrency", "concurrent requests", "d"),
            ("output_throughput", "output tok/s", ".1f"),
            ("total_token_throughput", "total tok/s", ".1f"),
            ("mean_ttft_ms", "mean TTFT ms", ".0f"), ("mean_tpot_ms", "mean TPOT ms", ".0f"),
            ("peak_rss_mib", "peak RSS MiB", ".0f"), ("kv_pool_mib", "KV pool MiB", ".0f"),
            ("warmup_s", "engine start s", ".1f")]))
        ctx = context_sweep(model, tok, _ints(args.contexts), eargs,
                            batch=args.context_batch, output_len=args.output_len)
        out["context"] = ctx
        print(table(ctx, [
            ("context", "context", "d"), ("batch", "batch", "d"),
            ("output_throughput", "output tok/s", ".1f"), ("mean_ttft_ms", "mean TTFT ms", ".0f"),
            ("decode_step_ms", "decode step ms", ".0f"), ("peak_rss_mib", "peak RSS MiB", ".0f")]))
        plot(args, lambda d: [plots.plot_scale(conc, "concurrency", d, "scale_concurrency"),
                               plots.plot_scale(ctx, "context", d, "scale_context")])
    dump_json(args.output_json, out)
    return 0


def cmd_overhead(args) -> int:
    from jaxserve.bench.engine_run import make_llm
    from jaxserve.bench.overhead import (
        component_overhead,
        engine_overhead,
        gpu_step_ms,
        tiny_model,
    )

    levels = _ints(args.num_running)
    if args.context_len < 1:
        raise SystemExit(f"--context-len must be at least 1, got {args.context_len}")
    if not args.skip_pipeline and args.pipeline_device != "measured":
        from jaxserve.bench.simulator import PRESETS

        if args.sim_preset not in PRESETS:
            raise SystemExit(f"--sim-preset: unknown {args.sim_preset!r}; choose from "
                             f"{sorted(PRESETS)}")
    comp = [component_overhead(n, prompt_len=args.context_len) for n in levels]
    for r in comp:
        r["gpu_step_ms"] = gpu_step_ms(r["num_running"])
        r["share_of_gpu_step"] = r["total"] / (r["total"] + r["gpu_step_ms"])
    print(f"Host components, no model (median ms per decode step; prompts of "
          f"{args.context_len} tokens):")
    print(table(comp, [
        ("num_running", "running", "d"), ("schedule", "schedule", ".3f"),
        ("update", "update_from_output", ".3f"), ("step_arrays", "build_step_arrays", ".3f"),
        ("pack_inputs", "pack", ".3f"), ("sampling_metadata", "sampling arrays", ".3f"),
        ("pack_sampling", "pack sampling", ".3f"), ("total", "total", ".3f"),
        ("gpu_step_ms", "gpu-8b step ms", ".1f"), ("share_of_gpu_step", "share", ".1%")]))
    out = {"components": comp}
    if not args.skip_engine:
        from models.default_model import default_model_path
        from models.loaders import load_tokenizer

        tok = load_tokenizer(args.model or default_model_path())
        top = max(levels)
        budget = max(2 * top, 256)  # room to admit prompts beside `top` decodes
        # NOTE: max_model_len >= the budget: the runner's warm-up puts a whole bucket in
        # one dummy request, whose block table must fit max_model_len.
        llm = make_llm(tiny_model(), tok, max_model_len=budget, max_num_seqs=top,
                       max_num_batched_tokens=budget, num_kv_blocks=top * 8 + 64)
        eng = [engine_overhead(llm, n, output_kind=kind)
               for kind in ("CUMULATIVE", "FINAL_ONLY") for n in levels]
        for r in eng:
            r["gpu_step_ms"] = gpu_step_ms(r["num_running"])
            r["share_of_gpu_step"] = r["host"] / (r["host"] + r["gpu_step_ms"])
        print("\nWhole engine step over a tiny random model (median ms per decode step):")
        print(table(eng, [
            ("output_kind", "outputs", "s"), ("num_running", "running", "d"),
            ("scheduling", "scheduling", ".2f"), ("input_preparation", "input prep", ".2f"),
            ("output_processing", "rows + outputs + detok", ".2f"),
            ("host", "host total", ".2f"), ("device", "device (tiny)", ".2f"),
            ("step", "step", ".2f"), ("host_share", "host share", ".1%"),
            ("gpu_step_ms", "gpu-8b step ms", ".1f"), ("share_of_gpu_step", "share", ".1%")]))
        out["engine"] = eng
    if not args.skip_pipeline:
        out["pipeline"] = _pipeline_table(args, levels)
    dump_json(args.output_json, out)
    return 0


def _pipeline_table(args, levels: list[int]) -> list[dict]:
    """Device idle between steps, sync vs async, interleaved: on a simulated accelerator
    and/or on this machine's own device, timed."""
    import os

    import jax

    from jaxserve.bench.engine_run import make_llm
    from jaxserve.bench.overhead import tiny_model
    from jaxserve.bench.pipeline import cost_model_seconds, pipeline_run
    from models.default_model import default_model_path
    from models.loaders import load_tokenizer

    tok = load_tokenizer(args.model or default_model_path())
    top = max(levels)
    budget = max(2 * top, 256)
    devices = []
    if args.pipeline_device in ("simulated", "both"):
        # NOTE: a 2048-token vocabulary (ids valid for the tokenizer) keeps the real CPU
        # step negligible beside the simulated device's.
        devices.append((f"{args.sim_preset} (simulated)", tiny_model(vocab_size=2048),
                        cost_model_seconds(args.sim_preset)))
    if args.pipeline_device in ("measured", "both"):
        # NOTE: the real vocabulary: its LM head and sampler make a step that costs
        # something on this device (the rest of the model is one small layer).
        devices.append((f"{jax.default_backend()} (measured)", tiny_model(), None))
    rows = []
    for name, model, cost in devices:
        llm = make_llm(model, tok, max_model_len=budget, max_num_seqs=top,
                       max_num_batched_tokens=budget, num_kv_blocks=top * 8 + 64)
        for n in levels:
            for overlap in (False, True, False, True):
                row = pipeline_run(llm, n, cost, overlap=overlap)
                row.update(load=os.getloadavg()[0], device=name,
                           scheduling="async" if overlap else "sync")
                rows.append(row)
    print("\nDevice idle between decode steps (ms per step; host critical path = idle):")
    print(table(rows, [
        ("device", "device", "s"), ("num_running", "running", "d"),
        ("scheduling", "scheduling", "s"), ("device_ms", "device ms", ".2f"),
        ("idle_ms", "idle (host critical path)", ".2f"), ("step_ms", "step", ".2f"),
        ("idle_share", "idle share", ".1%"), ("load", "load avg", ".2f")]))
    return rows


def cmd_quant(args) -> int:
    from jaxserve.bench.quant import MODES, run_quant_bench

    names = [m[0] for m in MODES]
    wanted = [x.strip() for x in args.modes.split(",")] if args.modes else names
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; choose from {names}")
    # NOTE: in --modes order (a mode may repeat, for interleaved A, B, A runs)
    modes = [next(m for m in MODES if m[0] == w) for w in wanted]
    batches = _ints(args.batch_sizes)
    rows = run_quant_bench(args.model, modes, greedy_prompts=args.greedy_prompts,
                           greedy_tokens=args.greedy_tokens, batches=batches,
                           context=args.context_len, speed_only=args.speed_only)
    if args.speed_only:
        print(table(rows, [("mode", "mode", "s"), ("weight_mib", "weights MiB", ".1f"),
                           ("kv_bytes_per_token", "KV B/token", ".0f"),
                           ("kv_capacity_tokens", "KV tokens/GiB", "d"),
                           *[(f"tok_s_b{b}", f"tok/s b{b}", ".2f") for b in batches],
                           ("load_avg", "load", ".1f")]))
        dump_json(args.output_json, {"rows": rows})
        return 0
    print(f"perplexity of transformers float32 on the text: {rows[0]['ref_ppl']:.3f}")
    print(table(rows, [
        ("mode", "mode", "s"), ("max_abs_logit", "max |dlogit|", ".3f"), ("kl", "KL", ".2e"),
        ("ppl", "ppl", ".3f"), ("ppl_ratio", "ppl / f32 HF", ".4f"),
        ("greedy_prefix", "greedy agree", ".3f"), ("greedy_identical", "identical", ".2f"),
        ("weight_mib", "weights MiB", ".1f"), ("kv_bytes_per_token", "KV B/token", ".0f"),
        ("kv_capacity_tokens", "KV tokens/GiB", "d"),
        *[(f"tok_s_b{b}", f"tok/s b{b}", ".1f") for b in batches],
        ("load_avg", "load", ".1f")]))
    dump_json(args.output_json, {"rows": rows})
    return 0


def cmd_structured(args) -> int:
    from jaxserve.bench.engine_run import make_llm
    from jaxserve.bench.structured import constrained_throughput, mask_times
    from models.default_model import default_model_path
    from models.loaders import load_model, load_tokenizer

    path = args.model or default_model_path()
    model, tok = load_model(path), load_tokenizer(path)
    masks = mask_times(tok, model.cfg.vocab_size, _ints(args.rows), args.steps)
    print("\nHost time to build a step's token bitmasks (JSON schema, random valid paths):")
    print(table(masks, [("rows", "constrained rows", "d"), ("batched_ms", "engine ms/step", ".2f"),
                        ("us_per_row", "us/row", ".1f"),
                        ("single_ms", "one row at a time ms/step", ".2f"),
                        ("load", "load", ".1f")]))
    llm = make_llm(model, tok, max_num_seqs=args.batch, max_num_batched_tokens=256,
                   max_model_len=512)
    rows = constrained_throughput(llm, args.batch, args.max_tokens, args.repeats)
    print(f"\nThroughput of {args.batch} greedy requests, none vs all constrained "
          "(interleaved):")
    print(table(rows, [("repeat", "rep", "d"), ("batch", "batch", "s"), ("tokens", "tokens", "d"),
                       ("wall_s", "wall s", ".1f"), ("tok_s", "tok/s", ".1f"),
                       ("ms_per_step", "ms/step", ".1f"), ("compiles", "compiles", "d"),
                       ("load", "load", ".1f")]))
    dump_json(args.output_json, {"masks": masks, "throughput": rows})
    return 0


def add_parsers(bsub) -> None:
    """Adds `bench roofline`, `bench scale`, `bench overhead`, `bench quant` and
    `bench structured`."""
    so = bsub.add_parser("structured", help="structured outputs: mask-building time per step "
                                             "and throughput constrained vs free")
    so.add_argument("--model", default=None, help="GGUF file or HF directory (default: the "
                                                    "embedded SmolLM2-135M-Instruct)")
    so.add_argument("--rows", default="1,32,256",
                    help="comma list of constrained rows per step (default: 1,32,256)")
    so.add_argument("--steps", type=int, default=32, help="timed steps per row count (32)")
    so.add_argument("--batch", type=int, default=32, help="requests per batch (default: 32)")
    so.add_argument("--max-tokens", type=int, default=96, help="tokens per request (96)")
    so.add_argument("--repeats", type=int, default=2, help="interleaved repeats (default: 2)")
    so.add_argument("--output-json", default=None, help="also write the rows as JSON")
    so.set_defaults(handler=cmd_structured)
    qb = bsub.add_parser("quant", help="accuracy, memory and speed of weight / KV formats")
    qb.add_argument("--model", default=None, help="GGUF file or HF directory (default: the "
                                                    "embedded SmolLM2-135M-Instruct)")
    qb.add_argument("--modes", default="", help="comma list of modes (default: all)")
    qb.add_argument("--greedy-prompts", type=int, default=16, help="prompts (default: 16)")
    qb.add_argument("--greedy-tokens", type=int, default=256,
                    help="greedy tokens per prompt (default: 256)")
    qb.add_argument("--batch-sizes", default="1,32", help="decode batches (default: 1,32)")
    qb.add_argument("--context-len", type=int, default=128, help="decode context (128)")
    qb.add_argument("--speed-only", action="store_true",
                    help="only bytes, KV capacity and decode speed (no accuracy passes, no "
                         "warm-up): for modes too slow on this CPU for the full table")
    qb.add_argument("--output-json", default=None, help="also write the rows as JSON")
    qb.set_defaults(handler=cmd_quant)
    roof = bsub.add_parser("roofline", help="decode-step MFU and bandwidth use per batch size")
    add_engine_group(roof)
    roof.add_argument("--batch-sizes", default="1,8,32",
                      help="comma list of decode batch sizes (default: 1,8,32)")
    roof.add_argument("--context-len", type=int, default=128,
                      help="context of every request (default: 128)")
    roof.add_argument("--num-steps", type=int, default=5,
                      help="timed decode steps per batch size (default: 5)")
    roof.set_defaults(handler=cmd_roofline)

    sc = bsub.add_parser("scale", help="throughput and memory vs concurrency and context; "
                                       "warm-up time cold and with the compilation cache")
    add_engine_group(sc)
    sc.add_argument("--concurrency", default="1,8,32,128",
                    help="comma list of concurrent requests (default: 1,8,32,128)")
    sc.add_argument("--contexts", default="128,512,1024,2048",
                    help="comma list of context lengths (default: 128,512,1024,2048)")
    sc.add_argument("--context-batch", type=int, default=4,
                    help="requests per context run (default: 4)")
    sc.add_argument("--input-len", type=int, default=32,
                    help="prompt tokens in the concurrency sweep (default: 32)")
    sc.add_argument("--output-len", type=int, default=16,
                    help="output tokens per request (default: 16)")
    sc.add_argument("--skip-warmup", action="store_true", help="skip the warm-up probes")
    sc.add_argument("--warmup-only", action="store_true", help="only the warm-up probes")
    sc.add_argument("--plot-dir", default=None, help="write PNG plots here (needs matplotlib)")
    sc.set_defaults(handler=cmd_scale)

    ov = bsub.add_parser("overhead", help="host time per step at many running requests")
    ov.add_argument("--num-running", default="16,256,1024",
                    help="comma list of running requests (default: 16,256,1024)")
    ov.add_argument("--context-len", type=int, default=64,
                    help="prompt tokens of each request in the model-free component "
                         "timings (block tables grow with it; default: 64)")
    ov.add_argument("--skip-engine", action="store_true",
                    help="only the model-free component timings")
    ov.add_argument("--skip-pipeline", action="store_true",
                    help="skip the device-idle comparison of sync and async scheduling")
    ov.add_argument("--sim-preset", default="gpu-8b",
                    help="simulated device of the idle comparison (default: gpu-8b)")
    ov.add_argument("--pipeline-device", choices=("simulated", "measured", "both"),
                    default="both",
                    help="the idle comparison's device: the simulated accelerator, this "
                         "machine's own device with each step's end timed, or both "
                         "(default)")
    ov.add_argument("--model", default=None,
                    help="where the tokenizer comes from (default: the embedded model)")
    ov.add_argument("--output-json", default=None, help="write the full results here as JSON")
    ov.set_defaults(handler=cmd_overhead)

