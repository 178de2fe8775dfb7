"""Engine configuration of what serves the model: devices (`ParallelConfig`) and LoRA
adapters (`LoRAConfig`); re-exported by `jaxserve.config`."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config_checks import check as _check
from jaxserve.config_checks import check_types as _check_types


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices serve the model.

    Attributes:
        tensor_parallel_size: Devices one model is split over (heads and MLP units).
        data_parallel_size: Independent replicas, each on its own group of devices.
        device_ids: The devices of this replica (default: the first
            `devices_per_replica` devices); set by the data-parallel front end.
        enable_expert_parallel: A mixture of experts' routed experts split over the
            tensor-parallel devices, whole experts per device (vLLM's: the expert-parallel
            size is the tensor-parallel size), instead of each expert's width split.
        expert_parallel_size: Devices of an "expert" mesh axis in front of the
            tensor-parallel ones (a mixture of experts only): the experts are split over
            it, attention and dense weights replicated over it (None or 1: no such axis).
        enable_dp_attention: Data-parallel attention over the "expert" axis (sglang's
            `enable_dp_attention`; vLLM's data parallelism with expert parallelism): each
            of its `expert_parallel_size` devices holds 1/n of the page pool and attends
            only the requests the scheduler gives its rank; tokens meet at the experts
            (`jaxserve.parallel.dp_attention`). Needs an `expert_parallel_size` over 1.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    device_ids: tuple[int, ...] | None = None
    enable_expert_parallel: bool = False
    expert_parallel_size: int | None = None
    enable_dp_attention: bool = False

    def __post_init__(self):
        _check_types(self)
        _check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
               "tensor_parallel_size", self.tensor_parallel_size, "a positive integer")
        _check(isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1,
               "data_parallel_size", self.data_parallel_size, "a positive integer")
        _check(self.expert_parallel_size is None or self.expert_parallel_size >= 1,
               "expert_parallel_size", self.expert_parallel_size, "a positive integer or None")
        _check(self.device_ids is None or len(self.device_ids) == self.devices_per_replica,
               "device_ids", self.device_ids,
               "one id per device of the replica (expert_parallel_size x tensor_parallel_size)")
        _check(not self.enable_dp_attention or (self.expert_parallel_size or 1) > 1,
               "enable_dp_attention", self.enable_dp_attention,
               "used with an expert_parallel_size over 1 (its devices are the attention ranks)")
        _check(not self.enable_dp_attention or self.tensor_parallel_size == 1,
               "enable_dp_attention", self.enable_dp_attention,
               "used with tensor_parallel_size=1 (ranks split over tensor-parallel devices "
               "are not built)")

    @property
    def attention_ranks(self) -> int:
        """Ranks the requests' attention is spread over (1: every device attends every
        request)."""
        return (self.expert_parallel_size or 1) if self.enable_dp_attention else 1

    @property
    def devices_per_replica(self) -> int:
        """Devices one engine's mesh spans: expert_parallel_size x tensor_parallel_size."""
        return (self.expert_parallel_size or 1) * self.tensor_parallel_size


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served per request (vLLM's engine arguments).

    Attributes:
        enable_lora: Whether requests may name an adapter (`lora_request=`).
        max_loras: Adapters one step may run (the device's slots per target module).
        max_lora_rank: Largest adapter rank served (every slot's rank axis).
        max_cpu_loras: Adapters kept loaded on the host (an LRU); None: `max_loras`.
        lora_impl: How a step computes its rows' updates (`models.linear.lora.LORA_IMPLS`), or
            "auto": the CPU LoRA kernel ("grouped") for float32 weights on one CPU device,
            else "masked" (`models.linear.lora.resolve_impl`).
    """

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_impl: str = "auto"

    def __post_init__(self):
        from models.linear.lora import LORA_IMPLS

        _check_types(self)
        _check(self.max_loras >= 1, "max_loras", self.max_loras, "a positive integer")
        _check(self.max_lora_rank >= 1, "max_lora_rank", self.max_lora_rank,
               "a positive integer")
        _check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
               "max_cpu_loras", self.max_cpu_loras, f"None or >= max_loras ({self.max_loras})")
        _check(self.lora_impl in ("auto", *LORA_IMPLS), "lora_impl", self.lora_impl,
               f"one of {('auto', *LORA_IMPLS)}")

    @property
    def cpu_slots(self) -> int:
        """Adapters the host keeps loaded."""
        return self.max_cpu_loras or self.max_loras
