"""Multi-host start-up: one process per host joins one JAX runtime via `jax.distributed`.

After `initialize`, `jax.devices()` lists every host's devices, so a tensor-parallel mesh
built from them spans hosts and XLA's collectives cross the interconnect. Every process
runs the same program (multi-controller SPMD): the same engine arguments and the same
requests in the same order, so each process's scheduler makes the same decisions.
"""

from __future__ import annotations

import logging

import jax

from jaxserve.utils import split_host_port, wait_for_listener

logger = logging.getLogger("jaxserve")


def initialize(coordinator_address: str, num_processes: int | None,
               process_id: int | None, timeout: int = 60) -> None:
    """Joins the distributed runtime (call before anything touches a device).

    Args:
        coordinator_address: "host:port" of process 0, identical on every process.
        num_processes: Total processes (one per host).
        process_id: This process's index in [0, num_processes).
        timeout: Seconds to wait for every process to join, and after which a process
            that stopped answering (died, hung) takes the others down with an error.

    Raises:
        ValueError: Missing or inconsistent counts, or a bad address.
        RuntimeError: (from JAX) The processes did not all join within `timeout`.
    """
    if num_processes is None or process_id is None:
        raise ValueError("--num-processes and --process-id are required with "
                         "--coordinator-address")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, num_processes={num_processes}), "
                         f"got {process_id}")
    host_port = split_host_port(coordinator_address)
    if host_port is None:
        raise ValueError(f"coordinator_address must be host:port, got {coordinator_address!r}")
    if timeout < 1:
        raise ValueError(f"distributed timeout must be at least 1 s, got {timeout}")
    if process_id != 0:
        wait_for_listener(*host_port, timeout, "coordinator_address",
                          "start process 0 with the same address, or raise "
                          "--distributed-timeout")
    else:
        logger.info("jaxserve: coordinator at %s waits up to %d s for %d processes",
                    coordinator_address, timeout, num_processes)
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout,
                               heartbeat_timeout_seconds=timeout,
                               shutdown_timeout_seconds=timeout)
    logger.info("jaxserve: process %d of %d, %d local / %d global devices",
                jax.process_index(), jax.process_count(), jax.local_device_count(),
                jax.device_count())
