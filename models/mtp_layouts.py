"""Where each family's checkpoint keeps its MTP layers, and the few ways their math differs.

DeepSeek-V3 (vLLM's `DeepSeekMTP`) keeps its MTP layer as the decoder layer past the last,
`model.layers.{L}.*`, with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and an optional
`shared_head.head`; it zeroes the embedding at position 0 and chains the layer's pre-norm
output into the next step. Qwen3-Next and Qwen3.5 (vLLM's `Qwen3NextMTP`, `Qwen3_5MTP`) keep
theirs under `mtp.*`: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc` [H, 2H], a gated
full-attention layer `mtp.layers.0.*` and `mtp.norm`; the target's LM head proposes, no
position is masked, and the next step reads the layer's normed output (what vLLM's MTP model
returns). The role names (`enorm`, `hnorm`, `eh_proj`, `head`) are DeepSeek's for all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MtpLayout:
    """One family's MTP tensors and math.

    Attributes:
        architectures: The targets' architectures.
        count_keys: Config keys giving the number of MTP layers (the first present counts).
        prefix: Prefix of the MTP tensors; "{L}" is the target's layer count.
        block_prefix: Prefix of the MTP layer's decoder tensors (read as layer 0).
        names: {role: name under `prefix`} for "enorm", "hnorm", "eh_proj" and "norm" (the
            layer's final norm), and "head" where the checkpoint may carry an LM head.
        layer_index: The index the family's own code gives the MTP layer when it decides
            whether its MLP is dense (vLLM's: the checkpoint index L for DeepSeek, 0 in
            `mtp.layers` for Qwen); None: the target's layer count.
        mask_first: The embedding at position 0 is zeros (DeepSeek's).
        chain_normed: A later step reads the layer's output after its final norm (Qwen's),
            not before it (DeepSeek's).
    """

    architectures: tuple[str, ...]
    count_keys: tuple[str, ...]
    prefix: str
    block_prefix: str
    names: dict
    layer_index: int | None
    mask_first: bool
    chain_normed: bool

    def tensor(self, role: str, num_layers: int) -> str:
        """The checkpoint name of `role`'s weight for a target of `num_layers` layers."""
        return f"{self.prefix}{self.names[role]}.weight".replace("{L}", str(num_layers))

    def block(self, num_layers: int) -> str:
        """The prefix of the MTP layer's decoder tensors."""
        return self.block_prefix.replace("{L}", str(num_layers))


DEEPSEEK = MtpLayout(
    architectures=("DeepseekV3ForCausalLM",), count_keys=("num_nextn_predict_layers",),
    prefix="model.layers.{L}.", block_prefix="model.layers.{L}.",
    names={"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
           "norm": "shared_head.norm", "head": "shared_head.head"},
    layer_index=None, mask_first=True, chain_normed=False)

QWEN = MtpLayout(
    architectures=("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
    count_keys=("num_nextn_predict_layers", "mtp_num_hidden_layers"),
    prefix="mtp.", block_prefix="mtp.layers.0.",
    names={"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
           "norm": "norm"},
    layer_index=0, mask_first=False, chain_normed=True)

LAYOUTS = {arch: layout for layout in (DEEPSEEK, QWEN) for arch in layout.architectures}
