"""MTP proposals: the target checkpoint's own multi-token-prediction layer as the draft head.

The same machinery as EAGLE-3's (`eagle`: `observe` after each target step over the positions
it made valid, a jitted loop of k - 1 steps before the next, the head's own pool and prefix
cache), with the head of `models.mtp`: it reads one aux state, the target's residual stream
after its last layer (aux id L, vLLM's numbering), through the target's final norm, and the
target's embeddings; its greedy pick is `shared_head.head`'s argmax, or the target's LM head.
"""

from __future__ import annotations

import functools

import jax

from jaxserve.config import SpeculativeConfig
from jaxserve.sample.rowwise import argmax_rows
from jaxserve.spec_decode.eagle import Eagle3Speculator
from jaxserve.spec_decode.eagle_programs import HeadProgramSpec
from jaxserve.spec_decode.eagle_setup import target_embedding
from models.loaders.mtp import load_mtp
from models.model import variables
from models.mtp import MtpHead, mtp_forward


class MtpSpeculator(Eagle3Speculator):
    """Proposes with the target's MTP layer (see the module docstring).

    Args:
        config: `SpeculativeConfig` of method "mtp" (`model`: the checkpoint directory
            holding the layer, default the target's; or a loaded `models.mtp.MtpHead`).
        target: The target `Model`.
        Others: as `Eagle3Speculator`'s.

    Raises:
        ValueError: A target or checkpoint without MTP layers (`load_mtp`).
    """

    def fit_head(self, config: SpeculativeConfig, target, dtype: str) -> tuple:
        head = config.model if isinstance(config.model, MtpHead) else load_mtp(
            target, config.model)
        return head, (target.cfg.num_layers,)

    def empty_pool(self, num_pages: int, page_size: int) -> jax.Array:
        block = self.head.block
        return jax.numpy.zeros(block.kv_pages_shape(num_pages, page_size), block.dtype)

    def program_spec(self, target) -> HeadProgramSpec:
        head = self.head

        def forward(params, target_params, embeds, g, positions, kv_pages, md):
            return mtp_forward(head, params, embeds, g, positions, kv_pages, md)

        def combine(params, target_params, aux):  # [T, 1, H]: the target's final norm
            return target.module.apply(variables(target_params), aux[:, 0],
                                       method=lambda m, x: m.norm(x))

        def pick(params, target_params, normed):
            if "head" in params:
                logits = (normed @ params["head"].T.astype(normed.dtype)).astype(jax.numpy.float32)
            else:
                logits = target.compute_logits(target_params, normed)
            return argmax_rows(logits)  # i32[R]

        embed = functools.partial(_embed, target_embedding(target))
        return HeadProgramSpec(forward, combine, pick, embed, head.block.dtype, self.page_size,
                               self.k - 1, self.max_rows)


def _embed(target_embed, params, target_params, ids):
    """The target's embeddings of `ids` (the MTP layer shares them)."""
    return target_embed(target_params, ids)
