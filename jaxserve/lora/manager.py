"""`LoRAManager`: the host side of serving adapters: loaded weights (an LRU) and device slots.

Adapters are read from their PEFT directories when a request first names them (so a bad
adapter fails that request at once) and kept in an LRU of `max_cpu_loras`; one evicted
is read again from its path when a request needs it. A step's adapters get the device's
`max_loras` slots: an adapter already in a slot keeps it, the others take the least
recently used slots of adapters the step does not run. The scheduler admits no more
than `max_loras` adapters among the running requests, so a step's adapters always fit.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable

from jaxserve.config import LoRAConfig
from jaxserve.lora.request import LoRAAdapterNotFoundError, LoRARequest
from models.config import ArchConfig
from models.loaders.peft_adapter import CONFIG_FILE, LoRAWeights, load_peft_adapter
from models.lora import TARGETS, served_targets


def check_adapter_exists(lora: LoRARequest) -> None:
    """Raises `LoRAAdapterNotFoundError` where vLLM finds no adapter: a missing path, or a
    directory without `adapter_config.json` (an existing file is a plain ValueError later,
    as vLLM's "not a directory")."""
    path = lora.lora_path
    if not os.path.exists(path) or (os.path.isdir(path)
                                    and not os.path.isfile(os.path.join(path, CONFIG_FILE))):
        raise LoRAAdapterNotFoundError(lora.lora_name, path)


class LoRAManager:
    """Loaded adapters and the adapter held by each device slot.

    Args:
        config: The engine's LoRA settings.
        cfg: The base model's architecture.

    Attributes:
        slots: The adapter id (`lora_int_id`) in each device slot, 0 when empty.
        num_loads: Adapters read from disk so far.
    """

    def __init__(self, config: LoRAConfig, cfg: ArchConfig):
        self.config = config
        self.cfg = cfg
        self.targets = served_targets(cfg)
        self._loaded: OrderedDict[int, tuple[LoRARequest, LoRAWeights]] = OrderedDict()
        self.slots: list[int] = [0] * config.max_loras
        self._slot_use: list[int] = [0] * config.max_loras  # last step each slot served
        self._clock = 0
        self.num_loads = 0

    @property
    def loaded_ids(self) -> list[int]:
        """Ids of the adapters loaded on the host, least recently used first."""
        return list(self._loaded)

    def add(self, lora: LoRARequest) -> LoRAWeights:
        """Loads `lora` (or refreshes its place in the LRU) and returns its weights.

        Raises:
            LoRAAdapterNotFoundError: No adapter at the path (`check_adapter_exists`).
            ValueError: Not a `LoRARequest`; an id already loaded from another path; an
                adapter that is not a PEFT LoRA directory, whose rank passes
                `max_lora_rank`, whose shapes do not fit the base, or that targets a
                module the base lacks or that is not adapted here
                (`models.loaders.peft_adapter.load_peft_adapter`).
        """
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        held = self._loaded.get(lora.lora_int_id)
        if held is not None:
            if held[0].lora_path != lora.lora_path:
                raise ValueError(f"LoRA adapter id {lora.lora_int_id} is already loaded from "
                                 f"{held[0].lora_path!r}, not {lora.lora_path!r} (one id per "
                                 "adapter)")
            self._loaded.move_to_end(lora.lora_int_id)
            return held[1]
        check_adapter_exists(lora)
        weights = load_peft_adapter(lora.lora_path, self.cfg, self.config.max_lora_rank)
        extra = [m for b, m in TARGETS if (b, m) in weights.stacks and (b, m) not in self.targets]
        if extra:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path!r}) targets "
                             f"{', '.join(extra)}, which this model does not adapt (targets: "
                             f"{', '.join(m for _, m in self.targets)})")
        self.num_loads += 1
        self._loaded[lora.lora_int_id] = (lora, weights)
        while len(self._loaded) > self.config.cpu_slots:
            self._loaded.popitem(last=False)
        return weights

    def remove(self, lora_id: int) -> bool:
        """Forgets a loaded adapter and empties its slot (so an id reused for other weights
        never reads the old ones); requests still running it read it again from their own
        `LoRARequest` when next scheduled. Returns whether it was loaded."""
        self.slots = [0 if held == lora_id else held for held in self.slots]
        return self._loaded.pop(lora_id, None) is not None

    def assign(self, loras: Iterable[LoRARequest]) -> tuple[dict[int, int],
                                                            list[tuple[int, LoRAWeights]]]:
        """Slots for one step's adapters.

        Args:
            loras: The adapters of the step's requests (repeats allowed).

        Returns:
            ({lora_int_id: slot}, [(slot, weights) to write to the device first]).

        Raises:
            ValueError: More distinct adapters than `max_loras` (the scheduler admits no
                such step), or one that no longer loads from its path.
        """
        wanted = {lo.lora_int_id: lo for lo in loras}
        if len(wanted) > len(self.slots):
            raise ValueError(f"a step runs {len(wanted)} LoRA adapters; max_loras is "
                             f"{len(self.slots)}")
        self._clock += 1
        slot_of = {lora_id: s for s, lora_id in enumerate(self.slots) if lora_id in wanted}
        writes = []
        free = sorted((s for s, lora_id in enumerate(self.slots) if lora_id not in wanted),
                      key=lambda s: self._slot_use[s])
        for lora_id, lora in wanted.items():
            if lora_id not in slot_of:
                slot = free.pop(0)
                writes.append((slot, self.add(lora)))
                self.slots[slot] = lora_id
                slot_of[lora_id] = slot
        for slot in slot_of.values():
            self._slot_use[slot] = self._clock
        return slot_of, writes
