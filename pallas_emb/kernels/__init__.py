"""One function per kernel operation, dispatching on the backend.

`backend` is "pallas" (Triton kernels on GPU), "interpret" (the same kernels
through Pallas' interpreter, any platform) or "xla" (the jnp twins in
`reference.py`). A Mosaic GPU implementation of an operation would be one
more branch here; the wrappers never see the difference.
"""

from __future__ import annotations

import functools
import warnings

from pallas_emb.kernels import reference

BACKENDS = ("pallas", "interpret", "xla")

# jax 0.11.2 warns at every Triton lowering; silence exactly that message.
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be "
                      r"removed in a future JAX version\.")


@functools.cache
def _filter_triton_deprecation() -> None:
  warnings.filterwarnings("ignore", message=TRITON_DEPRECATION,
                          category=DeprecationWarning)


def _pallas(backend: str) -> bool:
  """True for the Pallas backends (and installs the warning filter)."""
  if backend not in BACKENDS:
    raise ValueError(f"pallas_emb backend={backend!r} is not one of "
                     f"{BACKENDS}.")
  if backend == "xla":
    return False
  _filter_triton_deprecation()
  return True


def gather_rows(table, ids, *, backend: str):
  """`[N, S]` rows of a `[V, S]` shard for `[N]` ids (wrapped, clamped)."""
  if not _pallas(backend):
    return reference.gather_rows(table, ids)
  from pallas_emb.kernels import gather
  return gather.gather_rows(table, ids, interpret=backend == "interpret")


def segment_sum_rows(grads, segment_ids, num_segments: int, *, round_dtype,
                     backend: str):
  """f32 `[U, S]` segment sums of `[N, S]` rows and `[U + 1]` row statistics.

  `row_sq[u] = sum_c round(grad_accum[u, c])**2` with the rounding of
  `round_dtype` (the table dtype); `row_sq[U]` is the total. Segment ids
  outside `[0, U)` are dropped.
  """
  if not _pallas(backend):
    return reference.segment_sum_rows(grads, segment_ids, num_segments,
                                      round_dtype=round_dtype)
  from pallas_emb.kernels import segment_sum
  return segment_sum.segment_sum_rows(grads, segment_ids, num_segments,
                                      round_dtype=round_dtype,
                                      interpret=backend == "interpret")


def adagrad_apply(table, row_state, last_step, unique_tokens, grad_accum,
                  row_sq, apply, step, learning_rate, *, hparams,
                  backend: str):
  """The row-wise Adagrad update of DESIGN §4.5 on the rows a batch used.

  Returns `(table, row_state, last_step)`; `last_step` is None in eager mode.
  """
  if not _pallas(backend):
    return reference.adagrad_apply(table, row_state, last_step,
                                   unique_tokens, grad_accum, row_sq, apply,
                                   step, learning_rate, hparams=hparams)
  from pallas_emb.kernels import adagrad
  return adagrad.adagrad_apply(table, row_state, last_step, unique_tokens,
                               grad_accum, row_sq, apply, step,
                               learning_rate, hparams=hparams,
                               interpret=backend == "interpret")
