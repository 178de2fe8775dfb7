"""PEFT LoRA adapters read for a base model: every target's A/B stacks equal what PEFT's own
merge adds to the base weights (rank and alpha patterns, rsLoRA, layers left alone, fused
modules), and every bad adapter is a ValueError naming the problem."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxserve.lora import LoRARequest
from models.loaders.peft_adapter import TARGETS, load_peft_adapter
from models.registry import arch_config_from_hf

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=64)


def base_model(config_cls="LlamaConfig", model_cls="LlamaForCausalLM", **overrides):
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**{**SMALL, **overrides},
                                            architectures=[model_cls])
    return getattr(transformers, model_cls)(cfg).eval()


def save_adapter(model, directory, seed=1, **lora):
    """`model` wrapped by PEFT with `lora`, random nonzero A and B, saved to `directory`;
    returns the PEFT-merged copy's state dict (the oracle)."""
    import copy

    wrapped = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    wrapped.save_pretrained(directory)
    return {k: v.detach().numpy() for k, v in wrapped.merge_and_unload().state_dict().items()}


def check_deltas(model, merged, weights, cfg, fused=None):
    """Each target's base + A @ B equals the merged weight, every layer (zeros where the
    adapter leaves a module alone)."""
    base = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for (block, module) in TARGETS:
        for layer in range(cfg.num_layers):
            name, rows = f"model.layers.{layer}.{block}.{module}.weight", slice(None)
            if fused and module in fused:
                name, rows = f"model.layers.{layer}.{block}.{fused[module][0]}.weight", \
                    fused[module][1]
            want = (merged[name] - base[name])[rows].T  # [in, out]
            if (block, module) not in weights.stacks:
                np.testing.assert_allclose(want, 0, atol=1e-6)
                continue
            a, b = weights.stacks[(block, module)]
            np.testing.assert_allclose(a[layer] @ b[layer], want, atol=2e-6, rtol=1e-5)


def test_patterns_and_untouched_layers_match_peft_merge(tmp_path):
    model = base_model()
    cfg = arch_config_from_hf(model.config.to_dict())
    merged = save_adapter(model, tmp_path, r=4, lora_alpha=8,
                          target_modules=["q_proj", "v_proj", "down_proj"],
                          rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 3},
                          layers_to_transform=[0, 2])
    weights = load_peft_adapter(str(tmp_path), cfg, max_lora_rank=8)
    assert weights.rank == 4 and weights.targets == ("q_proj", "v_proj", "down_proj")
    a, b = weights.stacks[("self_attn", "v_proj")]
    assert a.shape == (3, 32, 4) and b.shape == (3, 4, 16)
    assert not a[:, :, 2:].any() and not a[1].any()  # rank 2 padded; layer 1 left alone
    check_deltas(model, merged, weights, cfg)


def test_rslora_on_every_target(tmp_path):
    model = base_model()
    cfg = arch_config_from_hf(model.config.to_dict())
    merged = save_adapter(model, tmp_path, r=8, lora_alpha=16, use_rslora=True,
                          target_modules=[m for _, m in TARGETS])
    weights = load_peft_adapter(str(tmp_path), cfg)
    assert weights.targets == tuple(m for _, m in TARGETS)
    check_deltas(model, merged, weights, cfg)


def test_fused_qkv_and_gate_up_are_cut_into_the_decoders_modules(tmp_path):
    model = base_model("Phi3Config", "Phi3ForCausalLM", pad_token_id=0)
    cfg = arch_config_from_hf(model.config.to_dict())
    merged = save_adapter(model, tmp_path, r=4, lora_alpha=4,
                          target_modules=["qkv_proj", "gate_up_proj"])
    weights = load_peft_adapter(str(tmp_path), cfg)
    assert weights.targets == ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    q, kv, i = 32, 16, 48
    fused = {"q_proj": ("qkv_proj", slice(0, q)), "k_proj": ("qkv_proj", slice(q, q + kv)),
             "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
             "gate_proj": ("gate_up_proj", slice(0, i)), "up_proj": ("gate_up_proj",
                                                                      slice(i, 2 * i))}
    check_deltas(model, merged, weights, cfg, fused)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    model = base_model()
    directory = tmp_path_factory.mktemp("adapter")
    save_adapter(model, directory, r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"])
    return str(directory), arch_config_from_hf(model.config.to_dict())


def edited(adapter_dir, tmp_path, config=None, tensors=None):
    """A copy of the adapter with its config updated by `config` and its tensors replaced
    by `tensors(old) -> new`."""
    from safetensors.numpy import load_file, save_file

    src, _ = adapter_dir
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open(os.path.join(src, "adapter_config.json")) as f:
        cfg = json.load(f)
    with open(tmp_path / "adapter_config.json", "w") as f:
        json.dump({**cfg, **(config or {})}, f)
    old = load_file(os.path.join(src, "adapter_model.safetensors"))
    save_file((tensors or dict)(old), str(tmp_path / "adapter_model.safetensors"))
    return str(tmp_path)


def renamed(old, new):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


@pytest.mark.parametrize("config,tensors,match", [
    ({"peft_type": "IA3"}, None, "peft_type 'IA3' is not supported"),
    # vLLM's refusals, in vLLM's words (its clients and tests match on them)
    ({"use_dora": True}, None, "does not yet support DoRA"),
    ({"bias": "all"}, None, "Adapter bias cannot be used without bias_enabled"),
    ({"bias": "lora_only"}, None, "Adapter bias cannot be used without bias_enabled"),
    ({"modules_to_save": ["lm_head"]}, None, "only supports modules_to_save being None"),
    ({"fan_in_fan_out": True}, None, "fan_in_fan_out=True is not supported"),
    (None, renamed("o_proj", "out_proj"), "target module self_attn.out_proj"),
    (None, renamed("layers.1.", "layers.7."), "is for layer 7; the base has 3 layers"),
    (None, renamed("self_attn.q_proj.lora_A", "embed_tokens.lora_embedding_A"),
     "is not a LoRA weight of a decoder layer"),
    (None, lambda t: {k: v for k, v in t.items() if "q_proj.lora_B" not in k},
     "q_proj has no lora_B weight"),
    (None, lambda t: {k: (v[:, :16] if "q_proj.lora_A" in k else v) for k, v in t.items()},
     r"do not fit the base's module \(want \[r, 32\] and \[32, r\]\)"),
    (None, lambda t: {}, "holds no LoRA weights"),
])
def test_bad_adapters_name_the_problem(adapter_dir, tmp_path, config, tensors, match):
    path = edited(adapter_dir, tmp_path, config, tensors)
    with pytest.raises(ValueError, match=match):
        load_peft_adapter(path, adapter_dir[1])


def test_rank_above_the_maximum_and_non_peft_directories(adapter_dir, tmp_path):
    path, cfg = adapter_dir
    with pytest.raises(ValueError, match=r"LoRA rank 4 is greater than max_lora_rank 2\."):
        load_peft_adapter(path, cfg, max_lora_rank=2)
    # The config's `r` is refused even where the tensors are smaller (as vLLM checks it)...
    big_r = edited(adapter_dir, tmp_path / "big-r", {"r": 32})
    with pytest.raises(ValueError, match="LoRA rank 32 is greater than max_lora_rank 16"):
        load_peft_adapter(big_r, cfg, max_lora_rank=16)
    # ...and the tensors' rank where the config understates it.
    small_r = edited(adapter_dir, tmp_path / "small-r", {"r": 1})
    with pytest.raises(ValueError, match=r"o_proj: LoRA rank 4 is greater than max_lora_rank 2"):
        load_peft_adapter(small_r, cfg, max_lora_rank=2)
    # Every vLLM refusal at once, in one message (vLLM's order).
    every = edited(adapter_dir, tmp_path / "every", {"r": 32, "bias": "all", "use_dora": True,
                                                     "modules_to_save": ["lm_head"]})
    with pytest.raises(ValueError, match=r"modules_to_save being None .*\. jaxserve does not "
                                         r"yet support DoRA\. LoRA rank 32 is greater than "
                                         r"max_lora_rank 16\. Adapter bias cannot"):
        load_peft_adapter(every, cfg, max_lora_rank=16)
    with pytest.raises(ValueError, match="is not a directory"):
        load_peft_adapter(str(tmp_path / "missing"), cfg)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="has no adapter_config.json: not a PEFT adapter"):
        load_peft_adapter(str(tmp_path), cfg)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json is not JSON"):
        load_peft_adapter(str(tmp_path), cfg)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lora_name="", lora_int_id=1), "lora_name must be a non-empty string"),
    (dict(lora_name="a", lora_int_id=0), "lora_int_id must be a positive integer"),
    (dict(lora_name="a", lora_int_id=True), "lora_int_id must be a positive integer"),
    (dict(lora_name="a", lora_int_id=1, lora_path=3), "lora_path must be a string"),
])
def test_lora_request_fields_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(**kwargs)


def test_lora_request_is_vllms():
    req = LoRARequest("sql", 3, "/adapters/sql")
    assert (req.name, req.adapter_id, req.path) == ("sql", 3, "/adapters/sql")
    assert req == LoRARequest("sql", 3, "/adapters/sql", base_model_name="base")
    assert hash(req) == hash(LoRARequest("sql", 3, "/adapters/sql"))
