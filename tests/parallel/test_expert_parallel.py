"""Expert parallelism on 8 CPU devices: a tiny Qwen3-MoE's greedy tokens under EP 2 and 4,
EP 2 x TP 2, `enable_expert_parallel` with TP 2 and plain TP 2 equal one device's; the
compiled step all-reduces the experts' partial outputs and never gathers their stacks; no
routing compiles anything once a bucket's programs exist; every bad size is a clear error.

The router sends most tokens to the experts of the first devices: its rows for experts
4-7 are zero, so a token takes an expert from 4-7 only when fewer than two of 0-3 score
above zero, and then (ties broken by the lower id) only 4 or 5; experts 6 and 7 (all of
the last device's under EP 4) never get a token. The oracle is the one-device engine
(whose tokens `tests/e2e/test_moe_greedy.py` holds to transformers').
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.e2e.hf_family import TINY, build_hf_model

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")
torch = pytest.importorskip("torch")

GREEDY = SamplingParams(temperature=0, max_tokens=10, detokenize=False, ignore_eos=True)
NUM_EXPERTS = 8
CONFIG = dict(TINY, num_hidden_layers=2, head_dim=16, num_experts=NUM_EXPERTS,
              num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
# Two token buckets (4 and 8; prompts are chunked): each layout compiles few programs (a
# model step on 8 devices is seconds to compile here).
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=128, num_kv_blocks=64,
             attention_backend="xla")


@pytest.fixture(scope="module")
def moe_dir(smollm2_tokenizer, tmp_path_factory) -> str:
    """A tiny Qwen3-MoE whose routers favour experts 0-3 (see the module docstring), with
    a sharper LM head (greedy choices are not near-ties), saved as safetensors."""
    path = str(tmp_path_factory.mktemp("qwen3_moe_ep"))
    hf = build_hf_model("Qwen3MoeConfig", "Qwen3MoeForCausalLM", CONFIG, smollm2_tokenizer,
                        path, norm_center=1.0)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight[4:] = 0.0  # [E, H]: experts 4-7 score 0 for every token
        hf.lm_head.weight.mul_(4.0)
    hf.save_pretrained(path, safe_serialization=True)
    return path


def _prompts():
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": [int(t) for t in rng.integers(3, 49152, n)]}
            for n in (5, 23, 9, 40)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(moe_dir):
    """One device's greedy tokens (no warm-up: it compiles only the steps it runs)."""
    llm = LLM(moe_dir, warmup=False, **SMALL)
    return _tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def ep2(moe_dir):
    """Expert parallelism 2 (the model loaded by path straight into its shards); no warm-up
    (it compiles only the steps it runs: the test counts compiles from there)."""
    return LLM(moe_dir, expert_parallel_size=2, warmup=False, **SMALL)


def _experts(llm) -> dict:
    params = llm.engine.runner.params
    tree = params.get("packed", params.get("params", params))
    return tree["layers"]["mlp"]["experts"]


def test_routing_is_skewed(moe_dir, smollm2_tokenizer):
    """The fixture's router: most pairs to experts 0-3, none to 6 and 7."""
    from models.loaders import load_model
    from models.moe import route

    model = load_model(moe_dir, "float32")
    gate = np.asarray(model.params["layers"]["mlp"]["gate"]["kernel"][0])  # [H, E]
    x = np.random.default_rng(1).normal(size=(512, gate.shape[0])).astype(np.float32)
    _, ids = route(x @ gate, 2, model.cfg.router_order, model.cfg.norm_topk_prob)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=NUM_EXPERTS)
    assert counts[:4].sum() > 0.7 * counts.sum() and counts[6:].sum() == 0, counts


def test_expert_parallel_2_matches_one_device(ep2, reference):
    assert _tokens(ep2.generate(_prompts(), GREEDY, use_tqdm=False)) == reference
    layout = ep2.engine.layout
    assert dict(layout.mesh.shape) == {"expert": 2, "kv": 1, "rep": 1}
    assert layout.size == 1 and layout.num_devices == 2
    gate = _experts(ep2)["gate_proj"]  # [L, E, H, I]
    assert gate.sharding.spec[1] in ("expert", ("expert",))
    assert {s.data.shape[1] for s in gate.addressable_shards} == {NUM_EXPERTS // 2}
    # Other prompts (other routings, other batch mixes) in the same buckets compile nothing:
    # the routing is traced under the mesh too.
    compiled = ep2.get_metrics()["jaxserve:num_compilations"]
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(3, 49152, n).tolist()} for n in (2, 31, 7)]
    ep2.generate(prompts, GREEDY, use_tqdm=False)
    assert ep2.get_metrics()["jaxserve:num_compilations"] == compiled


def test_step_all_reduces_and_never_gathers_the_experts(ep2):
    hlo = _step_hlo(ep2)
    assert re.search(r"all-reduce(-start)?\(", hlo)
    _no_expert_gather(ep2, hlo)


# 6 pages (5 usable) for requests of 1-4 pages: preempted, by recompute or swap.
PREEMPT = dict(num_kv_blocks=6)


@pytest.mark.slow  # more layouts of what the EP 2 case checks (each compiles its programs)
@pytest.mark.parametrize("args,mesh,expert_split,width_split", [
    (dict(expert_parallel_size=4, **PREEMPT), (4, 1, 1), 4, 1),
    (dict(expert_parallel_size=2, tensor_parallel_size=2, preemption_mode="swap", **PREEMPT),
     (2, 2, 1), 2, 2),
    (dict(enable_expert_parallel=True, tensor_parallel_size=2), (1, 2, 1), 2, 1),
    (dict(tensor_parallel_size=2), (1, 2, 1), 1, 2),
], ids=["ep4", "ep2xtp2_swap", "enable_ep_tp2", "tp2"])
def test_layouts_match_one_device(moe_dir, smollm2_tokenizer, reference, args, mesh,
                                  expert_split, width_split):
    from models.loaders import load_model

    # A model handed over loaded (the experts' serving form, sharded by the runner).
    llm = LLM(load_model(moe_dir, "float32"), tokenizer=smollm2_tokenizer, warmup=False,
              **{**SMALL, **args})
    assert _tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == reference
    if "num_kv_blocks" in args:
        assert llm.get_metrics()["jaxserve:num_preemptions"] > 0
        if args.get("preemption_mode") == "swap":
            assert llm.get_metrics()["jaxserve:num_swap_outs"] > 0
    layout = llm.engine.layout
    assert tuple(layout.mesh.shape.values()) == mesh
    ex = layout.experts
    assert (ex.num_expert_shards, ex.num_width_shards) == (expert_split, width_split)
    down = _experts(llm)["down_proj"]  # [L, E, I, H]
    assert {s.data.shape[1:3] for s in down.addressable_shards} == {
        (NUM_EXPERTS // expert_split, CONFIG["moe_intermediate_size"] // width_split)}
    hlo = _step_hlo(llm)
    assert re.search(r"all-reduce(-start)?\(", hlo)
    _no_expert_gather(llm, hlo)


def _step_hlo(llm) -> str:
    """The compiled text of the engine's first model step."""
    runner = llm.engine.runner
    (layout, decode_only), step = next(iter(runner.programs.model_steps().items()))
    buf = jax.device_put(np.zeros(layout.size, np.int32), llm.engine.layout.replicated())
    return step.lower(runner.params, runner.kv_pages, buf,
                      runner.no_prev_ids).compile().as_text()


def _no_expert_gather(llm, hlo: str) -> None:
    """No all-gather in `hlo` produces an expert stack (one layer's or all layers') whole."""
    shapes = set()
    for leaf in _experts(llm).values():
        shapes.add(",".join(map(str, leaf.shape)))
        shapes.add(",".join(map(str, leaf.shape[1:])))
    for line in hlo.splitlines():
        if "all-gather" in line:
            assert not any(f"[{s}]" in line for s in shapes), line


def test_bad_expert_parallel_sizes_are_clear_errors(moe_dir, tiny_model_dir):
    from models.loaders import load_model

    model = load_model(moe_dir, "float32")
    cases = [
        (dict(expert_parallel_size=3), "expert_parallel_size=3 does not divide num_experts=8"),
        (dict(expert_parallel_size=4, tensor_parallel_size=4),
         "expert_parallel_size=4 x tensor_parallel_size=4 needs 16 devices; 8 available"),
        (dict(expert_parallel_size=0), "expert_parallel_size must be a positive integer"),
        (dict(expert_parallel_size=2, device_ids=(0, 1, 2)), "device_ids must be one id per"),
        (dict(enable_expert_parallel="yes"), "enable_expert_parallel must be True or False"),
        (dict(data_parallel_size=2, expert_parallel_size=4, tensor_parallel_size=2),
         "needs 16 devices; 8 available"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            LLM(model, warmup=False, **args, **SMALL)
    dense = load_model(tiny_model_dir, "float32")
    for args, name in ((dict(enable_expert_parallel=True), "enable_expert_parallel"),
                       (dict(expert_parallel_size=2), "expert_parallel_size=2")):
        with pytest.raises(ValueError, match=f"{name} needs a mixture-of-experts model"):
            LLM(dense, warmup=False, **args, **SMALL)


def test_expert_layout_errors():
    """Sizes the tiny engine cannot reach: experts or widths the split does not divide."""
    from jaxserve.parallel.layouts import expert_layout, make_tensor_parallel
    from models.config import ArchConfig

    cfg = ArchConfig("Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=6,
                     num_experts_per_tok=2, moe_intermediate_size=30)
    with pytest.raises(ValueError, match=re.escape(
            "tensor_parallel_size=4 (enable_expert_parallel) does not divide num_experts=6")):
        expert_layout(cfg, 4, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide "
                                         "moe_intermediate_size=30"):
        make_tensor_parallel(cfg, 4)
    with pytest.raises(ValueError, match="expert_parallel_size must be at least 1"):
        expert_layout(cfg, 1, expert_parallel_size=0)
    shared = ArchConfig("Qwen2MoeForCausalLM", vocab_size=64, hidden_size=32,
                        intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                        head_dim=8, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=20)
    with pytest.raises(ValueError, match="does not divide shared_expert_intermediate_size=20"):
        expert_layout(shared, 8, enable_expert_parallel=False)
    # The layouts themselves: (axes splitting E, axes splitting I).
    cfg8 = ArchConfig("Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32,
                      intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32)
    assert expert_layout(cfg8, 2) == ((), ("kv", "rep"))
    assert expert_layout(cfg8, 2, enable_expert_parallel=True) == (("kv", "rep"), ())
    assert expert_layout(cfg8, 2, 2) == (("expert",), ("kv", "rep"))
    assert expert_layout(cfg8, 2, 2, True) == (("expert", "kv", "rep"), ())


def test_cli_flags_reach_the_engine_arguments():
    from jaxserve.entrypoints.cli.args import Parser, add_engine_args, engine_kwargs

    p = Parser()
    add_engine_args(p)
    args = p.parse_args(["m", "--enable-expert-parallel", "--expert-parallel-size", "2",
                         "--tensor-parallel-size", "2"])
    kwargs = engine_kwargs(args)
    assert (kwargs["enable_expert_parallel"], kwargs["expert_parallel_size"],
            kwargs["tensor_parallel_size"]) == (True, 2, 2)
    assert "enable_expert_parallel" not in engine_kwargs(p.parse_args(["m"]))


@pytest.mark.slow  # two more engines' programs
def test_data_parallel_replicas_of_expert_parallel_engines(moe_dir, reference):
    """Two replicas of EP 2 take 2 devices each (`ParallelConfig.devices_per_replica`)."""
    llm = LLM(moe_dir, data_parallel_size=2, expert_parallel_size=2, warmup=False, **SMALL)
    meshes = [sorted(d.id for d in r.layout.mesh.devices.flat) for r in llm.engine.replicas]
    assert meshes == [[0, 1], [2, 3]]
    assert _tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == reference


@pytest.mark.slow  # another family's model and engine
def test_shared_expert_and_dense_layers_under_ep2_tp2_match_transformers(smollm2_tokenizer,
                                                                         tmp_path_factory,
                                                                         torch_one_thread):
    """Qwen2-MoE with a dense middle layer (`models.mixed`) and a shared expert (both split
    as a dense MLP over "kv"/"rep"), its routed experts split over "expert" and their
    width, against transformers' `generate`."""
    from tests.e2e.hf_family import PROMPTS, check_engine_greedy

    path = str(tmp_path_factory.mktemp("qwen2_moe_ep"))
    config = dict(TINY, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  mlp_only_layers=[1])
    hf = build_hf_model("Qwen2MoeConfig", "Qwen2MoeForCausalLM", config, smollm2_tokenizer,
                        path, norm_center=1.0)
    llm = LLM(path, expert_parallel_size=2, tensor_parallel_size=2, warmup=False, **SMALL)
    assert llm.engine.model.cfg.dense_layers == (1,)
    assert llm.engine.layout.experts.expert_axes == ("expert",)
    gate = _experts(llm)["gate_proj"]  # [L_sparse, E, H, I]
    assert {s.data.shape[1:] for s in gate.addressable_shards} == {(4, 64, 16)}
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    check_engine_greedy(llm, hf, smollm2_tokenizer, ids, max_tokens=8)
