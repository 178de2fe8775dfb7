"""`scripts/benchmarks/bench_mla_decode.py`: its model parses as the shape it names (DeepSeek-V3's
attention ratios scaled down), sizes off the ratios are refused; the script prints its table
(slow tier)."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest

from models.registry import arch_config_from_hf
from scripts.benchmarks.bench_mla_decode import hf_config


def test_the_model_has_deepseek_v3_ratios():
    cfg = arch_config_from_hf(hf_config(1024, 4, 256))
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.is_mla
    assert (cfg.num_heads, cfg.kv_lora_rank, cfg.head_dim, cfg.qk_nope_head_dim,
            cfg.v_head_dim, cfg.q_lora_rank) == (16, 128, 32, 64, 64, 256)
    assert cfg.dense_layers == (0,) and cfg.num_experts == 8
    assert cfg.mla_form == "absorbed"  # the script replaces it per form


@pytest.mark.parametrize("hidden, layers", [(1000, 4), (1024, 1)])
def test_sizes_off_the_ratios_are_refused(hidden, layers):
    with pytest.raises(ValueError, match=f"--hidden \\({hidden}\\) must be a multiple of 256 "
                                         f"and --layers \\({layers}\\) at least 2"):
        hf_config(hidden, layers, 256)


@pytest.mark.slow  # a benchmark smoke run: eight engines compiled (~25 s here)
def test_the_script_prints_its_table(monkeypatch):
    from scripts.benchmarks import bench_mla_decode

    monkeypatch.setattr(sys, "argv", [
        "bench_mla_decode", "--contexts", "32,64", "--batches", "1,2", "--hidden", "256",
        "--layers", "2", "--vocab", "256", "--rounds", "1"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench_mla_decode.main()
    lines = out.getvalue().splitlines()
    assert "| batch | context | absorbed ms | expanded ms | expanded / absorbed | load |" in lines
    assert sum(line.startswith(("| 1 | ", "| 2 | ")) for line in lines) == 4
    assert any(line.startswith("batch 2, context 64: absorbed ") and "; load " in line
               for line in lines)
