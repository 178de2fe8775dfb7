"""The linear-attention hybrids served end to end: greedy tokens of a tiny Qwen3.5 (and, slow,
Qwen3-Next, Qwen3.5-MoE and Granite 4.0's Mamba-2 hybrid, dense and with routed experts)
through `LLM` equal transformers' `generate` alone, batched and chunked, under swap and
recompute preemption, with n > 1 (forked state slots) and with n-gram speculation (states
backed up before a verify step and read back on a rejection); an abort frees its slot;
nothing compiles after warm-up; prefix caching is on: a hit resumes a state snapshot, skips
the cached tokens' compute and gives the miss's tokens.

The model side (numerics per step, state contract) is tests/models/test_hybrid.py's.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from jaxserve import LLM, SamplingParams
from tests.e2e.hf_family import (
    LINEAR,
    PROMPTS,
    SMALL,
    build_hf_model,
    hf_greedy,
    qwen_hybrid_norm_center,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = {
    # linear, full attention, linear: the state carried beside one layer's pages.
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(SMALL, **LINEAR, num_hidden_layers=3,
                     layer_types=["linear_attention", "full_attention", "linear_attention"])),
    # Its fused projections, experts and shared expert; full attention every second layer.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(SMALL, **LINEAR, num_hidden_layers=2, full_attention_interval=2,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48)),
    # Qwen3.5's layers with experts in every layer (the text model of Qwen3.5-MoE).
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(SMALL, **LINEAR, num_hidden_layers=2, full_attention_interval=2,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48)),
    # Granite 4.0's Mamba-2 layers (the SSD state in the same pools) beside rotary attention,
    # its multipliers apart from 1 (tests/models/test_numerics.py's shapes, hidden 64).
    "granite": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                dict(SMALL, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                     shared_intermediate_size=96, mamba_n_heads=8, mamba_d_head=16,
                     mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, num_local_experts=0,
                     embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=0.25,
                     attention_multiplier=0.2, position_embedding_type="rope",
                     initializer_range=0.05, tie_word_embeddings=False)),
}
# Granite 4.0-H Tiny's layers: routed experts (`block_sparse_moe`) beside the shared MLP,
# attention without rotary.
FAMILIES["granite_moe"] = (*FAMILIES["granite"][:2],
                           dict(FAMILIES["granite"][2], num_local_experts=4,
                                num_experts_per_tok=2, intermediate_size=32,
                                position_embedding_type="nope"))
# Families whose RMSNorms scale by `1 + weight` (the gated norms of their linear layers by
# the weight itself); Granite's all scale by the weight.
ZERO_CENTRED = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
MAX_TOKENS = 16
# 4 sequences, an 8-token budget (buckets 4 and 8: two model programs; every prompt chunks),
# 7 pages of 16 tokens (6 usable) for one full-attention layer: SWAP_BATCH's 4 running
# requests need 12, so requests are preempted. Swap space for the pages; the host state
# slots come with it. N-gram speculation (backup state slots, one per sequence); its gate
# pauses proposals that do not pay, so the other checks also step with async scheduling.
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2}
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=4, max_model_len=128, num_kv_blocks=7,
              attention_backend="xla", preemption_mode="swap", swap_space=0.05,
              enable_prefix_caching=True, warmup=True, speculative_config=SPEC)
SWAP_BATCH = [*PROMPTS, "Sliding windows keep only the most recent keys, so old pages can "
              "be given back", "Once upon a time there was a small engine that served many "
              "requests", "def fibonacci(n): return n if n < 2 else"]
SHARED = "PROMPTS[0] and five tokens of PROMPTS[1]"  # its ids share PROMPTS[0]'s beyond a page
# Prompts whose text repeats: a prompt, 8 tokens of a greedy continuation, then the prompt
# again. Its end recurs in the text, so n-gram lookup proposes the earlier continuation, which
# the tiny models partly follow (Granite follows the first two whole; the third rejects). The
# last one's earlier continuation turns into another prompt's after 2 tokens (`SPLICED`), so
# a model that follows its own (Granite with experts follows every one) rejects there.
REPEATED = [PROMPTS[0], SWAP_BATCH[3], PROMPTS[2], SWAP_BATCH[4]]
SPLICED = {SWAP_BATCH[4]: SWAP_BATCH[5]}


def continuation(want: dict[str, list[int]], prompt: str) -> list[int]:
    """The 8 tokens `prompt`'s repeated form puts between its two copies."""
    other = SPLICED.get(prompt)
    return want[prompt][:8] if other is None else want[prompt][:2] + want[other][:6]


def repeated(prompt: str) -> str:
    """The key of `prompt`'s repeated form (`REPEATED`) in `Served.ids` and `Served.want`."""
    return f"repeated: {prompt}"


def _norm_center(name: str):
    """Where a family's norms are drawn around (`build_hf_model`): Qwen's zero-centred
    `1 + weight` RMSNorms at 0 beside their plain gated norms, Granite's all at 1."""
    return qwen_hybrid_norm_center if name in ZERO_CENTRED else 1.0


@dataclasses.dataclass
class Served:
    """A family's warmed-up engine, its prompts' ids, transformers' greedy tokens for each,
    and what the engine logged while it started."""

    llm: LLM
    ids: dict[str, list[int]]
    want: dict[str, list[int]]
    startup_log: str
    warm: bool = True  # warmed up: nothing may compile while serving

    def check(self, prompts: list[str], n: int = 1) -> dict[str, float]:
        """Serves `prompts` batched (`n` greedy completions each), asserts transformers'
        tokens for every completion, that every page and state slot came back and that
        nothing compiled; returns what the engine's counters gained."""
        before = self.llm.get_metrics()
        params = SamplingParams(n=n, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": self.ids[p]} for p in prompts], params,
                                 use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            assert len(out.outputs) == n
            for completion in out.outputs:
                assert completion.token_ids == self.want[prompt], prompt
        after = self.llm.get_metrics()
        assert after["jaxserve:kv_cache_usage_perc"] == 0.0
        slots = self.llm.engine.scheduler.kv.state_slots
        assert slots.num_free_slots == slots.num_request_slots - 1  # every slot but the null one
        assert slots.backups.num_slots == ENGINE["max_num_seqs"]
        assert slots.backups.num_free == slots.backups.num_slots  # and every backup
        gained = {k.removeprefix("jaxserve:"): after[k] - before[k] for k in before}
        if self.warm:
            assert gained["num_compilations"] == 0  # warm-up compiled every program
        return gained


# Slow: the same engine paths with experts (Qwen3-Next), or Mamba-2 layers (Granite 4.0, with
# and without experts).
@pytest.fixture(scope="module", params=["qwen3_5", *(
    pytest.param(name, marks=pytest.mark.slow)
    for name in ("qwen3_next", "qwen3_5_moe", "granite", "granite_moe"))])
def served(request, smollm2_tokenizer, tmp_path_factory):
    """The family's engine, built and warmed up once for every check of this file."""
    name = request.param
    directory = str(tmp_path_factory.mktemp(name))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config_cls, model_cls, config = FAMILIES[name]
        hf = build_hf_model(config_cls, model_cls, config, smollm2_tokenizer, directory,
                            _norm_center(name))
        ids = {p: smollm2_tokenizer(p).input_ids for p in SWAP_BATCH}
        want = {p: hf_greedy(hf, ids[p], MAX_TOKENS) for p in SWAP_BATCH}
        ids[SHARED] = ids[PROMPTS[0]] + ids[PROMPTS[1]][:5]
        want[SHARED] = hf_greedy(hf, ids[SHARED], MAX_TOKENS)
        for p in REPEATED:
            ids[repeated(p)] = ids[p] + continuation(want, p) + ids[p]
            want[repeated(p)] = hf_greedy(hf, ids[repeated(p)], MAX_TOKENS)
    finally:
        torch.set_num_threads(threads)
    assert all(len(set(w)) > 1 for w in want.values())  # not a degenerate repeat
    assert min(len(x) for x in ids.values()) > ENGINE["max_num_batched_tokens"]  # chunked
    records = _LogRecords()
    logger = logging.getLogger("jaxserve")
    logger.addHandler(records)
    try:
        llm = LLM(directory, **ENGINE)
    finally:
        logger.removeHandler(records)
    assert llm.engine.model.has_linear_attention
    return Served(llm, ids, want, "\n".join(records.messages))


class _LogRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_greedy_alone_and_batched_chunked(served):
    """Each prompt alone, then all batched; every prompt is longer than the 8-token budget,
    so its state is carried from chunk to chunk."""
    served.check(PROMPTS[1:2])
    served.check(PROMPTS)


def test_swap_then_recompute_preemption(served):
    """A batch whose pages do not fit the pool: requests are swapped out (pages and state
    rows to the host) and back in; then the same batch preempted by recompute (the state
    starts again from zero in whatever slot comes next)."""
    gained = served.check(SWAP_BATCH)
    assert gained["num_preemptions"] > 0
    assert gained["num_swap_outs"] > 0 and gained["num_swap_ins"] > 0
    scheduler = served.llm.engine.scheduler
    swap_config = scheduler.config
    scheduler.config = dataclasses.replace(swap_config, preemption_mode="recompute")
    try:
        gained = served.check(SWAP_BATCH)
    finally:
        scheduler.config = swap_config
    assert gained["num_preemptions"] > 0 and gained["num_swap_outs"] == 0


def test_fan_out_children_copy_the_state(served):
    """n = 3 greedy completions: the children fork after the prompt's sample, each into a
    slot holding a copy of the parent's state, and all go on as transformers does."""
    served.check(PROMPTS[:2], n=3)


def test_abort_frees_the_slot(served):
    engine = served.llm.engine
    slots = engine.scheduler.kv.state_slots
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("to-abort", {"prompt_token_ids": served.ids[PROMPTS[0]]}, params)
    for _ in range(3):  # past the first chunk: the request holds a slot
        engine.step()
    assert slots.num_free_slots < slots.num_request_slots - 1
    engine.abort_request("to-abort")
    engine.flush()
    assert slots.num_free_slots == slots.num_request_slots - 1
    served.check(PROMPTS[1:2])  # and the next request is served as before


def test_prefix_hit_resumes_a_state_snapshot(served):
    """A, then B sharing A's prompt beyond a page: B's page-aligned prefix resumes the
    snapshot A's aligned chunks left at its last full page (counted as hits, not computed)
    and B's tokens are transformers'; after a reset B misses and gives the same tokens."""
    engine = served.llm.engine
    kv, runner = engine.scheduler.kv, engine.runner
    assert kv.prefix_caching_disabled_reason is None and kv.snapshots is not None
    assert "prefix caching is off" not in served.startup_log
    assert engine.cache_config_info()["enable_prefix_caching"] is True
    assert served.llm.get_metrics()["jaxserve:prefix_caching_enabled{reason=}"] == 1.0
    page = kv.page_size
    num_hit = len(served.ids[PROMPTS[0]]) // page * page
    assert num_hit >= page
    assert engine.reset_prefix_cache()
    served.check([PROMPTS[0]])
    computed = runner.num_scheduled_tokens
    assert served.check([SHARED])["prefix_cache_hits"] == num_hit
    num_computed_hit = runner.num_scheduled_tokens - computed
    assert engine.reset_prefix_cache() and not len(kv.snapshots)
    computed = runner.num_scheduled_tokens
    assert served.check([SHARED])["prefix_cache_hits"] == 0
    assert runner.num_scheduled_tokens - computed == num_computed_hit + num_hit


def test_ngram_speculation_backs_up_and_restores_the_state(served):
    """Proposals every step (the gate never pauses): a verifying request's state is copied
    to a backup slot first; where a proposal is rejected it is read back and the accepted
    tokens are computed again. Batched with a prompt whose text never recurs (no proposals),
    under the pool's preemption: the tokens stay transformers'."""
    engine = served.llm.engine
    gate, backups = engine.speculator.gate, engine.scheduler.kv.state_slots.backups
    saved = gate.min_acceptance
    gate.min_acceptance, gate.paused_for = 0.0, 0
    restores = backups.num_restores
    try:
        gained = served.check([*map(repeated, REPEATED), PROMPTS[1]])
    finally:
        gate.min_acceptance = saved
    accepted, drafted = (gained[f"spec_decode_num_{k}_tokens"] for k in ("accepted", "draft"))
    assert 0 < accepted < drafted  # proposals held, and some were rejected
    assert backups.num_restores > restores  # a rejection read the state back
    # A generation token is counted once, however often its state was recomputed.
    assert gained["generation_tokens"] == (len(REPEATED) + 1) * MAX_TOKENS


@pytest.mark.slow  # its own engine over two virtual CPU devices (a second compile, ~20 s)
def test_tensor_parallel_2_serves_transformers_tokens(served):
    """The Gated DeltaNet layers split by key heads and the state pools with them
    (`TensorParallel.state_shardings`), swap and fork copies included; Mamba-2 layers and
    their pools run whole on each device (`splits_linear_layers`), attention and MLPs
    split."""
    directory = served.llm.engine.model.source
    llm = LLM(directory, **{**ENGINE, "warmup": False}, tensor_parallel_size=2)
    state = llm.engine.runner.kv_pages
    assert len(state.recurrent.sharding.device_set) == 2
    assert state.recurrent.sharding.is_fully_replicated == (
        served.llm.engine.model.cfg.linear_kind == "mamba2")
    tp = Served(llm, served.ids, served.want, "", warm=False)
    gained = tp.check(SWAP_BATCH)
    assert gained["num_swap_outs"] > 0
    tp.check(PROMPTS[:1], n=2)


@pytest.mark.slow  # its own engine over two virtual CPU devices (a second compile)
def test_expert_parallel_2_serves_transformers_tokens(served):
    """A hybrid's routed experts split over an expert axis of 2 (half the experts on each
    device, the partial outputs summed; the linear layers, attention and state pools
    replicated), swap and forks included: how Granite's experts spread, since its Mamba-2
    layers refuse tensor parallelism."""
    if not served.llm.engine.model.cfg.is_moe:
        pytest.skip("a dense model has no experts to split")
    directory = served.llm.engine.model.source
    llm = LLM(directory, **{**ENGINE, "warmup": False}, expert_parallel_size=2)
    params = llm.engine.runner.params
    experts = params.get("params", params)["layers"]["mlp"]["experts"]["gate_proj"]
    assert len(experts.sharding.device_set) == 2
    assert experts.addressable_shards[0].data.shape[1] == experts.shape[1] // 2  # [L, E/2, ...]
    ep = Served(llm, served.ids, served.want, "", warm=False)
    gained = ep.check(SWAP_BATCH)
    assert gained["num_swap_outs"] > 0
    ep.check(PROMPTS[:1], n=2)


@pytest.mark.slow  # its own model and two engines over two virtual CPU devices (~30 s)
def test_all_attention_granite_with_experts_splits_by_tensor_parallelism(smollm2_tokenizer,
                                                                          tmp_path):
    """A Granite 4.0 without Mamba-2 layers (every layer attends) is refused nothing: its
    experts split by width (tensor parallelism 2) or whole (`enable_expert_parallel`), the
    ungated shared MLP by columns and rows, and the tokens stay transformers'."""
    config_cls, model_cls, config = FAMILIES["granite_moe"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = build_hf_model(config_cls, model_cls, dict(config, layer_types=["attention"] * 3),
                            smollm2_tokenizer, str(tmp_path), 1.0)
        ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
        want = [hf_greedy(hf, x, MAX_TOKENS) for x in ids]
    finally:
        torch.set_num_threads(threads)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for split in (dict(), dict(enable_expert_parallel=True)):
        llm = LLM(str(tmp_path), max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128,
                  num_kv_blocks=16, attention_backend="xla", warmup=False,
                  tensor_parallel_size=2, **split)
        assert llm.engine.model.cfg.is_moe and not llm.engine.model.has_linear_attention
        outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, split
