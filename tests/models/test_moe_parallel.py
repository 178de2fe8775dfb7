"""The routed experts on a device mesh (`models/moe_parallel.py`) against the one-device
dense reference: every split of E and I over the 8 CPU devices, per-layer weights and the
serving form's whole stacks, both grouped matmuls, skewed routers (a device with no pair)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.moe import GROUPED_IMPLS, dense_experts, grouped_experts, route
from models.moe_parallel import ExpertSharding, local_routing, sharded_experts

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")

L, E, H, FF, T = 3, 8, 16, 12, 10  # layers, experts, hidden, one expert's width, tokens
# (axes splitting E, axes splitting I) on the mesh ("expert": 2, "kv": 2, "rep": 2).
SPLITS = {"ep2_width4": (("expert",), ("kv", "rep")), "ep8": (("expert", "kv", "rep"), ()),
          "width4": ((), ("kv", "rep")), "ep4": (("kv", "rep"), ())}


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("expert", "kv", "rep"))


def _stacks(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.key(seed), 3)
    return {"gate_proj": jax.random.normal(k[0], (L, E, H, FF)),
            "up_proj": jax.random.normal(k[1], (L, E, H, FF)),
            "down_proj": jax.random.normal(k[2], (L, E, FF, H))}


def _routing(skew: bool):
    logits = jax.random.normal(jax.random.key(1), (T, E))
    if skew:  # every pair on experts 0-2: under EP 8 five devices get no pair
        logits = logits.at[:, 3:].add(-50.0)
    return route(logits, 2, "softmax_topk", True)


# NOTE: the CPU serves the loop; ragged_dot (GPU/TPU), the spread router and one layer's
# weights (the engine tests run the last two) go to the slow tier.
@pytest.mark.parametrize("impl", [i if i == "loop" else pytest.param(i, marks=pytest.mark.slow)
                                  for i in GROUPED_IMPLS])
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("stacked", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["layer", "stacks"])
@pytest.mark.parametrize("skew", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["spread", "skewed"])
def test_sharded_matches_dense_reference(mesh, impl, split, stacked, skew):
    sharding = ExpertSharding(mesh, *SPLITS[split])
    stacks = _stacks()
    experts = stacks if stacked else {n: v[1] for n, v in stacks.items()}
    specs = sharding.tree_specs(experts, stacked)
    placed = {n: jax.device_put(v, NamedSharding(mesh, specs[n])) for n, v in experts.items()}
    x = jax.random.normal(jax.random.key(2), (T, H))
    weights, ids = _routing(skew)
    grouped = lambda *a, **kw: grouped_experts(*a, impl=impl, **kw)
    fn = jax.jit(lambda x, w, i, e, layer: sharded_experts(grouped, x, w, i, e, "silu",
                                                           sharding, layer=layer))
    ours = fn(x, weights, ids, placed, jnp.int32(1) if stacked else None)
    ref = dense_experts(x, weights, ids, {n: v[1] for n, v in stacks.items()})
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-4)
    # Each device holds only its share of the experts and of their width.
    shard = placed["down_proj"].addressable_shards[0].data.shape
    e_axis = 1 if stacked else 0
    assert shard[e_axis] == E // sharding.num_expert_shards
    assert shard[e_axis + 1] == FF // sharding.num_width_shards


def test_local_routing_maps_other_devices_pairs_past_the_local_experts():
    weights = jnp.asarray([[0.75, 0.25], [0.5, 0.5]])
    ids = jnp.asarray([[3, 0], [5, 2]])
    w, i = local_routing(weights, ids, jnp.int32(2), 2)  # this device: experts 2 and 3
    np.testing.assert_array_equal(i, [[1, 2], [2, 0]])  # 2 = the virtual expert
    np.testing.assert_array_equal(w, [[0.75, 0.0], [0.0, 0.5]])
    # The virtual expert is counted by no group, so the grouped matmuls never reach it.
    np.testing.assert_array_equal(jnp.bincount(i.ravel(), length=2), [1, 1])


def test_leaf_specs():
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2, 1), ("expert", "kv", "rep"))
    s = ExpertSharding(mesh, ("expert",), ("kv", "rep"))
    assert s.leaf_spec("gate_proj", (L, E, H, FF), True) == P(None, "expert", None,
                                                              ("kv", "rep"))
    assert s.leaf_spec("down_proj", (E, FF, H), False) == P("expert", ("kv", "rep"), None)
    # A per-column scale of down (one row) stays whole; E is still split.
    assert s.leaf_spec("down_proj", (L, E, 1, H), True) == P(None, "expert", None, None)
    assert ExpertSharding(mesh).leaf_spec("up_proj", (E, H, FF), False) == P(None, None, None)


def test_quantized_blocks_that_would_straddle_devices_are_refused():
    """Down's q8_0 scales [L, E, I / 32, H] with I / 32 = 3 blocks cannot split in two: the
    codes would split mid-block while the scales stayed whole, so it is an error."""
    mesh = Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2, 1), ("expert", "kv", "rep"))
    s = ExpertSharding(mesh, (), ("kv", "rep"))
    assert s.leaf_spec("down_proj", (L, E, 96, H), True) == P(None, None, ("kv", "rep"), None)
    with pytest.raises(ValueError, match=r"does not split over the 2 tensor-parallel devices"):
        s.leaf_spec("down_proj", (L, E, 3, H), True)
