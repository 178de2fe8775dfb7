"""Linear-attention hybrids (Qwen3-Next, Qwen3.5): config parsing and its errors, the state
contract (`HybridCache`, `state_slots`), and requests batched in one step each in their slot.

Numerics against transformers: the hybrid cases of tests/models/test_numerics.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve.parallel.layouts import make_tensor_parallel
from models.gated_deltanet import HybridCache
from models.kv_groups import KVGroupLayout
from models.loaders.gdn_fused import cut_piece
from models.model import Model, random_params
from models.registry import arch_config_from_hf
from pallas_kernels import AttentionMetadata

HF = dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=64, hidden_size=32,
          intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
          num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
          linear_conv_kernel_dim=4)
PAGE = 4


def test_default_pattern_partial_rotary_and_gate():
    cfg = arch_config_from_hf(HF)
    assert cfg.linear_layers == (0, 1, 2) and cfg.attention_layers == (3,)
    assert cfg.partial_rotary_factor == 0.25 and cfg.rotary_dim == 4
    assert cfg.attn_output_gate and cfg.qk_norm and cfg.norm_offset == 1.0
    assert cfg.linear_conv_dim == 2 * 2 * 8 + 4 * 8
    assert arch_config_from_hf({**HF, "full_attention_interval": 2}).linear_layers == (0, 2)
    # Qwen3.5's published rope parameters: its multimodal rotary sections (text positions
    # are alike on all three axes, so text sees the plain rotary) and its own factor.
    mrope = arch_config_from_hf({**HF, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True}})
    assert mrope.rope_theta == 1e7 and mrope.rotary_dim == 8
    moe = arch_config_from_hf({**HF, "architectures": ["Qwen3_5MoeForCausalLM"],
                               "num_experts": 4, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 16,
                               "shared_expert_intermediate_size": 24})
    assert moe.norm_topk_prob and moe.num_experts == 4 and not moe.dense_layers
    dense_next = arch_config_from_hf({**HF, "architectures": ["Qwen3NextForCausalLM"],
                                      "num_experts": 0})
    assert not dense_next.is_moe and dense_next.linear_layers == (0, 1, 2)


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention",
                       "full_attention"]), "unsupported layer_types entry 'sliding_attention'"),
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
    (dict(full_attention_interval=0), "full_attention_interval=0"),
    (dict(linear_num_value_heads=3), r"linear_num_value_heads \(3\) must be a multiple"),
    (dict(linear_key_head_dim=0), "linear_key_head_dim must be positive"),
    (dict(linear_conv_kernel_dim="4"), "linear_conv_kernel_dim='4'"),
    (dict(layer_types=["linear_attention"] * 4), "leaves no full_attention layer"),
])
def test_bad_configs_name_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        arch_config_from_hf({**HF, **change})


def test_fused_rows_that_do_not_match_the_heads():
    cfg = arch_config_from_hf(HF)
    with pytest.raises(ValueError, match=r"'x.in_proj_qkvz.weight' has 10 rows, expected 2 key"):
        cut_piece(cfg, "x.in_proj_qkvz.weight", np.zeros((10, 32)), "z")


def test_tensor_parallel_must_divide_the_key_heads():
    with pytest.raises(ValueError, match="does not divide linear_num_key_heads=2"):
        make_tensor_parallel(arch_config_from_hf({**HF, "num_attention_heads": 4}), 4)


@pytest.fixture(scope="module")
def model() -> Model:
    cfg = arch_config_from_hf(HF)
    return Model(cfg, random_params(cfg, seed=1))


def test_state_shapes_and_bytes(model):
    shapes = model.state_shapes(5)
    assert shapes["conv"].shape == (3, 5, 3, 64) and shapes["recurrent"].shape == (3, 5, 4, 8, 8)
    assert model.state_bytes_per_slot == 4 * 3 * (3 * 64 + 4 * 8 * 8)
    cache = model.empty_cache(num_pages=6, page_size=PAGE, num_state_slots=5)
    assert isinstance(cache, HybridCache)
    assert cache.pages.shape[0] == 1  # the one full-attention layer keeps pages
    with pytest.raises(ValueError, match="num_state_slots=1"):
        model.empty_cache(6, PAGE, 1)
    plain = Model(dataclasses.replace(model.cfg, linear_layers=(), linear_num_key_heads=0),
                  model.params)
    assert not plain.has_linear_attention and plain.state_shapes(5) == {}


def test_only_full_attention_layers_get_kv(model):
    """The serving KV layout counts the full-attention layers alone (the pool holds one)."""
    from jaxserve.runner.serving import serving_kv_layout

    assert model.cfg.attention_windows == (0,)
    layout = serving_kv_layout(model, 64, True)
    assert layout.num_layers == 1 and layout.num_slots == 1
    assert Model(model.cfg, model.params, kv_layout=layout).kv_pages_shape(3, PAGE)[0] == 1


def test_panels_are_refused(model):
    from models.linear import serving_form
    from pallas_kernels import cpu_ffi

    if not cpu_ffi.available():
        pytest.skip(f"no CPU kernel here: {cpu_ffi.unavailable_reason()}")
    with pytest.raises(ValueError, match="panels needs .* Qwen3_5ForCausalLM"):
        serving_form(model, backend="cpu", panels=True)


def test_hybrid_needs_its_cache_and_one_kv_group(model):
    md = AttentionMetadata(jnp.zeros(8, jnp.int32), jnp.zeros((1, 2), jnp.int32),
                           jnp.ones(1, jnp.int32), jnp.asarray([0, 1], jnp.int32))
    pages = jnp.zeros(model.kv_pages_shape(3, PAGE))
    with pytest.raises(ValueError, match="HybridCache"):
        model.forward(model.params, jnp.zeros(8, jnp.int32), jnp.zeros(8, jnp.int32), pages, md)
    two = KVGroupLayout((0, 4), (0,), (0,), 1)
    with pytest.raises(ValueError, match="keeps one"):
        Model(model.cfg, model.params, kv_layout=two)


_JITTED: dict[int, tuple] = {}  # id(model) -> (model, its jitted step)


def _jitted(model):
    if id(model) not in _JITTED:
        def run(params, ids, pos, cache, md):
            cache, hidden = model.forward(params, ids, pos, cache, md)
            return cache, model.compute_logits(params, hidden)

        _JITTED[id(model)] = (model, jax.jit(run))
    return _JITTED[id(model)][1]


def _step(model, cache, seqs, slots):
    """One step of up to two requests: seqs [(token ids, start position)], each in its own
    pages (request i: pages 1 + 2i, 2 + 2i) and state slot, padded to 16 tokens and three
    rows (one shape: one compile); returns (cache, each request's logits)."""
    n_tok, rows = 16, 3
    ids, pos, slot_map, cu, lens = [], [], [], [0], []
    tables = np.zeros((rows, 3), np.int32)
    for i, (toks, start) in enumerate(seqs):
        tables[i, :2] = [1 + 2 * i, 2 + 2 * i]
        p = np.arange(start, start + len(toks))
        ids += list(toks)
        pos += list(p)
        slot_map += list(tables[i, p // PAGE] * PAGE + p % PAGE)
        cu.append(cu[-1] + len(toks))
        lens.append(start + len(toks))
    pad, pad_rows = n_tok - len(ids), rows - len(seqs)
    md = AttentionMetadata(
        jnp.asarray(slot_map + [0] * pad, jnp.int32), jnp.asarray(tables),
        jnp.asarray(lens + [0] * pad_rows, jnp.int32),
        jnp.asarray(cu + [cu[-1]] * pad_rows, jnp.int32),
        state_slots=jnp.asarray(list(slots) + [0] * pad_rows, jnp.int32))
    cache, logits = _jitted(model)(model.params, jnp.asarray(ids + [0] * pad, jnp.int32),
                                   jnp.asarray(pos + [0] * pad, jnp.int32), cache, md)
    logits = np.asarray(logits)
    return cache, [logits[a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]


# NOTE: slow: its one compile is ~7 s here (the chunked delta rule's, mostly); the default
# tier's hybrid numerics (tests/models/test_numerics.py) carry a state through chunks and
# single-token steps in a shuffled slot beside a padded request in the null slot.
@pytest.mark.slow
def test_batched_requests_keep_their_own_state(model):
    """Two requests prefilled then decoded together, each in its own state slot, give the
    logits each gives alone; a decode step without the carried state does not."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 6).tolist(), rng.integers(0, 64, 5).tolist()
    fresh = lambda: model.empty_cache(8, PAGE, 5)
    _, (alone_a,) = _step(model, fresh(), [(a, 0)], [3])
    _, (alone_b,) = _step(model, fresh(), [(b, 0)], [1])
    cache, (pa, pb) = _step(model, fresh(), [(a[:4], 0), (b[:3], 0)], [3, 1])
    cache, (da, db) = _step(model, cache, [(a[4:], 4), (b[3:], 3)], [3, 1])
    np.testing.assert_allclose(np.concatenate([pa, da]), alone_a, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([pb, db]), alone_b, rtol=0, atol=1e-5)
    # The same decode step from zeroed states (pages kept) must disagree: the state carries.
    cache2, _ = _step(model, fresh(), [(a[:4], 0), (b[:3], 0)], [3, 1])
    cache2 = cache2._replace(conv=jnp.zeros_like(cache2.conv),
                             recurrent=jnp.zeros_like(cache2.recurrent))
    _, (lost_a, _) = _step(model, cache2, [(a[4:], 4), (b[3:], 3)], [3, 1])
    assert np.abs(lost_a - alone_a[4:]).max() > 1e-2


# NOTE: slow: two ~5 s compiles (one device and two).
@pytest.mark.slow
def test_tensor_parallel_2_matches_one_device(model):
    """Weights split by heads (the linear layers' by key heads), the state pools by channels
    and value heads: a prefill then a decode step give one device's logits, and the pools
    stay split."""
    tp = make_tensor_parallel(model.cfg, 2)
    specs = tp.param_specs(model.params)["layers"]["linear_attn"]
    assert specs["in_proj_qkv"]["kernel"] == P(None, None, ("kv", "rep"))
    assert specs["out_proj"]["kernel"] == P(None, ("kv", "rep"), None)
    assert specs["conv1d"] == P(None, None, ("kv", "rep"))
    sharded = Model(model.cfg, tp.shard_params(model.params))
    fresh = model.empty_cache(8, PAGE, 5)
    state = tp.state_shardings()
    split = HybridCache(jax.device_put(fresh.pages, tp.kv_pages_sharding()),
                        jax.device_put(fresh.conv, state["conv"]),
                        jax.device_put(fresh.recurrent, state["recurrent"]))
    a = np.random.default_rng(1).integers(0, 64, 7).tolist()
    cache, (want_p,) = _step(model, fresh, [(a[:6], 0)], [2])
    _, (want_d,) = _step(model, cache, [(a[6:], 6)], [2])
    cache, (got_p,) = _step(sharded, split, [(a[:6], 0)], [2])
    _, (got_d,) = _step(sharded, cache, [(a[6:], 6)], [2])
    np.testing.assert_allclose(np.concatenate([got_p, got_d]),
                               np.concatenate([want_p, want_d]), rtol=0, atol=1e-5)
    # ("kv" has one device here: the spec may name "rep" alone)
    assert cache.recurrent.sharding.is_equivalent_to(state["recurrent"], 5)
    assert cache.conv.sharding.is_equivalent_to(state["conv"], 4)


def test_truncated_draft_is_refused(model):
    from jaxserve.spec_decode.draft import truncate_layers

    with pytest.raises(ValueError, match=r"linear_layers=\[0, 1, 2\]\) is not built"):
        truncate_layers(model, 2)
