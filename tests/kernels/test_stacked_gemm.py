"""The `cpu` backend's layer matmuls (`pallas_kernels/cpu_ffi/gemm.py`, the panel method of
`models/linear/panels.py`) against `jnp` matmuls and the standard model."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from models.config import ArchConfig
from models.linear import STACKS, ServingChoice, can_panel, serving_form
from models.model import Model, random_params
from models.quant import NO_QUANT
from pallas_kernels.cpu_ffi import gemm
from tests.kernels.cases import slow_except
from tests.kernels.test_model_backends import ENGINE
from tests.kernels.test_model_backends import TINY as SERVED
from tests.models.helpers import forward_logits

pytestmark = pytest.mark.skipif(not gemm.available(),
                                reason="needs a C++ compiler and the CPU platform")

TINY = ArchConfig("LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96,
                  num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16,
                  layer_windows=(0, 0, 0), max_position_embeddings=256)


@pytest.fixture(scope="module")
def weights():
    return np.random.default_rng(0).standard_normal((3, 40, 100)).astype(np.float32)


# NOTE: tiles are 8 rows with AVX-512 and 6 (or 2, below 6 rows) with AVX2: these counts
# leave every remainder row count (1-7 and 1-5) on either.
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15])
def test_every_layer_matches_jnp(weights, rows):
    x = np.random.default_rng(rows).standard_normal((rows, 40)).astype(np.float32)
    packed = gemm.pack(weights)  # 100 columns: three units of 48, the last one padded
    assert packed.shape == (3, 9, 40, 16)
    fn = jax.jit(lambda x, i: gemm.stacked_gemm(x, packed, i, 100))  # layer traced
    for layer in range(3):
        np.testing.assert_allclose(np.asarray(fn(x, layer)), x @ weights[layer],
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [24, 37])
def test_many_panels_and_row_tiles_match_jnp(rows):
    # 11 units of three panels over the pool's threads, each claimed one ahead and
    # prefetched while the one before it runs; its tiles share each unit's prefetch (3-5
    # row tiles with AVX-512; with AVX2, 12-21 tiles over three column passes).
    w = np.random.default_rng(3).standard_normal((2, 70, 500)).astype(np.float32)
    x = np.random.default_rng(rows).standard_normal((rows, 70)).astype(np.float32)
    fn = jax.jit(lambda x, i: gemm.stacked_gemm(x, gemm.pack(w), i, 500))
    for layer in range(2):
        np.testing.assert_allclose(np.asarray(fn(x, layer)), x @ w[layer],
                                   rtol=1e-5, atol=1e-4)


def test_unpack_inverts_pack(weights):
    np.testing.assert_array_equal(np.asarray(gemm.unpack(gemm.pack(weights), 100)), weights)


def test_pack_lays_out_other_widths():
    w = np.random.default_rng(1).standard_normal((2, 5, 96)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(gemm.pack(w, 16, unit=3)), np.asarray(gemm.pack(w)))
    wide = np.asarray(gemm.pack(w[:, :, :70], 48, unit=1))  # the layout before 16 columns
    assert wide.shape == (2, 2, 5, 48)
    np.testing.assert_array_equal(wide[:, 1, :, :22], w[:, :, 48:70])
    assert not wide[:, 1, :, 22:].any()  # zero-padded past the last column


def test_loop_over_layers_matches_jnp():
    sq = np.random.default_rng(1).standard_normal((3, 96, 96)).astype(np.float32) * 0.1
    packed = gemm.pack(sq)
    x = np.random.default_rng(2).standard_normal((9, 96)).astype(np.float32)
    got = jax.jit(lambda x: jax.lax.fori_loop(
        0, 3, lambda i, x: jnp.tanh(gemm.stacked_gemm(x, packed, i, 96)), x))(x)
    want = x
    for layer in range(3):
        want = np.tanh(want @ sq[layer])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_layer_index_is_clamped(weights):
    x = np.ones((2, 40), np.float32)
    packed = gemm.pack(weights)
    for layer, want in ((7, 2), (-1, 0)):
        np.testing.assert_allclose(np.asarray(gemm.stacked_gemm(x, packed, layer, 100)),
                                   x @ weights[want], rtol=1e-5, atol=1e-4)


def test_bad_shapes_are_value_errors(weights):
    packed = gemm.pack(weights)
    with pytest.raises(ValueError, match="do not fit panels"):
        gemm.stacked_gemm(np.ones((2, 39), np.float32), packed, 0, 100)
    with pytest.raises(ValueError, match="do not fit panels"):
        gemm.stacked_gemm(np.ones((2, 40), np.float32), packed, 0, 200)
    with pytest.raises(ValueError, match="stacked weights"):
        gemm.pack(weights[0])


def test_the_kernel_rejects_panels_not_in_whole_units(weights):
    # The kernel's own check, under the wrapper's: four panels are a unit and a third.
    packed = gemm.pack(weights)[:, :4]
    out = jax.ShapeDtypeStruct((2, 4 * gemm.PANEL), jnp.float32)
    call = jax.ffi.ffi_call(gemm.TARGET, out)
    with pytest.raises(jax.errors.JaxRuntimeError, match="stacked_gemm: inconsistent shapes"):
        jax.block_until_ready(call(np.ones((2, 40), np.float32), packed,
                                   jnp.asarray(0, jnp.int32)))


# NOTE: two programs per case (the standard model's and the packed model's): the default tier
# runs biases and a tied embedding together; each alone and neither, the slow tier (the
# packed model's untied LM head and bias-free layers serve in test_model_backends.py's engines).
@pytest.mark.parametrize("bias,tied", slow_except(
    [(False, False), (True, False), (False, True), (True, True)], 3))
def test_packed_model_gives_the_standard_logits(bias, tied):
    cfg = dataclasses.replace(TINY, qkv_bias=bias, mlp_bias=bias, tie_word_embeddings=tied)
    params = jax.tree_util.tree_map(lambda x: x * 3.0, random_params(cfg, seed=3))
    if bias:  # random_params zeroes biases: make them count
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.1 if "bias" in jax.tree_util.keystr(p) else x, params)
    # NOTE: both on the `cpu` backend, so that only the matmuls differ (the attention of
    # a short prompt runs on the C++ kernel there, on XLA's tiles on `xla`).
    standard = Model(cfg, params, serving=ServingChoice("cpu"))
    paneled = serving_form(standard, panels=True)
    assert paneled.serving.panels and not standard.serving.panels
    assert not paneled.quant and paneled.quant.name == "none"  # packed is not quantized
    rest, stacks = paneled.params["params"], paneled.params[STACKS]
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_leaves_with_path(rest["layers"])]
    assert not [p for p in paths if "kernel" in p]  # packed, not kept twice
    assert any("bias" in p for p in paths) == bias
    assert stacks["layers"]["mlp"]["up_proj"]["kernel"].shape == (3, 6, 64, 16)  # 96 columns
    head = stacks["embed_tokens" if tied else "lm_head"]
    assert list(head) == ["embedding" if tied else "kernel"]  # the LM head packed too
    assert head["embedding" if tied else "kernel"].shape == (1, 9, cfg.hidden_size, 16)  # 97
    assert "lm_head" not in rest and ("embed_tokens" in rest) != tied  # not kept twice
    ids = [int(t) for t in np.random.default_rng(4).integers(0, cfg.vocab_size, 37)]
    np.testing.assert_allclose(forward_logits(paneled, ids), forward_logits(standard, ids),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_unpacks_and_saves_the_standard_tree(tied, tmp_path):
    from models.loaders.orbax_ckpt import save_checkpoint

    # NOTE: the tied model has biases too (their leaves make the round trip): the model of
    # test_packed_model_gives_the_standard_logits's default case, whose init is compiled.
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied, qkv_bias=tied, mlp_bias=tied)
    params = random_params(cfg, seed=5)
    paneled = serving_form(Model(cfg, params, serving=ServingChoice("cpu")), panels=True)
    assert serving_form(paneled, panels=True) is paneled
    back = serving_form(paneled, panels=False)
    assert back.quant == NO_QUANT and serving_form(back, panels=False) is back
    jax.tree_util.tree_map(np.testing.assert_array_equal, back.params, params)
    hlo = jax.jit(paneled.forward).lower(paneled.params, *_step_args(paneled)).as_text()
    # Each of the layer's 7 matmuls reads its whole stack [L, P, K, 16] (the scan
    # broadcasts it), not a copy of one layer sliced out of it.
    stacks = re.findall(rf"custom_call @{gemm.TARGET}\(.*: \(tensor<[^>]*>, tensor<(\d+)x", hlo)
    assert stacks == [str(cfg.num_layers)] * 7
    assert gemm.TARGET not in jax.jit(back.forward).lower(back.params,
                                                           *_step_args(back)).as_text()
    save_checkpoint(str(tmp_path / "ckpt"), cfg, paneled.params, "float32", None,
                    quant=paneled.quant)
    saved = json.loads((tmp_path / "ckpt" / "jaxserve_model.json").read_text())
    assert saved["quantization"] == NO_QUANT.to_dict()  # packing is never saved
    restored = ocp.StandardCheckpointer().restore(tmp_path / "ckpt" / "params")
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, params)


def test_a_truncated_packed_model_is_the_truncated_model_packed():
    from jaxserve.spec_decode.draft import truncate_layers

    cfg = dataclasses.replace(TINY, tie_word_embeddings=True, qkv_bias=True, mlp_bias=True)
    model = Model(cfg, random_params(cfg, seed=5), serving=ServingChoice("cpu"))
    draft = truncate_layers(serving_form(model, panels=True), 2)
    assert draft.serving.panels and draft.cfg.num_layers == 2
    assert draft.params[STACKS]["layers"]["self_attn"]["q_proj"]["kernel"].shape[0] == 2
    jax.tree_util.tree_map(np.testing.assert_array_equal,
                           serving_form(draft, panels=False).params,
                           truncate_layers(model, 2).params)


def test_a_packed_weight_missing_is_a_value_error():
    cfg = dataclasses.replace(TINY, tie_word_embeddings=True, qkv_bias=True, mlp_bias=True)
    paneled = serving_form(Model(cfg, random_params(cfg, seed=5), serving=ServingChoice("cpu")),
                           panels=True)
    del paneled.params[STACKS]["layers"]["mlp"]["down_proj"]
    with pytest.raises(ValueError, match="down_proj: no 'kernel' in the 'stacks' collection"):
        jax.eval_shape(paneled.forward, paneled.params, *_step_args(paneled))  # traced only


def _step_args(model):
    from pallas_kernels import AttentionMetadata

    md = AttentionMetadata(slot_mapping=jnp.zeros(4, jnp.int32),
                           block_tables=jnp.zeros((1, 4), jnp.int32),
                           kv_lens=jnp.array([4], jnp.int32),
                           cu_q_lens=jnp.array([0, 4], jnp.int32))
    pool = jnp.zeros(model.kv_pages_shape(8, 16), jnp.float32)
    return jnp.zeros(4, jnp.int32), jnp.arange(4, dtype=jnp.int32), pool, md


def test_sharded_weights_are_not_packed():
    from jaxserve.runner.serving import on_one_device

    params = random_params(TINY, seed=6)
    assert on_one_device(params)
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = NamedSharding(mesh, PartitionSpec(None, None, "tp"))
    params["layers"]["mlp"]["up_proj"]["kernel"] = jax.device_put(
        params["layers"]["mlp"]["up_proj"]["kernel"], spec)
    assert not on_one_device(params)
    assert can_panel(TINY, NO_QUANT, jnp.float32, "cpu")
    assert not can_panel(TINY, NO_QUANT, jnp.float32, "cpu", one_device=False)


@pytest.mark.parametrize("change", [{"backend": "xla"}, {"dtype": jnp.bfloat16}])
def test_packing_needs_the_cpu_backend_and_float32(change):
    params = random_params(TINY, seed=6)
    args = {"backend": "cpu", "dtype": jnp.float32} | change
    assert not can_panel(TINY, NO_QUANT, args["dtype"], args["backend"])
    model = Model(TINY, params, args["dtype"], serving=ServingChoice(args["backend"]))
    with pytest.raises(ValueError, match="packing the weights into panels needs the 'cpu' "
                                         "backend"):
        serving_form(model, panels=True)


def test_the_engine_serves_the_cpu_backend_packed(monkeypatch):
    from types import SimpleNamespace

    from jaxserve import LLM, SamplingParams

    # NOTE: the model, weights and engine sizes of test_model_backends.py, whose xla and
    # cpu (packed) engines compile the same step programs.
    params = jax.tree_util.tree_map(lambda x: x * 3.0, random_params(SERVED, seed=7))
    standard = Model(SERVED, params, serving=ServingChoice("cpu"))
    outs = {}
    # A model handed over in either form serves in the backend's: packed on `cpu`, not on
    # `xla`.
    for backend, model in (("cpu", standard), ("xla", serving_form(standard, panels=True))):
        llm = LLM(model, warmup=False, tokenizer=SimpleNamespace(eos_token_id=None),
                  attention_backend=backend, **ENGINE)
        assert llm.engine.model.serving.panels == (backend == "cpu")
        prompts = [{"prompt_token_ids": [3, 5, 7, 11 + i]} for i in range(3)]
        res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                   ignore_eos=True, detokenize=False),
                           use_tqdm=False)
        outs[backend] = [r.outputs[0].token_ids for r in res]
    assert outs["cpu"] == outs["xla"]
    monkeypatch.setenv("JAXSERVE_CPU_PANELS", "0")
    llm = LLM(serving_form(standard, panels=True), warmup=False, max_model_len=64,
              tokenizer=SimpleNamespace(eos_token_id=None), num_kv_blocks=32)
    assert llm.engine.model.serving.backend == "cpu" and not llm.engine.model.serving.panels


def test_an_unavailable_kernel_keeps_xla_matmuls(monkeypatch):
    monkeypatch.setattr(gemm, "_registered", lambda: "building the FFI library failed")
    assert not can_panel(TINY, NO_QUANT, jnp.float32, "cpu")
    with pytest.raises(RuntimeError, match="CPU matmul kernel is unavailable"):
        gemm.stacked_gemm(np.ones((2, 40), np.float32), gemm.pack(np.ones((1, 40, 48))), 0, 48)


def test_a_failing_build_names_the_library(monkeypatch, tmp_path):
    from pallas_kernels.cpu_ffi import build

    monkeypatch.setenv("JAXSERVE_FFI_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # exits 1
    assert "building the CPU matmul kernel failed" in build.register(
        gemm.SOURCE, "StackedGemm", "jaxserve_never_registered", "the CPU matmul kernel", "y")
    assert not [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")]  # no library


def test_only_the_real_rows_are_multiplied():
    # A step's padding tokens: `rows` (traced) of 9 rows are computed, the rest written 0.
    panels = gemm.pack(np.random.default_rng(3).standard_normal((2, 40, 50)).astype(np.float32))
    x = np.random.default_rng(4).standard_normal((9, 40)).astype(np.float32)
    fn = jax.jit(lambda x, r: gemm.stacked_gemm(x, panels, 1, 50, r))
    for rows in (0, 2, 9, 30):
        got = np.asarray(fn(x, rows))
        real = min(rows, 9)
        assert not got[real:].any()
        if real:
            np.testing.assert_array_equal(got[:real],
                                          np.asarray(gemm.stacked_gemm(x[:real], panels, 1, 50)))
