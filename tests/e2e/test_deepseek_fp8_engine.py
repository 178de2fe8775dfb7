"""A DeepSeek-V3 FP8 checkpoint (its MLA projections, experts and dense MLP in blocks with edge
blocks, kv_b_proj dequantized at load) served by the engine with quantization="auto":
transformers' greedy tokens on the dequantized weights, alone and batched, chunked."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import PROMPTS, hf_greedy
from tests.models.test_fp8_checkpoint import write_deepseek_fp8

torch = pytest.importorskip("torch")

# An 8-token budget (every prompt is longer: each is prefilled in chunks), as
# tests/e2e/test_quantized_checkpoint_engine.py's engines.
ENGINE = {**TINY_ENGINE, "warmup": False, "max_num_batched_tokens": 8, "max_num_seqs": 8,
          "max_model_len": 128, "num_kv_blocks": 32}
MAX_TOKENS = 12


@pytest.mark.slow(reason="a DeepSeek engine's compiles (~18 s); the default tier loads the "
                         "same kind of checkpoint (tests/models/test_fp8_checkpoint.py)")
def test_deepseek_v3_fp8_greedy_alone_and_batched(smollm2_tokenizer, tmp_path):
    directory = str(tmp_path / "model")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf, _ = write_deepseek_fp8(directory, vocab_size=49152)  # SmolLM2's vocabulary
        smollm2_tokenizer.save_pretrained(directory)
        ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
        want = [hf_greedy(hf, x, MAX_TOKENS) for x in ids]
    finally:
        torch.set_num_threads(threads)
    assert all(len(x) > ENGINE["max_num_batched_tokens"] for x in ids)  # chunked prefill
    assert all(len(set(w)) > 1 for w in want)  # not a degenerate repeat
    llm = LLM(directory, quantization="auto", **ENGINE)
    assert llm.engine.quantization == "fp8"
    leaves = {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in
              jax.tree_util.tree_leaves_with_path(llm.engine.runner.params)}
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        assert leaves[f"layers/self_attn/{name}/qweight"].dtype == np.dtype("float8_e4m3fn")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for which in ([1], [0, 1, 2]):
        outs = llm.generate([{"prompt_token_ids": ids[i]} for i in which], params,
                            use_tqdm=False)
        for i, out in zip(which, outs, strict=True):
            assert out.outputs[0].token_ids == want[i], i
