"""The `cpu` backend's quantized layer matmuls (`pallas_kernels/cpu_ffi/qgemm.py`, the
quantized panels of `models/linear/panels.py`) against `jnp` dequantize-then-matmul and
the XLA quantized path on the same blocks: GGUF's blocks, checkpoints' q4 groups with
float16 or float32 zeros, and FP8 block-scaled codes."""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models.linear import STACKS, ServingChoice, can_panel, serving_form, standard_params
from models.linear.panels import PanelLinear, plan_supported
from models.loaders.gguf_quant import GGUF_KEPT, decode_gguf_rows
from models.model import Model, random_params
from models.quant import (
    NO_QUANT,
    QuantFormat,
    quantize_params,
    quantize_stack,
    to_leaves,
    uniform_plan,
)
from pallas_kernels.cpu_ffi import qgemm
from pallas_kernels.fp8_matmul.reference import dequantize_fp8
from pallas_kernels.quant_matmul.reference import q4_int8_matmul_reference, quant_matmul_reference
from tests.kernels.test_model_backends import ENGINE
from tests.kernels.test_model_backends import TINY as SERVED
from tests.models.helpers import forward_logits
from tests.models.test_gguf_quant import _random_q4_k

pytestmark = pytest.mark.skipif(not qgemm.available(),
                                reason="needs a C++ compiler, x86-64 AVX2/F16C and the CPU")

LAYERS = 3


def _gguf_stack(type_name: str, k: int, n: int, seed: int) -> tuple[QuantFormat, dict]:
    """The format and stacked on-device leaves [L, ., n] of random GGUF blocks of
    `type_name` (Q4_0, Q4_1, Q8_0 by gguf's quantizer; Q4_K random raw blocks), decoded by
    the loader (`decode_gguf_rows`) as a GGUF file's are."""
    import gguf

    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(LAYERS):
        if type_name == "Q4_K":
            raw = _random_q4_k(n, k // 256, rng)
        else:
            w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
            raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
        layers.append(to_leaves(decode_gguf_rows(type_name, raw, k)))
    return GGUF_KEPT[type_name], {m: np.stack([x[m] for x in layers]) for m in layers[0]}


def _references(x, w: dict, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(jnp dequantize-then-matmul of x's rows, what the kernel computes below
    `qgemm.STAGE_ROWS` rows: q4 with x split into int8 parts per block as the kernel does,
    `q4_int8_matmul_reference`; q8 the same product). Rows are independent in both, so
    one call serves every row count of a test."""
    x = jnp.asarray(x)
    exact = np.asarray(quant_matmul_reference(x, w, kind))
    return exact, exact if kind == "q8" else np.asarray(q4_int8_matmul_reference(x, w))


def _check(got, refs, rows: int, atol: float = 2e-4, msg: str = "") -> None:
    """`got` [rows, N] against the first `rows` rows of `_references`, and within 5e-4 of
    the float product (what splitting x costs, more where the zero term cancels most)."""
    exact, split = (r[:rows] for r in refs)
    want = split if rows < qgemm.STAGE_ROWS else exact
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=atol, err_msg=msg)
    assert np.linalg.norm(np.asarray(got) - exact) <= 5e-4 * np.linalg.norm(exact), msg


def _check_every_layer(leaves: dict, kind: str, n: int, seed: int) -> None:
    """Rows 1-13 (`ROWS`) of one x against every layer."""
    k = leaves["qweight"].shape[1] * (2 if kind == "q4" else 1)
    panels = qgemm.pack(leaves, kind)
    x = np.random.default_rng(seed).standard_normal((max(ROWS), k)).astype(np.float32)
    fn = jax.jit(lambda x, i: qgemm.stacked_qgemm(x, panels, kind, i, n))  # layer traced
    for layer in range(LAYERS):
        refs = _references(x, {m: a[layer] for m, a in leaves.items()}, kind)
        for rows in ROWS:
            _check(fn(x[:rows], layer), refs, rows, msg=f"layer {layer}, {rows} rows")


# NOTE: rows 1-13 take every path: one row, the register tiles of 2-11 rows (6 rows on AVX2,
# 4 on AVX-512: every remainder) and the dequantized units from 12 rows (6- or 8-row tiles).
ROWS = list(range(1, 14))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_gguf_blocks_match_jnp(fmt):
    k = 256 if fmt == "Q4_K" else 96  # Q4_K super-blocks are 256 values
    kind_fmt, leaves = _gguf_stack(fmt, k, 100, seed=len(fmt))  # 100: 3 units, one padded
    _check_every_layer(leaves, kind_fmt.kind, 100, seed=len(fmt))


@pytest.mark.parametrize("fmt,n", [(QuantFormat("q8", 0), 50), (QuantFormat("q8", 32), 131),
                                   (QuantFormat("q4", 32), 77)])
def test_quantized_odd_widths_match_jnp(fmt, n):
    # int8 per channel (block = K: 72 rows, no 32-row blocks), Q8_0 and Q4_1 quantizers
    k = 72 if fmt.block == 0 else 64
    w = np.random.default_rng(n).standard_normal((LAYERS, k, n)).astype(np.float32)
    leaves = quantize_stack(fmt, w)
    _check_every_layer(leaves, fmt.kind, n, seed=n)


def _served(fmt: QuantFormat, leaves: dict, n: int) -> dict:
    """`leaves` packed as the cpu backend serves them (`PanelLinear`), checked to come back
    unchanged (the checkpoint's groups and blocks)."""
    panels = PanelLinear(fmt).to_serving(leaves, stacked=True)
    back = PanelLinear(fmt).to_standard(panels, n, stacked=True)
    for name, leaf in leaves.items():  # FP8 codes compared as bytes (NaN-free either way)
        np.testing.assert_array_equal(np.asarray(back[name]).view(np.uint8),
                                      np.asarray(leaf).view(np.uint8), err_msg=name)
    return panels


@pytest.mark.parametrize("group,zeros", [(64, np.float32), (128, np.float16), (0, np.float32)])
def test_checkpoint_q4_groups_match_jnp(group, zeros):
    # GPTQ/AWQ groups of 64 and 128 and per channel (0: G = K) read without repeating their
    # scales, zeros -z * scale kept in float32 (AWQ, asymmetric GPTQ) or float16.
    k, n = 256, 100
    rng = np.random.default_rng(group)
    ng = k // (group or k)
    scales = (rng.random((2, ng, n)) * 0.02 + 1e-3).astype(np.float16)  # f16[L, K / G, N]
    leaves = {"qweight": rng.integers(0, 256, (2, k // 2, n), dtype=np.uint8),
              "scales": scales,
              "zeros": (-rng.integers(0, 16, (2, ng, n)) * scales.astype(np.float32)
                        * (1 + 1e-3 * rng.standard_normal((2, ng, n)))).astype(zeros)}
    fmt = QuantFormat("q4", group, np.dtype(zeros).name)
    panels = _served(fmt, leaves, n)
    assert panels["scales"].shape == (2, 9, ng, 16) and panels["zeros"].dtype == zeros
    x = rng.standard_normal((13, k)).astype(np.float32)
    fn = jax.jit(lambda x, i: qgemm.stacked_qgemm(x, panels, "q4", i, n))
    for layer in range(2):
        refs = _references(x, {m: a[layer] for m, a in leaves.items()}, "q4")
        for rows in (1, 3, 13):  # one row, a remainder tile, the staged path
            _check(fn(x[:rows], layer), refs, rows, msg=f"layer {layer}, {rows} rows")


@pytest.mark.parametrize("block", [(128, 128), (0, 1)])
def test_fp8_codes_match_jnp(block):
    # FP8 E4M3 codes widened in registers (subnormals, -0 and the largest, 448, included)
    # times block scales: DeepSeek's 128x128 blocks (widened to one scale per column) and
    # per channel.
    k, n = 256, 100
    rng = np.random.default_rng(block[0])
    values = rng.standard_normal((2, k, n)) * np.exp2(rng.integers(-10, 6, (2, k, n)))
    values[:, 0, :4] = (448.0, -448.0, -0.0, 2.0 ** -9)
    codes = np.clip(values, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    fmt = QuantFormat("fp8", block[0], block_n=block[1])
    bk, bn = fmt.blocks_for(k, n)
    leaves = {"qweight": codes, "block_scales": (rng.random((2, -(-k // bk), -(-n // bn)))
                                                 * 0.01 + 1e-4).astype(np.float32)}
    panels = _served(fmt, leaves, n)
    assert panels["block_scales"].shape == (2, 9, k // bk, 16)
    x = rng.standard_normal((13, k)).astype(np.float32)
    fn = jax.jit(lambda x, i: qgemm.stacked_qgemm(x, panels, "fp8", i, n))
    for layer in range(2):
        w = dequantize_fp8({m: jnp.asarray(a[layer]) for m, a in leaves.items()}, (bk, bn))
        exact = np.asarray(jnp.dot(x, w, precision="highest"))
        for rows in (1, 3, 13):
            _check(fn(x[:rows], layer), (exact, exact), rows, msg=f"{layer}, {rows} rows")


def test_many_units_over_threads_match_jnp():
    w = np.random.default_rng(9).standard_normal((2, 128, 500)).astype(np.float32)
    leaves = quantize_stack(QuantFormat("q4", 32), w)
    k_leaves = {m: a[:2] for m, a in leaves.items()}
    panels = qgemm.pack(k_leaves, "q4")
    x = np.random.default_rng(1).standard_normal((37, 128)).astype(np.float32)
    for layer in range(2):
        refs = _references(x, {m: a[layer] for m, a in leaves.items()}, "q4")
        _check(qgemm.stacked_qgemm(x, panels, "q4", layer, 500), refs, 37, atol=5e-4)


def test_unpack_inverts_pack_and_the_layer_is_clamped():
    w = np.random.default_rng(2).standard_normal((LAYERS, 64, 70)).astype(np.float32)
    leaves = quantize_stack(QuantFormat("q4", 32), w)
    panels = qgemm.pack(leaves, "q4")
    assert panels["qweight"].shape == (LAYERS, 6, 32, 16) and panels["zeros"].dtype == jnp.float16
    jax.tree_util.tree_map(np.testing.assert_array_equal, qgemm.unpack(panels, 70, "q4"),
                           leaves)
    x = np.ones((2, 64), np.float32)
    for layer, want in ((7, LAYERS - 1), (-1, 0)):
        refs = _references(x, {m: a[want] for m, a in leaves.items()}, "q4")
        _check(qgemm.stacked_qgemm(x, panels, "q4", layer, 70), refs, 2)


def test_bad_inputs_are_value_errors():
    w = np.random.default_rng(3).standard_normal((2, 64, 48)).astype(np.float32)
    leaves = quantize_stack(QuantFormat("q4", 32), w)
    panels = qgemm.pack(leaves, "q4")
    with pytest.raises(ValueError, match="do not fit q4 panels"):
        qgemm.stacked_qgemm(np.ones((1, 32), np.float32), panels, "q4", 0, 48)
    with pytest.raises(ValueError, match="do not fit q4 panels"):
        qgemm.stacked_qgemm(np.ones((1, 64), np.float32), panels, "q4", 0, 96)
    with pytest.raises(ValueError, match="unknown quantized format 'q2'; expected one of q8"):
        qgemm.stacked_qgemm(np.ones((1, 64), np.float32), panels, "q2", 0, 48)
    with pytest.raises(ValueError, match=r"lacks leaves \['zeros'\]"):
        qgemm.pack({"qweight": leaves["qweight"], "scales": leaves["scales"]}, "q4")
    with pytest.raises(ValueError, match="stacked q4 leaves"):
        qgemm.pack({m: a[0] for m, a in leaves.items()}, "q4")
    assert not qgemm.supports("q4", 64, 0) and not qgemm.supports("q8", 72, 32)
    assert qgemm.supports("q8", 72, 72) and qgemm.supports("q4", 64, 32)


def test_the_kernel_rejects_inconsistent_shapes():
    # The kernel's own check, under the wrapper's: scales of another layer count.
    w = np.random.default_rng(4).standard_normal((2, 64, 48)).astype(np.float32)
    panels = qgemm.pack(quantize_stack(QuantFormat("q8", 32), w), "q8")
    out = jax.ShapeDtypeStruct((1, 48), jnp.float32)
    call = jax.ffi.ffi_call(qgemm.TARGETS["q8"], out)
    with pytest.raises(jax.errors.JaxRuntimeError, match="stacked_qgemm q8: inconsistent"):
        jax.block_until_ready(call(np.ones((1, 64), np.float32), panels["qweight"],
                                   panels["scales"][:1], jnp.asarray(0, jnp.int32)))


@pytest.mark.parametrize("kind,tied", [("q4", True), ("q8", False)])
def test_packed_quantized_model_gives_the_xla_quantized_logits(kind, tied):
    # q4 per channel with float32 zeros (an asymmetric GPTQ checkpoint's: one group of K),
    # q8 in SERVED's blocks of 32 (hidden 64, intermediate 96).
    cfg = dataclasses.replace(SERVED, tie_word_embeddings=tied)
    fmt = QuantFormat(kind, 0, "float32") if kind == "q4" else QuantFormat(kind, 32)
    plan = uniform_plan("gptq" if kind == "q4" else "q8_0", fmt)
    params = jax.tree_util.tree_map(lambda x: x * 3.0, random_params(cfg, seed=7))
    quantized = jax.tree_util.tree_map_with_path(  # the quantizer's zeros, as float32
        lambda path, a: a.astype(np.float32) if path[-1].key == "zeros" else a,
        quantize_params(params, plan))
    standard = Model(cfg, quantized, quant=plan, serving=ServingChoice("cpu"))
    paneled = serving_form(standard, panels=True)
    assert paneled.serving.panels and paneled.quant.formats == plan.formats
    stacks, rest = paneled.params[STACKS], paneled.params["params"]
    assert sorted(stacks["layers"]["mlp"]["up_proj"]) == sorted(qgemm.LEAVES[kind])
    head = "embed_tokens" if tied else "lm_head"
    assert sorted(stacks[head]) == sorted(qgemm.LEAVES[kind])  # the head's codes, packed
    assert stacks[head]["qweight"].shape[:2] == (1, 9)  # 97 columns: 3 units
    assert head not in rest and ("embed_tokens" in rest) != tied  # not kept twice
    ids = [int(t) for t in np.random.default_rng(4).integers(0, SERVED.vocab_size, 21)]
    # NOTE: q4 sums s * sum(x q) + z * sum(x) per block (two terms that partly cancel), XLA
    # sum(x (q s + z)): logits of magnitude ~8 differ in the fifth digit.
    np.testing.assert_allclose(forward_logits(paneled, ids), forward_logits(standard, ids),
                               rtol=1e-4, atol=1e-3)
    back = serving_form(paneled, panels=False)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back.params, standard.params)


def test_a_format_the_kernel_lacks_is_not_packed():
    # SERVED's input sizes are 64 and 96: a group of 64 does not divide the MLP's 96.
    assert not plan_supported(uniform_plan("gptq", QuantFormat("q4", 64)), SERVED)
    assert plan_supported(uniform_plan("awq", QuantFormat("q4", 32, "float32")), SERVED)
    assert plan_supported(uniform_plan("int8", QuantFormat("q8", 0)), SERVED)
    # FP8 blocks of 32 along K: one f32 scale per column would add 12.5% to the codes;
    # per channel (K = 64, 96) they add 6% at most; a tied FP8 embedding stays on XLA.
    fp8 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert not plan_supported(uniform_plan("fp8", QuantFormat("fp8", 32, block_n=32), fp8),
                              SERVED)
    assert plan_supported(uniform_plan("fp8", QuantFormat("fp8", 0, block_n=1), fp8), SERVED)
    tied = dataclasses.replace(SERVED, tie_word_embeddings=True)
    assert not plan_supported(uniform_plan("fp8", QuantFormat("fp8", 0, block_n=1)), tied)


def test_panels_keep_a_checkpoints_bytes(tmp_path):
    # Issue 62's bound, device weight bytes within 10% of the checkpoint's, on the cpu
    # backend's panels: sizes that need no padding columns (multiples of 48) and groups of
    # 128 (kept, not repeated: that was +17.6% on the quantized tensors). AWQ's zeros grow
    # from 4 bits to float32 (~+5%), FP8's 128x128 block scales to one per column (~+3%);
    # MXFP4's and NVFP4's codes and scales keep their bytes (1.00).
    from jaxserve.bench.quant_checkpoints import Shape, write_checkpoint
    from models.loaders import load_model

    shape = Shape(hidden=384, intermediate=768, layers=1, vocab=96, head_dim=64, kv_heads=3)
    for name in ("gptq-int4", "awq-int4", "fp8", "ct-mxfp4", "ct-nvfp4"):
        checkpoint = write_checkpoint(str(tmp_path / name), name, shape)
        loaded = load_model(str(tmp_path / name))
        model = serving_form(loaded, backend="cpu", panels=True)
        assert model.serving.panels and "q_proj" in model.params[STACKS]["layers"]["self_attn"]
        device = sum(a.nbytes for a in jax.tree_util.tree_leaves(model.params))
        assert device / checkpoint <= 1.10, (name, device / checkpoint)
        back = standard_params(model.params, model.cfg, model.quant)  # the groups, blocks
        want = loaded.params["layers"]["mlp"]["down_proj"]
        for leaf, got in back["layers"]["mlp"]["down_proj"].items():
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                          np.asarray(want[leaf]).view(np.uint8), err_msg=leaf)


@pytest.mark.slow(reason="two engines (~14 s); the default tier's GPTQ and AWQ checkpoint "
                        "engines serve on the panels (tests/e2e/...checkpoint_engine.py)")
def test_the_engine_serves_quantized_weights_on_the_kernel(monkeypatch):
    from jaxserve import LLM, SamplingParams

    # NOTE: the sizes of test_model_backends.py's engines; int8 per channel (q8).
    plan = uniform_plan("int8", QuantFormat("q8", 0))
    params = jax.tree_util.tree_map(lambda x: x * 3.0, random_params(SERVED, seed=7))
    model = Model(SERVED, quantize_params(params, plan), quant=plan,
                  serving=ServingChoice("cpu"))
    prompts = [{"prompt_token_ids": [3, 5, 7, 11 + i]} for i in range(3)]
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                              detokenize=False)
    outs = {}
    for panels in ("1", "0"):  # the kernel, then XLA's quantized matmuls
        monkeypatch.setenv("JAXSERVE_CPU_PANELS", panels)
        llm = LLM(model, warmup=False, tokenizer=SimpleNamespace(eos_token_id=None), **ENGINE)
        assert llm.engine.model.serving.panels == (panels == "1")
        res = llm.generate(prompts, sampling, use_tqdm=False)
        outs[panels] = [r.outputs[0].token_ids for r in res]
    assert outs["1"] == outs["0"]
    assert len({t for o in outs["1"] for t in o}) > 3  # not a degenerate repetition


def test_an_unavailable_quantized_kernel_keeps_xla(monkeypatch):
    monkeypatch.setattr(qgemm, "_registered", lambda: "building the FFI library failed")
    plan = uniform_plan("int8", QuantFormat("q8", 0))
    assert not can_panel(SERVED, plan, jnp.float32, "cpu")
    assert can_panel(SERVED, NO_QUANT, jnp.float32, "cpu")  # the float kernel still serves
    with pytest.raises(RuntimeError, match="quantized matmul kernel is unavailable"):
        qgemm.stacked_qgemm(np.ones((1, 64), np.float32),
                            {"qweight": np.zeros((1, 3, 64, 16), np.int8),
                             "scales": np.zeros((1, 3, 1, 16), np.float16)}, "q8", 0, 48)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_only_the_real_rows_are_multiplied(kind):
    # A step's padding tokens: `rows` (traced) of 13 rows are computed, the rest written 0.
    w = np.random.default_rng(5).standard_normal((2, 64, 70)).astype(np.float32)
    leaves = quantize_stack(QuantFormat(kind, 32), w)
    panels = qgemm.pack(leaves, kind)
    x = np.random.default_rng(6).standard_normal((13, 64)).astype(np.float32)
    fn = jax.jit(lambda x, r: qgemm.stacked_qgemm(x, panels, kind, 1, 70, r))
    for rows in (0, 1, 5, 13, 20):
        got = np.asarray(fn(x, rows))
        real = min(rows, 13)
        assert not got[real:].any()
        if real:  # the first rows as a call of just those rows computes them
            np.testing.assert_array_equal(got[:real], np.asarray(
                qgemm.stacked_qgemm(x[:real], panels, kind, 1, 70)))
