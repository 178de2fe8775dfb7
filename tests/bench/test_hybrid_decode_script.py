"""`scripts/benchmarks/bench_hybrid_decode.py`: its three models parse as the shapes it names
(the hybrid's layer pattern, Qwen3.5's head ratios, the same widths in all three), sizes that
break the ratios are refused, the split by difference adds up; the script prints its table
(slow tier)."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest

from models.registry import arch_config_from_hf
from scripts.benchmarks.bench_hybrid_decode import hf_configs, split


def test_the_three_models_share_every_width():
    cfgs = {n: arch_config_from_hf(c) for n, c in hf_configs(1024, 8, 256).items()}
    hybrid, full, attn = cfgs["hybrid"], cfgs["all_attn"], cfgs["attn_only"]
    assert hybrid.linear_layers == (0, 1, 2, 4, 5, 6)
    assert hybrid.attention_layers == (3, 7)
    assert full.linear_layers == () and full.num_layers == 8
    assert attn.linear_layers == () and attn.num_layers == 2
    for cfg in cfgs.values():
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                cfg.head_dim) == (1024, 3072, 8, 2, 128)
        assert cfg.attn_output_gate and cfg.qk_norm
    # Qwen3.5's ratios: hidden / 256 linear key heads, twice that value heads, of 128.
    assert (hybrid.linear_num_key_heads, hybrid.linear_num_value_heads,
            hybrid.linear_key_head_dim, hybrid.linear_value_head_dim) == (4, 8, 128, 128)


@pytest.mark.parametrize("hidden, layers", [(768, 8), (1024, 6)])
def test_sizes_off_the_ratios_are_refused(hidden, layers):
    with pytest.raises(ValueError, match=f"--hidden \\({hidden}\\) must be a multiple of 512 "
                                         f"and --layers \\({layers}\\) of 4"):
        hf_configs(hidden, layers, 256)


def test_the_split_adds_up_to_the_hybrid():
    # 8 layers: 2 attention. all_attn's 6 extra attention layers cost 60 - 12 = 48 ms, so 16
    # for the hybrid's two; the rest 12 - 16 = -4 can only come from noise, kept visible.
    med = {"hybrid": 40.0, "all_attn": 60.0, "attn_only": 12.0}
    lin, attn, rest = split(med, 8)
    assert (lin, attn, rest) == (28.0, 16.0, -4.0)
    assert lin + attn + rest == med["hybrid"]


@pytest.mark.slow  # a benchmark smoke run: twelve engines compiled
def test_the_script_prints_its_table(monkeypatch):
    from scripts.benchmarks import bench_hybrid_decode

    monkeypatch.setattr(sys, "argv", [
        "bench_hybrid_decode", "--contexts", "32,64", "--batches", "1,2", "--hidden", "512",
        "--layers", "4", "--vocab", "256", "--rounds", "1"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench_hybrid_decode.main()
    lines = out.getvalue().splitlines()
    assert "| batch | context | hybrid ms | all-attention ms | hybrid / all-attention | " \
           "hybrid's linear layers ms | its attention layers ms | rest ms |" in lines
    assert sum(line.startswith(("| 1 | ", "| 2 | ")) for line in lines) == 4
    assert any(line.startswith("batch 2, context 64: hybrid ") and "; load " in line
               for line in lines)
    assert any(line.startswith("batch 1, 64 / 32: hybrid ") for line in lines)
