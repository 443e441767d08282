"""Process start-up: simulated CPU devices (before jax), jax.distributed.

No jax at import: `simulate_cpu_devices` must run before jax starts.
"""

from __future__ import annotations

import os

from examples.config import TrainConfig

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def simulate_cpu_devices(count: int = 8) -> None:
  """Gives the CPU platform `count` devices unless XLA_FLAGS already says."""
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if _DEVICE_COUNT_FLAG not in xla_flags:
    os.environ["XLA_FLAGS"] = (
        f"{xla_flags} {_DEVICE_COUNT_FLAG}={count}".strip())


def initialize_distributed(config: TrainConfig) -> None:
  """`jax.distributed.initialize` from the config ('' / 0 / -1: auto)."""
  import jax  # pylint: disable=g-import-not-at-top
  if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
    # Cross-process collectives of CPU devices; GPUs use NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = {}
  if config.coordinator_address:
    kwargs["coordinator_address"] = config.coordinator_address
  if config.num_processes:
    kwargs["num_processes"] = config.num_processes
  if config.process_id >= 0:
    kwargs["process_id"] = config.process_id
  jax.distributed.initialize(**kwargs)
