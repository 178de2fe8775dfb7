"""Multi-token prediction (MTP) layers as a draft head: the block, its forward, its greedy pick.

DeepSeek-V3, Qwen3-Next and Qwen3.5 checkpoints keep `num_nextn_predict_layers` (Qwen3.5:
`mtp_num_hidden_layers`) MTP layers beside the decoder (where, and how their math differs:
`models.mtp_layouts`): two RMSNorms `enorm` and `hnorm` (Qwen: `pre_fc_norm_embedding`,
`pre_fc_norm_hidden`), `eh_proj` [H, 2H] (Qwen: `fc`), a full decoder layer of the target's
own kind (DeepSeek's latent attention, Qwen's gated attention; the target's mixture of
experts), a final norm and an LM head (DeepSeek's `shared_head.head` where the checkpoint has
it; the target's otherwise). For position p, with e the embedding of token p + 1 (the target's
table; DeepSeek zeroes it at position 0, as vLLM does) and g the target's final hidden state
at p (after its final norm: what vLLM's target model returns):

    x = eh_proj([enorm(e), hnorm(g)])                           # [T, 2H] -> [T, H]
    prenorm = layer(x)                                          # the layer's residual stream
    logits = head(norm(prenorm))

Each later step feeds the layer the embedding of the token it proposed and, as g, its own
`prenorm` (DeepSeek) or `norm(prenorm)` (Qwen: its MTP model returns the normed state; vLLM's
chaining). The layer runs as a one-layer `Decoder` of the target's family (`block_config`):
`x` enters as every token's embedding (`mm_embeds`), its final norm is the MTP layer's, and the
residual stream after its layer is its aux id 1. Its K/V is that decoder's one-layer pool (a
latent pool for DeepSeek; the head needs no state slots: the layer is full attention). With
several MTP layers the first serves every step (vLLM cycles through them; the checkpoints of
these families ship one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.layers import RMSNorm
from models.model import Model
from models.mtp_layouts import LAYOUTS, MtpLayout

# The families whose checkpoints carry MTP layers this module serves.
MTP_ARCHITECTURES = tuple(LAYOUTS)


def block_config(cfg: ArchConfig) -> ArchConfig:
    """The one-layer decoder that runs an MTP layer of a target of config `cfg`: full
    attention (a hybrid's MTP layer is a full-attention layer), a one-token vocabulary whose
    embedding is never read (`mtp_forward` gives every token its input), no LM head of its
    own (`pick` applies the head), and the target's experts unless the family's own rule
    makes the layer dense (its index in `MtpLayout.layer_index` among `dense_layers`:
    DeepSeek's index L is past `first_k_dense_replace`; Qwen's 0 follows
    `mlp_only_layers` / `decoder_sparse_step`)."""
    layout = LAYOUTS[cfg.architecture]
    index = cfg.num_layers if layout.layer_index is None else layout.layer_index
    experts = 0 if index in cfg.dense_layers else cfg.num_experts
    return dataclasses.replace(cfg, num_layers=1, layer_windows=(0,), dense_layers=(),
                               linear_layers=(), num_experts=experts, vocab_size=1,
                               tie_word_embeddings=True)


@dataclass
class MtpHead:
    """A loaded MTP draft.

    Attributes:
        block: The MTP layer as a one-layer `Model` (`block_config`; its final norm the MTP
            layer's: `shared_head.norm`, Qwen's `mtp.norm`).
        params: {"block": its params, "enorm", "hnorm": [H], "eh_proj": [H, 2H] ([out, in]),
            and "head": [V, H] where the checkpoint has `shared_head.head`} (DeepSeek's role
            names for every family).
        layer: The layer's index in the checkpoint (the target's layer count).
        eps: The RMSNorms' epsilon.
        layout: The family's MTP layout (`models.mtp_layouts`).
        source: Where it came from.
    """

    block: Model
    params: dict
    layer: int
    eps: float
    layout: MtpLayout
    source: str = ""

    @property
    def weight_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self.params))


def rms(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """The target's RMSNorm of x [T, H] (`models.layers.RMSNorm`: DeepSeek's scales by the
    weight after the cast back, Qwen's by `1 + weight` in float32 before it)."""
    return RMSNorm(eps, weight.dtype, offset).apply({"params": {"scale": weight}}, x)


def mtp_forward(head: MtpHead, params: dict, embeds: jax.Array, g: jax.Array,
                positions: jax.Array, kv_pages, md):
    """One step of the MTP layer over a step's tokens (any mix of requests).

    Args:
        head: The head (its block and epsilon: static).
        params: Its weights (`MtpHead.params`).
        embeds: [T, H] embeddings of each position's next token.
        g: [T, H] the target's final hidden states, or the layer's own output of the step
            before (`chained`).
        positions: i32[T] each token's position.
        kv_pages: The block's one-layer pool.
        md: Its metadata (over the head's pages).

    Returns:
        (kv_pages, normed [T, H] after the layer's final norm, chained [T, H]: what the next
        step reads as g, the pre-norm stream or `normed` (`MtpLayout.chain_normed`)).
    """
    e = embeds  # [T, H]
    if head.layout.mask_first:
        e = jnp.where((positions == 0)[:, None], jnp.zeros_like(embeds), embeds)
    offset = head.block.cfg.norm_offset
    x = jnp.concatenate([rms(e, params["enorm"], head.eps, offset),
                         rms(g, params["hnorm"], head.eps, offset)], axis=-1)  # [T, 2H]
    x = x @ params["eh_proj"].T.astype(x.dtype)  # [T, H]
    num_tokens = x.shape[0]
    kv_pages, normed, aux = head.block.forward(
        params["block"], jnp.zeros(num_tokens, jnp.int32), positions, kv_pages, md,
        aux_layers=(1,), mm_embeds=(x, jnp.arange(num_tokens, dtype=jnp.int32)))
    chained = normed if head.layout.chain_normed else aux[:, 0]  # aux: [T, 1, H]
    return kv_pages, normed, chained
