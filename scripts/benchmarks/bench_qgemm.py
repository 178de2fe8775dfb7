"""Benchmark: the CPU quantized matmul kernel (`pallas_kernels/cpu_ffi/stacked_qgemm.cc`),
which reads q8/q4 codes in place, against the float32 panels (`stacked_gemm.cc`).

`layers`: the default model's layer loop (30 layers x 7 matmuls, the matmuls alone) over
its float32 weights (panels), the same weights quantized Q4_1-style (q4) and as Q8_0 (q8),
in place; and the XLA quantized path (`quant_matmul_xla` inside a scan) for reference:

    python -m scripts.benchmarks.bench_qgemm layers --batch-sizes 1,8,32

`--compare-source` times another version of the kernel's source beside this one on the
same q4 panels, as form `other` (e.g. the version of a commit before a change):

    git show 8b34823:pallas_kernels/cpu_ffi/stacked_qgemm.cc > /tmp/before.cc
    python -m scripts.benchmarks.bench_qgemm layers --compare-source /tmp/before.cc --forms q4,other

`head`: the default model's tied LM head [576, 49152] (its Q8_0 blocks) as float32 panels,
through the kernel, and through XLA's quantized matmul:

    python -m scripts.benchmarks.bench_qgemm head --batch-sizes 1,32

`memory`: the resident set of a process that loads the default model (float32, or with
its blocks kept) and builds an `LLM` over it with a fixed small page pool, after each
step, one fresh process per form:

    python -m scripts.benchmarks.bench_qgemm memory

`decode`: decode tok/s of the embedded SmolLM2 GGUF served with its Q4_1 blocks in place
(`--quantization gguf`, the `cpu` backend) against float32 (the CPU default), at batch
sizes 1 and 32, interleaved A, B, A, B, the load average beside each figure:

    python -m scripts.benchmarks.bench_qgemm decode --batch-sizes 1,32 --rounds 2

`--forms` picks the engines: `q4_kv_f32` and `q4_kv_bf16` serve the blocks with float32 or
bfloat16 KV pages instead of their default float16:

    python -m scripts.benchmarks.bench_qgemm decode --forms q4_kv_f32,q4_in_place,q4_kv_bf16
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.quant import QuantFormat, quantize_stack
from pallas_kernels.cpu_ffi import gemm, qgemm
from pallas_kernels.quant_matmul.reference import dequantize
from pallas_kernels.quant_matmul.xla import quant_matmul_xla
from scripts.benchmarks.bench_stacked_gemm import layer_weights, time_forms


def _loop(mm):
    """The layer loop of `bench_stacked_gemm.ffi_loop_of` with matmul `mm(x, name, i)`."""
    def run(w, x):
        def body(i, x):
            q, k, v = mm(w, x, "q", i), mm(w, x, "k", i), mm(w, x, "v", i)
            x = x + mm(w, q + jnp.pad(k + v, ((0, 0), (0, q.shape[1] - k.shape[1]))), "o", i)
            return x + mm(w, jax.nn.silu(mm(w, x, "g", i)) * mm(w, x, "u", i), "d", i)
        return jax.lax.fori_loop(0, w["_layers"].shape[0], body, x)
    return jax.jit(run)


def _cols(w, name):
    return w["_cols"][name].shape[0]


float_loop = _loop(lambda w, x, n, i: gemm.stacked_gemm(x, w[n], i, _cols(w, n)))
q4_loop = _loop(lambda w, x, n, i: qgemm.stacked_qgemm(x, w[n], "q4", i, _cols(w, n)))
q8_loop = _loop(lambda w, x, n, i: qgemm.stacked_qgemm(x, w[n], "q8", i, _cols(w, n)))
OTHER_TARGET = "jaxserve_bench_qgemm_other_q4"


def _other_q4(x, panels, layer, n):
    """`qgemm.stacked_qgemm` (q4) through the FFI target of `--compare-source`."""
    out = jax.ShapeDtypeStruct((x.shape[0], panels["qweight"].shape[1] * 16), jnp.float32)
    y = jax.ffi.ffi_call(OTHER_TARGET, out)(
        x, *(panels[m] for m in qgemm.LEAVES["q4"]), jnp.asarray(layer, jnp.int32))
    return y[:, :n]


other_q4_loop = _loop(lambda w, x, n, i: _other_q4(x, w[n], i, _cols(w, n)))
xla_q4_loop = _loop(lambda w, x, n, i: quant_matmul_xla(
    x, jax.tree_util.tree_map(lambda a: a[i], w[n]), "q4"))


def layers(args) -> None:
    """The matmul micro-benchmark (module docstring)."""
    if not (gemm.available() and qgemm.available()):
        raise SystemExit("the CPU matmul kernels are unavailable here")
    stacked, _ = layer_weights()
    stacked = {k: np.asarray(w) for k, w in stacked.items()}
    meta = {"_layers": jnp.zeros((stacked["q"].shape[0],)),
            "_cols": {k: jnp.zeros((w.shape[2],)) for k, w in stacked.items()}}
    q4 = {k: quantize_stack(QuantFormat("q4", 32), w) for k, w in stacked.items()}
    q8 = {k: quantize_stack(QuantFormat("q8", 32), w) for k, w in stacked.items()}
    forms = {
        "f32": (float_loop, {**meta, **{k: gemm.pack(w) for k, w in stacked.items()}}),
        "q4": (q4_loop, {**meta, **{k: qgemm.pack(w, "q4") for k, w in q4.items()}}),
        "q8": (q8_loop, {**meta, **{k: qgemm.pack(w, "q8") for k, w in q8.items()}}),
        "xla_q4": (xla_q4_loop, {**meta, **jax.tree_util.tree_map(jnp.asarray, q4)}),
    }
    if args.compare_source:
        from pallas_kernels.cpu_ffi.build import register

        error = register(os.path.abspath(args.compare_source), "StackedQ4Gemm", OTHER_TARGET,
                         f"the kernel of {args.compare_source}", "no 'other' form")
        if error:
            raise SystemExit(error)
        forms["other"] = (other_q4_loop, forms["q4"][1])
    forms = {n: forms[n] for n in args.forms.split(",")}
    hidden = stacked["q"].shape[1]
    x = jnp.linspace(-0.05, 0.05, 3 * hidden, dtype=jnp.float32).reshape(3, hidden)
    if "q4" in forms and "xla_q4" in forms:  # the same blocks two ways
        np.testing.assert_allclose(np.asarray(q4_loop(forms["q4"][1], x)),
                                   np.asarray(xla_q4_loop(forms["xla_q4"][1], x)),
                                   rtol=1e-3, atol=1e-3)
    time_forms(forms, hidden, [int(s) for s in args.batch_sizes.split(",")], args.rounds,
               args.iters)


def head(args) -> None:
    """The LM head micro-benchmark (module docstring)."""
    from jaxserve.bench.roofline import median_seconds
    from models.default_model import default_model_path
    from models.loaders import load_model

    model = load_model(default_model_path(), quantization="gguf")
    leaves = {k: np.asarray(v) for k, v in model.params["embed_tokens"].items()}
    kind = dict(model.quant.formats)["embed_tokens"].kind
    dense = np.asarray(dequantize(leaves, kind))  # f32[hidden, vocab]: the same values
    k, n = dense.shape
    panels = qgemm.pack({m: a[None] for m, a in leaves.items()}, kind)
    forms = {
        "f32": (jax.jit(lambda w, x: gemm.stacked_gemm(x, w, 0, n)), gemm.pack(dense[None])),
        kind: (jax.jit(lambda w, x: qgemm.stacked_qgemm(x, w, kind, 0, n)), panels),
        f"xla_{kind}": (jax.jit(lambda w, x: quant_matmul_xla(x, w, kind)),
                        jax.tree_util.tree_map(jnp.asarray, leaves)),
    }
    print("| round | batch | load avg | " + " | ".join(f"{f} ms" for f in forms)
          + " |\n|---:|---:|---:|" + "---:|" * len(forms))
    for r in range(args.rounds):
        for b in [int(s) for s in args.batch_sizes.split(",")]:
            x = jnp.linspace(-1, 1, b * k, dtype=jnp.float32).reshape(b, k)
            ms = [1000 * median_seconds(fn, w, x, iters=args.iters) for fn, w in forms.values()]
            print(f"| {r + 1} | {b} | {os.getloadavg()[0]:.2f} | "
                  + " | ".join(f"{m:.2f}" for m in ms) + " |", flush=True)


MEMORY_CHILD = """
import gc, json, sys
def rss():
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f)
    return {k: int(d[k].split()[0]) / 2**20 for k in ("VmRSS", "VmHWM")}  # GiB
out = {"start": rss()}
import jax
from models.default_model import default_model_path
from models.loaders import load_model
jax.numpy.zeros(1).block_until_ready()
out["jax"] = rss()
model = load_model(default_model_path(), quantization=sys.argv[1])
out["loaded"] = rss()
out["weight_bytes"] = model.weight_bytes / 2**30
from jaxserve import LLM, SamplingParams
llm = LLM(model, attention_backend="cpu", max_model_len=512, max_num_seqs=8,
          max_num_batched_tokens=256, num_kv_blocks=64)
del model
gc.collect()
out["engine"] = rss()
llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
gc.collect()
out["generated"] = rss()
out["panels"] = llm.engine.model.serving.panels
print("RESULT " + json.dumps(out))
"""


def memory(args) -> None:
    """The resident-set benchmark (module docstring)."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print("| weights | load avg | weight GiB | after import | after load | engine built "
          "| after a generate | peak |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for quantization in ("none", "gguf"):
        proc = subprocess.run([sys.executable, "-c", MEMORY_CHILD, quantization], env=env,
                              capture_output=True, text=True, check=True)
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        r = json.loads(line[len("RESULT "):])
        print(f"| {quantization} (panels: {r['panels']}) | "
              f"{os.getloadavg()[0]:.2f} | {r['weight_bytes']:.3f} | {r['jax']['VmRSS']:.2f} | "
              f"{r['loaded']['VmRSS']:.2f} | {r['engine']['VmRSS']:.2f} | "
              f"{r['generated']['VmRSS']:.2f} | {r['generated']['VmHWM']:.2f} |", flush=True)


def _decode_tok_s(llm, batch: int, tokens: int) -> float:
    """Generated tokens per second of `batch` greedy requests of `tokens` tokens each,
    timed from the first token on (the prompt's step excluded)."""
    from jaxserve import SamplingParams

    prompts = [f"Write a story about the number {i}." for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2))  # warm
    short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, short)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompts, full)
    return batch * tokens / max(time.perf_counter() - t - prefill, 1e-9)


# `decode`'s forms: load settings. "q4_in_place" serves float16 KV pages (its "auto").
DECODE_FORMS = {"f32": dict(quantization="none"), "q4_in_place": dict(quantization="gguf"),
                "q4_kv_f32": dict(quantization="gguf", kv_cache_dtype="float32"),
                "q4_kv_bf16": dict(quantization="gguf", kv_cache_dtype="bfloat16")}


def decode(args) -> None:
    """The engine decode benchmark (module docstring)."""
    from jaxserve import LLM
    from models.default_model import default_model_path

    path = default_model_path()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    common = dict(max_num_seqs=max(sizes), max_model_len=512, max_num_batched_tokens=256,
                  attention_backend="cpu", num_kv_blocks=max(sizes) * 512 // 16 + 8)
    engines = {form: LLM(path, **DECODE_FORMS[form], **common)
               for form in args.forms.split(",")}
    for name, llm in engines.items():
        served = llm.engine.model
        print(f"# {name}: quantization {served.quant.name!r}, panels "
              f"{served.serving.panels}, KV pages "
              f"{llm.engine.runner.kv_pages.dtype}")
    later = list(engines)[1:]
    print("| round | batch | load avg | " + " | ".join(f"{n} tok/s" for n in engines)
          + "".join(f" | {n} / {list(engines)[0]}" for n in later)
          + " |\n|---:|---:|---:|" + "---:|" * (len(engines) + len(later)))
    for r in range(args.rounds):
        for b in sizes:
            res = []
            for llm in engines.values():
                res.append(_decode_tok_s(llm, b, args.tokens))
            print(f"| {r + 1} | {b} | {os.getloadavg()[0]:.2f} | "
                  + " | ".join(f"{v:.1f}" for v in res)
                  + "".join(f" | {v / res[0]:.2f}" for v in res[1:]) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    lp = sub.add_parser("layers", help="the layer matmuls alone")
    lp.add_argument("--batch-sizes", default="1,8,32")
    lp.add_argument("--iters", type=int, default=9)
    lp.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    lp.add_argument("--forms", default="f32,q4,q8,xla_q4",
                    help="forms to time (the first is the ratios' baseline)")
    lp.add_argument("--compare-source", default=None,
                    help="another version of stacked_qgemm.cc, timed as form 'other' (q4)")
    hp = sub.add_parser("head", help="the LM head, Q8_0 in place vs float32 vs XLA")
    hp.add_argument("--batch-sizes", default="1,32")
    hp.add_argument("--iters", type=int, default=9)
    hp.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    sub.add_parser("memory", help="resident set, float32 vs the blocks kept")
    dp = sub.add_parser("decode", help="engine decode tok/s, Q4_1 in place vs float32")
    dp.add_argument("--batch-sizes", default="1,32")
    dp.add_argument("--tokens", type=int, default=64, help="tokens decoded per request")
    dp.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    dp.add_argument("--forms", default="f32,q4_in_place",
                    help=f"forms to time, the first the ratios' baseline: {list(DECODE_FORMS)}")
    args = p.parse_args()
    {"layers": layers, "head": head, "memory": memory, "decode": decode}[args.what](args)


if __name__ == "__main__":
    main()
