"""gpt-oss through the engine beyond the conformance row: its MXFP4 experts served as stored
equal transformers' dequantizing load, greedy; expert parallelism 2 over those experts
equals one device; and a long decode holds only its full-attention layers' pages past the
window (the sliding layers' group gives pages back). All slow: the default tier's gpt-oss
numerics are tests/models/test_numerics.py's and tests/models/test_gpt_oss.py's."""

from __future__ import annotations

import jax
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import PROMPTS, TINY, build_hf_model, hf_greedy, long_decode

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.models.gpt_oss_mxfp4 import dequantized_hf, write_mxfp4  # noqa: E402

pytestmark = pytest.mark.slow(reason="gpt-oss engines (~10-20 s each); numerics are default")

WINDOW = 8  # one page of 8: a page leaves the sliding group's window every 8 tokens
ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
# Sliding, full, sliding, full (gpt-oss's default pattern); 4 experts of 32 (MXFP4 blocks of
# 32 along both expert widths), top 2.
CONFIG = dict(TINY, num_hidden_layers=4, head_dim=16, num_local_experts=4,
              num_experts_per_tok=2, intermediate_size=32, sliding_window=WINDOW,
              rope_parameters=ROPE)
MAX_TOKENS = 16
ENGINE = {**TINY_ENGINE, "warmup": False, "block_size": 8, "max_num_batched_tokens": 16,
          "max_model_len": 256}


@pytest.fixture(scope="module")
def float_dir(smollm2_tokenizer, tmp_path_factory) -> str:
    """The tiny float gpt-oss, its expert biases and sinks drawn apart from their zero and
    small initial values."""
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    hf = build_hf_model("GptOssConfig", "GptOssForCausalLM", CONFIG, smollm2_tokenizer, path,
                        norm_center=1.0)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("_proj_bias", ".bias")):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def mxfp4(float_dir, smollm2_tokenizer, tmp_path_factory):
    """(MXFP4 directory, prompts' ids, transformers' dequantized greedy tokens)."""
    path = write_mxfp4(float_dir, str(tmp_path_factory.mktemp("gpt_oss_mx") / "m"))
    hf = dequantized_hf(path)
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    return path, ids, [hf_greedy(hf, x, MAX_TOKENS) for x in ids]


def _greedy(llm: LLM, ids) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_mxfp4_experts_greedy_equal_transformers(mxfp4):
    path, ids, want = mxfp4
    llm = LLM(path, **ENGINE)
    assert llm.engine.model.quant.name == "mxfp4"
    assert _greedy(llm, ids[:1]) == want[:1]  # alone
    assert _greedy(llm, ids) == want  # batched
    assert all(len(set(w)) > 1 for w in want)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")
def test_expert_parallel_mxfp4_equals_one_device(mxfp4):
    """EP 2 (two of the four MXFP4 experts per device, their biases with them) gives one
    device's tokens, which are transformers' (above)."""
    path, ids, want = mxfp4
    llm = LLM(path, **ENGINE, expert_parallel_size=2)
    experts = llm.engine.runner.params
    experts = experts.get("params", experts)["layers"]["mlp"]["experts"]
    assert len(experts["down_proj"]["qweight"].sharding.device_set) == 2
    assert _greedy(llm, ids) == want


def test_pages_go_back_during_a_long_decode(float_dir, smollm2_tokenizer):
    """While one request decodes 120 tokens, the sliding layers' group holds at most the
    window's pages (two or three of 8 tokens), the full layers' group one per 8 tokens."""
    llm = LLM(float_dir, **ENGINE)
    engine, kv = llm.engine, llm.engine.kv
    assert kv.num_groups == 2 and sorted(kv.group_windows) == [0, WINDOW]
    ids = smollm2_tokenizer(PROMPTS[0]).input_ids
    seen = long_decode(engine, ids, 120)
    most, used = seen["most"], seen["used"]
    full = kv.group_windows.index(0)
    sliding = 1 - full
    length = len(ids) + 120
    assert most[sliding] <= 3 < most[full]
    assert most[full] >= (length - 1) // 8  # every token's page kept
    assert used <= most[full] + 3  # the pool: the full group's pages, the window's few more
    assert kv.usage == 0.0 and kv.pool.num_used_pages == 0


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")
def test_tensor_parallel_equals_transformers(float_dir, smollm2_tokenizer):
    """TP 2 (query heads split, the sinks whole on each device and sliced with them; each
    expert's width split, its gate/up biases with it, the down bias added once) gives
    transformers' float tokens."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir, attn_implementation="eager", dtype=torch.float32).eval()
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    llm = LLM(float_dir, **ENGINE, tensor_parallel_size=2)
    assert _greedy(llm, ids) == [hf_greedy(hf, x, MAX_TOKENS) for x in ids]
