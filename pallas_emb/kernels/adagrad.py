"""The fused sparse row-wise Adagrad update, in place.

Row-wise Adagrad is one rule (`common.AdagradRule`: the arithmetic of
`common.adagrad_row_update` / `common.adagrad_new_values`, shared with the
jnp twin) of the generic sparse-update kernel in `sparse_update.py`; this
module is its hyper-parameter entry point (`AdagradHParams`), kept for the
kernel tests, the benchmarks and the block-size sweep.

Run `python -m pallas_emb.kernels.adagrad --help` for the block-size sweep.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_emb.kernels import common
from pallas_emb.kernels import sparse_update
from pallas_emb.kernels.hparams import AdagradHParams

# The generic kernel's tile config (it has no element-wise state here).
AdagradConfig = sparse_update.SparseUpdateConfig


def resolve_config(config: AdagradConfig | None, num_unique: int,
                   width: int) -> AdagradConfig:
  """`config` with every None field filled in by the shape heuristic."""
  return sparse_update.resolve_config(config, num_unique, width)


def adagrad_apply(table: jax.Array, row_state: jax.Array,
                  last_step: jax.Array | None, unique_tokens: jax.Array,
                  grad_accum: jax.Array, row_sq: jax.Array, apply, step,
                  learning_rate, *, hparams: AdagradHParams,
                  interpret: bool = False,
                  config: AdagradConfig | None = None):
  """Row-wise Adagrad on the rows of `unique_tokens`, in place.

  Args:
    row_state: f32 `[V]` accumulators.
    last_step: int32 `[V]` (lazy mode) or None (eager mode).
    step: int32 scalar (lazy mode's current step).
    learning_rate: f32 scalar.
    hparams: the static `AdagradHParams`.
    The others: as `sparse_update.sparse_update`.

  Returns:
    `(table, row_state, last_step)`, `last_step` None in eager mode.
  """
  common.check_adagrad_args(last_step, hparams)
  rows = (row_state,) + (() if last_step is None else (last_step,))
  table, rows, _ = sparse_update.sparse_update(
      common.AdagradRule(hparams), table, rows, (), unique_tokens,
      grad_accum, row_sq, apply, step, (learning_rate,),
      interpret=interpret, config=config)
  return table, rows[0], rows[1] if hparams.lazy else None


# --------------------------------------------------------------------------
# Block-size sweep: python -m pallas_emb.kernels.adagrad
# --------------------------------------------------------------------------


def main(argv=None) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from pallas_emb.kernels import reference  # pylint: disable=g-import-not-at-top
  from pallas_emb.kernels import sweep  # pylint: disable=g-import-not-at-top

  args = sweep.parse_args("adagrad", argv, rows=10_000_000, tokens=262_144)
  unique = np.unique(sweep.zipf_ids(args.tokens, args.rows, args.zipf,
                                    args.seed))
  hparams = AdagradHParams(eps=1e-8, inv_width=1 / 128, lazy=True,
                           accum_decay_rate=float(np.log(2) / 2500),
                           weight_decay_rate=1e-4)

  def setup(width, dtype, key):
    k1, k2 = jax.random.split(key)
    table = jax.random.normal(k1, (args.rows, width), jnp.float32).astype(
        dtype)
    grad = jax.random.normal(k2, (unique.size, width), jnp.float32)
    row_sq = jnp.sum(jnp.square(grad), axis=1)
    return (table, jnp.zeros((args.rows,), jnp.float32),
            jnp.zeros((args.rows,), jnp.int32),
            jnp.asarray(unique.astype(np.int32)), grad, row_sq)

  def run(config, table, state, last, tokens, grad, row_sq):
    return adagrad_apply(table, state, last, tokens, grad, row_sq, True, 7,
                         0.05, hparams=hparams, interpret=args.interpret,
                         config=config)

  def twin(table, state, last, tokens, grad, row_sq):
    return reference.adagrad_apply(table, state, last, tokens, grad, row_sq,
                                   True, 7, 0.05, hparams=hparams)

  def timer(config, inputs):
    # In place: the table and state are donated and fed back every call.
    fn = jax.jit(lambda st, *a: run(config, *st, *a), donate_argnums=0)
    seconds, _ = sweep.time_donated(
        fn, tuple(jnp.copy(x) for x in inputs[:3]), inputs[3:], args.reps)
    return seconds

  def candidates(width, dtype):
    del dtype
    top = common.next_pow2(width)
    for block_cols in sweep.pow2_down(min(top, 8), min(top, 256)):
      for block_rows in sweep.pow2_down(8, 1024):
        if 128 <= block_rows * block_cols <= 8192:
          for num_warps in (1, 2, 4, 8):
            yield AdagradConfig(block_rows, block_cols, num_warps)

  def bytes_moved(width, dtype):
    return unique.size * width * (2 * jnp.dtype(dtype).itemsize + 4)

  sweep.run_sweep(
      args, setup=setup, run=run, twin=twin, candidates=candidates,
      default=lambda width, dtype: resolve_config(None, unique.size, width),
      bytes_moved=bytes_moved, exact=args.interpret, timer=timer)


if __name__ == "__main__":
  main()
