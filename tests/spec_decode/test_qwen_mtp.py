"""Qwen3-Next's MTP drafts: a tiny random Qwen3-Next (Gated DeltaNet beside gated attention;
its cache a `HybridCache`) whose checkpoint carries an MTP layer (`mtp.*`, written by the test:
`qwen_mtp_target`). Greedy outputs equal transformers' target alone (batched, chunked,
recomputed after preemption; alone; with prefix hits); every proposal the engine makes is the
torch reference's (transformers' full-attention decoder layer as the MTP block, vLLM's
`Qwen3NextMTP` math around it); bad checkpoints are ValueErrors naming the field."""

from __future__ import annotations

import functools

import pytest

from jaxserve import LLM
from jaxserve.config import SpeculativeConfig
from jaxserve.spec_decode.mtp import MtpSpeculator
from models.loaders import load_model
from models.mtp_layouts import QWEN
from tests.e2e.hf_family import hf_greedy
from tests.spec_decode import mtp_checks
from tests.spec_decode.mtp_checks import ARGS, MAX_TOKENS, PROMPTS, generate, recording

pytest.importorskip("torch")
qwen_mtp_target = pytest.importorskip("tests.spec_decode.qwen_mtp_target")

K = 2
# mtp_checks.ARGS's 9 pages are of the one full-attention layer here; the second pass's prefix
# hits also resume the linear layer's state snapshots.


@pytest.fixture(scope="module")
def target_dir(smollm2_tokenizer, tmp_path_factory):
    """(directory, transformers' target, the MTP block as a transformers layer)."""
    import torch

    torch.set_num_threads(1)  # the reference's small layer calls: threads only contend
    directory = str(tmp_path_factory.mktemp("qwen3_next_mtp"))
    return (directory, *qwen_mtp_target.write_target(directory, smollm2_tokenizer))


@pytest.fixture(scope="module")
def want(target_dir, smollm2_tokenizer) -> list[list[int]]:
    hf = target_dir[1]
    return [hf_greedy(hf, smollm2_tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def spec(target_dir, smollm2_tokenizer) -> tuple[LLM, list]:
    llm = LLM(load_model(target_dir[0], "float32"), tokenizer=smollm2_tokenizer,
              speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": K},
              **ARGS)
    assert isinstance(llm.engine.speculator, MtpSpeculator)
    return llm, recording(llm)


def check_proposals(records, final, target_dir, k: int = K) -> int:
    """Every recorded proposal is the torch reference's (`mtp_checks.check_proposals`)."""
    directory, hf, block = target_dir
    tensors = qwen_mtp_target.mtp_tensors(directory)

    @functools.cache
    def states(tokens: tuple[int, ...]):
        return qwen_mtp_target.target_states(hf, list(tokens))

    def reference(tokens, num, base, k):
        return qwen_mtp_target.reference_proposals(hf, block, tensors, states(tuple(tokens)),
                                                   tokens, num, base, k)

    return mtp_checks.check_proposals(records, final, reference, k)


@pytest.mark.slow(reason="~25 s; the default tier runs MTP's shared machinery on DeepSeek-V3 "
                         "(tests/spec_decode/test_mtp.py) and this file's refusals")
def test_greedy_identity_and_proposals(spec, want, target_dir):
    """Batched, chunked and preempted; alone; alone again with prefix hits (the target
    resumes the linear layer's state snapshot; the batch's four requests left none of the
    first prompt's in the four snapshot rows): transformers' tokens; proposals were made and
    each is the reference's (the layer's K/V stayed right across steps, preemption and the
    head's prefix cache, beside the target's linear states); every page went back."""
    llm, records = spec
    records.clear()
    head = llm.engine.speculator.head
    assert head.layout is QWEN and "head" not in head.params  # the target's LM head
    assert not head.block.cfg.linear_layers and head.block.cfg.num_experts == 4
    before = llm.get_metrics()
    got, final = generate(llm, PROMPTS)
    assert got == want
    mid = llm.get_metrics()
    assert mid["jaxserve:num_preemptions"] > before["jaxserve:num_preemptions"]
    for _ in range(2):
        got, more = generate(llm, PROMPTS[:1])
        assert got == want[:1]
        final.update(more)
    after = llm.get_metrics()
    assert after["jaxserve:prefix_cache_hits"] > mid["jaxserve:prefix_cache_hits"]
    assert llm.engine.speculator.pages.num_cached_pages_hit > 0
    drafted = "jaxserve:spec_decode_num_draft_tokens"
    assert after[drafted] > mid[drafted] > before[drafted]
    assert after["jaxserve:kv_cache_usage_perc"] == 0.0
    assert not llm.engine.speculator.pages.seqs
    assert len(records) > 20
    assert check_proposals(records, final, target_dir) > 0.9 * K * len(records)


def test_refusals(target_dir, tmp_path):
    """A Qwen3-Next checkpoint whose config counts no MTP layer, and one without the `mtp.*`
    tensors: each a ValueError naming the field (the other refusals are the family-blind
    ones of tests/spec_decode/test_mtp.py)."""
    import json
    import os
    import shutil

    from safetensors.numpy import load_file, save_file

    directory = target_dir[0]
    sizes = dict(num_pages=4, page_size=16, max_model_len=64, max_num_seqs=2)
    target = load_model(directory, "float32")

    def make(**extra):
        config = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2,
                                              **extra})
        return MtpSpeculator(config, target=target, **sizes)

    counted = str(tmp_path / "none")
    shutil.copytree(directory, counted)
    with open(os.path.join(counted, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(counted, "config.json"), "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 0}, f)
    with pytest.raises(ValueError, match=r"speculative_config.method: .* holds no MTP layer "
                                         r"\(num_nextn_predict_layers/mtp_num_hidden_layers=0"):
        make(model=counted)
    bare = str(tmp_path / "bare")  # its config counts one, its file holds no mtp.*
    os.makedirs(bare)
    shutil.copy(os.path.join(directory, "config.json"), bare)
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    save_file({n: t for n, t in tensors.items() if not n.startswith("mtp.")},
              os.path.join(bare, "model.safetensors"))
    with pytest.raises(ValueError, match=r"speculative_config.method: .* no mtp.fc.weight"):
        make(model=bare)


@pytest.mark.slow  # another target and engine: ~40 s
def test_qwen3_5(smollm2_tokenizer, tmp_path):
    """Qwen3.5 (dense; `mtp_num_hidden_layers` counts its layer): the same layout, its MTP
    layer's MLP dense as the target's; greedy output stays transformers' and every proposal
    (k = 3) is the reference's."""
    directory = str(tmp_path)
    hf, block = qwen_mtp_target.write_target(directory, smollm2_tokenizer, "qwen3_5")
    llm = LLM(load_model(directory, "float32"), tokenizer=smollm2_tokenizer,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3},
              **{**ARGS, "enable_prefix_caching": False})
    assert llm.engine.speculator.head.block.cfg.num_experts == 0
    records = recording(llm)
    got, final = generate(llm, PROMPTS[:3])
    assert got == [hf_greedy(hf, smollm2_tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS[:3]]
    assert check_proposals(records, final, (directory, hf, block), k=3) > 0.9 * 3 * len(records)


@pytest.mark.slow  # a warmed-up engine: its compiles from an empty cache
def test_nothing_compiles_after_warm_up(target_dir, smollm2_tokenizer, want):
    llm = LLM(load_model(target_dir[0], "float32"), tokenizer=smollm2_tokenizer,
              speculative_config={"method": "mtp", "num_speculative_tokens": K},
              **{**ARGS, "warmup": True})
    llm.engine.speculator.gate.min_acceptance = 0.0
    assert generate(llm, PROMPTS)[0] == want
    metrics = llm.get_metrics()
    assert metrics["jaxserve:spec_decode_num_drafts"] > 0
    assert metrics["jaxserve:num_compilations"] == 0
