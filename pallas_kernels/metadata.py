"""Per-step attention metadata shared by the model, the kernels and the runner.

Page pool layout (one array for the whole model):
    kv_pages: dtype[num_slots, 2, num_kv_heads, num_pages, page_size, head_dim]
Axis 0 holds one layer per slot: num_slots = num_layers with one KV cache group, fewer with
a hybrid cache (`models.kv_groups`: each group's layers share its pages, one slot each).
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
import jax.numpy as jnp


@partial(jax.tree_util.register_dataclass,
         data_fields=["slot_mapping", "block_tables", "kv_lens", "cu_q_lens", "state_slots",
                      "q_span_end"],
         meta_fields=["decode_only", "short_tiles", "num_ranks"])
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go and what each request attends to.

    Tokens of all requests are packed on one axis: request `i` owns tokens
    `cu_q_lens[i]:cu_q_lens[i+1]`, which are the last tokens of its `kv_lens[i]` context.
    Padded requests have `q_len == kv_len == 0`; padded tokens (past `cu_q_lens[-1]`)
    write to slot 0 of the null page and produce zeros.

    Attributes:
        slot_mapping: i32[num_tokens] page_id * page_size + offset of each token's K/V;
            i32[num_groups, num_tokens] with several KV cache groups.
        block_tables: i32[max_num_seqs, max_pages_per_seq] page ids per request (0 pads);
            i32[num_groups, max_num_seqs, max_pages_per_seq] with several groups (a page a
            sliding group gave back reads as 0, the null page, masked by the window).
        kv_lens: i32[max_num_seqs] context length of each request after this step.
        cu_q_lens: i32[max_num_seqs + 1] cumulative query lengths.
        state_slots: i32[max_num_seqs] each request's row of the state pools of a model
            with linear-attention layers (`models.gated_deltanet.HybridCache`; slot 0 is
            the null slot padded requests use); None for models without such layers. A
            request whose `kv_lens` equals its query length starts from a zero state.
        decode_only: Static. Every request has exactly one query and token i belongs to
            request i (num_tokens == max_num_seqs), so the decode kernel serves the step.
        short_tiles: Static. Steps may hold requests of a few new tokens after a context
            (speculative proposals being verified): the XLA path gives them a pass of
            small query tiles. Off, that pass is not compiled (it was ~25% of a model
            step's compile time) and such requests share the ordinary tiles.
        q_span_end: i32[num_tokens] for each query token, the end (exclusive, a position of
            its request) of the bidirectional span it sits in (Gemma 3's image tokens see
            their whole image): the token also sees its span's later keys, all of which this
            step writes or wrote before; 0 for tokens outside any span. None: causal only
            (every program without spans is unchanged). Spans must lie within a sliding
            window (a query inside one already sees the span's earlier keys).
        num_ranks: Static. Data-parallel attention's ranks (`pallas_kernels.rank_split`):
            above 1 the step is laid out rank by rank, each rank's rows and tokens a block
            of equal size and its `cu_q_lens` a block of R + 1 counted from its own first
            token; the kernels then run per rank.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    decode_only: bool = False
    short_tiles: bool = False
    # NOTE: last, so the positional constructions (the runner's) stay as they are.
    state_slots: jax.Array | None = None
    num_ranks: int = 1
    q_span_end: jax.Array | None = None

    @property
    def num_real_tokens(self) -> jax.Array:
        """i32[]: the step's real tokens (they come first; the rest is padding). Laid out
        by ranks, every token counts (each rank's padding lies between the ranks)."""
        if self.num_ranks > 1:
            return jnp.int32(self.slot_mapping.shape[-1])
        return self.cu_q_lens[-1]

    @property
    def num_groups(self) -> int:
        """KV cache groups whose tables this step carries (1: the plain 2-D arrays)."""
        return 1 if self.block_tables.ndim == 2 else self.block_tables.shape[0]

    def for_group(self, group) -> AttentionMetadata:
        """The metadata one group's layers attend with: its slot mapping and block tables
        as the plain 1-D and 2-D arrays (`group` may be traced, e.g. in the layer scan).
        Metadata of one group is returned as it is."""
        if self.block_tables.ndim == 2:
            return self
        pick = lambda x: jax.lax.dynamic_index_in_dim(x, group, keepdims=False)
        return dataclasses.replace(self, slot_mapping=pick(self.slot_mapping),
                                   block_tables=pick(self.block_tables))


def kv_pages_shape(num_slots: int, num_kv_heads: int, num_pages: int, page_size: int,
                   head_dim: int) -> tuple[int, ...]:
    """Shape of the page pool for a model (see the module docstring): `num_slots` is the
    model's layer count with one KV cache group, `KVGroupLayout.num_slots` with several."""
    return (num_slots, 2, num_kv_heads, num_pages, page_size, head_dim)


def latent_pages_shape(num_slots: int, num_pages: int, page_size: int,
                       latent_dim: int) -> tuple[int, ...]:
    """Shape of an MLA model's latent pool (`pallas_kernels.mla`): the page pool's layout
    with one K/V entry and one head whose row is `latent_dim` = kv_lora_rank +
    qk_rope_head_dim values (c_kv, then k_pe), so page plans and sizing treat it as any."""
    return (num_slots, 1, 1, num_pages, page_size, latent_dim)
