"""Per family, one engine equals transformers: batched, chunked, prefix hits, swap, n-gram."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import LINEAR, PROMPTS, TINY, qwen_hybrid_norm_center

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@dataclasses.dataclass(frozen=True)
class Family:
    """One row of the table: a tiny random transformers model of the family.

    Attributes:
        name: Test id.
        config_cls: transformers config class name.
        model_cls: transformers model class name.
        config: The config's fields (SmolLM2's vocabulary, hidden 64: `TINY` and the
            family's own).
        expect: `ArchConfig` fields the loader must have parsed (dotted for nested ones):
            the family's features are served, not defaulted away.
        norm_center: Where the random norm weights are drawn around (0 for Gemma's
            `1 + weight`, 1 elsewhere), so the norms matter; or a function of the
            parameter's name (Qwen3.5's `1 + weight` norms beside its plain gated norm).
        engine: Engine arguments of its own, over `ENGINE`. With `warmup=True` every check
            also asserts that nothing compiled after warm-up.
    """

    name: str
    config_cls: str
    model_cls: str
    config: dict
    expect: dict = dataclasses.field(default_factory=dict)
    norm_center: float | Callable[[str], float] = 1.0
    engine: dict = dataclasses.field(default_factory=dict)


DENSE = dict(TINY, num_hidden_layers=2)
MOE = dict(DENSE, num_experts_per_tok=2)
WINDOW = 8  # shorter than every prompt: the windows bind
# Gemma 2/3: heads of 16, query scale apart from head_dim, soft caps that bind.
GEMMA = dict(TINY, head_dim=16, sliding_window=WINDOW)
# The hybrid KV cache (sliding and full layers: a page table per KV cache group, Gemma 2's
# two, Gemma 3's three) takes a page of each group per 16 tokens: a pool of 12 holds no
# request of LONG's length.
HYBRID_POOL = dict(num_kv_blocks=24)
# A window on every layer: a request holds its window's pages only (two of 16 tokens), so
# the pool that makes SWAP_BATCH preempt is smaller.
WINDOWED_POOL = dict(num_kv_blocks=6)
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
             "short_factor": [1.0, 1.2, 1.9, 3.0], "long_factor": [1.3, 3.5, 8.0, 24.0]}
ROUTED = dict(enable_return_routed_experts=True)
# gpt-oss's YaRN (untruncated) over a quarter of the tiny context.
GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
# Gemma 4: four layers (sliding, full of heads twice as wide, twice), the last two sharing
# the first two's KV; its
# tied LM head (Gemma 4's default; untied, its greedy text never repeats a token, so n-gram
# speculation would propose nothing).
GEMMA4 = dict(TINY, tie_word_embeddings=True, num_hidden_layers=4, head_dim=16,
              global_head_dim=32, sliding_window=WINDOW,
              layer_types=["sliding_attention", "full_attention"] * 2,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=49152,
              num_kv_shared_layers=2, attention_k_eq_v=True, use_double_wide_mlp=True)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}

# The table: adding a family is adding a row. The configs are those the older family tests
# served (tests/e2e/test_gemma_greedy.py, test_phi3_greedy.py, test_moe_greedy.py,
# test_family_modes_greedy.py, which now take them from here): two layers, Gemma 3 three
# (its pattern of 3: two sliding layers, then a global one).
FAMILIES = [
    Family("llama", "LlamaConfig", "LlamaForCausalLM", DENSE,
           dict(num_kv_heads=2, qkv_bias=False, tie_word_embeddings=False)),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", DENSE,
           dict(qkv_bias=True, o_bias=False)),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(DENSE, head_dim=16),
           dict(qk_norm=True, qkv_bias=False)),
    Family("mistral", "MistralConfig", "MistralForCausalLM",
           dict(DENSE, sliding_window=WINDOW), dict(layer_windows=(WINDOW, WINDOW)),
           engine=WINDOWED_POOL),
    # Fused qkv/gate_up weights, LongRoPE's long factors with half of each head rotated,
    # a window on every layer.
    Family("phi3", "Phi3Config", "Phi3ForCausalLM",
           dict(DENSE, original_max_position_embeddings=WINDOW, partial_rotary_factor=0.5,
                sliding_window=WINDOW, rope_parameters=PHI3_ROPE),
           {"rotary_dim": 8, "rope_scaling.use_long_factors": True,
            "layer_windows": (WINDOW, WINDOW)}, engine=WINDOWED_POOL),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
           dict(GEMMA, num_hidden_layers=2, query_pre_attn_scalar=32,
                attn_logit_softcapping=2.0, final_logit_softcapping=4.0),
           dict(layer_windows=(WINDOW, 0), attn_logit_softcap=2.0, final_logit_softcap=4.0),
           norm_center=0.0, engine=HYBRID_POOL),
    Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
           dict(GEMMA, num_hidden_layers=3, query_pre_attn_scalar=16,
                sliding_window_pattern=3, final_logit_softcapping=4.0,
                rope_parameters=GEMMA3_ROPE),
           dict(layer_windows=(WINDOW, WINDOW, 0), qk_norm=True, local_rope_theta=100.0,
                final_logit_softcap=4.0),
           norm_center=0.0, engine=HYBRID_POOL),
    # Routing captured (top-k then softmax): every check also compares each completion's
    # routed experts with transformers' router.
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM",
           dict(MOE, num_local_experts=8, sliding_window=None),
           dict(num_experts=8, router_order="topk_softmax"), engine=ROUTED),
    Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
           dict(MOE, num_experts=8, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, norm_topk_prob=False),
           dict(num_experts=8, shared_expert_intermediate_size=48, norm_topk_prob=False,
                router_order="softmax_topk")),
    # Warmed up: no routing of any check compiles a program after warm-up (its routing
    # captured, softmax then top-k).
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
           dict(MOE, num_experts=8, moe_intermediate_size=32, head_dim=16,
                norm_topk_prob=True),
           dict(num_experts=8, norm_topk_prob=True, qk_norm=True),
           engine=dict(ROUTED, warmup=True)),
    Family("olmoe", "OlmoeConfig", "OlmoeForCausalLM",
           dict(MOE, num_experts=8, intermediate_size=32),
           dict(num_experts=8, qk_norm=True, qk_norm_full=True)),
    # Linear-attention hybrids (slow: tests/e2e/test_hybrid_engine.py serves Qwen3.5 in the
    # default tier): per-request state slots, snapshots for the prefix hits and backups for
    # speculation. Gated DeltaNet beside gated attention with `1 + weight` norms (the linear
    # layers' gated norm plain), and Granite 4.0's Mamba-2 beside plain attention.
    Family("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
           dict(DENSE, **LINEAR, num_hidden_layers=3,
                layer_types=["linear_attention", "full_attention", "linear_attention"]),
           dict(linear_layers=(0, 2), linear_kind="gated_deltanet", attn_output_gate=True),
           norm_center=qwen_hybrid_norm_center),
    Family("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
           dict(MOE, **LINEAR, num_experts=4, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, full_attention_interval=2),
           dict(linear_layers=(0,), num_experts=4, shared_expert_intermediate_size=48),
           norm_center=qwen_hybrid_norm_center),
    Family("granite_hybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
           dict(MOE, layer_types=["mamba", "attention"], num_local_experts=4,
                intermediate_size=32, shared_intermediate_size=48, mamba_n_heads=8,
                mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                position_embedding_type="nope", initializer_range=0.02,
                tie_word_embeddings=False),
           dict(linear_layers=(0,), linear_kind="mamba2", num_experts=4)),
    # DeepSeek-V3 (slow: tests/models/test_numerics.py compares its logits in the default
    # tier): latent pages (one latent per token and layer), grouped sigmoid routing with the
    # correction bias, shared experts, the first layer dense. (Its routing is not captured:
    # the check compares transformers' top-k router logits, which DeepSeek's groups and
    # bias do not follow.)
    Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
           dict(MOE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                n_group=2, topk_group=1, moe_intermediate_size=32, n_shared_experts=1,
                first_k_dense_replace=1),
           dict(kv_lora_rank=16, router_order="sigmoid_topk", dense_layers=(0,))),
    # gpt-oss: attention sinks, sliding then full layers (the hybrid KV cache), biased router
    # and experts with the clamped SwiGLU, YaRN; routing captured (top-k then softmax).
    Family("gpt_oss", "GptOssConfig", "GptOssForCausalLM",
           dict(MOE, num_local_experts=4, intermediate_size=32, head_dim=16,
                sliding_window=WINDOW, rope_parameters=GPT_OSS_ROPE),
           dict(layer_windows=(WINDOW, 0), attention_sinks=True, moe_bias=True,
                swiglu_limit=7.0, router_order="topk_softmax"),
           engine=dict(HYBRID_POOL, **ROUTED)),
    # Gemma 4: per-layer inputs, the last two layers reading layers 0 and 1's KV (no pool
    # slot of their own: one slot per group), keys as values on the full layers, the
    # double-wide MLP, proportional rotary; sliding then full layers (the hybrid KV cache).
    Family("gemma4", "Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4,
           dict(layer_windows=(WINDOW, 0, WINDOW, 0), per_layer_input_size=8,
                kv_shared_layers=2, attention_k_eq_v=True, double_wide_mlp=True,
                **{"rope_scaling.rope_type": "proportional"}),
           engine=HYBRID_POOL),
    # Llama 4: chunked local attention (chunks of 8: a chunked KV cache group beside the NoPE
    # layer's full one), NoPE with temperature, q/k norm, interleaved llama3 rotary, a MoE
    # layer (top-1 sigmoid on the expert input, shared expert) beside a dense one; routing
    # captured.
    Family("llama4", "Llama4TextConfig", "Llama4ForCausalLM",
           dict(TINY, num_hidden_layers=2, head_dim=16, intermediate_size=32,
                intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=WINDOW,
                floor_scale=4, attn_scale=0.5,
                rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 16}),
           dict(layer_windows=(-WINDOW, 0), nope_layers=(1,), dense_layers=(0,),
                router_order="topk_sigmoid", qk_l2_norm=True, attn_temperature_tuning=True),
           engine=dict(HYBRID_POOL, **ROUTED)),
]


# Rows left to the slow tier (`pytest -m slow`; each row is an engine's compiles, ~7-11 s):
# the default tier keeps one row per engine mechanism (phi3: a dense model with GQA, a
# window on every layer, fused weights, partial rotary; gemma3: the hybrid KV cache's groups
# and Gemma's norms, global layers; qwen3_moe: a mixture of experts, routing captured, warmed
# up), and each family's own features stay in the default tier's numerics
# (tests/models/test_numerics.py) through the paged cache, chunked and whole:
SLOW_ROWS = {
    # a dense model with GQA through every check: the phi3 row (GQA too) and gemma3's global
    # layer (no window); Llama served against transformers: tests/e2e/test_greedy.py's
    # SmolLM2 (a Llama); numerics: llama_gqa_llama3rope, llama_bias.
    "llama": "a dense GQA model is the phi3 row's; SmolLM2 is tests/e2e/test_greedy.py's",
    # routing captured (n > 1 and aborts included): the qwen3_moe row; its top-k-then-softmax
    # router: numerics granite_moe_nope and tests/models/test_moe.py's Mixtral router.
    "mixtral": "routing capture is the qwen3_moe row's; its router order is numerics'",
    # q/k/v bias (model code, no engine path of its own): the default tier's numerics
    # (qwen2_window_layers: Qwen2's layout, llama_bias), drawn apart from zero.
    "qwen2": "a dense model with GQA is the phi3 row's; Qwen2's biases are numerics'",
    # q/k norm with a head_dim of its own: the qwen3_moe row.
    "qwen3": "q/k norm and head_dim 16 are the qwen3_moe row's",
    # a window on every layer (the windowed pool): the phi3 row; numerics: mistral_sliding.
    "mistral": "a window on every layer is the phi3 row's",
    # the hybrid KV cache: the gemma3 row (three groups) and Gemma 2's own engine in
    # tests/e2e/test_gemma_hybrid_kv.py; the attention soft cap: numerics gemma2_softcap.
    "gemma2": "the hybrid KV cache is the gemma3 row's",
    # softmax-then-top-k routing: qwen3_moe; full q/k norm: numerics olmoe_full_qknorm.
    "olmoe": "its router order is the qwen3_moe row's",
    # the shared expert through the engine: tests/e2e/test_moe_mixed_greedy.py's Qwen2-MoE
    # (default tier); numerics: qwen2_moe_shared.
    "qwen2_moe": "its shared expert is served by tests/e2e/test_moe_mixed_greedy.py",
    # the state group (slots, snapshots, backups): tests/e2e/test_hybrid_engine.py's Qwen3.5
    # through the same checks; numerics: qwen3_5_hybrid, qwen3_next_moe_fused, granite_*.
    "qwen3_5": "its state group is tests/e2e/test_hybrid_engine.py's (default tier)",
    "qwen3_next": "its state group is tests/e2e/test_hybrid_engine.py's (default tier)",
    "granite_hybrid": "its state group is tests/e2e/test_hybrid_engine.py's (default tier)",
    # the latent pool's engine paths; numerics: deepseek_v3_mla (default tier).
    "deepseek_v3": "latent pages: numerics deepseek_v3_mla and tests/models/test_deepseek.py",
    # the hybrid KV cache and routing capture: the gemma3 and qwen3_moe rows; sinks, biases,
    # the clamp: numerics gpt_oss (default tier).
    "gpt_oss": "its engine paths are the gemma3 and qwen3_moe rows'; numerics gpt_oss",
    # the hybrid KV cache: the gemma3 row; per-layer inputs, shared KV, keys as values:
    # numerics gemma4_ple_shared_kv, the MoE block gemma4_moe_block (default tier, through
    # the paged cache; engine, EP 2, int8 experts: tests/e2e/test_gemma4_moe_engine.py).
    "gemma4": "its engine paths are the gemma3 row's; numerics gemma4_ple_shared_kv and "
              "gemma4_moe_block",
    # chunked KV groups through the engine; numerics llama4_chunked_nope_moe (default tier),
    # the chunk mask on every path: tests/kernels/test_chunked_attention.py (default tier).
    "llama4": "chunked groups are this row's alone but an engine row costs ~10 s; numerics "
              "llama4_chunked_nope_moe and tests/kernels/test_chunked_attention.py",
}


def _rows() -> list:
    return [pytest.param(f, id=f.name, marks=[pytest.mark.slow(reason=SLOW_ROWS[f.name])]
                         if f.name in SLOW_ROWS else []) for f in FAMILIES]


def family(name: str) -> Family:
    """The table's row of that name (other files serve the same tiny models other ways)."""
    return next(f for f in FAMILIES if f.name == name)


# One engine per family for every check: prefix caching, swap preemption into a pool too
# small for SWAP_BATCH (12 pages of 16 tokens, the null page included), n-gram speculation
# proposing from any repeated token. NOTE: an 8-token budget and 8 sequences: two token
# buckets (4 and 8) to compile, where `TINY_ENGINE`'s 64 tokens make five; the long prompt
# still chunks. No other default-tier file serves these models, so sizes shared with
# theirs would share no program.
ENGINE = {**TINY_ENGINE, "warmup": False, "max_num_batched_tokens": 8, "max_num_seqs": 8,
          "max_model_len": 128,
          "num_kv_blocks": 12, "enable_prefix_caching": True, "preemption_mode": "swap",
          "swap_space": 0.05,
          "speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_min": 1, "prompt_lookup_max": 2}}
MAX_TOKENS = 24
# Past the token budget (chunked prefill), sharing no page with the other prompts: its
# second run's hits are its first run's pages.
LONG = " ".join(["A river carries sand down to the delta, where the slow water lays it in "
                 "wide banks, and the farmers know"] * 4)
# Eight requests: more pages than the pool holds, windowed families' included.
SWAP_BATCH = [*PROMPTS, LONG, "Sliding windows keep only the most recent keys, so old "
              "pages can be given back", "Once upon a time there was a small engine that "
              "served many requests", "def fibonacci(n): return n if n < 2 else", "1, 2, 3,"]


def _build_hf(row: Family, tokenizer, directory: str):
    """The float32 transformers model (eager attention) with its norms drawn around
    `norm_center` and its biases drawn too, saved with `tokenizer` into `directory`."""
    cfg = getattr(transformers, row.config_cls)(**row.config, attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, row.model_cls)(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                center = row.norm_center
                p.copy_((center(name) if callable(center) else center) + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
    hf.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return hf


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          min_new_tokens=MAX_TOKENS, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _hf_routing(hf, ids: list[int], k: int, dense: tuple[int, ...] = ()) -> np.ndarray:
    """i32[len(ids), L, k]: the experts transformers' routers rank first for each token of
    `ids` (teacher-forced), heaviest first; -1 on the `dense` layers (no router)."""
    with torch.no_grad():
        router = iter(hf(torch.tensor([ids]), output_router_logits=True).router_logits)
    none = np.full((len(ids), k), -1)
    return np.stack([none if i in dense else torch.topk(next(router), k).indices.numpy()
                     for i in range(hf.config.num_hidden_layers)], axis=1)


@dataclasses.dataclass
class Served:
    """A row's engine (`warm`: warmed up), its prompts' ids and transformers' greedy tokens
    for each."""

    family: Family
    llm: LLM
    warm: bool
    ids: dict[str, list[int]]
    want: dict[str, list[int]]
    routing: dict[str, np.ndarray] | None = None  # captured: transformers' routed experts
    hf: object = None  # the transformers model
    directory: str = ""  # where it is saved

    def check(self, prompts: list[str]) -> dict[str, float]:
        """Serves `prompts` batched, asserts transformers' tokens for each; returns what the
        engine's counters gained."""
        before = self.llm.get_metrics()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": self.ids[p]} for p in prompts], params,
                                 use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            ours = out.outputs[0].token_ids
            assert ours == self.want[prompt], (self.family.name, prompt)
            routed = out.outputs[0].routed_experts
            if self.routing is None:
                assert routed is None
            else:  # the prompt and every output but the last went through the model
                np.testing.assert_array_equal(routed, self.routing[prompt])
        after = self.llm.get_metrics()
        assert after["jaxserve:kv_cache_usage_perc"] == 0.0  # every page given back
        gained = {k.removeprefix("jaxserve:"): after[k] - before[k] for k in before
                  if isinstance(before[k], (int, float))}
        if self.warm:  # warm-up compiled every program these steps ran
            assert gained["num_compilations"] == 0, self.family.name
        return gained


@pytest.fixture(scope="module", params=_rows())
def served(request, smollm2_tokenizer, tmp_path_factory):
    """The row's engine (built once for its four checks) and transformers' tokens, on one
    torch thread."""
    row = request.param
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        directory = str(tmp_path_factory.mktemp(row.name))
        hf = _build_hf(row, smollm2_tokenizer, directory)
        prompts = dict.fromkeys([*PROMPTS, LONG, *SWAP_BATCH])
        ids = {p: smollm2_tokenizer(p).input_ids for p in prompts}
        want = {p: _hf_greedy(hf, ids[p]) for p in prompts}
        args = {**ENGINE, **row.engine}
        routing = None
        if args.get("enable_return_routed_experts"):
            k = row.config["num_experts_per_tok"]
            dense = row.expect.get("dense_layers", ())
            routing = {p: _hf_routing(hf, ids[p] + want[p][:-1], k, dense) for p in prompts}
    finally:
        torch.set_num_threads(threads)
    assert all(len(set(w)) > 1 for w in want.values())  # not a degenerate repeat
    llm = LLM(directory, **args)
    llm.engine.speculator.gate.min_acceptance = 0.0  # never paused: proposals every step
    cfg = llm.engine.model.cfg
    for field, value in row.expect.items():
        got = cfg
        for part in field.split("."):
            got = getattr(got, part)
        assert got == value, (row.name, field)
    return Served(row, llm, args["warmup"], ids, want, routing, hf, directory)


def test_batched_greedy(served):
    assert min(len(served.ids[p]) for p in PROMPTS) > WINDOW  # the windows bind
    served.check(PROMPTS)


def test_chunked_prefill_then_prefix_hits(served):
    """A prompt past the token budget, sent twice: the second run reads the first's pages."""
    assert len(served.ids[LONG]) > ENGINE["max_num_batched_tokens"]
    served.check([LONG])
    assert served.check([LONG])["prefix_cache_hits"] > 0


def test_swap_preemption(served):
    """A batch whose pages do not fit the pool: requests are swapped out and back in."""
    gained = served.check(SWAP_BATCH)
    assert gained["num_preemptions"] > 0
    assert gained["num_swap_outs"] > 0 and gained["num_swap_ins"] > 0


def _lookup_chances(ids: list[int], out: list[int]) -> int:
    """Decode steps at which the text so far ends with a token seen before in it (a
    one-token n-gram match: a proposal), by transformers' tokens."""
    return sum(out[i - 1] in ids + out[:i - 1] for i in range(1, len(out)))


def test_ngram_speculation(served):
    """Proposals are made (the text repeats a token: transformers' own tokens show where)
    and verified: the tokens stay transformers'."""
    prompts = [*PROMPTS, LONG]
    assert sum(_lookup_chances(served.ids[p], served.want[p]) for p in prompts) > 0
    gained = served.check(prompts)
    assert gained["spec_decode_num_draft_tokens"] > 0


def test_routed_experts_of_every_sample(served):
    """Routing capture with n > 1 (the samples fork after the prompt: each has its own
    tokens' routing after the shared prompt's), and nothing kept for an aborted request."""
    if served.routing is None:
        pytest.skip("this row does not capture routing")
    ids, k = served.ids[PROMPTS[1]], served.family.config["num_experts_per_tok"]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6)
    out = served.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for c in out.outputs:
            np.testing.assert_array_equal(
                c.routed_experts, _hf_routing(served.hf, ids + c.token_ids[:-1], k,
                                              served.family.expect.get("dense_layers", ())))
    finally:
        torch.set_num_threads(threads)
    engine = served.llm.engine
    engine.add_request("aborted", {"prompt_token_ids": ids},
                       SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    (final,) = engine.abort_request("aborted")
    assert final.outputs[0].routed_experts is None
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.outputs.routing) == 0


def test_routed_experts_need_a_mixture_of_experts(served):
    if served.family.name != "phi3":
        pytest.skip("one dense row is enough")
    with pytest.raises(ValueError, match="enable_return_routed_experts needs a "
                                         "mixture-of-experts model"):
        LLM(served.directory, **{**ENGINE, "enable_return_routed_experts": True})
