"""`LoRARequest`: which adapter a request runs with (vLLM's fields and meaning), and
`LoRAAdapterNotFoundError`: the error for a path that holds no adapter."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request, as vLLM's `LoRARequest`.

    Attributes:
        lora_name: The adapter's name (the server's `model` field picks it by this name).
        lora_int_id: A positive id, unique per adapter: requests with equal ids share the
            loaded adapter, and prefix-cache pages are keyed by it.
        lora_path: The PEFT adapter directory (`adapter_config.json` and
            `adapter_model.safetensors`).
        base_model_name: The base model the adapter was trained on (informational; the
            server lists it as the adapter's `parent`).

    Raises:
        ValueError: An empty name, an id that is not a positive integer, or a path that is
            not a string.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be a positive integer, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of `lora_int_id`."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of `lora_name`."""
        return self.lora_name

    @property
    def path(self) -> str:
        """vLLM's alias of `lora_path`."""
        return self.lora_path


class LoRAAdapterNotFoundError(ValueError):
    """No adapter at a `LoRARequest`'s path (vLLM's `LoRAAdapterNotFoundError`, with its
    message): the path does not exist, or is a directory without `adapter_config.json`.
    The server answers it with a 404 (vLLM's `NotFoundError`); it is a ValueError like
    every other adapter that does not load.

    Args:
        lora_name: The adapter's name.
        lora_path: The path that holds no adapter.
    """

    def __init__(self, lora_name: str, lora_path: str):
        super().__init__(f"Loading lora {lora_name} failed: No adapter found for {lora_path}")
        self.lora_name, self.lora_path = lora_name, lora_path
