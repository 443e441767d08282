"""One function per kernel operation, dispatching on the backend.

`backend` is a resolved kernel backend (`validation.KERNEL_BACKENDS`):

* "triton": the Pallas Triton kernels of `triton/` (GPU);
* "mosaic_tpu": the Pallas Mosaic kernels of `mosaic_tpu/` (TPU);
* "xla": `xla.py`, the same operations in jnp (any platform, tuned for
  XLA:CPU);
* "interpret" / "mosaic_tpu_interpret": the Triton / Mosaic kernels through
  Pallas' interpreters (any platform; what CI runs).

`reference.py` holds the plain oracles every implementation is tested
against. An operation a backend has no kernel for runs its xla version
(the Mosaic backend sums duplicates and reads int8 tables with XLA's ops).
A Mosaic GPU implementation would be one more module here; the wrappers
never see the difference.

Each Pallas kernel takes a frozen config (tile sizes, warps, stages);
`config=None`, or None fields of a config, take the kernel's shape
heuristic. `KernelConfig` bundles one config per operation for the public
wrappers. The xla backend ignores configs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp

from pallas_emb.kernels import common
from pallas_emb.kernels import reference  # pylint: disable=unused-import
from pallas_emb.kernels import xla

if TYPE_CHECKING:
  from pallas_emb.kernels.triton.gather import GatherConfig
  from pallas_emb.kernels.triton.pool import PoolConfig
  from pallas_emb.kernels.triton.quantized_gather import QuantizedGatherConfig
  from pallas_emb.kernels.triton.segment_sum import SegmentSumConfig
  from pallas_emb.kernels.triton.sparse_update import SparseUpdateConfig

# The one definition lives with the other argument checks.
from pallas_emb.validation import KERNEL_BACKENDS  # pylint: disable=g-bad-import-order

TRITON = ("triton", "interpret")
MOSAIC_TPU = ("mosaic_tpu", "mosaic_tpu_interpret")

# jax 0.11.2 warns at every Triton lowering; exactly this message is
# silenced, around our own pallas_calls only (`quiet_triton_deprecation`).
TRITON_DEPRECATION = common.TRITON_DEPRECATION
quiet_triton_deprecation = common.quiet_triton_deprecation


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tile configs of the Triton kernels; None = the shape heuristic.

  gather: `gather.GatherConfig` (lookup of sequence ids); pool:
  `pool.PoolConfig` (lookup of pooled bags); segment_sum:
  `segment_sum.SegmentSumConfig`; update:
  `sparse_update.SparseUpdateConfig` (every optimizer's update kernel);
  quantized: `quantized_gather.QuantizedGatherConfig` (the lookup of an
  int8 serving state, sequence ids and pooled bags).
  Frozen and hashable, so it can be a static argument of a jit. Reach it
  through `lookup(..., kernel_config=)`, `apply_gradients(...,
  kernel_config=)` or `EmbeddingCollection(..., kernel_config=)` (which the
  Trainer and the layers use). The Mosaic and xla backends ignore it.
  """
  gather: GatherConfig | None = None
  segment_sum: SegmentSumConfig | None = None
  update: SparseUpdateConfig | None = None
  pool: PoolConfig | None = None
  quantized: QuantizedGatherConfig | None = None


def _implementation(backend: str, table=None) -> str:
  """"triton", "mosaic_tpu" or "xla": whose kernels run `backend`."""
  if backend not in KERNEL_BACKENDS:
    raise ValueError(f"pallas_emb kernel backend={backend!r} is not one of "
                     f"{KERNEL_BACKENDS} (resolve a user's choice with "
                     "validation.resolve_backend).")
  if (backend != "xla" and table is not None
      and table.dtype == common.BF16_BITS):
    raise TypeError(
        f"pallas_emb backend={backend!r} got a uint16 table (a bf16 table's "
        "bits, as a state of the xla backend holds it); the Pallas kernels "
        "take bf16: move the state over through table_arrays / "
        "state_from_arrays of a collection with this backend.")
  if backend in TRITON:
    return "triton"
  return "mosaic_tpu" if backend in MOSAIC_TPU else "xla"


def _interpret(backend: str):
  """The `interpret` argument of the Pallas kernels for `backend`."""
  return backend in ("interpret", "mosaic_tpu_interpret")


def gather_rows(table, ids, *, backend: str, config=None, width=None):
  """`[N, S]` rows of a `[V, S]` shard for `[N]` ids (wrapped, clamped).

  `width`: S, for a table in the Mosaic backend's stored layout
  (`mosaic_tpu/stored.py`, whose rows are padded); None: `table.shape[1]`.
  """
  impl = _implementation(backend, table)
  if impl == "triton":
    from pallas_emb.kernels.triton import gather  # pylint: disable=g-import-not-at-top
    return gather.gather_rows(table, ids, config=config,
                              interpret=_interpret(backend))
  if impl == "mosaic_tpu":
    from pallas_emb.kernels.mosaic_tpu import lookup  # pylint: disable=g-import-not-at-top
    return lookup.gather_rows(table, ids, width=width,
                              interpret=_interpret(backend))
  return xla.gather_rows(table, ids)


def segment_sum_rows(grads, segment_ids, num_segments: int, *, round_dtype,
                     backend: str, config=None):
  """f32 `[U, S]` segment sums of `[N, S]` rows and `[U + 1]` row statistics.

  `row_sq[u] = sum_c round(grad_accum[u, c])**2` with the rounding of
  `round_dtype` (the table dtype); `row_sq[U]` is the total. Segment ids
  outside `[0, U)` are dropped.
  """
  if _implementation(backend) != "triton":
    return xla.segment_sum_rows(grads, segment_ids, num_segments,
                                round_dtype=round_dtype)
  from pallas_emb.kernels.triton import segment_sum  # pylint: disable=g-import-not-at-top
  return segment_sum.segment_sum_rows(grads, segment_ids, num_segments,
                                      round_dtype=round_dtype,
                                      interpret=_interpret(backend),
                                      config=config)


def grad_sums(rows, entry_rows, slots, weights, num_slots: int, live_slots,
              *, backend: str, slot_sorted: bool = False):
  """f32 `[num_slots, G]` sums of `weights[e] * rows[entry_rows[e]]` per
  slot, in entry order (the Mosaic backend's segment sum from a bag's
  gradient straight to its entries' slots; `mosaic_tpu/segment_sum.py`).
  `slot_sorted`: the entries come in slot order (the dedup's by-product)."""
  if _implementation(backend) != "mosaic_tpu":
    raise ValueError(f"pallas_emb grad_sums runs on the Mosaic backend, not "
                     f"{backend!r}.")
  from pallas_emb.kernels.mosaic_tpu import segment_sum  # pylint: disable=g-import-not-at-top
  return segment_sum.grad_sums(rows, entry_rows, slots, weights, num_slots,
                               live_slots, slot_sorted=slot_sorted,
                               interpret=_interpret(backend))


def sparse_update_rows(rule, table, row_state, element_state,
                       unique_tokens, grad_accum, row_sq, apply, step,
                       scalars, *, emb_width, backend: str, config=None,
                       sorted_tokens: bool = False):
  """An optimizer's fused update of the rows a batch used.

  `rule` is the optimizer's `triton.sparse_update.UpdateRule`; returns
  `(table, row_state, element_state)`, the states as tuples in the rule's
  order. `sorted_tokens`: `unique_tokens` ascend (the dedup's buffer),
  which lets the Mosaic backend stream the table (its `sparse_update`).
  """
  args = (rule, table, row_state, element_state, unique_tokens, grad_accum,
          row_sq, apply, step, scalars)
  impl = _implementation(backend, table)
  if impl == "triton":
    from pallas_emb.kernels.triton import sparse_update  # pylint: disable=g-import-not-at-top
    return sparse_update.sparse_update(*args, emb_width=emb_width,
                                       interpret=_interpret(backend),
                                       config=config)
  if impl == "mosaic_tpu":
    from pallas_emb.kernels.mosaic_tpu import sparse_update  # pylint: disable=g-import-not-at-top
    return sparse_update.sparse_update(*args, emb_width=emb_width,
                                       interpret=_interpret(backend),
                                       sorted_tokens=sorted_tokens)
  return xla.sparse_update(*args, emb_width=emb_width)


def pool_rows(table, rows, weights, bag_starts, *, max_len: int,
              backend: str, config=None, out_dtype=None, width=None):
  """`[M, S]` f32-accumulated weighted sums of the rows of CSR bags.

  Bag m holds the entries `[bag_starts[m], bag_starts[m + 1])` (at most
  `max_len`); the result is rounded once to `out_dtype` (default: the
  table dtype; f32 keeps partial sums unrounded). `width`: as
  `gather_rows`'.
  """
  impl = _implementation(backend, table)
  if impl != "mosaic_tpu":  # (the Mosaic pool lays bags out from numpy ones)
    bag_starts = jnp.asarray(bag_starts)
  if impl == "triton":
    from pallas_emb.kernels.triton import pool  # pylint: disable=g-import-not-at-top
    return pool.pool_rows(table, rows, weights, bag_starts, max_len=max_len,
                          config=config, interpret=_interpret(backend),
                          out_dtype=out_dtype)
  if impl == "mosaic_tpu":
    from pallas_emb.kernels.mosaic_tpu import lookup  # pylint: disable=g-import-not-at-top
    return lookup.pool_rows(table, rows, weights, bag_starts,
                            max_len=max_len, width=width,
                            interpret=_interpret(backend),
                            out_dtype=out_dtype)
  return xla.pool_rows(table, rows, weights, bag_starts,
                       max_len=max_len, out_dtype=out_dtype)


def gather_dequantized(codes, scale, bias, ids, *, backend: str,
                       config=None):
  """f32 `[N, S]` rows of a `[V, S]` uint8 shard of a row-wise int8 table,
  `codes[r] * scale[r] + bias[r]` for `[N]` ids (wrapped, clamped)."""
  if _implementation(backend) != "triton":
    return xla.gather_dequantized(codes, scale, bias, ids)
  from pallas_emb.kernels.triton import quantized_gather  # pylint: disable=g-import-not-at-top
  return quantized_gather.gather_dequantized(
      codes, scale, bias, ids, config=config,
      interpret=_interpret(backend))


def pool_dequantized(codes, scale, bias, rows, weights, bag_starts, *,
                     max_len: int, backend: str, config=None):
  """f32 `[M, S]` weighted sums of dequantized rows of CSR bags (as
  `pool_rows`, accumulated and returned in f32)."""
  bag_starts = jnp.asarray(bag_starts)
  if _implementation(backend) != "triton":
    return xla.pool_dequantized(codes, scale, bias, rows, weights,
                                bag_starts, max_len=max_len)
  from pallas_emb.kernels.triton import quantized_gather  # pylint: disable=g-import-not-at-top
  return quantized_gather.pool_dequantized(
      codes, scale, bias, rows, weights, bag_starts, max_len=max_len,
      config=config, interpret=_interpret(backend))
