"""Per-step attention metadata shared by the model, the kernels and the runner.

Page pool layout (one array for the whole model):
    kv_pages: dtype[num_layers, 2, num_kv_heads, num_pages, page_size, head_dim]
Axis 1 is K (0) or V (1). Head-major pages keep each (head, page) a contiguous
`[page_size, head_dim]` tile, the unit a TPU or GPU kernel copies, and let tensor
parallelism shard axis 2. Page 0 is the null page: never handed out, written by padded
tokens, read only under a length mask. Layers index axis 0 so a `lax.scan` over layers can
carry the whole pool and update it in place.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax


@partial(jax.tree_util.register_dataclass,
         data_fields=["slot_mapping", "block_tables", "kv_lens", "cu_q_lens"],
         meta_fields=["decode_only", "short_tiles"])
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go and what each request attends to.

    Tokens of all requests are packed on one axis: request `i` owns tokens
    `cu_q_lens[i]:cu_q_lens[i+1]`, which are the last tokens of its `kv_lens[i]` context.
    Padded requests have `q_len == kv_len == 0`; padded tokens (past `cu_q_lens[-1]`)
    write to slot 0 of the null page and produce zeros.

    Attributes:
        slot_mapping: i32[num_tokens] page_id * page_size + offset of each token's K/V.
        block_tables: i32[max_num_seqs, max_pages_per_seq] page ids per request (0 pads).
        kv_lens: i32[max_num_seqs] context length of each request after this step.
        cu_q_lens: i32[max_num_seqs + 1] cumulative query lengths.
        decode_only: Static. Every request has exactly one query and token i belongs to
            request i (num_tokens == max_num_seqs), so the decode kernel serves the step.
        short_tiles: Static. Steps may hold requests of a few new tokens after a context
            (speculative proposals being verified): the XLA path gives them a pass of
            small query tiles. Off, that pass is not compiled (it was ~25% of a model
            step's compile time) and such requests share the ordinary tiles.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    decode_only: bool = False
    short_tiles: bool = False


def kv_pages_shape(num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
                   head_dim: int) -> tuple[int, ...]:
    """Shape of the page pool for a model (see the module docstring)."""
    return (num_layers, 2, num_kv_heads, num_pages, page_size, head_dim)
