"""Linear methods: how each weight is stored and multiplied, chosen once per model.

The seam between the models and the hardware (vLLM's `LinearMethodBase`/`quant_method`).
The decoder builds `Linear(features, methods.linear(name))` and `Embedding(...)` and calls
them; which leaves a weight holds, which kernel multiplies it and how a checkpoint's
tensors become those leaves is the method's business:

    base.py      `LinearMethod` / `EmbedMethod` (the interface), the `Linear` and
                 `Embedding` modules, `STACKS` (weights read whole at the layer index)
    dense.py     `FloatLinear`, `QuantLinear` (q8/q4 through `quant_matmul`), their
                 embeddings
    fp8.py       `Fp8Linear` (FP8 codes with block scales, through `fp8_matmul`)
    fp4.py       `Fp4Linear` (MXFP4/NVFP4 codes with block scales, through `fp4_matmul`)
    panels.py    the `cpu` backend's packed panels (`PanelLinear`, `PanelEmbed`)
    lora.py      `LoRALinear`, a method wrapping another with per-token adapter updates
    context.py   the per-step values a method reads (real rows, LoRA slots)
    registry.py  `ServingChoice` -> `Methods` (`choose_methods`), the serving transforms
                 (`serving_params`, `standard_params`), the platform's defaults

`docs/design.md` ("How to add a weight format") says how a new format becomes one method.
"""

from models.linear.base import STACKS, Embedding, EmbedMethod, Linear, LinearMethod
from models.linear.context import ForwardContext, forward_context
from models.linear.registry import (
    Methods,
    ServingChoice,
    can_panel,
    choose_methods,
    serving_form,
    serving_params,
    standard_params,
)

__all__ = [
    "STACKS",
    "EmbedMethod",
    "Embedding",
    "ForwardContext",
    "Linear",
    "LinearMethod",
    "Methods",
    "ServingChoice",
    "can_panel",
    "choose_methods",
    "forward_context",
    "serving_form",
    "serving_params",
    "standard_params",
]
