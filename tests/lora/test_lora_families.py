"""LoRA adapters on the registry's other families equal the PEFT-merged transformers model:
a mixture of experts (attention adapted; its experts are not), Gemma 2 (sandwich norms,
GELU, a hybrid KV cache) and Phi-3 (fused qkv and gate_up checkpoints, cut by the loader)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from models.linear.lora import resolve_impl
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import SMALL
from tests.lora.adapters import hf_greedy, make_adapters

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

PROMPTS = ["Once upon a time, in a village by the sea, there lived",
           "The three primary colors are red, yellow and"]
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, tie_word_embeddings=False),
                  {"attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj",
                                                                    "v_proj", "o_proj"])}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=16, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                    attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh"),
               {"qv_mlp": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                  "gate_proj", "down_proj"])}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False),
             {"fused": dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj",
                                                                "gate_up_proj"])}),
}


def _family(name, tokenizer, root):
    """(transformers base, its directory) of a tiny random model of `name`."""
    config_cls, model_cls, extra, _ = FAMILIES[name]
    config = getattr(transformers, config_cls)(**SMALL, **extra, attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    path = str(root / name)
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("gemma2", marks=pytest.mark.slow),
                                    pytest.param("phi3", marks=pytest.mark.slow)])
def test_family_adapter_equals_its_merged_model(family, smollm2_tokenizer, tmp_path):
    torch.set_num_threads(1)
    base, path = _family(family, smollm2_tokenizer, tmp_path)
    adapters = make_adapters(base, str(tmp_path / "adapters"), FAMILIES[family][3])
    (adapter,) = adapters.values()
    # NOTE: the mixture of experts runs XLA's masked form (the others the default: the CPU
    # kernel where it builds), so both forms run through a whole engine in the default tier.
    impl = "masked" if family == "qwen3_moe" else "auto"
    llm = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, warmup=False,
              lora_impl=impl, **TINY_ENGINE)
    assert llm.engine.runner.model.serving.lora_impl == ("masked" if family == "qwen3_moe"
                                                 else resolve_impl("auto", "float32",
                                                                   True))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = PROMPTS + PROMPTS
    outs = llm.generate(prompts, greedy, use_tqdm=False,
                        lora_request=[adapter.request()] * 2 + [None] * 2)
    want = ([hf_greedy(adapter.merged, smollm2_tokenizer, p, 8) for p in PROMPTS]
            + [hf_greedy(base, smollm2_tokenizer, p, 8) for p in PROMPTS])
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert want[:2] != want[2:]
