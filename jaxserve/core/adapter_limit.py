"""`AdapterLimit`: vLLM's admission rule for LoRA adapters: at most `max_loras` distinct
adapters among the running requests (the device's adapter slots)."""

from __future__ import annotations

from collections.abc import Iterable

from jaxserve.request import Request


class AdapterLimit:
    """Which requests' adapters fit beside the running requests' during one admission pass.

    Args:
        max_loras: Most distinct adapters running at once; None: no limit (no adapters).
    """

    def __init__(self, max_loras: int | None):
        self.max_loras = max_loras

    def running(self, running: Iterable[Request]) -> set[int] | None:
        """The adapter ids of the running requests (None when adapters are not limited):
        built once per admission pass, then kept current by `note`."""
        if self.max_loras is None:
            return None
        return {r.lora_id for r in running if r.lora_id}

    @staticmethod
    def note(request: Request, adapters: set[int] | None) -> None:
        """Adds the adapter of a request that starts running to `adapters`."""
        if adapters is not None and request.lora_id:
            adapters.add(request.lora_id)

    def fits(self, request: Request, adapters: set[int] | None) -> bool:
        """Whether `request` may run beside the running requests, whose adapters are
        `adapters` (`running`): it has no adapter, or one they use, or fewer than
        `max_loras` adapters are running."""
        if adapters is None or not request.lora_id:
            return True
        return request.lora_id in adapters or len(adapters) < self.max_loras
