"""`LoRASlots`: the device's LoRA adapter slots and each step's per-token slot index.

The device holds `max_loras` slots per served target module, stacked with the layers
(`models.lora.COLLECTION`'s tree: A [L, in, S, R], B [L, S, R, out], zero-padded to
`max_lora_rank`, in the model dtype, split over a tensor-parallel mesh like the base
weights). Putting an adapter in a slot is one jitted `dynamic_update_slice` per leaf with
the slot as a traced index (the stacks donated): any slot, any adapter, one program, so
loading, evicting and replacing adapters never recompiles the step. Which adapter is in
which slot is the host's business (`jaxserve.lora.manager.LoRAManager`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import LoRAConfig
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.lora.manager import LoRAManager
from jaxserve.parallel.sharding import TensorParallel
from models.loaders.peft_adapter import LoRAWeights
from models.lora import stack_shapes
from models.model import Model


def _write_slot(stacks: dict, slot: jax.Array, new: dict) -> dict:
    """`stacks` with slot `slot` (i32[]) of every leaf replaced by `new`'s leaf (A
    [L, in, R] into [L, in, S, R] at axis 2, B [L, R, out] into [L, S, R, out] at axis 1)."""

    def put(path, stack, leaf):
        axis = 2 if path[-1].key == "a" else 1
        return jax.lax.dynamic_update_slice_in_dim(
            stack, jnp.expand_dims(leaf, axis).astype(stack.dtype), slot, axis=axis)

    return jax.tree_util.tree_map_with_path(put, stacks, new)


class LoRASlots:
    """Adapter slot stacks on the device, filled on demand for each step.

    Args:
        model: The serving model (its architecture and dtype).
        config: The engine's LoRA settings.
        layout: The tensor-parallel layout (None: the default device).

    Attributes:
        manager: The host side (loaded adapters, which adapter each slot holds).
        stacks: The slot stacks (device arrays), passed to every step.
        num_writes: Slots written so far (warm-up's included).
    """

    def __init__(self, model: Model, config: LoRAConfig, layout: TensorParallel | None):
        self.manager = LoRAManager(config, model.cfg)
        self.rank = config.max_lora_rank
        self.shapes = stack_shapes(model.cfg, config.max_loras, config.max_lora_rank)
        tree: dict = {"layers": {}}
        for (block, module), (a, b) in self.shapes.items():
            tree["layers"].setdefault(block, {})[module] = {
                "a": jax.ShapeDtypeStruct(a, model.dtype),  # [L, in, S, R]
                "b": jax.ShapeDtypeStruct(b, model.dtype)}  # [L, S, R, out]
        shardings = None if layout is None else layout.lora_shardings(tree)
        kw = {} if shardings is None else {"out_shardings": shardings}
        self.stacks = jax.jit(lambda: jax.tree_util.tree_map(
            lambda x: jnp.zeros(x.shape, x.dtype), tree), **kw)()
        self._write = jax.jit(_write_slot, donate_argnums=0, **kw)
        self.num_writes = 0

    def write(self, slot: int, weights: LoRAWeights | None) -> None:
        """Puts an adapter's weights in `slot` (None: zeros); modules it leaves alone, and
        ranks past its own, are zeros."""
        new: dict = {"layers": {}}
        for (block, module), (shape_a, shape_b) in self.shapes.items():
            a = np.zeros(shape_a[:2] + shape_a[3:], np.float32)  # f32[L, in, R]
            b = np.zeros(shape_b[:1] + shape_b[2:], np.float32)  # f32[L, R, out]
            if weights is not None and (block, module) in weights.stacks:
                wa, wb = weights.stacks[(block, module)]
                a[:, :, :wa.shape[2]] = wa
                b[:, :wb.shape[1]] = wb
            new["layers"].setdefault(block, {})[module] = {"a": a, "b": b}
        self.stacks = self._write(self.stacks, np.int32(slot), new)
        self.num_writes += 1

    def token_slots(self, out: SchedulerOutput, num_tokens: int) -> np.ndarray:
        """Each token's adapter slot in a step (-1: the base model), after writing the
        adapters the step needs into their slots.

        Returns:
            i32[num_tokens]; padding -1.

        Raises:
            ValueError: More adapters than slots, or an adapter that no longer loads.
        """
        loras = [out.requests[s.request_id].lora_request for s in out.scheduled if s.lora_id]
        slot_of, writes = self.manager.assign(loras)
        for slot, weights in writes:
            self.write(slot, weights)
        per_request = np.fromiter((slot_of.get(s.lora_id, -1) for s in out.scheduled),
                                  np.int32, len(out.scheduled))  # i32[num_requests]
        counts = [len(s.token_ids) for s in out.scheduled]
        slots = np.full(num_tokens, -1, np.int32)  # i32[num_tokens]
        slots[:sum(counts)] = np.repeat(per_request, counts)
        return slots
