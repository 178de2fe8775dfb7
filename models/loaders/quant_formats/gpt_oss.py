"""gpt-oss's own MXFP4 checkpoints (`quantization_config.quant_method: "mxfp4"`): the routed
experts' stacks kept as stored, as the ``mxfp4`` kind (`models.quant`); attention, the
router, the embedding and the LM head are float in those checkpoints and stay so.

A layer's projection is `mlp.experts.<stack>_blocks` u8[E, N, K / 32, 16] and
`<stack>_scales` u8[E, N, K / 32] (`quant_formats.fp4.gpt_oss_expert_leaves`), `gate_up_proj`
holding gate and up interleaved along N (gate the even rows, as the float stack's columns:
`models.loaders.gpt_oss_names`). The reader serves each expert's projection in row form.
"""

from __future__ import annotations

import numpy as np

from models.loaders.checkpoint_quant import CheckpointFormat, register
from models.loaders.gpt_oss_names import expert_tensor, is_gpt_oss
from models.loaders.quant_formats.fp4 import gpt_oss_expert_leaves
from models.quant import EXPERT_MODULES, FP4_BLOCKS, QuantFormat, QuantPlan

MXFP4 = QuantFormat("mxfp4", FP4_BLOCKS["mxfp4"])


@register("mxfp4")
def gpt_oss_mxfp4_format(qc: dict, path: str, cfg) -> CheckpointFormat:
    """The format of a gpt-oss checkpoint whose experts are MXFP4.

    Raises:
        ValueError: A `quant_method: "mxfp4"` config on another architecture than
            gpt-oss's (that method is its own), or a `modules_to_not_convert` naming the
            experts (the config's field named). The reader raises one naming the tensor and
            the field for misshapen blocks or scales.
    """
    if not is_gpt_oss(cfg):
        raise ValueError(f"{path}: quantization_config.quant_method 'mxfp4' is gpt-oss's "
                         f"expert format; {cfg.architecture} does not store it")
    for module in qc.get("modules_to_not_convert") or ():
        if "experts" in module:
            raise ValueError(f"{path}: quantization_config.modules_to_not_convert names "
                             f"{module!r}: float experts in an MXFP4 gpt-oss checkpoint are "
                             "not served")
    plan = QuantPlan(tuple((m, MXFP4) for m in EXPERT_MODULES), "mxfp4")
    cache: dict[str, dict[str, np.ndarray]] = {}  # one stack's leaves: a layer's E experts

    def reader(source, name: str) -> dict[str, np.ndarray]:
        found = expert_tensor(name)
        if found is None or found[2] != "weight":
            raise KeyError(name)
        stacked, expert, _, parity = found
        if stacked not in cache:
            cache.clear()
            cache[stacked] = gpt_oss_expert_leaves(source.get(stacked + "_blocks"),
                                                   source.get(stacked + "_scales"), stacked)
        cols = slice(None) if parity is None else slice(parity, None, 2)
        # [E, K', N] stack -> one expert's row form [N', K'] (the gate's or up's rows of N)
        return {leaf: np.ascontiguousarray(v[expert][:, cols].T)
                for leaf, v in cache[stacked].items()}

    return CheckpointFormat("mxfp4", plan, reader)
