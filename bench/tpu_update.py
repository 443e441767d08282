"""The Mosaic sparse update alone: the row kernel against the stream kernel.

    python -m bench.tpu_update                          # on a TPU
    python -m bench.tpu_update --smoke                  # CPU, interpreter

One stored table (f32, `--rows` x `--width`) and its optimizer's state,
updated at `--slots` distinct ascending rows (a dedup's buffer of
`--buffer` slots, the rest fill values), by `sparse_update.STREAM`
"never" (each touched row by DMA, the row-wise part in XLA) and "always"
(`stream_update`: every row through VMEM in blocks), and, as the floor of
the stream, a kernel that only copies the table through the same blocks.
Each is a jitted, donated call timed alone (median of `--repeats`), so
each figure includes one dispatch. The `xla` part of `sparse_update`'s
cost model (`stream_update.worth_streaming`) comes from these figures.
"""

from __future__ import annotations

import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import numpy as np

from bench.settings import apply_settings

_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny sizes, interpreter.")
_ROWS = flags.DEFINE_integer("rows", 1_000_000, "Table rows.")
_WIDTH = flags.DEFINE_integer("width", 64, "Table columns (f32).")
_SLOTS = flags.DEFINE_list("slots", ["0", "16384", "77000", "280000"],
                           "Distinct rows updated.")
_BUFFER = flags.DEFINE_integer("buffer", 327_680, "Slots of the buffer.")
_OPTIMIZERS = flags.DEFINE_list("optimizers", ["sgd", "rowwise_adagrad",
                                               "adam"], "Sparse optimizers.")
_METHODS = flags.DEFINE_list("methods", ["never", "always", "copy"],
                             "STREAM values, and copy (the floor).")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed rounds.")
_SET = flags.DEFINE_multi_string("set", [], "MODULE.NAME=VALUE knobs.")


def _copy_kernel(table_ref, out_ref):
  out_ref[...] = table_ref[...]


def stream_copy(table, block, interpret=False):
  """The table through VMEM in `block`-row blocks, in place: the stream
  kernel's HBM traffic and grid, no work."""
  spec = pl.BlockSpec((block, table.shape[1]), lambda b: (b, 0))
  return pl.pallas_call(
      _copy_kernel, out_shape=jax.ShapeDtypeStruct(table.shape, table.dtype),
      grid=(pl.cdiv(table.shape[0], block),), in_specs=[spec],
      out_specs=spec, input_output_aliases={0: 0},
      interpret=pltpu.InterpretParams() if interpret else False)(table)


def _timed(fn, state, repeats):
  state = jax.block_until_ready(fn(state))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    state = jax.block_until_ready(fn(state))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def main(argv):
  del argv
  apply_settings(_SET.value)
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  from pallas_emb import kernels  # pylint: disable=g-import-not-at-top
  from pallas_emb.kernels.mosaic_tpu import sparse_update  # pylint: disable=g-import-not-at-top
  from pallas_emb.kernels.mosaic_tpu import stored  # pylint: disable=g-import-not-at-top
  from pallas_emb.kernels.mosaic_tpu import stream_update  # pylint: disable=g-import-not-at-top
  from pallas_emb.optimizers import base  # pylint: disable=g-import-not-at-top

  smoke = _SMOKE.value
  rows = 4096 if smoke else _ROWS.value  # whole blocks: see stream_update
  buffer = 600 if smoke else _BUFFER.value
  slots_list = [min(int(s), buffer, rows) for s in _SLOTS.value]
  backend = "mosaic_tpu_interpret" if smoke else "mosaic_tpu"
  width = _WIDTH.value
  grad_width = stored.grad_width(width, jnp.float32)
  optimizers = {"sgd": pe.Sgd(0.1), "rowwise_adagrad": pe.RowwiseAdagrad(0.1),
                "adam": pe.Adam(0.01)}
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{rows:,} x {width} f32, buffer {buffer:,}"
        f"{''.join(', ' + x for x in _SET.value)}")
  print("| optimizer | slots | method | stream block | ms |\n"
        "|---|---|---|---|---|")
  rng = np.random.default_rng(0)
  for name in _OPTIMIZERS.value:
    opt = optimizers[name]
    table = stored.to_stored(jnp.zeros((rows, width), jnp.float32))
    row_state = tuple(jnp.full((rows,), 0.5, jnp.float32)
                      for s in opt.slots() if s.kind == base.ROW)
    element_state = tuple(jnp.full((rows, grad_width), 0.5, jnp.float32)
                          for s in opt.slots() if s.kind != base.ROW)
    block = stream_update.block_rows(
        table.shape[1] + grad_width * len(element_state))
    for slots in slots_list:
      tokens = np.full(buffer, np.iinfo(np.int32).max, np.int32)
      tokens[:slots] = np.sort(rng.choice(rows, slots, replace=False))
      grad = np.zeros((buffer, grad_width), np.float32)
      grad[:slots, :width] = rng.standard_normal((slots, width))
      row_sq = (grad ** 2).sum(axis=1)
      tokens, grad, row_sq = map(jnp.asarray, (tokens, grad, row_sq))
      for method in _METHODS.value:
        if method == "copy":
          fn = jax.jit(lambda s, block=block: (stream_copy(
              s[0], block, interpret=smoke),) + tuple(s[1:]),
                       donate_argnums=0)
        else:
          def update(state, method=method, tokens=tokens, grad=grad,
                     row_sq=row_sq, opt=opt):
            step = jnp.int32(3)
            with _stream(sparse_update, method):
              return kernels.sparse_update_rows(
                  opt, *state, tokens, grad, row_sq, jnp.bool_(True), step,
                  opt.scalars(step), emb_width=width, backend=backend,
                  sorted_tokens=True)
          fn = jax.jit(update, donate_argnums=0)
        state = (table, row_state, element_state)
        state = jax.tree.map(jnp.copy, state)
        ms = _timed(fn, state, 1 if smoke else _REPEATS.value)
        print(f"| {name} | {slots:,} | {method} | {block} | {ms:.3f} |",
              flush=True)


class _stream:  # pylint: disable=invalid-name
  """`sparse_update.STREAM` set while a function is traced."""

  def __init__(self, module, value):
    self.module, self.value = module, value

  def __enter__(self):
    self.old, self.module.STREAM = self.module.STREAM, self.value

  def __exit__(self, *exc):
    self.module.STREAM = self.old


if __name__ == "__main__":
  app.run(main)
