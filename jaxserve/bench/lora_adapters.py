"""Random PEFT LoRA adapters for a model's architecture, written without torch or PEFT (for
benchmarks and tests that need adapter files, not a trained adapter's numbers)."""

from __future__ import annotations

import json
import os

import numpy as np

from models.config import layer_matmul_shapes
from models.lora import served_targets


def write_random_adapter(directory: str, cfg, rank: int, seed: int) -> str:
    """A PEFT LoRA adapter directory of random A and B on every served projection."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes = layer_matmul_shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for block, module in served_targets(cfg):
            d_in, d_out = shapes[(block, module)]
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) / d_in ** 0.5
                                                ).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (0.1 * rng.standard_normal((d_out, rank))
                                                ).astype(np.float32)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                   "target_modules": sorted({m for _, m in served_targets(cfg)})}, f)
    return directory
