"""Multi-token prediction (MTP) layers as a draft head: the block, its forward, its greedy pick.

DeepSeek-V3 keeps `num_nextn_predict_layers` MTP layers after the decoder's L layers, as
`model.layers.{L + i}.*` (vLLM's `DeepSeekMTP`): RMSNorms `enorm` and `hnorm`, `eh_proj`
[H, 2H], a full decoder layer of the target's own kind (latent attention, the mixture of
experts of a sparse layer), `shared_head.norm` and `shared_head.head` (an LM head; the
target's where the checkpoint has none). For position p, with e the embedding of token
p + 1 (the target's table; zeros at position 0, as vLLM masks it) and g the target's final
hidden state at p (after its final norm: what vLLM's target model returns):

    x = eh_proj([enorm(e), hnorm(g)])                           # [T, 2H] -> [T, H]
    prenorm = layer(x)                                          # the layer's residual stream
    logits = head(shared_head.norm(prenorm))

Each later step feeds the layer its own `prenorm` as g with the embedding of the token it
proposed (vLLM's chaining). The layer runs as a one-layer `Decoder` of the target's family
(`block_config`): `x` enters as every token's embedding (`mm_embeds`), its final norm is
`shared_head.norm`, and the residual stream after its layer is its aux id 1. Its K/V is that
decoder's one-layer pool (a latent pool for DeepSeek). With several MTP layers the first
serves every step (vLLM cycles through them; DeepSeek-V3 ships one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.model import Model

# The families whose checkpoints carry MTP layers this module serves.
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def block_config(cfg: ArchConfig) -> ArchConfig:
    """The one-layer decoder that runs an MTP layer of a target of config `cfg`: its layer
    sparse (DeepSeek's MTP layer index is past `first_k_dense_replace`), full attention, a
    one-token vocabulary whose embedding is never read (`mtp_forward` gives every token
    its input) and no LM head of its own (`pick` applies the head)."""
    return dataclasses.replace(cfg, num_layers=1, layer_windows=(0,), dense_layers=(),
                               vocab_size=1, tie_word_embeddings=True)


@dataclass
class MtpHead:
    """A loaded MTP draft.

    Attributes:
        block: The MTP layer as a one-layer `Model` (`block_config`; its norm
            `shared_head.norm`).
        params: {"block": its params, "enorm", "hnorm": [H], "eh_proj": [H, 2H] ([out, in]),
            and "head": [V, H] where the checkpoint has `shared_head.head`}.
        layer: The layer's index in the checkpoint (the target's layer count).
        eps: The RMSNorms' epsilon.
        source: Where it came from.
    """

    block: Model
    params: dict
    layer: int
    eps: float
    source: str = ""

    @property
    def weight_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self.params))


def rms(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """DeepSeek's RMSNorm of x [T, H]: in float32, cast back, then scaled."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def mtp_forward(head: MtpHead, params: dict, embeds: jax.Array, g: jax.Array,
                positions: jax.Array, kv_pages, md):
    """One step of the MTP layer over a step's tokens (any mix of requests).

    Args:
        head: The head (its block and epsilon: static).
        params: Its weights (`MtpHead.params`).
        embeds: [T, H] embeddings of each position's next token.
        g: [T, H] the target's final hidden states, or the layer's own `prenorm` of the step
            before.
        positions: i32[T] each token's position.
        kv_pages: The block's one-layer pool.
        md: Its metadata (over the head's pages).

    Returns:
        (kv_pages, normed [T, H] after `shared_head.norm`, prenorm [T, H]).
    """
    e = jnp.where((positions == 0)[:, None], jnp.zeros_like(embeds), embeds)  # [T, H]
    x = jnp.concatenate([rms(e, params["enorm"], head.eps), rms(g, params["hnorm"], head.eps)],
                        axis=-1)  # [T, 2H]
    x = x @ params["eh_proj"].T.astype(x.dtype)  # [T, H]
    num_tokens = x.shape[0]
    kv_pages, normed, aux = head.block.forward(
        params["block"], jnp.zeros(num_tokens, jnp.int32), positions, kv_pages, md,
        aux_layers=(1,), mm_embeds=(x, jnp.arange(num_tokens, dtype=jnp.int32)))
    return kv_pages, normed, aux[:, 0]  # aux: [T, 1, H], the stream after the layer
