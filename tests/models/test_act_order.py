"""Act-order checkpoints (GPTQ `desc_act` with `g_idx`, compressed-tensors `actorder` with
`weight_g_idx`) read as they are: tiny models whose Linears are quantized in random
act-order groups, by the test's GPTQ packer (`int_packers`, from the published format) and
by compressed-tensors' own compressor (`ct_pack`), give transformers' logits and greedy
tokens on the dequantized weights, on XLA's quantized matmul and the CPU panels, alone and
batched; a module whose g_idx is in order keeps no permutation; bad g_idx are refused
naming the tensor and the field."""

from __future__ import annotations

import numpy as np
import pytest

from models.linear import serving_form, standard_params
from models.linear.registry import can_panel
from models.loaders import load_model
from models.quant import PERM, QuantPlan
from tests.models.helpers import (
    QUANT_IDS,
    QUANT_LLAMA,
    QUANT_QWEN3_MOE,
    checkpoint_variant,
    forward_logits,
    hf_logits,
)
from tests.models.int_packers import write_gptq_act_order

torch = pytest.importorskip("torch")

ATOL = 2e-5  # float32: the same weights, summed in another order


def not_k_proj(base: str) -> bool:
    """Every Linear but k_proj is act-order (k_proj's g_idx stays k // group_size)."""
    return "k_proj" not in base


def write_gptq(directory, config=QUANT_LLAMA, act_order=not_k_proj, **kw):
    return write_gptq_act_order(directory, config, act_order, **kw)


def check_logits(model, hf):
    ours, ref = forward_logits(model, QUANT_IDS), hf_logits(hf, QUANT_IDS)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.fixture(scope="module")
def gptq_act_order(tmp_path_factory):
    """(directory, transformers' model on the dequantized weights, our model)."""
    directory = tmp_path_factory.mktemp("gptq_act_order")
    hf, _ = write_gptq(directory)
    return str(directory), hf, load_model(str(directory))


def test_gptq_act_order_equals_transformers_on_xla_and_panels(gptq_act_order):
    _, hf, model = gptq_act_order
    attn = model.params["layers"]["self_attn"]
    assert PERM not in attn["k_proj"]  # its g_idx is in order: no leaf, no gather
    perm = np.asarray(attn["q_proj"][PERM])  # i32[L, K, 1], a permutation per layer
    assert perm.shape == (2, 128, 1) and perm.dtype == np.int32
    assert all(sorted(p[:, 0]) == list(range(128)) and (p[:, 0] != np.arange(128)).any()
               for p in perm)
    check_logits(model, hf)
    assert QuantPlan.from_dict(model.quant.to_dict()) == model.quant  # a checkpoint's plan
    # The permutation costs what the file's g_idx does: device bytes within 10% of its.
    assert abs(model.weight_bytes / model.checkpoint_bytes - 1) < 0.10
    # Symmetric 4-bit: the CPU kernel reads the sorted codes in place, x gathered first
    # (the engine's greedy test below serves from them); the standard leaves (the
    # permutation too) come back as loaded.
    assert can_panel(model.cfg, model.quant, model.dtype, "cpu")
    panel = serving_form(model, backend="cpu", panels=True)
    back = standard_params(panel.params, panel.cfg, panel.quant)["layers"]["self_attn"]
    for name in ("qweight", "scales", "zeros", PERM):
        np.testing.assert_array_equal(back["q_proj"][name], attn["q_proj"][name])


@pytest.mark.slow(reason="the panels' logits; their greedy tokens stay in the default tier")
def test_gptq_act_order_panels_logits(gptq_act_order):
    _, hf, model = gptq_act_order
    check_logits(serving_form(model, backend="cpu", panels=True), hf)


def test_gptq_act_order_greedy_tokens_batched_from_panels(gptq_act_order, smollm2_tokenizer):
    """The engine's greedy tokens (the CPU panels; prompts together, chunked by a small
    token budget) are transformers' greedy continuations of the dequantized model (alone:
    the teacher-forced argmax above)."""
    from jaxserve import LLM, SamplingParams

    _, hf, model = gptq_act_order
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 128, n)] for n in (5, 19, 11)]
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6,
                              do_sample=False, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    llm = LLM(model, tokenizer=smollm2_tokenizer, warmup=False, max_num_seqs=4,
              max_num_batched_tokens=16, max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False)

    def run(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    assert llm.engine.runner.model.methods.linear("q_proj").stacked  # served from panels
    assert run(prompts) == want


@pytest.mark.slow(reason="more act-order layouts of a tested path (each compiles a model)")
@pytest.mark.parametrize("case", ["asym-v1", "8bit-v2", "qwen3moe"])
def test_more_act_order_layouts_equal_transformers(case, tmp_path):
    """Asymmetric 4-bit (float32 zeros: XLA's matmul), 8-bit, and a mixture of experts
    whose every expert has its own permutation (gathered per expert in the expert loop;
    the dense reference un-permutes each expert's rows)."""
    if case == "asym-v1":
        hf, _ = write_gptq(tmp_path, sym=False)
    elif case == "8bit-v2":
        hf, _ = write_gptq(tmp_path, bits=8, group=64, v1=False)
    else:
        hf, _ = write_gptq(tmp_path, QUANT_QWEN3_MOE, act_order=lambda base: True)
    model = load_model(str(tmp_path))
    if case == "qwen3moe":
        from models.moe import dequantize_experts

        perm = np.asarray(model.params["layers"]["mlp"]["experts"]["down_proj"][PERM])
        assert perm.shape == (2, 4, 128, 1)  # [L, E, K, 1]: one permutation per expert
        assert len({p.tobytes() for p in perm[0]}) == 4
        dense = dequantize_experts({k: {n: v[0] for n, v in w.items()} for k, w in
                                    model.params["layers"]["mlp"]["experts"].items()})
        hf_down = hf.model.layers[0].mlp.experts.down_proj.detach().numpy()  # [E, H, I]
        np.testing.assert_allclose(np.asarray(dense["down_proj"]),
                                   hf_down.transpose(0, 2, 1), rtol=0, atol=1e-6)
    check_logits(model, hf)


def test_compressed_tensors_actorder_group_equals_its_decompressor(tmp_path):
    """compressed-tensors pack-quantized int4, asymmetric in groups of 32, `actorder:
    "group"` with each Linear's `weight_g_idx` (compressed by its own compressor in
    llm-compressor's act-order layout): the logits of transformers on the decompressed
    weights."""
    pytest.importorskip("compressed_tensors")
    from tests.models.ct_pack import scheme, write_ct

    sch = scheme("pack-quantized", num_bits=4, type="int", strategy="group", group_size=32,
                 symmetric=False)
    hf, tensors = write_ct(str(tmp_path), QUANT_LLAMA, sch, act_order=not_k_proj)
    g_idx = tensors["model.layers.0.self_attn.q_proj.weight_g_idx"].numpy()
    assert (np.diff(g_idx) < 0).any()  # the groups really are out of order
    model = load_model(str(tmp_path))
    assert model.quant.get("q_proj").act_order and not model.quant.get("k_proj").act_order
    check_logits(model, hf)

    def actorder(value):  # the same tensors, the scheme's actorder changed
        def edit(qc):
            qc["config_groups"]["group_0"]["weights"]["actorder"] = value
        return edit

    # Any actorder reads weight_g_idx as it is; none with one out of order, or an unknown
    # value, is refused naming the tensor or the field.
    from models.loaders import read_arch_config
    from models.loaders.checkpoint_quant import checkpoint_format

    variant = checkpoint_variant(str(tmp_path), tmp_path / "weight", config=actorder("weight"))
    assert checkpoint_format(variant, read_arch_config(variant)).plan == model.quant
    with pytest.raises(ValueError, match=r"_proj': weight_g_idx orders groups by activation"):
        load_model(checkpoint_variant(str(tmp_path), tmp_path / "none", config=actorder(None)))
    with pytest.raises(ValueError, match=r"weights.actorder 'columns' is not supported"):
        load_model(checkpoint_variant(str(tmp_path), tmp_path / "bad",
                                      config=actorder("columns")))


Q = "model.layers.1.self_attn.q_proj"
BAD_G_IDX = {  # id: (g_idx edit, message)
    "length": (lambda g: g[:100],
               rf"'{Q}': g_idx must be an integer array of shape \(128,\)"),
    "range": (lambda g: np.where(g == 3, 4, g),
              rf"'{Q}': g_idx holds groups 0..4, outside \[0, 4\)"),
    "unequal-groups": (lambda g: np.where(g == 3, 2, g),
                       rf"'{Q}': g_idx puts 0 to 64 inputs in a group; every group must hold 32"),
    "float": (lambda g: g.astype(np.float32), rf"'{Q}': g_idx must be an integer array"),
}  # an out-of-order g_idx under desc_act=false: test_int_checkpoints' "act-order"


@pytest.mark.parametrize("case", list(BAD_G_IDX))
def test_a_bad_g_idx_is_refused_naming_the_tensor(case, gptq_act_order, tmp_path):
    edit, message = BAD_G_IDX[case]
    tensors = lambda t: t.update({f"{Q}.g_idx": np.ascontiguousarray(edit(t[f"{Q}.g_idx"]))})
    with pytest.raises(ValueError, match=message):
        load_model(checkpoint_variant(gptq_act_order[0], tmp_path / "m", tensors))
