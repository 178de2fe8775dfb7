"""`jaxserve.bench.quant_checkpoints` and `scripts/benchmarks/bench_quant_formats.py`: each
written checkpoint loads with `quantization="auto"` in the format it names (the GPTQ zero
points the symmetric ones), its device bytes near its checkpoint's; bad requests are refused;
the script prints its table (slow tier)."""

from __future__ import annotations

import contextlib
import io
import sys

import jax
import numpy as np
import pytest

from jaxserve.bench.quant_checkpoints import FORMATS, Shape, write_checkpoint
from models.loaders import load_model

TINY = Shape(hidden=256, intermediate=512, layers=1, vocab=256)
SERVED = {"float32": (None, None), "fp8": ("fp8", "fp8"), "gptq-int4": ("gptq", "q4"),
          "awq-int4": ("awq", "q4"), "gptq-int8": ("gptq", "q8"),
          "gptq-int4-g32": ("gptq", "q4"), "ct-w4a16": ("compressed-tensors", "q4"),
          "ct-w8a8-int8": ("compressed-tensors", "q8"),
          "ct-fp8-dynamic": ("compressed-tensors", "fp8"),
          "ct-mxfp4": ("compressed-tensors", "mxfp4"), "ct-nvfp4": ("compressed-tensors", "nvfp4")}


def test_every_format_is_checked_here():
    assert set(SERVED) == set(FORMATS)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_checkpoint_loads_in_its_format(fmt, tmp_path):
    ckpt_bytes = write_checkpoint(str(tmp_path), fmt, TINY)
    model = load_model(str(tmp_path), quantization="auto")
    name, kind = SERVED[fmt]
    assert (model.quant.name if model.quant else None) == name
    q = model.params["layers"]["self_attn"]["q_proj"]
    assert ("kernel" in q) == (kind is None)
    if kind is not None:
        plan_fmt = model.quant.get("q_proj")
        assert (plan_fmt.kind, plan_fmt.block) == (kind, FORMATS[fmt][2])
    if fmt.startswith("gptq-int4") or fmt == "ct-w4a16":  # symmetric: zero point 8
        np.testing.assert_array_equal(np.asarray(q["zeros"], np.float32),
                                      -8 * np.asarray(q["scales"], np.float32))
    device = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    assert abs(device / ckpt_bytes - 1) < 0.10


def test_an_unknown_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="format 'gptq-int3' is not one of float32, fp8"):
        write_checkpoint(str(tmp_path), "gptq-int3", TINY)


def test_a_width_the_group_does_not_divide_is_refused(tmp_path):
    with pytest.raises(ValueError, match="intermediate 544 must be multiples of gptq-int4's "
                                         "group size 128"):
        write_checkpoint(str(tmp_path), "gptq-int4", Shape(hidden=256, intermediate=544))


@pytest.mark.slow  # a benchmark smoke run: two engines compiled
def test_the_script_prints_its_table(monkeypatch):
    from scripts.benchmarks import bench_quant_formats

    monkeypatch.setattr(sys, "argv", [
        "bench_quant_formats", "--formats", "float32,gptq-int8", "--batches", "1",
        "--hidden", "256", "--intermediate", "512", "--layers", "1", "--vocab", "256",
        "--rounds", "1"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench_quant_formats.main()
    lines = out.getvalue().splitlines()
    assert "| format | served as | checkpoint MiB | device MiB | device / checkpoint | " \
           "batch 1 ms | x float32 |" in lines
    assert any(line.startswith("| gptq-int8 | q8/128, ") for line in lines)
    assert any(line.startswith("batch 1: float32 ") and "; load " in line for line in lines)
