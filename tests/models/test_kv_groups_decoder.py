"""The decoder over a hybrid KV cache (several KV cache groups) computes what the plain pool does.

The oracle is the same model on the plain one-group pool (whose numerics
`test_numerics.py` checks against transformers): a tiny random Gemma-like model (sliding
and full-attention layers, soft caps, sandwich norms) runs the same teacher-forced steps
both ways. In the hybrid run each group has its own pages, every unwritten slot holds NaN,
and the sliding groups give back (null out, and poison) the pages that fell out of the
window before each step, as the host-side manager does. On the cpu backend both run with
packed panels (`models.linear.panels`, read at the layer index, not the pool slot).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.utils import cdiv
from models.config import ArchConfig
from models.kv_groups import KVGroupLayout, kv_group_layout, single_group
from models.linear import ServingChoice, can_panel, serving_form
from models.model import Model, random_params
from pallas_kernels import AttentionMetadata, cpu_ffi

CFG = ArchConfig("Gemma2ForCausalLM", vocab_size=97, hidden_size=32, intermediate_size=48,
                 num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8,
                 layer_windows=(8, 0, 8, 0, 8, 8), hidden_act="gelu_pytorch_tanh",
                 norm_offset=1.0, embed_scale=True, sandwich_norms=True,
                 attn_logit_softcap=20.0, max_position_embeddings=64)
LAYOUT = kv_group_layout(CFG.layer_windows)  # groups: full (1, 3), sliding (0, 2), (4, 5)
PAGE, WIDTH, NUM_PAGES = 4, 7, 48
# New tokens of two requests per step, every step padded to 8 tokens (one compile per
# layout): chunked prefills, decodes, and a chunk after the sliding groups gave pages back
# (its tile reads them as the null page). The Pallas decode kernel over given-back pages
# is tests/kernels/test_kv_groups.py's.
STEPS = [(5, 3), (5, 3), (4, 4), (1, 1), (1, 1), (6, 2), (1, 1), (1, 1)]
BACKENDS = ["xla", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_ffi.available(), reason="no CPU decode kernel here")),
    # NOTE: the Pallas kernels over a group's tables are checked alone in the default tier
    # (tests/kernels/test_kv_groups.py); the whole interpreted model is slow.
    pytest.param("pallas", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def params():
    # Sharper than the default init, so the attention pattern matters to the logits.
    return jax.tree_util.tree_map(lambda x: x * 3.0, random_params(CFG, seed=3))


def test_layout_of_the_test_model():
    assert LAYOUT == KVGroupLayout((0, 8, 8), (1, 0, 1, 0, 2, 2), (0, 0, 1, 1, 0, 1), 2)


def _run(model: Model, tables: np.ndarray, windows: tuple[int, ...], poison: float):
    """Teacher-forced logits of STEPS' tokens, per step, through block tables per group
    (i32[G, 2, WIDTH]); a group with a window gives back its pages before the window."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (2, sum(s[0] for s in STEPS))).astype(np.int32)
    kv = jnp.full(model.kv_pages_shape(NUM_PAGES, PAGE), poison, model.dtype)
    tables = tables.copy()
    grouped = model.is_hybrid

    def step(params, kv, ids, pos, md):
        kv, hidden = model.forward(params, ids, pos, kv, md)
        return kv, model.compute_logits(params, hidden)

    step = jax.jit(step)
    done, out = [0, 0], []
    for counts in STEPS:
        n, bucket = sum(counts), 8
        for g, window in enumerate(windows):  # pages wholly before every query's window
            for r in range(2 if window else 0):
                for p in range(max(0, done[r] - window + 1) // PAGE):
                    if tables[g, r, p]:
                        kv = kv.at[:, :, :, tables[g, r, p]].set(jnp.nan)
                        tables[g, r, p] = 0
        ids, pos = np.zeros(bucket, np.int32), np.zeros(bucket, np.int32)
        row = np.zeros(bucket, np.int64)
        cu = [0]
        for r, c in enumerate(counts):
            ids[cu[-1]:cu[-1] + c] = tokens[r, done[r]:done[r] + c]
            pos[cu[-1]:cu[-1] + c] = np.arange(done[r], done[r] + c)
            row[cu[-1]:cu[-1] + c] = r
            cu.append(cu[-1] + c)
        slots = tables[:, row, pos // PAGE] * PAGE + pos % PAGE  # i32[G, bucket]
        slots[:, n:] = 0
        kv_lens = np.array([d + c for d, c in zip(done, counts, strict=True)], np.int32)
        md = AttentionMetadata(jnp.asarray(slots if grouped else slots[0]),
                               jnp.asarray(tables if grouped else tables[0]),
                               jnp.asarray(kv_lens), jnp.asarray(cu, jnp.int32))
        kv, logits = step(model.params, kv, jnp.asarray(ids), jnp.asarray(pos), md)
        out.append(np.asarray(logits[:n]))
        done = list(kv_lens)
    return np.concatenate(out)


def _tables(num_groups: int) -> np.ndarray:
    """i32[num_groups, 2, WIDTH]: every group's pages its own, shuffled, from one pool."""
    need = cdiv(sum(s[0] for s in STEPS), PAGE)
    pages = np.random.default_rng(1).permutation(np.arange(1, NUM_PAGES))
    tables = np.zeros((num_groups, 2, WIDTH), np.int32)
    tables[:, :, :need] = pages[:num_groups * 2 * need].reshape(num_groups, 2, need)
    return tables


@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_layout_gives_the_plain_pools_logits(params, backend):
    plain = Model(CFG, params, serving=ServingChoice(backend))
    hybrid = Model(CFG, params, serving=ServingChoice(backend), kv_layout=LAYOUT)
    if can_panel(CFG, plain.quant, plain.dtype, backend):  # panels, read by layer
        plain, hybrid = serving_form(plain, panels=True), serving_form(hybrid, panels=True)
        assert hybrid.kv_layout == LAYOUT and hybrid.serving.panels
    assert hybrid.kv_pages_shape(NUM_PAGES, PAGE)[0] == 2  # slots, not layers
    want = _run(plain, _tables(1), (0,), 0.0)
    got = _run(hybrid, _tables(3), LAYOUT.windows, np.nan)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # The ablation: a group keeping fewer tokens than its layers' window changes the logits
    # (so the runs above did read the sliding groups' pages through their own tables).
    short = _run(hybrid, _tables(3), (0, 4, 4), 0.0)
    assert np.abs(short - want).max() > 1e-3


def test_one_group_layout_is_the_plain_model(params):
    plain = Model(CFG, params, serving=ServingChoice("xla"))
    same = Model(CFG, params, serving=ServingChoice("xla"),
                 kv_layout=single_group(CFG.num_layers))
    assert not same.is_hybrid and same.module == plain.module
    assert same.kv_pages_shape(5, PAGE) == plain.kv_pages_shape(5, PAGE) == (6, 2, 2, 5, 4, 8)


def test_metadata_of_another_group_count_is_an_error(params):
    hybrid = Model(CFG, params, serving=ServingChoice("xla"), kv_layout=LAYOUT)
    kv = jnp.zeros(hybrid.kv_pages_shape(4, PAGE))
    ids = jnp.zeros(2, jnp.int32)
    # plain 2-D arrays; two groups' arrays; three groups' tables with one slot mapping
    for slots, tables in [((2,), (2, 3)), ((2, 2), (2, 2, 3)), ((2,), (3, 2, 3))]:
        md = AttentionMetadata(jnp.zeros(slots, jnp.int32), jnp.zeros(tables, jnp.int32),
                               jnp.ones(2, jnp.int32), jnp.arange(3, dtype=jnp.int32))
        with pytest.raises(ValueError, match="do not carry the 3 KV cache group"):
            hybrid.forward(hybrid.params, ids, ids, kv, md)


@pytest.mark.parametrize("layout,match", [
    (single_group(5), "kv_layout maps 5 layers; the model has 6"),
    (KVGroupLayout((0, 8), (1, 0, 1, 0, 1, 1), (0, 0, 1, 1, 2, 3), 2),
     "layer 4 has group 1 / slot 2, outside 2 groups of 2 slots"),
    (KVGroupLayout((0, 8), (1, 0, 1, 0, 1, 2), (0, 0, 1, 1, 2, 0), 3), "layer 5 has group 2"),
    (KVGroupLayout((0, 8), (1, 0, 1, 0, 1, 1), (0, 0, 1, 1, 1, 0), 2),
     "layer 4 shares slot 1 of group 1"),
    (KVGroupLayout((8, 4), (1, 0, 1, 0, 1, 1), (0, 0, 1, 1, 2, 3), 4),
     "layer 0 .window 8. is in group 1, which keeps only the last 4 tokens"),
    (KVGroupLayout((8, 0), (1, 0, 1, 0, 1, 1), (0, 0, 1, 1, 2, 3), 4),
     "layer 1 .window none. is in group 0"),
    (KVGroupLayout((0,), (0,) * 6, tuple(range(6)), 7), "num_slots=7 must be in"),
])
def test_layout_that_does_not_fit_is_an_error(params, layout, match):
    with pytest.raises(ValueError, match=match):
        Model(CFG, params, serving=ServingChoice("xla"), kv_layout=layout)
