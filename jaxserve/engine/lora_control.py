"""`LoRAControl`: an engine's LoRA adapter calls (vLLM's `add_lora`, `remove_lora`,
`list_loras`), over the runner's adapter slots (`jaxserve.runner.lora_slots`)."""

from __future__ import annotations


class LoRAControl:
    """Mixed into `LLMEngine`: reads `self.runner.lora` (None without `enable_lora`)."""

    def add_lora(self, lora_request) -> bool:
        """Loads an adapter now (vLLM's `add_lora`); True once loaded.

        Raises:
            ValueError: The engine was built without `enable_lora`, or the adapter does not
                load (`jaxserve.lora.manager.LoRAManager.add`: the message names the
                problem).
        """
        if self.runner.lora is None:
            raise ValueError("lora_request given, but the engine serves no LoRA adapters "
                             "(build it with enable_lora=True)")
        self.runner.lora.manager.add(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets a loaded adapter (vLLM's `remove_lora`); requests running it finish with
        it. Returns whether it was loaded."""
        return self.runner.lora is not None and self.runner.lora.manager.remove(lora_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters loaded (vLLM's `list_loras`)."""
        return set() if self.runner.lora is None else set(self.runner.lora.manager.loaded_ids)
