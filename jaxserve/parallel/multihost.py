"""Multi-host start-up: one process per host joins one JAX runtime via `jax.distributed`.

After `initialize`, `jax.devices()` lists every host's devices, so a tensor-parallel mesh
built from them spans hosts and XLA's collectives cross the interconnect. Every process
runs the same program (multi-controller SPMD): the same engine arguments and the same
requests in the same order, so each process's scheduler makes the same decisions.
"""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger("jaxserve")


def initialize(coordinator_address: str, num_processes: int | None,
               process_id: int | None) -> None:
    """Joins the distributed runtime (call before anything touches a device).

    Args:
        coordinator_address: "host:port" of process 0, identical on every process.
        num_processes: Total processes (one per host).
        process_id: This process's index in [0, num_processes).

    Raises:
        ValueError: Missing or inconsistent counts.
    """
    if num_processes is None or process_id is None:
        raise ValueError("--num-processes and --process-id are required with "
                         "--coordinator-address")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    logger.info("jaxserve: process %d of %d, %d local / %d global devices",
                jax.process_index(), jax.process_count(), jax.local_device_count(),
                jax.device_count())
