"""The C++ CPU decode kernel (the "cpu" backend) against the jnp reference: decode rows of
every geometry, unrolled and generic head sizes, windows, soft caps, empty rows, NaN in free
pages, pools it does not read, prefill tokens of short contexts (each a kernel row) beside
the XLA tiles of long ones; and every way its build can fail."""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention, resolve_backend
from pallas_kernels.cpu_ffi import build, op, paged_decode_cpu
from pallas_kernels.kv_quant import quantize_kv
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla
from tests.kernels.cases import Geometry, slow_except, tolerance
from tests.kernels.test_ragged_paged_attention import GEOMETRIES, SM_SCALE
from tests.kernels.test_ragged_xla import LAYOUTS, inputs

# NOTE: by name: the package's `ragged_paged_attention` attribute is the function.
XLA_MODULE = importlib.import_module("pallas_kernels.ragged_paged_attention.xla")

needs_kernel = pytest.mark.skipif(not op.available(),
                                  reason=f"no CPU decode kernel here: {op.unavailable_reason()}")

reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))
# NOTE: calls pass `sliding_window` even when it is 0: an omitted one is a constant of the
# program, a passed one an argument, so calls with and without a window share a compile.


# The serving default `cpu_context_max_len`: more keys than any request of these tests has
# (8 pages of at most 16), so every token goes to the kernel, as with no limit at all.
EVERY_TOKEN = 768


def attention(backend: str, min_rows: int = 1, context_max_len: int = EVERY_TOKEN):
    """The XLA path, its decode rows on the kernel ("cpu") or not ("xla"); the kernel from
    steps of `min_rows` tokens on (the test steps have 4 rows, the serving default is 8),
    and for every token of requests with at most `context_max_len` keys."""
    # NOTE: one jitted function per setting, however it is asked for: tests of the same
    # setting and shapes share a compile.
    return _attention(backend, min_rows, context_max_len)


@functools.cache
def _attention(backend: str, min_rows: int, context_max_len: int):
    return jax.jit(functools.partial(ragged_paged_attention_xla, cpu_decode=backend == "cpu",
                                     cpu_decode_min_rows=min_rows,
                                     cpu_context_max_len=context_max_len),
                   static_argnames=("sm_scale", "soft_cap"))


def decode_inputs(g: Geometry, kv_lens, seed=0, poison=np.nan):
    """Decode rows first (one token each, as the runner packs them), then padding."""
    return inputs(g, [1 if k else 0 for k in kv_lens], kv_lens, seed, poison)


def check(g, kv_lens, window=0, soft_cap=None, seed=0, scale=1.0):
    q, kv_pages, md = decode_inputs(g, kv_lens, seed)
    q = (q * scale).astype(q.dtype)
    common = dict(sm_scale=SM_SCALE, sliding_window=window, soft_cap=soft_cap)
    want = np.asarray(reference(q, kv_pages, 1, md, **common), np.float32)
    got = np.asarray(attention("cpu")(q, kv_pages, 1, md, **common), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(g.dtype), rtol=0)
    rows = sum(1 for k in kv_lens if k)
    assert not got[rows:].any(), "padded tokens must produce zeros"
    return got


# Rows of one key, of a page and a bit, a full table (8 pages), and an empty row.
KV_LENS = [1, 19, 64, 0]


# NOTE: one compile per geometry (the window is data). The default tier runs the kernel's
# unrolled code with key-by-key scoring (page size 8, GQA 1) and with 16-key blocks (page
# size 16, head size 64, GQA 3); head size 128 runs in test_soft_cap_matches_reference and
# test_prefill_tokens_on_the_kernel_with_a_soft_cap, and bfloat16 queries and pools in the
# slow tier (16-bit pools under float32 queries, the CPU serving case:
# test_16_bit_pools_match_reference_on_their_float32_values).
@needs_kernel
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("g", slow_except(GEOMETRIES, 0, 3), ids=str)
def test_decode_rows_match_reference(g, window):
    kv_lens = [min(k, g.width * g.page_size) for k in KV_LENS]
    check(g, kv_lens, window)


@needs_kernel
@pytest.mark.parametrize("g", slow_except([Geometry(8, 2, 12, 32), Geometry(4, 3, 1, 48)], 0),
                         ids=str)
def test_generic_head_sizes_match_reference(g):
    # Head sizes and groups without an unrolled copy in the kernel (its generic loop; the
    # second geometry, the same code, in the slow tier).
    check(g, [5, 30, 17, 2], window=7)


@needs_kernel
def test_soft_cap_matches_reference():
    # NOTE: head size 128 (16-key blocks), the programs of the prefill test with a cap below.
    g = GEOMETRIES[1]
    capped = check(g, [40, 3, 64, 11], soft_cap=2.0, scale=4.0)
    q, kv_pages, md = decode_inputs(g, [40, 3, 64, 11])
    uncapped = np.asarray(reference(q * 4.0, kv_pages, 1, md, sm_scale=SM_SCALE,
                                    sliding_window=0))
    assert np.abs(uncapped - capped).max() > 1e-2


@needs_kernel
def test_many_rows_spread_over_threads():
    # 32 rows x 3 KV heads: more work items than threads, in any order of completion.
    g = Geometry(16, 3, 3, 64, num_seqs=32, num_tokens=32, num_pages=160, width=8)
    kv_lens = [int(k) for k in np.random.default_rng(1).integers(1, 129, 32)]
    for _ in range(3):
        check(g, kv_lens, seed=4)


@needs_kernel
def test_nan_in_free_pages_changes_nothing():
    g = GEOMETRIES[3]
    outs = []
    for poison in (np.nan, 0.0, 1e4):
        q, kv_pages, md = decode_inputs(g, KV_LENS, 2, poison)
        outs.append(np.asarray(attention("cpu")(q, kv_pages, 1, md, sm_scale=SM_SCALE,
                                                 sliding_window=0)))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@needs_kernel
def test_nan_in_unread_slots_of_live_pages_changes_nothing():
    # The kernel scores whole 16-key blocks and drops the keys outside [window start,
    # len): NaN there (past each row's length in its last page, before the window start
    # in its first block) must not reach any output.
    g = Geometry(16, 3, 3, 64)
    kv_lens, window = [40, 19, 64, 27], 5
    q, kv_pages, md = decode_inputs(g, kv_lens, 6)
    pool = np.array(kv_pages)
    tables = np.asarray(md.block_tables)
    for row, n in enumerate(kv_lens):
        last = tables[row, (n - 1) // g.page_size]
        pool[:, :, :, last, (n - 1) % g.page_size + 1:] = np.nan  # past the length
        first = n - window  # keys before the window start, in the block that holds it
        for key in range(first // 16 * 16, first):
            pool[:, :, :, tables[row, key // g.page_size], key % g.page_size] = np.nan
    common = dict(sm_scale=SM_SCALE, sliding_window=window)
    got = np.asarray(attention("cpu")(q, jax.numpy.asarray(pool), 1, md, **common))
    want = np.asarray(attention("cpu")(q, kv_pages, 1, md, **common))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


@needs_kernel
def test_loading_the_kernel_keeps_subnormals():
    # A library linked with GCC's crtfastmath.o would turn on flush-to-zero for the whole
    # process when it loads (NumPy and torch numerics included).
    assert op.available()
    tiny = np.float32(1e-39)  # subnormal in float32
    assert tiny * np.float32(1.0) > 0


def test_non_positive_soft_cap_is_an_error():
    g = GEOMETRIES[3]
    q, kv_pages, md = decode_inputs(g, KV_LENS)
    qg = q[:4].reshape(4, g.num_kv_heads, g.group, g.head_dim)
    with pytest.raises(ValueError, match="soft_cap must be positive .* got 0.0"):
        paged_decode_cpu(qg, kv_pages, 1, md.block_tables, md.kv_lens, 0, sm_scale=SM_SCALE,
                         soft_cap=0.0)


@needs_kernel
@pytest.mark.parametrize("context_max_len", [0, EVERY_TOKEN])
def test_mixed_steps_merge_decode_rows_with_chunks(context_max_len):
    # Decode rows (the kernel) beside a prefill chunk of 26 keys: on the XLA context part's
    # tiles at 0, on the kernel (one row per token) at EVERY_TOKEN.
    q, kv_pages, md = inputs(GEOMETRIES[3], [1, 1, 1, 20], [9, 30, 2, 26], seed=3)
    want = np.asarray(reference(q, kv_pages, 1, md, sm_scale=SM_SCALE, sliding_window=4))
    got = np.asarray(attention("cpu", context_max_len=context_max_len)(
        q, kv_pages, 1, md, sm_scale=SM_SCALE, sliding_window=4))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


# Every token on the kernel, long contexts on the tiles and short ones on the kernel (the
# layouts' contexts are 1-57 keys), every prompt token on the tiles.
CONTEXT_MAX_LENS = [EVERY_TOKEN, 20, 0]


@needs_kernel
@pytest.mark.parametrize("context_max_len", CONTEXT_MAX_LENS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prefill_tokens_of_short_contexts_match_reference(layout, context_max_len):
    # Chunks, fresh prompts and verifying rows, each request on whichever side its context
    # length puts it, in a sliding window (so a token's first keys are skipped too).
    q, kv_pages, md = inputs(GEOMETRIES[3], *LAYOUTS[layout], seed=4)
    common = dict(sm_scale=SM_SCALE, sliding_window=5)
    want = np.asarray(reference(q, kv_pages, 1, md, **common))
    got = np.asarray(attention("cpu", context_max_len=context_max_len)(q, kv_pages, 1, md,
                                                                        **common))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    padded = int(np.asarray(md.cu_q_lens)[-1])
    assert not got[padded:].any(), "padded tokens must produce zeros"


@needs_kernel
@pytest.mark.parametrize("g", slow_except([Geometry(8, 2, 12, 32), GEOMETRIES[1]], 1), ids=str)
def test_prefill_tokens_on_the_kernel_with_a_soft_cap(g):
    # A generic head size (slow tier: the cap is the same code for every head size, and
    # test_soft_cap_matches_reference caps decode rows) and the unrolled head size 128,
    # every token on the kernel.
    q, kv_pages, md = inputs(g, [13, 1, 6, 0], [13, 40, 30, 0], seed=5)
    q = q * 4.0
    common = dict(sm_scale=SM_SCALE, soft_cap=2.0, sliding_window=0)
    want = np.asarray(reference(q, kv_pages, 1, md, **common), np.float32)
    got = np.asarray(attention("cpu")(q, kv_pages, 1, md, **common), np.float32)
    np.testing.assert_allclose(got, want, atol=tolerance(g.dtype), rtol=0)


# NOTE: a compile each; 30 splits the step between both routes (the default tier), the
# others send every token to one route (slow tier).
@needs_kernel
@pytest.mark.parametrize("context_max_len", slow_except([10**6, 30, 0], 1))
def test_each_token_takes_one_route(monkeypatch, context_max_len):
    # With the kernel answering "no keys" for every row, the tokens routed to it come out
    # exactly zero and the others still match the reference: no token is left to both
    # routes (it would match) or to neither (the reference check above). Verifying rows
    # beside a chunk, with the short tiles' pass: contexts 9-46 keys, one decode row; at
    # 30 the 23-key request is the kernel's, the 40- and 46-key ones the tiles'.
    q_lens, kv_lens = LAYOUTS["verifying_rows_beside_a_chunk"]
    q, kv_pages, md = inputs(GEOMETRIES[3], q_lens, kv_lens, seed=7)
    md = dataclasses.replace(md, short_tiles=True)

    def nothing(q, *args, **kwargs):
        n, k, g, d = q.shape
        return (jnp.zeros((n, k, g, d)), jnp.full((n, k, g), -1e30), jnp.zeros((n, k, g)))

    monkeypatch.setattr(XLA_MODULE, "paged_decode_cpu", nothing)
    fn = jax.jit(functools.partial(ragged_paged_attention_xla, cpu_decode=True,
                                   cpu_decode_min_rows=1, cpu_context_max_len=context_max_len),
                 static_argnames=("sm_scale",))
    got = np.asarray(fn(q, kv_pages, 1, md, sm_scale=SM_SCALE))
    want = np.asarray(reference(q, kv_pages, 1, md, sm_scale=SM_SCALE, sliding_window=0))
    for row, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        tokens = slice(sum(q_lens[:row]), sum(q_lens[:row + 1]))
        if q_len == 1 or kv_len <= context_max_len:
            assert not got[tokens].any(), f"row {row}: its tokens reached the tiles too"
        else:
            np.testing.assert_allclose(got[tokens], want[tokens], atol=2e-5, rtol=0)


@needs_kernel
def test_short_contexts_change_route_with_the_threshold():
    # The same step through the kernel and through the tiles: equal to rounding, but not
    # bit for bit, so the threshold does move the prompt's tokens between the two.
    q, kv_pages, md = inputs(GEOMETRIES[3], [20, 1, 0, 0], [20, 9, 0, 0], seed=6)
    common = dict(sm_scale=SM_SCALE, sliding_window=0)
    kernel = np.asarray(attention("cpu", context_max_len=20)(q, kv_pages, 1, md, **common))
    tiles = np.asarray(attention("cpu", context_max_len=19)(q, kv_pages, 1, md, **common))
    np.testing.assert_allclose(kernel, tiles, atol=2e-5, rtol=0)
    assert not np.array_equal(kernel[:20], tiles[:20])
    np.testing.assert_array_equal(kernel[20], tiles[20])  # the decode row: the kernel both


@needs_kernel
def test_int8_pool_keeps_the_xla_decode_part():
    # An 8-bit pool is not the kernel's: "cpu" must give what "xla" gives.
    g = GEOMETRIES[3]
    q, kv_pages, md = decode_inputs(g, KV_LENS, poison=0.0)
    pool = quantize_kv(kv_pages, np.int8)
    assert not op.supports(pool)
    np.testing.assert_array_equal(
        np.asarray(attention("cpu")(q, pool, 1, md, sm_scale=SM_SCALE)),
        np.asarray(attention("xla")(q, pool, 1, md, sm_scale=SM_SCALE)))


# (dtype, geometry): float16 (the CPU default for a GGUF's blocks) on 16-key blocks in the
# default tier; bfloat16 there, and both in the generic loop (row by row conversion), in
# the slow tier.
POOLS_16 = [("float16", GEOMETRIES[3]), ("bfloat16", Geometry(8, 2, 12, 32)),
            ("bfloat16", GEOMETRIES[3]), ("float16", Geometry(8, 2, 12, 32))]


@needs_kernel
@pytest.mark.parametrize("dtype,g", slow_except(POOLS_16, 0),
                         ids=[f"{d}-{g}" for d, g in POOLS_16])
def test_16_bit_pools_match_reference_on_their_float32_values(dtype, g):
    # The pool float32 queries read on the CPU with kv_cache_dtype float16/bfloat16. The
    # oracle is the reference on the same pages widened to float32: the kernel widens each
    # element exactly and sums in float32, the XLA tiles widen what they gather. Decode
    # rows and a short chunk on the kernel, a longer chunk on the tiles (20 keys at most).
    q, kv_pages, md = inputs(g, [1, 9, 1, 12], [20, 14, 40, 31], seed=7)
    pool = kv_pages.astype(dtype)
    assert op.supports(pool) and not op.supports(kv_pages.astype(jnp.int8))
    # Rows of 16-bit pages are widened into a 256-float buffer: longer heads are XLA's.
    wide = jax.ShapeDtypeStruct((1, 2, 1, 2, 16, 320), pool.dtype)
    assert not op.supports(wide) and op.supports(wide.update(dtype=jnp.float32))
    common = dict(sm_scale=SM_SCALE, sliding_window=5)
    want = np.asarray(reference(q, pool.astype(jnp.float32), 1, md, **common))
    got = np.asarray(attention("cpu", context_max_len=20)(q, pool, 1, md, **common))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    # The pages are rounded: the float32 pool they came from gives other outputs.
    exact = np.asarray(reference(q, kv_pages, 1, md, **common))
    assert np.abs(exact - want).max() > 1e-4


@needs_kernel
def test_kernel_state_of_an_empty_row():
    g = GEOMETRIES[3]
    q, kv_pages, md = decode_inputs(g, KV_LENS)
    qg = q[:4].reshape(4, g.num_kv_heads, g.group, g.head_dim)
    acc, m, denom = map(np.asarray, paged_decode_cpu(qg, kv_pages, 1, md.block_tables,
                                                     md.kv_lens, 0, sm_scale=SM_SCALE))
    assert (acc[3] == 0).all() and (denom[3] == 0).all() and (m[3] == -1e30).all()
    assert (denom[:3] >= 1).all()  # the max key contributes exp(0) == 1


@needs_kernel
def test_small_steps_take_the_kernel_too():
    # Through the backend interface: the kernel serves steps of 4 tokens as of 8 (a batch-1
    # decode step's XLA decode part cost more than its whole attention on the kernel).
    g = Geometry(16, 3, 3, 64, num_tokens=4)
    q, kv_pages, md = decode_inputs(g, KV_LENS)
    big = Geometry(16, 3, 3, 64, num_seqs=8, num_tokens=8, num_pages=64)
    qb, kv_big, md_big = decode_inputs(big, [5, 30, 17, 2, 40, 1, 64, 9])
    fn = jax.jit(functools.partial(ragged_paged_attention, backend="cpu"),
                 static_argnames=("sm_scale",))
    for args in ((q, kv_pages, 1, md), (qb, kv_big, 1, md_big)):
        assert op.TARGET in fn.lower(*args, sm_scale=SM_SCALE).as_text()
        want = np.asarray(reference(*args, sm_scale=SM_SCALE))
        np.testing.assert_allclose(np.asarray(fn(*args, sm_scale=SM_SCALE)), want, atol=2e-5,
                                   rtol=0)


def test_missing_compiler_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSERVE_FFI_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found.*no-such-compiler-xyz"):
        build.build()


def test_failing_compile_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSERVE_FFI_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # exits 1
    with pytest.raises(RuntimeError, match="building the CPU decode kernel failed"):
        build.build()
    left = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
    assert not left, "a failed build must leave no library behind"


def test_processes_starting_together_build_a_library_once(monkeypatch, tmp_path):
    """Two builders at once (test workers, replicas): one compiles, the other waits on the
    library's lock and loads that build."""
    import shutil
    import threading

    calls = tmp_path / "calls"
    fake = tmp_path / "fake-cxx"
    # Logs each call; "compiles" by touching the object, "links" an empty shared library.
    fake.write_text(f"""#!/bin/sh
echo "$@" >> {calls}
sleep 0.5
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
case " $* " in *" -c "*) touch "$out" ;;
  *) {shutil.which("g++") or "c++"} -shared -fPIC -x c++ /dev/null -o "$out" ;; esac
""")
    fake.chmod(0o755)
    monkeypatch.setenv("JAXSERVE_FFI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(fake))
    errors = []

    def run():
        try:
            build.build()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(calls.read_text().splitlines()) == 2  # one compile and one link, not two each
    assert len(list((tmp_path / "cache").glob("*.so"))) == 1


def test_unavailable_kernel(monkeypatch):
    # "auto" falls back to "xla"; asking for "cpu" names why it cannot be had.
    monkeypatch.setattr(op, "_registered", lambda: "no C++ compiler found")
    assert resolve_backend("auto") == "xla"
    with pytest.raises(ValueError, match="backend 'cpu' is unavailable here: no C\\+\\+ comp"):
        resolve_backend("cpu")
