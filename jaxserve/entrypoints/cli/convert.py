"""`jaxserve convert`: a model to a jaxserve (orbax) checkpoint, the fastest to load later."""

from __future__ import annotations

import os
import time

import numpy as np

from jaxserve.config import DTYPES
from jaxserve.entrypoints.cli.args import quiet_start
from models.loaders.model_source import check_model_name
from models.quant import QUANTIZATIONS


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a model to a jaxserve (orbax) checkpoint")
    p.add_argument("src", nargs="?", default=None,
                   help="GGUF file or Hugging Face directory (default: the embedded model)")
    p.add_argument("dst", help="new directory to write")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="dtype of the stored weights (default: float32; auto: as "
                        "loading would)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="stored weight format (default: as loading would; gguf keeps a GGUF "
                        "file's quantized blocks)")
    p.set_defaults(handler=run)


def run(args) -> int:
    check_model_name(args.src)  # a local path, a hub id or a URL
    if os.path.exists(args.dst):
        raise ValueError(f"{args.dst} exists; give a new directory")
    quiet_start()
    from models.loaders import convert

    t0 = time.perf_counter()
    model = convert(args.src, args.dst, args.dtype, args.quantization)
    print(f"wrote {args.dst} ({model.cfg.architecture}, {np.dtype(model.dtype).name}, weights "
          f"{model.quant.name}, {model.weight_bytes / 2**20:.0f} MiB) in "
          f"{time.perf_counter() - t0:.1f}s")
    return 0
