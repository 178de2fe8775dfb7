"""Reads a PEFT LoRA adapter directory into per-module, per-layer A/B stacks for a base model.

A PEFT adapter is a directory with `adapter_config.json` (`peft_type` "LORA", `r`,
`lora_alpha`, `use_rslora`, `rank_pattern`, `alpha_pattern`, ...) and
`adapter_model.safetensors`, whose tensors are named after the base model's modules:
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (f32[r, in]) and
`...lora_B.weight` (f32[out, r]). The module's output gains `scaling * x @ A.T @ B.T`, with
`scaling = alpha / r` (rsLoRA: `alpha / sqrt(r)`). The tensors present say which modules and
layers the adapter changes; the config gives the scalings.

Here every target module becomes one A stack f32[L, in, rank] and one B stack
f32[L, rank, out] (the scaling folded into B; layers the adapter leaves alone, and ranks
below the adapter's largest, are zeros), in the decoder's [in, out] orientation. Modules a
base stores fused (Phi-3's `qkv_proj`, `gate_up_proj`) share their A; B is cut by rows into
the pieces the decoder keeps apart.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from models.config import ArchConfig, layer_matmul_shapes
from models.lora import TARGETS

# Fused checkpoint modules and the decoder modules their output rows hold, in order.
_FUSED = {("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
          ("mlp", "gate_up_proj"): ("gate_proj", "up_proj")}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.default)?\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter's weights, laid out for a base model.

    Attributes:
        rank: The largest rank of any module (every stack's rank axis).
        stacks: (block, module) -> (A f32[L, in, rank], B f32[L, rank, out]) with the
            scaling folded into B; only the modules the adapter targets.
    """

    rank: int
    stacks: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]

    @property
    def targets(self) -> tuple[str, ...]:
        """The target modules' names ("q_proj", ...), in the decoder's order."""
        return tuple(m for b, m in TARGETS if (b, m) in self.stacks)


def read_adapter_config(path: str, max_lora_rank: int | None = None) -> dict:
    """The adapter's `adapter_config.json`, checked to be a LoRA adapter jaxserve serves.

    The features vLLM refuses are refused with vLLM's wording (clients match on it), all
    of them in one message: `modules_to_save`, DoRA, a config `r` above `max_lora_rank`
    (whatever the tensors hold), and a `bias` other than "none".

    Args:
        path: The adapter directory.
        max_lora_rank: The largest rank served (None: any).

    Raises:
        ValueError: `path` is not a directory, has no config or weights (not a PEFT
            adapter), or the config asks for what is not served (another `peft_type`,
            DoRA, trained biases, `modules_to_save`, a rank above `max_lora_rank`,
            `fan_in_fan_out`, `lora_bias`).
    """
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r} is not a directory (a PEFT adapter is a "
                         f"directory with {CONFIG_FILE} and {WEIGHTS_FILE})")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise ValueError(f"LoRA adapter {path!r} has no {name}: not a PEFT adapter "
                             f"directory ({CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type "
                         f"{config.get('peft_type') if isinstance(config, dict) else config!r}"
                         " is not supported (only LORA)")
    problems = _unsupported(config, max_lora_rank)
    if problems:
        raise ValueError(f"LoRA adapter {path!r}: {' '.join(problems)}")
    refused = {"fan_in_fan_out": "fan_in_fan_out (Conv1D bases)", "lora_bias": "lora_bias"}
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {key}={config[key]!r} is not supported "
                             f"({what})")
    return config


def _unsupported(config: dict, max_lora_rank: int | None) -> list[str]:
    """vLLM's refusals of an adapter config (`PEFTHelper.validate_legal`'s sentences, with
    this engine's name), in vLLM's order."""
    problems = []
    if config.get("modules_to_save"):
        problems.append(f"jaxserve only supports modules_to_save being None (got "
                        f"{config['modules_to_save']!r}: fully trained modules).")
    if config.get("use_dora"):
        problems.append("jaxserve does not yet support DoRA.")
    rank = config.get("r")
    # NOTE: the config's `r` is checked as vLLM does, even where the saved tensors are
    # smaller (the tensors' own ranks are checked when they are read).
    if (max_lora_rank is not None and isinstance(rank, int) and not isinstance(rank, bool)
            and rank > max_lora_rank):
        problems.append(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.")
    if config.get("bias", "none") != "none":
        problems.append(f"Adapter bias cannot be used without bias_enabled (bias="
                        f"{config['bias']!r}; jaxserve serves adapters without trained "
                        "biases).")
    return problems


def _pattern_value(patterns: dict, name: str, default):
    """The value of the first pattern in `patterns` that `name` (a dotted module name)
    ends with, as PEFT's `rank_pattern` / `alpha_pattern` match; else `default`."""
    for pattern, value in (patterns or {}).items():
        if re.fullmatch(rf"(?:.*\.)?(?:{pattern})", name):
            return value
    return default


def _scaling(config: dict, name: str, rank: int) -> float:
    alpha = float(_pattern_value(config.get("alpha_pattern"), name,
                                 config.get("lora_alpha", 8)))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def load_peft_adapter(path: str, cfg: ArchConfig, max_lora_rank: int | None = None
                      ) -> LoRAWeights:
    """Reads the PEFT LoRA adapter in directory `path` for a base model of `cfg`.

    Args:
        path: The adapter directory.
        cfg: The base model's architecture.
        max_lora_rank: The largest rank served (None: any).

    Returns:
        The adapter's stacks (`LoRAWeights`).

    Raises:
        ValueError: Not a PEFT LoRA directory or an unsupported config
            (`read_adapter_config`); a tensor for a module the base lacks or jaxserve does
            not adapt (embeddings, the LM head, routed experts); a layer past the base's; an
            A or B whose shape does not fit the base's module; a rank above
            `max_lora_rank`; no LoRA tensor at all.
    """
    from safetensors.numpy import load_file

    config = read_adapter_config(path, max_lora_rank)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    shapes = layer_matmul_shapes(cfg)
    found: dict[tuple[int, str, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not a LoRA weight of a "
                             "decoder layer's attention or MLP projection (targets served: "
                             f"{', '.join(n for _, n in TARGETS)})")
        layer, block, module, which = int(m[1]), m[2], m[3], m[4]
        if (block, module) not in shapes and (block, module) not in _FUSED:
            raise ValueError(f"LoRA adapter {path!r}: target module {block}.{module} (tensor "
                             f"{key!r}) is not in the base's layers or not adapted by jaxserve "
                             f"(targets: {', '.join(n for _, n in TARGETS)})")
        if layer >= cfg.num_layers:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is for layer {layer}; the "
                             f"base has {cfg.num_layers} layers")
        found.setdefault((layer, block, module), {})[which] = np.asarray(value, np.float32)
    if not found:
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    pieces = _pieces(path, config, found, shapes, max_lora_rank)
    rank = max(a.shape[1] for a, _ in pieces.values())
    stacks = {}
    for (layer, block, module), (a, b) in pieces.items():
        if (block, module) not in stacks:
            d_in, d_out = shapes[(block, module)]
            stacks[(block, module)] = (np.zeros((cfg.num_layers, d_in, rank), np.float32),
                                       np.zeros((cfg.num_layers, rank, d_out), np.float32))
        stack_a, stack_b = stacks[(block, module)]
        stack_a[layer, :, :a.shape[1]] = a
        stack_b[layer, :b.shape[0]] = b
    return LoRAWeights(rank, stacks)


def _pieces(path, config, found, shapes, max_lora_rank):
    """(layer, block, module) -> (A f32[in, r], scaled B f32[r, out]), fused modules cut."""
    pieces = {}
    for (layer, block, module), ab in sorted(found.items()):
        name = f"model.layers.{layer}.{block}.{module}"
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise ValueError(f"LoRA adapter {path!r}: {name} has no lora_{missing} weight")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {path!r}: {name} lora_A {a.shape} and lora_B "
                             f"{b.shape} are not [r, in] and [out, r]")
        rank = a.shape[0]
        if max_lora_rank is not None and rank > max_lora_rank:
            raise ValueError(f"LoRA adapter {path!r}: {name}: LoRA rank {rank} is greater "
                             f"than max_lora_rank {max_lora_rank}.")
        parts = _FUSED.get((block, module), (module,))
        widths = [shapes[(block, p)][1] for p in parts]
        d_in = shapes[(block, parts[0])][0]
        if a.shape[1] != d_in or b.shape[0] != sum(widths):
            want = f"[r, {d_in}] and [{sum(widths)}, r]"
            raise ValueError(f"LoRA adapter {path!r}: {name} lora_A {a.shape} and lora_B "
                             f"{b.shape} do not fit the base's module (want {want})")
        scaled = (b * _scaling(config, name, rank)).T  # [r, out]
        for part, lo, hi in zip(parts, np.cumsum([0, *widths[:-1]]), np.cumsum(widths),
                                strict=True):
            pieces[(layer, block, part)] = (np.ascontiguousarray(a.T),
                                            np.ascontiguousarray(scaled[:, lo:hi]))
    return pieces
