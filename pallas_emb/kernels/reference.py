"""Plain-jnp twins of the Pallas kernels: the `xla` backend.

Each function has the signature and semantics of its kernel; the tests check
every kernel against its twin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_emb.kernels import common


def gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
  """Twin of `gather.gather_rows`."""
  ids = common.wrap_and_clamp(ids, table.shape[0])
  return jnp.take(table, ids, axis=0, mode="clip", unique_indices=False)
