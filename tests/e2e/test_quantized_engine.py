"""The engine over quantized weights and 8-bit KV pages: same tokens as float32 where the
weights are the same, pages (with their scales) survive swap (slow tier) and prefix
sharing, capacity grows with the smaller pages, and bad settings are ValueErrors naming the
field."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from models.linear import can_panel
from models.loaders import convert, load_model
from pallas_kernels.cpu_ffi import qgemm
from pallas_kernels.kv_quant import check_kv_cache_dtype

GREEDY = SamplingParams(temperature=0, max_tokens=16)
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
# Over two pages of shared prefix, so the prompts share full (8-bit) pages.
SHARED = ("It is a truth universally acknowledged, that a single man in possession of a good "
          "fortune, must be in want of a wife. However little known the feelings or views of "
          "such a man may be, this truth is well fixed. ")
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, warmup=False)
# A pool of a fixed size (the default sizes it from 1 GiB): what the tests run compiles once.
POOL = dict(num_kv_blocks=64)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _gap(logprobs: dict) -> float:
    """The gap between a position's two best logprobs (its sampled token and the runner-up,
    `logprobs=2`)."""
    best = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


@pytest.fixture(scope="module")
def gguf_model(smollm2_path):
    return load_model(smollm2_path, quantization="gguf")


def test_gguf_blocks_match_dequantized_weights(smollm2, gguf_model, smollm2_tokenizer):
    assert gguf_model.quant.name == "gguf"
    kinds = dict((m, f.kind) for m, f in gguf_model.quant.formats)
    assert kinds["q_proj"] == "q4" and kinds["embed_tokens"] == "q8"  # Q4_1 / Q8_0 file
    assert gguf_model.weight_bytes < smollm2.weight_bytes / 5
    dense = LLM(smollm2, tokenizer=smollm2_tokenizer, **SMALL, **POOL)
    quant = LLM(gguf_model, tokenizer=smollm2_tokenizer, **SMALL, **POOL)
    # On the `cpu` backend the blocks are read in place by the quantized matmul kernel.
    served = quant.engine.model
    assert served.serving.panels == can_panel(served.cfg, served.quant, served.dtype,
                                              served.serving.backend)
    # "auto" KV pages: float16 under the GGUF's blocks, float32 under the float32 weights.
    assert quant.engine.runner.kv_pages.dtype == np.float16
    assert dense.engine.runner.kv_pages.dtype == np.float32
    assert _tokens(quant.generate(PROMPTS, GREEDY)) == _tokens(dense.generate(PROMPTS, GREEDY))


@pytest.mark.slow
def test_gguf_blocks_in_place_match_transformers(gguf_model, hf_smollm2, smollm2_tokenizer):
    # The issue 49 oracle: the Q4_1 blocks read in place by the `cpu` backend's kernel give
    # transformers' greedy tokens on the same file (which it dequantizes to float32).
    # Slow: a 32-token transformers generate per prompt.
    from tests.e2e.test_greedy import MAX_TOKENS, _hf_greedy

    if not qgemm.available():
        pytest.skip("the CPU quantized matmul kernel is unavailable here")
    llm = LLM(gguf_model, tokenizer=smollm2_tokenizer, attention_backend="cpu", **SMALL, **POOL)
    assert llm.engine.model.serving.panels
    assert dict(llm.engine.model.quant.formats)["q_proj"].kind == "q4"
    tok = smollm2_tokenizer
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        ours = out[0].outputs[0].token_ids
        assert ours == _hf_greedy(hf_smollm2, ids, tok.eos_token_id), tok.decode(ours)


def test_int8_kv_prefix_sharing_keeps_tokens(gguf_model, smollm2_tokenizer):
    prompts = [SHARED + p for p in PROMPTS]
    roomy = LLM(gguf_model, tokenizer=smollm2_tokenizer, kv_cache_dtype="int8", **SMALL,
                **POOL)
    first = roomy.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=2))
    # A second pass of the same prompts hits the prefix cache: shared 8-bit pages.
    again = _tokens(roomy.generate(prompts, GREEDY))
    compared = 0
    for out, tokens in zip(first, again, strict=True):
        # NOTE: the hit changes the steps' chunks, and so which keys a token reads as it
        # computed them and which from 8-bit pages: the top-2 gaps move by up to 0.05 (SmolLM2,
        # 2026-12-07). The tokens must agree up to a near-tie of the first pass (its top
        # two logprobs within 0.06), where either token is right.
        want, sample = out.outputs[0].token_ids, out.outputs[0].logprobs
        close = [i for i, lp in enumerate(sample) if _gap(lp) < 0.06]
        upto = close[0] if close else len(want)
        assert tokens[:upto] == want[:upto], (upto, tokens, want)
        compared += upto
    assert compared >= 24  # of the 48 tokens
    assert roomy.get_metrics()["jaxserve:prefix_cache_hits"] > 0
    assert roomy.get_metrics()["jaxserve:kv_cache_usage_perc"] == 0  # no page leaked


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["int8", "float16"])
def test_small_kv_swap_keeps_tokens(gguf_model, smollm2_tokenizer, kv):
    # With 10 pages a scheduling pass swaps a request out and then schedules nothing; its
    # swap-out must still run (it once did not: KeyError in HostSwapSpace.swap_in). 8-bit
    # pages move with their scales, float16 ones as they are.
    prompts = [SHARED + p for p in PROMPTS]
    roomy = LLM(gguf_model, tokenizer=smollm2_tokenizer, kv_cache_dtype=kv, **SMALL)
    want = _tokens(roomy.generate(prompts, GREEDY))
    tight = LLM(gguf_model, tokenizer=smollm2_tokenizer, kv_cache_dtype=kv,
                num_kv_blocks=10, preemption_mode="swap", enable_prefix_caching=False, **SMALL)
    got = _tokens(tight.generate(prompts, GREEDY))
    m = tight.get_metrics()
    assert m["jaxserve:num_swap_outs"] > 0 and m["jaxserve:num_swap_ins"] > 0
    assert got == want


def test_kv_capacity_follows_bytes_per_token(gguf_model, smollm2_tokenizer):
    caps, dtypes = {}, {}
    for kv in ("auto", "float32", "float16", "bfloat16", "int8", "fp8_e5m2"):
        llm = LLM(gguf_model, tokenizer=smollm2_tokenizer, kv_cache_dtype=kv,
                  kv_cache_memory_gib=0.25, **SMALL)
        m = llm.get_metrics()
        pool = llm.engine.runner.kv_pages
        assert m["jaxserve:kv_cache_bytes_per_token"] * 16 * llm.engine.limits.num_pages \
            == pool.nbytes  # the metric is the pool's measured size
        caps[kv], dtypes[kv] = m["jaxserve:kv_cache_capacity_tokens"], pool.dtype.name
        if kv in ("int8", "fp8_e5m2"):
            assert pool.dtype.itemsize == 1 and pool.shape[-1] == 64 + 4
        else:
            assert pool.shape[-1] == 64
    assert dtypes["float16"] == "float16" and dtypes["bfloat16"] == "bfloat16"
    # "auto": float16 pages under a GGUF's blocks on the CPU (llama.cpp's cache type), the
    # float32 model's own dtype otherwise.
    assert dtypes["auto"] == "float16" and caps["auto"] == caps["float16"]
    assert caps["float16"] == caps["bfloat16"]
    assert 1.99 < caps["float16"] / caps["float32"] < 2.01
    assert caps["int8"] == caps["fp8_e5m2"]
    assert 3.6 < caps["int8"] / caps["float32"] < 3.9  # 256 bytes -> 68 per token and head


def test_quantized_checkpoint_loads_without_requantizing(smollm2_path, gguf_model, tmp_path):
    dst = str(tmp_path / "ckpt")
    convert(smollm2_path, dst, quantization="gguf")
    m = load_model(dst)
    assert m.quant == gguf_model.quant
    for a, b in zip(jax.tree_util.tree_leaves(m.params),
                    jax.tree_util.tree_leaves(gguf_model.params), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="quantization='int8'.*stored as 'gguf'"):
        load_model(dst, quantization="int8")


def test_int8_checkpoint_of_a_dense_model(tiny_model_dir, tmp_path):
    dst = str(tmp_path / "int8")
    convert(tiny_model_dir, dst, quantization="int8")
    m = load_model(dst)
    direct = load_model(tiny_model_dir, quantization="int8")
    assert m.quant.name == "int8"
    for a, b in zip(jax.tree_util.tree_leaves(m.params), jax.tree_util.tree_leaves(direct.params),
                    strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kwargs,field", [
    (dict(quantization="int4"), "quantization"),
    (dict(quantization=8), "quantization"),
    (dict(kv_cache_dtype="fp16"), "kv_cache_dtype"),
])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(**kwargs)


def test_gguf_quantization_needs_a_gguf_file(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization='gguf'.*hf model"):
        load_model(tiny_model_dir, quantization="gguf")


def test_loaded_model_with_another_quantization(gguf_model, smollm2_tokenizer):
    with pytest.raises(ValueError, match="quantization='int8' differs"):
        LLM(gguf_model, tokenizer=smollm2_tokenizer, quantization="int8")


def test_fp8_kv_refused_where_the_kernels_cannot_read_it(monkeypatch):
    check_kv_cache_dtype("fp8_e4m3", "xla")  # the XLA path reads fp8 everywhere
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3'.*TPU"):
        check_kv_cache_dtype("fp8_e4m3", "pallas")
    check_kv_cache_dtype("int8", "pallas")

    class OldGpu:
        compute_capability = "8.0"

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [OldGpu()])
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2'.*8.9"):
        check_kv_cache_dtype("fp8_e5m2", "pallas")


def test_float_kv_of_another_dtype_refused_by_the_pallas_kernels(tiny_model_dir):
    # The XLA and `cpu` paths widen any float page; the Pallas kernels read the model dtype.
    check_kv_cache_dtype("bfloat16", "xla", np.float32)
    check_kv_cache_dtype("float16", "cpu", np.float32)
    check_kv_cache_dtype("bfloat16", "pallas", jax.numpy.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype='float16' with the Pallas .*float32"):
        check_kv_cache_dtype("float16", "pallas", np.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' with the Pallas"):
        LLM(tiny_model_dir, attention_backend="pallas", kv_cache_dtype="bfloat16", **SMALL,
            **POOL)
