"""MTP drafts: a tiny random DeepSeek-V3 whose checkpoint carries one MTP layer (written by the
test: `mtp_target`). Greedy outputs equal transformers' target alone (batched, chunked,
recomputed after preemption, prefix hits; and alone); every proposal the engine makes is the
torch reference's (transformers' decoder layer as the MTP block, vLLM's math around it);
bad configs are ValueErrors naming the field."""

from __future__ import annotations

import pytest

from jaxserve import LLM
from jaxserve.config import SpeculativeConfig
from jaxserve.spec_decode.mtp import MtpSpeculator
from models.loaders import load_model
from tests.e2e.hf_family import hf_greedy
from tests.spec_decode import mtp_checks
from tests.spec_decode.mtp_checks import ARGS, MAX_TOKENS, PROMPTS, generate, recording

pytest.importorskip("torch")
mtp_target = pytest.importorskip("tests.spec_decode.mtp_target")

K = 2


@pytest.fixture(scope="module")
def target_dir(smollm2_tokenizer, tmp_path_factory):
    import torch

    torch.set_num_threads(1)  # the reference's small layer calls: threads only contend
    directory = str(tmp_path_factory.mktemp("deepseek_mtp"))
    return directory, mtp_target.write_target(directory, smollm2_tokenizer)


@pytest.fixture(scope="module")
def want(target_dir, smollm2_tokenizer) -> list[list[int]]:
    _, hf = target_dir
    return [hf_greedy(hf, smollm2_tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def spec(target_dir, smollm2_tokenizer) -> tuple[LLM, list]:
    directory, _ = target_dir
    llm = LLM(load_model(directory, "float32"), tokenizer=smollm2_tokenizer,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": K},
              **ARGS)
    assert isinstance(llm.engine.speculator, MtpSpeculator)
    return llm, recording(llm)


def check_proposals(records, final, target_dir, k: int = K) -> int:
    """Every recorded proposal is the torch reference's (`mtp_checks.check_proposals`)."""
    directory, hf = target_dir
    ref, tensors = mtp_target.reference_block(directory), mtp_target.mtp_tensors(directory)
    states = {}

    def reference(tokens, num, base, k):
        key = tuple(tokens)
        if key not in states:
            states[key] = mtp_target.target_states(hf, tokens)
        return mtp_target.reference_proposals(hf, ref, tensors, states[key], tokens, num,
                                              base, k)

    return mtp_checks.check_proposals(records, final, reference, k)


def test_greedy_identity_and_proposals(spec, want, target_dir):
    """Batched, chunked and preempted, then again with prefix hits: transformers' tokens;
    proposals were made and each is the reference's (the layer's latent K/V stayed right
    across steps, preemption and the head's prefix cache); every page went back."""
    llm, records = spec
    records.clear()
    before = llm.get_metrics()
    got, final = generate(llm, PROMPTS)
    assert got == want
    mid = llm.get_metrics()
    got, more = generate(llm, PROMPTS[:2])
    assert got == want[:2]
    final.update(more)
    after = llm.get_metrics()
    assert mid["jaxserve:num_preemptions"] > before["jaxserve:num_preemptions"]
    assert after["jaxserve:prefix_cache_hits"] > mid["jaxserve:prefix_cache_hits"]
    assert llm.engine.speculator.pages.num_cached_pages_hit > 0
    drafted = "jaxserve:spec_decode_num_draft_tokens"
    assert after[drafted] > mid[drafted] > before[drafted]
    assert after["jaxserve:kv_cache_usage_perc"] == 0.0
    assert not llm.engine.speculator.pages.seqs
    assert len(records) > 20
    assert check_proposals(records, final, target_dir) > 0.9 * K * len(records)


def test_greedy_identity_alone(spec, want):
    llm, _ = spec
    assert generate(llm, [PROMPTS[1]])[0] == [want[1]]


def test_refusals(target_dir, tiny_model_dir):
    """k < 1, a family without MTP layers, a checkpoint without them, no checkpoint: each a
    ValueError naming its field; vLLM's per-family names are the method's."""
    directory, _ = target_dir
    for alias in ("mtp", "deepseek_mtp", "qwen3_next_mtp"):
        cfg = SpeculativeConfig.from_dict({"method": alias, "num_speculative_tokens": 1})
        assert cfg.method == "mtp" and cfg.model is None
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 0})
    sizes = dict(num_pages=4, page_size=16, max_model_len=64, max_num_seqs=2)

    def make(target, **extra):
        config = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2,
                                              **extra})
        return MtpSpeculator(config, target=target, **sizes)

    llama = load_model(tiny_model_dir, "float32")
    with pytest.raises(ValueError, match=r"speculative_config.method: .*LlamaForCausalLM has none"):
        make(llama)
    deepseek = load_model(directory, "float32")
    with pytest.raises(ValueError, match=r"speculative_config.method: .* holds no MTP layer"):
        make(deepseek, model=tiny_model_dir)  # a checkpoint without the layer
    with pytest.raises(ValueError, match="speculative_config.model: no checkpoint directory"):
        make(deepseek, model=directory + "-missing")


@pytest.mark.slow  # another target and engine: ~30 s; the own-head form runs in the default tier
def test_the_targets_lm_head(smollm2_tokenizer, tmp_path):
    """A checkpoint without `shared_head.head`: the layer proposes with the target's LM
    head, as the reference does; greedy output stays transformers'."""
    directory = str(tmp_path)
    hf = mtp_target.write_target(directory, smollm2_tokenizer, own_head=False)
    llm = LLM(load_model(directory, "float32"), tokenizer=smollm2_tokenizer,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3},
              **{**ARGS, "enable_prefix_caching": False})
    assert "head" not in llm.engine.speculator.head.params
    records = recording(llm)
    got, final = generate(llm, PROMPTS[1:3])
    assert got == [hf_greedy(hf, smollm2_tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS[1:3]]
    assert check_proposals(records, final, (directory, hf), k=3) > 0.9 * 3 * len(records)


@pytest.mark.slow  # a warmed-up engine: its compiles from an empty cache
def test_nothing_compiles_after_warm_up(target_dir, smollm2_tokenizer, want):
    directory, _ = target_dir
    llm = LLM(load_model(directory, "float32"), tokenizer=smollm2_tokenizer,
              speculative_config={"method": "mtp", "num_speculative_tokens": K},
              **{**ARGS, "warmup": True})
    llm.engine.speculator.gate.min_acceptance = 0.0
    assert generate(llm, PROMPTS)[0] == want
    metrics = llm.get_metrics()
    assert metrics["jaxserve:spec_decode_num_drafts"] > 0
    assert metrics["jaxserve:num_compilations"] == 0
