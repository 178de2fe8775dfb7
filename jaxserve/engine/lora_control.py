"""`LoRAControl`: an engine's LoRA adapter calls (vLLM's `add_lora`, `remove_lora`,
`list_loras`), over the runner's adapter slots (`jaxserve.runner.lora_slots`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.runner.lora_slots import LoRASlots


class LoRAControl:
    """The adapters an engine serves (`LLMEngine` delegates its calls of the same names).

    Args:
        slots: The runner's adapter slots (`ModelRunner.lora`); None when the engine was
            built without `enable_lora`.
    """

    def __init__(self, slots: LoRASlots | None):
        self.slots = slots

    def add_lora(self, lora_request) -> bool:
        """Loads an adapter now (vLLM's `add_lora`); True once loaded.

        Raises:
            ValueError: The engine was built without `enable_lora`, or the adapter does not
                load (`jaxserve.lora.manager.LoRAManager.add`: the message names the
                problem).
        """
        if self.slots is None:
            raise ValueError("lora_request given, but the engine serves no LoRA adapters "
                             "(build it with enable_lora=True)")
        self.slots.manager.add(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets a loaded adapter (vLLM's `remove_lora`); requests running it finish with
        it. Returns whether it was loaded."""
        return self.slots is not None and self.slots.manager.remove(lora_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters loaded (vLLM's `list_loras`)."""
        return set() if self.slots is None else set(self.slots.manager.loaded_ids)
