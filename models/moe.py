"""The mixture-of-experts MLP: a router, the experts as one grouped matmul, a dense reference.

Each token picks `top_k` of `num_experts` gated MLPs (`route`, in its family's order). The
token x expert pairs (tokens x top_k, a static count per bucket: nothing is dropped) are
sorted by expert so each expert's rows are contiguous, and every projection is one
`jax.lax.ragged_dot` over the sorted rows (`grouped_experts`) on GPU and TPU; on the CPU,
where XLA expands `ragged_dot` into every row times every expert, a loop over the routed
experts in chunks of rows (`_expert_loop`) does the same work. `dense_experts` runs every
expert on every token, masked by the routing weights: the tests' oracle.

Expert weights are stacked on a leading expert axis (`[E, in, out]` per layer, `[L, E, in,
out]` in the layer scan's stack). On a device mesh `models.moe_parallel.sharded_experts`
runs `grouped_experts` on each device's experts (and slice of their width) and sums.
A projection the model's plan quantizes (`models.quant.EXPERT_MODULES`) is instead the
quantized leaves of `models.quant` with the same leading axes (q8: `qweight` i8[E, K, N],
`scales` f16[E, K // block, N]; q4 adds `zeros` and packs two codes a byte): the loop
dequantizes one routed expert's weights where it multiplies by them, `ragged_dot` gets the
layer's stack dequantized (`dequantize_experts`).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.layers import GatedMLP
from models.linear import STACKS, Linear, LinearMethod, Methods
from models.linear.registry import grouped_impl, stored_method
from models.moe_act import ExpertAct, expert_act, glu
from models.moe_parallel import ExpertSharding, sharded_experts
from models.moe_route import route
from models.quant import NIBBLE_KINDS, kind_of
from pallas_kernels.tuning import tuned

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# gpt-oss's expert biases (`ArchConfig.moe_bias`): gate and up f32[E, I] added inside the
# grouped experts, down f32[E, H] added by `MoEMLP` after them (with the routing weights).
GATE_UP_BIASES = ("gate_bias", "up_bias")
DOWN_BIAS = "down_bias"


def expert_kind(w) -> str | None:
    """The format kind ("q8", "q4", ...) of a quantized expert stack (a dict of
    `models.quant` leaves), None for a float one."""
    return kind_of(w) if isinstance(w, dict) else None


def _stack_shape(w) -> tuple[int, ...]:
    """The logical shape [..., E, K, N] of a float or quantized expert stack."""
    if not isinstance(w, dict):
        return tuple(w.shape)
    q = w["qweight"]
    packing = 2 if expert_kind(w) in NIBBLE_KINDS else 1
    return (*q.shape[:-2], q.shape[-2] * packing, q.shape[-1])


def _at(w, index):
    """One expert (or layer) of a float or quantized stack: every leaf indexed."""
    return jax.tree_util.tree_map(lambda v: v[index], w)


def _methods(experts: dict, methods: dict | None) -> dict[str, LinearMethod]:
    """Each projection's method: the model's, else the one its leaves are in (the stacks
    given without the model's `Methods`: tests, references)."""
    methods = methods or {}
    return {n: methods.get(n) or stored_method(experts[n] if isinstance(experts[n], dict)
                                               else {"kernel": experts[n]})
            for n in PROJECTIONS}


def dequantize_experts(experts: dict, dtype=jnp.float32, methods: dict | None = None) -> dict:
    """The experts' float stacks dtype[..., E, K, N]: quantized ones ([..., E, K', N]
    leaves) dequantized by their method, float ones cast."""
    methods = _methods(experts, methods)
    return {name: methods[name].dense(w, dtype) if name in PROJECTIONS else w.astype(dtype)
            for name, w in experts.items()}


def _check(x, experts, layer=None):
    gate, up, down = (_stack_shape(experts[n]) for n in PROJECTIONS)
    if layer is not None:  # the whole stack [L, E, ...]: check one layer's shapes
        gate, up, down = gate[1:], up[1:], down[1:]
    if (len(gate) != 3 or gate != up or down != (gate[0], gate[2], gate[1])
            or gate[1] != x.shape[-1]):
        raise ValueError(f"expert weights gate {gate}, up {up}, down {down} "
                         f"do not fit tokens {x.shape}: want [E, H, I], [E, H, I], [E, I, H]")


GROUPED_IMPLS = ("ragged_dot", "loop")


def _gate_up(gate: jax.Array, up: jax.Array, experts: dict, at) -> tuple:
    """The gate and up outputs [rows, I] plus their biases (`GATE_UP_BIASES`) where the
    experts have them: `at` indexes the bias stacks ([E, I] or [L, E, I]) to one expert's
    [I] or every row's [rows, I]."""
    if "gate_bias" not in experts:
        return gate, up
    return (gate + experts["gate_bias"][at].astype(gate.dtype),
            up + experts["up_bias"][at].astype(up.dtype))


def _expert_loop(xs: jax.Array, sizes: jax.Array, experts: dict, act: ExpertAct,
                 methods: dict[str, LinearMethod], layer=None) -> jax.Array:
    """The experts' gated MLPs over rows sorted by expert (`sizes[e]` rows each), expert by
    expert in chunks of `chunk` rows: a routed expert's weights are read once,
    an expert with no row costs nothing, and compute follows the rows (plus one
    partial chunk per routed expert). With `layer`, `experts` are the whole stacks
    [L, E, ...] and only the routed experts of that layer are read. Rows past
    `sum(sizes)` (pairs whose expert id is past E) are left zero."""
    pairs, hidden = xs.shape
    # NOTE: about the rows of one expert were the routing even (`pallas_kernels.tuning`):
    # a routed expert wastes at most one partial chunk, so about `pairs` rows in all.
    knobs = tuned("moe_loop")
    per_expert = -(-pairs // sizes.shape[0])
    multiple = knobs["chunk_multiple"]
    chunk = min(pairs, knobs["max_chunk"], multiple * -(-per_expert // multiple))
    xs = jnp.concatenate([xs, jnp.zeros((chunk, hidden), xs.dtype)])  # [P + chunk, H]
    ends = jnp.cumsum(sizes)  # i32[E]
    starts = ends - sizes

    # Only the routed experts are visited (their ids first, a traced trip count): a loop
    # over every expert cost time in proportion to E whatever the routing (an expert's
    # weight slice is invariant in its chunk loop, which XLA may hoist out of it).
    routed = jnp.argsort(sizes == 0, stable=True)  # i32[E]: routed experts first
    num_routed = jnp.sum(sizes > 0)

    def expert(j, out):
        e = routed[j]
        at = (e,) if layer is None else (layer, e)
        # Float weights are sliced here; a quantized expert's leaves are sliced inside the
        # chunk loop, beside its method's matmul (a fusion dequantizes the slice into the
        # tile the dot reads), so an expert with no row reads none of its bytes.
        dense = {n: experts[n][at] for n in PROJECTIONS if expert_kind(experts[n]) is None}

        def matmul(rows, name):
            w = dense[name] if name in dense else _at(experts[name], at)
            return methods[name].apply(w, rows)

        start, end = starts[e], ends[e]

        def step(c, out):
            row = start + c * chunk
            rows = jax.lax.dynamic_slice_in_dim(xs, row, chunk)  # [chunk, H]
            h = glu(act, *_gate_up(matmul(rows, "gate_proj"), matmul(rows, "up_proj"),
                                   experts, at))
            y = matmul(h, "down_proj")  # [chunk, H]
            keep = (row + jnp.arange(chunk) < end)[:, None]
            old = jax.lax.dynamic_slice_in_dim(out, row, chunk)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, old), row, 0)

        num_chunks = (sizes[e] + chunk - 1) // chunk
        return jax.lax.fori_loop(0, num_chunks, step, out)

    out = jax.lax.fori_loop(0, num_routed, expert, jnp.zeros_like(xs))
    return out[:pairs]


def grouped_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, experts: dict,
                    act: ExpertAct = "silu", impl: str | None = None, layer=None,
                    methods: dict[str, LinearMethod] | None = None) -> jax.Array:
    """The routed experts' outputs combined by the routing weights, computing only the
    (token, expert) pairs routed: pairs sorted by expert, each projection one grouped
    matmul over the sorted rows, the results put back in (token, k) order and summed.

    Args:
        x: [T, H] tokens.
        weights: f32[T, k] routing weights (`route`).
        ids: i32[T, k] expert of each pair; a pair with an id >= E is skipped (its
            output is zero), so a caller can drop pairs by mapping them past E.
        experts: {"gate_proj": [E, H, I], "up_proj": [E, H, I], "down_proj": [E, I, H]},
            each a float stack or the quantized leaves of one (`models.quant`: codes,
            scales, zeros with the same leading axes); optionally "gate_bias" and
            "up_bias" [E, I] (`GATE_UP_BIASES`; the down bias is the caller's).
        act: The gated MLP's activation (`models.layers.ACTIVATIONS` name, or
            `models.moe_act.ClampedSwiGLU`).
        impl: One of `GROUPED_IMPLS`; None: the platform's
            (`models.linear.registry.grouped_impl`).
        layer: i32[] when `experts` are the layer scan's whole stacks [L, E, ...] (the
            serving form, `models.linear.ServingChoice.whole_experts`): the layer to read.
        methods: Each projection's linear method (the model's `Methods.expert`); None:
            the method the leaves are in (`models.linear.registry.stored_method`).

    Returns:
        [T, H] in x's dtype.

    Raises:
        ValueError: Expert weights whose shapes do not fit, or an unknown `impl`.
    """
    _check(x, experts, layer)
    impl = impl or grouped_impl()
    methods = _methods(experts, methods)
    if impl not in GROUPED_IMPLS:
        raise ValueError(f"unknown grouped matmul {impl!r}; supported: {', '.join(GROUPED_IMPLS)}")
    num_tokens, top_k = ids.shape
    num_experts = _stack_shape(experts["gate_proj"])[0 if layer is None else 1]
    flat = ids.reshape(-1)  # i32[T*k]
    order = jnp.argsort(flat, stable=True)  # i32[T*k]: pairs sorted by expert
    xs = x[order // top_k]  # [T*k, H]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # i32[E]
    if impl == "loop":
        y_sorted = _expert_loop(xs, sizes, experts, act, methods, layer)
    else:
        if layer is not None:
            experts = {k: _at(v, layer) for k, v in experts.items()}
        # NOTE: a quantized layer is dequantized whole before the grouped matmul (every
        # expert of the layer, routed or not); a fused kernel would dequantize each
        # group's tiles in registers instead (docs/design.md, mixture of experts).
        experts = dequantize_experts(experts, xs.dtype, methods)
        gate = jax.lax.ragged_dot(xs, experts["gate_proj"], sizes)  # [T*k, I]
        up = jax.lax.ragged_dot(xs, experts["up_proj"], sizes)
        row_expert = jnp.minimum(flat[order], num_experts - 1)  # i32[T*k]: past E masked below
        h = glu(act, *_gate_up(gate, up, experts, row_expert))
        y_sorted = jax.lax.ragged_dot(h, experts["down_proj"], sizes)  # [T*k, H]
        # NOTE: rows past the groups (pairs of another device's experts under expert
        # parallelism) are zero on XLA's CPU path; ragged_dot does not promise it elsewhere.
        rows = jnp.arange(y_sorted.shape[0]) < jnp.sum(sizes)  # bool[T*k]
        y_sorted = jnp.where(rows[:, None], y_sorted, 0)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = y_sorted[inverse]  # [T*k, H] back in (token, k) order
    y = y.reshape(num_tokens, top_k, -1) * weights[..., None].astype(y.dtype)
    return jnp.sum(y, axis=1).astype(x.dtype)


def dense_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, experts: dict,
                  act: ExpertAct = "silu") -> jax.Array:
    """Reference of `grouped_experts`: every expert on every token, each output scaled by
    the token's weight for that expert (0 where not routed). Cost: all experts."""
    _check(x, experts)
    num_experts = experts["gate_proj"].shape[0]
    mask = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32)  # f32[T, k, E]
    per_expert = jnp.einsum("tk,tke->te", weights.astype(jnp.float32), mask)  # f32[T, E]
    gate = jnp.einsum("th,ehi->tei", x, experts["gate_proj"])
    up = jnp.einsum("th,ehi->tei", x, experts["up_proj"])
    gate, up = _gate_up(gate, up, experts, slice(None))  # biases [E, I] broadcast over T
    y = jnp.einsum("tei,eih->teh", glu(act, gate, up), experts["down_proj"])
    return jnp.einsum("teh,te->th", y, per_expert.astype(y.dtype)).astype(x.dtype)


def routed_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, *, experts: dict,
                   stacked: bool, layer, act: ExpertAct, methods: Methods,
                   reference: bool = False, sharding: ExpertSharding | None = None) -> jax.Array:
    """The routed experts of an `Experts` module (`experts`, `stacked`: what it returned)
    on tokens x [T, H] routed by f32[T, k] `weights` and i32[T, k] `ids`: `dense_experts`
    with `reference`, else `grouped_experts` of the methods' grouped matmul, per device
    under `sharding` (`models.moe_parallel.sharded_experts`). Returns [T, H]."""
    stack_methods = {n: methods.expert(n) for n in PROJECTIONS}
    if reference:
        if stacked:
            experts = {k: _at(v, layer) for k, v in experts.items()}
        return dense_experts(x, weights, ids,
                             dequantize_experts(experts, x.dtype, stack_methods), act)
    grouped = functools.partial(grouped_experts, impl=methods.grouped, methods=stack_methods)
    layer_arg = layer if stacked else None
    if sharding is not None:
        return sharded_experts(grouped, x, weights, ids, experts, act, sharding,
                               layer=layer_arg)
    return grouped(x, weights, ids, experts, act, layer=layer_arg)


class MoEMLP(nn.Module):
    """A sparse MLP layer: router `gate` [H, E], experts stacked in `experts`
    ({gate,up,down}_proj: [E, H, I], [E, H, I], [E, I, H]), and, when
    `cfg.shared_expert_intermediate_size`, Qwen2-MoE's shared expert (a `GatedMLP`)
    scaled by `sigmoid(shared_expert_gate(x))` (`cfg.shared_expert_gated`; Granite 4.0's
    shared MLP is added ungated).

    Attributes:
        cfg: Architecture config (`num_experts`, `num_experts_per_tok`,
            `moe_intermediate_size`, `router_order`, `norm_topk_prob`).
        dtype: Parameter dtype.
        methods: The model's methods: the router's and the shared expert's layers by
            name, the routed stacks' by projection (`Methods.expert`), and how the grouped
            matmul runs (`Methods.grouped`).
        reference: Run `dense_experts` instead of `grouped_experts` (tests).
        return_ids: Also return the routed expert ids (routing capture, vLLM's
            `enable_return_routed_experts`).
        sharding: How a device mesh splits the experts (`models.moe_parallel`): set, the
            grouped experts run per device under `shard_map`; None: one device (or
            replicated experts).
    """

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods
    reference: bool = False
    sharding: ExpertSharding | None = None
    return_ids: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, layer=None):
        """x [T, H] -> [T, H]; with `return_ids`, (that, i32[T, top_k] each token's routed
        experts in the router's order, the heaviest first)."""
        cfg, methods = self.cfg, self.methods
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        logits = Linear(e, methods.linear("gate"), cfg.moe_bias, self.dtype, layer,
                        name="gate")(x)  # [T, E]
        bias = None  # DeepSeek-V3's selection bias, `gate.e_score_correction_bias` in HF
        if cfg.router_order == "sigmoid_topk":
            bias = self.param("e_score_correction_bias", nn.initializers.zeros, (e,),
                              jnp.float32)  # f32[E]
        weights, ids = route(logits, cfg.num_experts_per_tok, cfg.router_order,
                             cfg.norm_topk_prob, n_group=cfg.n_group,
                             topk_group=cfg.topk_group, scale=cfg.routed_scaling_factor,
                             bias=bias)
        experts, stacked = Experts(e, h, i, methods, cfg.moe_bias, self.dtype,
                                   name="experts")()
        down_bias = experts.pop(DOWN_BIAS, None)  # [(L,) E, H]: added below, once per pair
        # [T, H], f32[T, k], i32[T, k] -> [T, H]
        run = functools.partial(routed_experts, experts=experts, stacked=stacked, layer=layer,
                                act=expert_act(cfg), methods=methods,
                                reference=self.reference, sharding=self.sharding)

        if cfg.router_order == "topk_sigmoid":
            # Llama 4 scales each expert's INPUT by its weight (transformers'
            # `Llama4TextMoe`: expert(x * w), not w * expert(x)): one pass per k, each pair's
            # input scaled and its output summed as it is (top-1 in the published models).
            ones = jnp.ones_like(weights[:, :1])  # f32[T, 1]
            out = sum(run((x * weights[:, j:j + 1].astype(x.dtype)).astype(x.dtype), ones,
                          ids[:, j:j + 1]) for j in range(ids.shape[1]))
        else:
            out = run(x, weights, ids)
        if down_bias is not None:
            # NOTE: outside the grouped experts: a width-split expert (tensor parallelism)
            # would add it once per device before their partial sums are added.
            table = down_bias[layer] if stacked else down_bias  # [E, H]
            out = out + jnp.einsum("tk,tkh->th", weights.astype(jnp.float32),
                                   table[ids].astype(jnp.float32)).astype(out.dtype)
        if cfg.shared_expert_intermediate_size:
            shared = GatedMLP(cfg, self.dtype, methods,
                              intermediate_size=cfg.shared_expert_intermediate_size,
                              name="shared_expert")(x, layer)
            if cfg.shared_expert_gated:
                gate = Linear(1, methods.linear("shared_expert_gate"), dtype=self.dtype,
                              layer=layer, name="shared_expert_gate")(x)  # [T, 1]
                shared = jax.nn.sigmoid(gate) * shared
            out = out + shared
        return (out, ids) if self.return_ids else out


class Experts(nn.Module):
    """The routed experts' weights, stacked on a leading expert axis (the axis expert
    parallelism shards), as their methods declare them (`Methods.expert`): a float stack
    per projection, or a quantized stack's leaves under the projection's name
    (`experts/gate_proj/qweight` [E, K', N], ...). In the serving form
    (`ServingChoice.whole_experts`) they are the whole layer stacks [L, E, ...] in the
    broadcast `STACKS`, which the layer scan does not slice (XLA:CPU would copy every
    expert of a layer out of the stack each step); the experts then index the layer
    themselves."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    methods: Methods
    bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> tuple[dict, bool]:
        """({"gate_proj": [E, H, I], "up_proj": [E, H, I], "down_proj": [E, I, H]}, False)
        (a quantized projection: its dict of leaves; with `bias`, also "gate_bias" and
        "up_bias" [E, I] and "down_bias" [E, H]), or in the serving form the same names'
        [L, E, ...] stacks and True."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        widths = dict(zip((*GATE_UP_BIASES, DOWN_BIAS), (i, i, h), strict=True))
        biases = widths if self.bias else {}
        if self.has_variable(STACKS, "gate_proj"):
            return {n: self.get_variable(STACKS, n) for n in (*PROJECTIONS, *biases)}, True
        out = {name: self.methods.expert(name).weights(self, k, n, lead=(e,), name=name)
               for name, (k, n) in zip(PROJECTIONS, ((h, i), (h, i), (i, h)), strict=True)}
        for name, width in biases.items():
            out[name] = self.param(name, nn.initializers.zeros, (e, width), self.dtype)
        return out, False
