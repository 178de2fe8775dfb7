"""Test helpers: random PEFT LoRA adapters for an HF model directory, and their oracle (the
PEFT-merged model's greedy tokens, from transformers)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import numpy as np

# Four adapters of different ranks, alphas and targets (rsLoRA on one), as PEFT configs.
ADAPTER_CONFIGS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "mlp4": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all16": dict(r=16, lora_alpha=16, use_rslora=True,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                  "up_proj", "down_proj"]),
    "ko2": dict(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj"]),
}


@dataclass
class Adapter:
    """One adapter written to disk and the merged transformers model it equals."""

    name: str
    lora_int_id: int
    path: str
    merged: object  # a transformers model with the adapter merged in

    def request(self):
        from jaxserve.lora import LoRARequest

        return LoRARequest(self.name, self.lora_int_id, self.path)


def load_hf(model_dir: str):
    """transformers' float32 model of an HF directory (the base), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def write_adapter(base, directory: str, seed: int, scale: float = 0.3, **lora) -> object:
    """Wraps a copy of `base` with PEFT's `LoraConfig(**lora)`, sets every A and B to random
    nonzero values (so the adapter changes the outputs), saves it to `directory`; returns
    the merged model (`merge_and_unload`)."""
    import peft
    import torch

    wrapped = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    wrapped.save_pretrained(directory)
    return wrapped.merge_and_unload().eval()


def make_adapters(base, root: str, configs: dict | None = None, first_id: int = 1
                  ) -> dict[str, Adapter]:
    """The adapters of `configs` (default `ADAPTER_CONFIGS`) for `base`, under `root`."""
    configs = ADAPTER_CONFIGS if configs is None else configs
    out = {}
    for i, (name, lora) in enumerate(configs.items()):
        path = os.path.join(root, name)
        out[name] = Adapter(name, first_id + i, path, write_adapter(base, path, seed=i + 1,
                                                                     **lora))
    return out


def hf_greedy(model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` (EOS ignored: exactly `max_tokens`)."""
    import torch

    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    return np.asarray(out[0, ids.shape[1]:]).tolist()
