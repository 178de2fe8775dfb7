"""A mixture of experts' router: each token's experts and their weights from the router's
logits, in its family's order (`models.config_checks.ROUTER_ORDERS`; `models.moe.MoEMLP`
calls it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config_checks import ROUTER_ORDERS


def route(logits: jax.Array, top_k: int, order: str, norm_topk_prob: bool, *,
          n_group: int = 1, topk_group: int = 1, scale: float = 1.0,
          bias: jax.Array | None = None):
    """Each token's experts and their weights.

    Args:
        logits: f32[T, E] router logits.
        top_k: Experts per token.
        order: "topk_softmax" (Mixtral: the k largest logits, softmax over those k),
            "softmax_topk" (Qwen-MoE, OLMoE, DeepSeek-V2: softmax over all experts, the k
            largest probabilities, divided by their sum when `norm_topk_prob`) or
            "sigmoid_topk" (DeepSeek-V3: sigmoid scores; the k largest of score + `bias`
            chosen, weighted by their scores, divided by their sum when `norm_topk_prob`) or
            "topk_sigmoid" (Llama 4: the k largest logits through a sigmoid; the caller
            scales each expert's input by its weight, `models.moe.MoEMLP`).
        norm_topk_prob: See `order`; "topk_softmax" weights always sum to one.
        n_group: Expert groups (consecutive ids); with more than one, a token's experts
            come from its `topk_group` best groups only, a group scored by its best
            probability ("softmax_topk", DeepSeek-V2's group_limited_greedy) or the sum of
            its two best biased scores ("sigmoid_topk").
        topk_group: See `n_group`.
        scale: The weights are multiplied by it (DeepSeek's `routed_scaling_factor`).
        bias: f32[E] "sigmoid_topk"'s correction bias (selection only); None: zeros.

    Returns:
        (weights f32[T, top_k], ids i32[T, top_k]).

    Raises:
        ValueError: An unknown `order`, or `top_k` outside 1..E.
    """
    if order not in ROUTER_ORDERS:
        raise ValueError(f"unknown router order {order!r}; supported: {', '.join(ROUTER_ORDERS)}")
    if not 0 < top_k <= logits.shape[-1]:
        raise ValueError(f"top_k={top_k} must be in 1..{logits.shape[-1]} (the experts)")
    logits = logits.astype(jnp.float32)
    if order in ("topk_softmax", "topk_sigmoid"):
        top, ids = jax.lax.top_k(logits, top_k)
        act = jax.nn.softmax if order == "topk_softmax" else jax.nn.sigmoid
        return act(top, axis=-1) if order == "topk_softmax" else act(top), ids
    sigmoid = order == "sigmoid_topk"
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)  # f32[T, E]
    choice = scores + bias.astype(jnp.float32) if sigmoid and bias is not None else scores
    if n_group > 1:
        choice = _group_limited(choice, n_group, topk_group, sigmoid)
    _, ids = jax.lax.top_k(choice, top_k)  # i32[T, k]
    weights = jnp.take_along_axis(scores, ids, axis=-1)  # f32[T, k]
    if norm_topk_prob:
        # NOTE: DeepSeek-V3 adds 1e-20 to the sum (sigmoid weights need not sum to one).
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (1e-20 if sigmoid else 0))
    return weights * scale if scale != 1.0 else weights, ids


def _group_limited(choice: jax.Array, n_group: int, topk_group: int, top2: bool) -> jax.Array:
    """f32[T, E] `choice` with the experts outside each token's `topk_group` best groups at
    -inf (a group scored by its best entry, or by its two best summed when `top2`)."""
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)  # f32[T, G, E / G]
    score = (jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1) if top2
             else jnp.max(grouped, axis=-1))  # f32[T, G]
    _, best = jax.lax.top_k(score, topk_group)  # i32[T, topk_group]
    keep = jnp.any(jnp.arange(n_group)[None, :, None] == best[:, None, :], axis=-1)  # [T, G]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, e)
