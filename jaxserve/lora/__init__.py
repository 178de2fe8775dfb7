"""LoRA adapters served per request (vLLM's interface): `LoRARequest` names one."""

from jaxserve.lora.request import LoRAAdapterNotFoundError, LoRARequest

__all__ = ["LoRAAdapterNotFoundError", "LoRARequest"]
