"""Quantized checkpoints (FP8 blocks, GPTQ, AWQ, MXFP4, NVFP4, compressed-tensors' int4 and
int8) served by the engine with quantization="auto": transformers' greedy tokens on the
dequantized weights, alone, batched, chunked, and split over two devices."""

from __future__ import annotations

import dataclasses
import logging
import os
import re

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import PROMPTS, TINY, hf_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# K = 64 (hidden) and 128 (MLP width): groups of 32 and FP8 blocks of 32 divide every matmul
# and every half of it (tensor parallelism 2 splits o_proj's and down_proj's K).
LLAMA = dict(TINY, model_type="llama", num_hidden_layers=2, intermediate_size=128, head_dim=16)
QWEN3_MOE = dict(TINY, num_hidden_layers=2, head_dim=16, moe_intermediate_size=64,
                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
# NOTE: an 8-token budget (two token buckets to compile, as tests/e2e/test_family_conformance.py):
# every prompt here is longer, so each is prefilled in chunks.
ENGINE = {**TINY_ENGINE, "warmup": False, "max_num_batched_tokens": 8, "max_num_seqs": 8,
          "max_model_len": 128, "num_kv_blocks": 32}
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _gptq(directory: str):
    from tests.models.int_packers import gptq_tensors, write_quantized

    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False,
          "checkpoint_format": "gptq"}
    hf, _ = write_quantized(directory, LLAMA, qc, lambda q, z, s: gptq_tensors(q, z, s, 4, True),
                            4, 32, False, min_zero=1)
    return hf


def _awq(directory: str):
    from tests.models.int_packers import awq_tensors, write_quantized

    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
          "version": "gemm"}
    hf, _ = write_quantized(directory, LLAMA, qc, awq_tensors, 4, 32, sym=False)
    return hf


def _fp8_moe(directory: str):
    """A Qwen3-MoE whose attention and routed experts are FP8 in 32x32 blocks."""
    from tests.models.fp8_pack import write_dense_dir, write_fp8_dir

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**QWEN3_MOE, attn_implementation="eager")
    hf = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [32, 32]}
    dense = write_fp8_dir(directory, hf, (32, 32), qc)
    return transformers.AutoModelForCausalLM.from_pretrained(
        write_dense_dir(directory + "-dense", directory, dense), dtype=torch.float32,
        attn_implementation="eager").eval()


def _fp4(preset: str, config: dict):
    """compressed-tensors' MXFP4 or NVFP4 (its own compressor: `tests/models/fp4_pack`)."""

    def write(directory: str):
        from tests.models.ct_pack import write_ct
        from tests.models.fp4_pack import fp4_scheme

        hf, _ = write_ct(directory, config, fp4_scheme(preset))
        return hf

    return write


def _ct_int(bits: int, fmt: str, config: dict, activations: dict | None = None, **weights):
    """compressed-tensors' integer schemes (its own compressor: `tests/models/ct_pack`)."""

    def write(directory: str):
        from tests.models.ct_pack import scheme, write_ct

        hf, _ = write_ct(directory, config, scheme(fmt, activations, num_bits=bits, type="int",
                                                   **weights))
        return hf

    return write


WRITERS = {"fp8": _fp8_moe, "gptq": _gptq, "awq": _awq,
           "mxfp4": _fp4("mxfp4", LLAMA), "nvfp4": _fp4("nvfp4", dict(QWEN3_MOE,
                                                                      model_type="qwen3_moe")),
           "ct-w4a16": _ct_int(4, "pack-quantized", dict(QWEN3_MOE, model_type="qwen3_moe"),
                               strategy="group", group_size=32, symmetric=False),
           "ct-w8a8": _ct_int(8, "int-quantized", LLAMA,
                              dict(num_bits=8, type="int", symmetric=True, strategy="token",
                                   dynamic=True), strategy="channel", symmetric=True)}
# The engines of formats served through compressed-tensors run in the slow tier: their
# readers and methods have default-tier tests in tests/models/test_fp4_checkpoint.py and
# tests/models/test_compressed_tensors.py.
CT = ("mxfp4", "nvfp4", "ct-w4a16", "ct-w8a8")
# The dense int4 and MXFP4 formats on the `cpu` backend, read in place by its quantized kernel
# (its panels: groups as stored, AWQ's and asymmetric GPTQ's float32 zeros, FP4 codes and
# scales as stored); the FP8 MoE on XLA.
PANELS = {"attention_backend": "cpu"}


@dataclasses.dataclass
class Checkpoint:
    """A format's tiny checkpoint, its engine and transformers' tokens (dequantized)."""

    name: str
    directory: str
    served: str  # the served format's name (compressed-tensors for `CT`)
    llm: LLM
    ids: list[list[int]]
    want: list[list[int]]
    log: list[str]  # the engine's startup log
    ties: list[int]  # where each prompt's greedy text reaches a tie of transformers' logits

    def check(self, llm: LLM, which: list[int]) -> None:
        outs = llm.generate([{"prompt_token_ids": self.ids[i]} for i in which], GREEDY,
                            use_tqdm=False)
        for i, out in zip(which, outs, strict=True):
            cut = self.ties[i]  # at a tie either token is right, and the text parts there
            assert out.outputs[0].token_ids[:cut] == self.want[i][:cut], (self.name, i, cut)


def _first_tie(hf, ids: list[int], want: list[int]) -> int:
    """The first position of `want` whose top two transformers logprobs are within 1e-4
    (len(want) if none): GPTQ's tiny checkpoint has an exact tie (gap 0.0) at its third
    prompt's tenth token, which the engine's float rounding may break either way."""
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids + want])).logits[0, len(ids) - 1:-1].log_softmax(-1)
    top = logprobs.topk(2, -1).values  # [len(want), 2]
    close = (top[:, 0] - top[:, 1] < 1e-4).nonzero()
    cut = int(close[0, 0]) if len(close) else len(want)
    assert cut >= MAX_TOKENS // 2, cut  # most of the text is still compared
    return cut


@pytest.fixture(scope="module", params=[
    pytest.param(w, marks=pytest.mark.slow(reason="one engine per format: compressed-tensors' "
                                                   "in the slow tier"))
    if w in CT else w for w in WRITERS])
def checkpoint(request, smollm2_tokenizer, tmp_path_factory) -> Checkpoint:
    """One engine per format (module-scoped: every check below shares it)."""
    directory = str(tmp_path_factory.mktemp(request.param) / "model")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = WRITERS[request.param](directory)
        smollm2_tokenizer.save_pretrained(directory)
        ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
        want = [hf_greedy(hf, x, MAX_TOKENS) for x in ids]
        ties = [_first_tie(hf, x, w) for x, w in zip(ids, want, strict=True)]
    finally:
        torch.set_num_threads(threads)
    assert all(len(x) > ENGINE["max_num_batched_tokens"] for x in ids)  # chunked prefill
    assert all(len(set(w)) > 1 for w in want)  # not a degenerate repeat
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("jaxserve")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # NOTE: setLevel, not `.level =`: it clears the cache
    try:
        llm = LLM(directory, quantization="auto",
                  **(ENGINE if request.param == "fp8" else {**ENGINE, **PANELS}))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    log = [r.getMessage() for r in records]
    served = "compressed-tensors" if request.param in CT else request.param
    return Checkpoint(request.param, directory, served, llm, ids, want, log, ties)


def _leaves(llm: LLM) -> dict[str, jax.Array]:
    """The served weights by path ("layers/self_attn/o_proj/qweight", ...), whatever
    collection (the serving form's) holds them."""
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in
            jax.tree_util.tree_leaves_with_path(llm.engine.runner.params)}


def test_served_in_the_checkpoints_format(checkpoint):
    assert checkpoint.llm.engine.quantization == checkpoint.served
    leaves = _leaves(checkpoint.llm)
    assert not any("o_proj/kernel" in p for p in leaves)  # kept quantized on the device
    # The CPU panels serve the dense models (int, MXFP4); the MoEs (their experts) go to XLA.
    panels = checkpoint.name in ("gptq", "awq", "ct-w8a8", "mxfp4")
    assert checkpoint.llm.engine.runner.model.serving.panels == panels
    if checkpoint.name == "fp8":  # the routed experts' stacks too
        assert any("experts" in p and "down_proj" in p and p.endswith("qweight")
                   and leaf.dtype == np.dtype("float8_e4m3fn") for p, leaf in leaves.items())
    if checkpoint.name == "nvfp4":  # codes and scales in their stored dtypes, experts too
        assert any("experts" in p and "down_proj" in p and p.endswith("e4m3_scales")
                   and leaf.dtype == np.dtype("float8_e4m3fn") for p, leaf in leaves.items())


def test_startup_log_names_the_format_and_its_bytes(checkpoint):
    """The log line gives the served format, its device bytes and the checkpoint's weight
    tensors' bytes (the files' sizes less their headers), within 10% of each other."""
    path = os.path.join(checkpoint.directory, "model.safetensors")
    with open(path, "rb") as f:  # safetensors: u64 header length, the JSON header, the data
        on_disk = os.path.getsize(path) - 8 - int.from_bytes(f.read(8), "little")
    (line,) = [m for m in checkpoint.log if m.startswith("jaxserve: weights ")]
    got = re.match(rf"jaxserve: weights {checkpoint.served}: ([\d.]+) MiB on the device, "
                   r"([\d.]+) MiB in the checkpoint \(x([\d.]+)\);", line)
    assert got, line
    device, ckpt, ratio = map(float, got.groups())
    assert ckpt == round(on_disk / 2**20, 2)
    assert device == round(checkpoint.llm.engine.model.weight_bytes / 2**20, 2)
    assert abs(ratio - 1) < 0.10


def test_greedy_alone_then_batched(checkpoint):
    """One prompt alone, then all of them in one batch; each prompt is longer than the
    token budget (chunked prefill)."""
    checkpoint.check(checkpoint.llm, [1])
    checkpoint.check(checkpoint.llm, [0, 1, 2])


TP_FORMATS = ["gptq", *(pytest.param(f, marks=pytest.mark.slow)
                       for f in ("fp8", "awq", "mxfp4", "nvfp4", "ct-w4a16"))]


# NOTE: one tensor-parallel engine in the default tier (GPTQ's groups split on K); FP8's
# and AWQ's compile another model step each (slow tier, ~6 s apiece here).
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")
@pytest.mark.parametrize("name", TP_FORMATS)
def test_tensor_parallel_2(name, checkpoint):
    if checkpoint.name != name:
        pytest.skip("one format per engine")
    llm = LLM(checkpoint.directory, quantization="auto", tensor_parallel_size=2, **ENGINE)
    (codes,) = [leaf for p, leaf in _leaves(llm).items() if p.endswith("o_proj/qweight")]
    assert len(codes.sharding.device_set) == 2
    assert codes.sharding.spec[-2] is not None  # row parallel: K split on group boundaries
    checkpoint.check(llm, [0, 1, 2])
