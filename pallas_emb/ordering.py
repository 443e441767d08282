"""Ordering a table's reads before its in-place write, by a data dependence.

A step looks rows up (reads the table) and later updates rows in place
(writes it). When the update's inputs do not depend on what was read -- a
loss linear in the embeddings has gradients that never read them -- nothing
orders the reads before the write, and XLA keeps both by copying the whole
table (twice per step, measured). An `optimization_barrier` orders nothing
once XLA expands it; a data dependence does. `after` adds one that costs a
scalar: the update's int32 input gets `int(read * 0)` of two elements of each
read, always 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def after(value: jax.Array, *reads: jax.Array) -> jax.Array:
  """`value` (an integer array), made to depend on each of `reads`.

  Each read contributes the max of its first two elements times 0 (a float
  times 0 is never folded by XLA; NaN, from an infinite or NaN element, is
  replaced by 0 before the conversion, whatever the platform does with NaN
  to int). A reduce, not one element: XLA:CPU copies a cheap element slice
  into every consumer, which keeps the whole read (e.g. the [B, W]
  embeddings) alive until the update's last op, while a reduce is computed
  once -- 15 MB less temporary memory in a 65,536-id step
  (docs/cpu_performance.md). Pass one read per producer that must come
  first: XLA slices through a concatenation to the part's own producer.
  """
  reads = [r for r in reads if r.size]
  if not reads:
    return value
  product = sum(jnp.max(r.reshape(-1)[:2].astype(jnp.float32))
                for r in reads) * 0
  zero = jnp.where(jnp.isnan(product), 0.0, product).astype(value.dtype)
  return value + zero
