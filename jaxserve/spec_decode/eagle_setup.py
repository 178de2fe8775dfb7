"""An EAGLE-3 head fitted to its target: loaded, checked, its aux layers and embeddings chosen."""

from __future__ import annotations

import functools

from jaxserve.spec_decode.eagle_programs import HeadProgramSpec, greedy
from models.eagle3 import combine_aux, default_aux_layers, head_forward
from models.loaders.eagle3 import Eagle3Head, load_eagle3
from models.model import variables
from pallas_kernels.attention_ops import AttentionOps

_IDS_FIELD = "speculative_config.eagle_aux_hidden_state_layer_ids"


def target_embedding(target):
    """`(target_params, i32[T]) -> [T, H]`: the target `Model`'s own embedding lookup (its
    weight form's), unscaled as an EAGLE-3 head reads it; the dtype of its aux states."""
    def embed(target_params, ids):
        return target.module.apply(variables(target_params), ids,
                                   method=lambda m, i: m.embed_tokens(i))
    return embed


def aux_layers_for(ids, num_layers: int) -> tuple[int, ...]:
    """The target layers a head reads, ascending (vLLM concatenates the aux states in the
    order its layers run); `ids` None: vLLM's default (`default_aux_layers`).

    Raises:
        ValueError: An id outside [0, num_layers) (names the field).
    """
    ids = default_aux_layers(num_layers) if ids is None else tuple(ids)
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)
           or not 0 <= i < num_layers]
    if bad or not ids:
        raise ValueError(f"{_IDS_FIELD}: {list(ids)} must name layers in [0, {num_layers}) of "
                         f"the target (vLLM's numbering: 0 is the embedding); out of range: "
                         f"{bad}")
    return tuple(sorted(ids))


def head_for_target(config, target, dtype: str):
    """The head of `config` (`model`: a directory or an `Eagle3Head`) checked against the
    target `Model`.

    Returns:
        (head, the target layers whose aux states it reads, ascending).

    Raises:
        ValueError: No head at the path, another vocabulary or hidden size than the
            target's, no embedding of its own where the target's has another width, or aux
            layer ids out of range or not as many as `fc` reads (each names its field).
    """
    head = config.model if isinstance(config.model, Eagle3Head) else load_eagle3(
        config.model, dtype)
    hc, tc = head.cfg, target.cfg
    if hc.vocab_size != tc.vocab_size:
        raise ValueError(f"speculative_config.model: the head's vocabulary has "
                         f"{hc.vocab_size} tokens, the target's {tc.vocab_size}")
    if hc.target_hidden_size != tc.hidden_size:
        raise ValueError(f"speculative_config.model: the head reads hidden states of "
                         f"{hc.target_hidden_size} (target_hidden_size), the target's have "
                         f"{tc.hidden_size}")
    own = "embed_tokens" in head.params
    if not own and hc.hidden_size != tc.hidden_size:
        raise ValueError(f"speculative_config.model: the head (hidden {hc.hidden_size}) has "
                         f"no embed_tokens of its own and the target's are {tc.hidden_size} wide")
    ids = aux_layers_for(config.aux_layer_ids if config.aux_layer_ids is not None
                         else hc.aux_layer_ids, tc.num_layers)
    if len(ids) * tc.hidden_size != head.params["fc"].shape[1]:
        raise ValueError(f"{_IDS_FIELD}: {len(ids)} layers give {len(ids) * tc.hidden_size} "
                         f"features; the head's fc reads {head.params['fc'].shape[1]}")
    return head, ids


def head_attention(target) -> str:
    """The attention backend of a head's one layer: the CPU kernels where the target runs on
    them (the XLA path's loop over KV blocks cost a SmolLM2 head ~3x its attention there),
    else the XLA path (the interpreted Pallas kernels are for tests; a TPU/GPU head layer
    is too small to matter)."""
    return "cpu" if target.methods.attention.backend == "cpu" else "xla"


def program_spec(head: Eagle3Head, target, num_steps: int, page_size: int,
                 max_rows: int) -> HeadProgramSpec:
    """The head's programs' static part for a runner serving `target` (its `Model`, whose
    embedding the head reads when it has none of its own)."""
    target_embed = target_embedding(target)
    if "embed_tokens" in head.params:
        embed = lambda params, target_params, ids: params["embed_tokens"][ids]  # noqa: E731
    else:
        embed = lambda params, target_params, ids: target_embed(target_params, ids)  # noqa: E731
    dtype = head.params["norm"].dtype
    forward = functools.partial(_forward, head.cfg, AttentionOps(head_attention(target)))
    combine = lambda params, target_params, aux: combine_aux(params, aux.astype(dtype))  # noqa: E731
    pick = lambda params, target_params, normed: greedy(params, normed)  # noqa: E731
    return HeadProgramSpec(forward, combine, pick, embed, dtype, page_size, num_steps,
                           max_rows)


def _forward(cfg, ops, params, target_params, embeds, g, positions, kv_pages, md):
    """`head_forward` in `HeadProgramSpec.forward`'s signature (the target's weights unread)."""
    return head_forward(cfg, ops, params, embeds, g, positions, kv_pages, md)
