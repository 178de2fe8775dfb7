"""LoRA adapters served per request (vLLM's interface): `LoRARequest` names one."""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
