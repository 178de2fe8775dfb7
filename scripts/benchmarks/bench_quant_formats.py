"""Decode step of one random-weight Llama written as a checkpoint in each quantized format
people download, against the same model in float32 (issue 62's benchmark).

Each format's checkpoint (`jaxserve.bench.quant_checkpoints`: float32, FP8 in 128x128
blocks, GPTQ int4 group 128 symmetric, AWQ int4 group 128, GPTQ int8 group 128, GPTQ int4
group 32 (GGUF's block, the finest group), and compressed-tensors' W4A16, W8A8 int8,
FP8_DYNAMIC, MXFP4A16 and NVFP4A16 presets) is written to a temporary directory, loaded with
`quantization="auto"` (the checkpoint's own format) and served in the form the engine picks
on this machine (`jaxserve.runner.serving`: the `cpu` backend's packed panels where its
kernels read the format, else XLA's matmuls). Each decode step (`batch` requests, one new
token each at `--context`) is compiled once per format (`runner.prepare_model_step`, as
`bench_moe`) and timed interleaved in one process (A B C, C B A, ...: machine drift hits all
alike); the median of `--rounds` rounds is printed with its ratio to the first format
(float32), and each format's served weight bytes against its checkpoint's tensor bytes.

Usage: python -m scripts.benchmarks.bench_quant_formats [--batches 1,32] [--layers 8]
       [--formats float32,fp8,gptq-int4,...] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import numpy as np

from jaxserve.bench.quant_checkpoints import FORMATS, Shape, write_checkpoint
from models.default_model import default_model_path
from models.loaders import load_model, load_tokenizer
from scripts.benchmarks.bench_moe import compiled, interleaved_ms

MB = 2 ** 20


def served_as(runner) -> str:
    """How a runner serves its layer matmuls: the format kind (and block) of its q_proj,
    and whether from the `cpu` backend's packed panels or XLA's matmuls."""
    model = runner.model
    fmt = model.quant.get("q_proj") if model.quant else None
    kind = "float32" if fmt is None else f"{fmt.kind}/{fmt.block}"
    form = "panels" if model.serving.panels else model.serving.backend + " (XLA matmuls)"
    return f"{kind}, {form}"


def weight_bytes(params) -> int:
    """Bytes of every array leaf of a params tree."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


def row(name: str, info: dict, med: dict[int, dict[str, float]], base: str) -> str:
    """One markdown table row: format, served form, bytes, and per batch ms and x base."""
    cells = [name, info["served"], f"{info['ckpt'] / MB:.0f}", f"{info['device'] / MB:.0f}",
             f"{info['device'] / info['ckpt']:.2f}"]
    for batch in med:
        ms = med[batch][name]
        cells += [f"{ms:.1f}", f"{ms / med[batch][base]:.2f}x"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    names = args.formats.split(",")
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        ap.error(f"unknown formats {unknown} (known: {', '.join(FORMATS)})")
    base = names[0]
    shape = Shape(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                  vocab=args.vocab)
    tok = load_tokenizer(default_model_path())
    models, info = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            directory = os.path.join(tmp, name)
            info[name] = {"ckpt": write_checkpoint(directory, name, shape)}
            models[name] = load_model(directory, quantization="auto")
    print(f"{shape}; context {args.context}, {args.rounds} rounds; base {base}", flush=True)
    med: dict[int, dict[str, float]] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        steps = {n: compiled(models[n], tok, batch, args.context) for n in names}
        for n in names:
            runner = steps[n][1]
            info[n].update(served=served_as(runner), device=weight_bytes(runner.params))
        times = interleaved_ms(steps, names, args.rounds)
        med[batch] = {n: float(np.median(times[n])) for n in names}
        print(f"batch {batch}: " + ", ".join(
            f"{n} {med[batch][n]:.2f} ms ({med[batch][n] / med[batch][base]:.2f}x)"
            for n in names) + f"; load {os.getloadavg()[0]:.2f}", flush=True)
        del steps
    print("\n| format | served as | checkpoint MiB | device MiB | device / checkpoint | "
          + " | ".join(f"batch {b} ms | x {base}" for b in med) + " |")
    print("|" + " --- |" * (5 + 2 * len(med)))
    for n in names:
        print(row(n, info[n], med, base))


if __name__ == "__main__":
    main()
