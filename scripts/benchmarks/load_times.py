"""Times `load_model` of the default model (SmolLM2-135M-Instruct) from each format.

Writes into a temporary directory:
  * the GGUF file itself (the embedded default, used in place),
  * a Hugging Face directory: transformers loads the GGUF and `save_pretrained`s it,
  * a jaxserve (orbax) checkpoint: `models.loaders.convert` of the GGUF,
then, after a warm-up import and backend start, times each `load_model` call (the files
were just written, so the page cache is warm) and checks that every format gives the
same parameters as the GGUF.

Usage:
    python -m scripts.benchmarks.load_times [--model PATH.gguf] [--dtype float32|bfloat16]
                                 [--repeats N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time


def _size_mb(path: str) -> float:
    if os.path.isfile(path):
        return os.path.getsize(path) / 2**20
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files) / 2**20


def write_hf_dir(gguf_path: str, dst: str) -> None:
    """transformers' own GGUF import, saved as a safetensors HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        # transformers 5 keeps a GGUF "quantization" config that save_pretrained refuses.
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(dst, safe_serialization=True)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=2, help="timed loads per format")
    ap.add_argument("--keep", default=None, help="write the formats here and keep them")
    args = ap.parse_args()

    # Warm-up: imports and backend start are not part of any format's load time.
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.default_model import default_model_path
    from models.loaders import convert, load_model

    jnp.zeros(8).block_until_ready()
    print(f"warm-up import + backend start: {time.perf_counter() - t0:.2f} s "
          f"(jax {jax.__version__}, {jax.devices()[0].platform})")

    gguf_path = args.model or default_model_path()
    work = args.keep or tempfile.mkdtemp(prefix="jaxserve_load_times_")
    os.makedirs(work, exist_ok=True)
    hf_dir = os.path.join(work, "hf")
    orbax_dir = os.path.join(work, "orbax")
    try:
        t = time.perf_counter()
        if not os.path.exists(hf_dir):
            write_hf_dir(gguf_path, hf_dir)
        print(f"wrote HF directory in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        if not os.path.exists(orbax_dir):
            convert(gguf_path, orbax_dir, args.dtype)
        print(f"wrote orbax checkpoint in {time.perf_counter() - t:.1f} s")

        formats = [("gguf", gguf_path), ("hf-safetensors", hf_dir), ("jaxserve-orbax", orbax_dir)]
        reference = None
        print(f"\nload_model(..., dtype={args.dtype!r}), warm page cache, "
              f"{args.repeats} load(s) each")
        print(f"{'format':<16} {'size MB':>8}  {'wall s (each load)':<24} identical to GGUF")
        for name, path in formats:
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                m = load_model(path, args.dtype)
                jax.block_until_ready(m.params)
                times.append(time.perf_counter() - t)
            leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(m.params)]
            if reference is None:
                reference, same = leaves, "(reference)"
            else:
                same = str(len(leaves) == len(reference) and all(
                    a.dtype == b.dtype and np.array_equal(a, b)
                    for a, b in zip(leaves, reference, strict=True)))
            del m
            each = ", ".join(f"{s:.2f}" for s in times)
            print(f"{name:<16} {_size_mb(path):8.0f}  {each:<24} {same}")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
