"""The generic sparse-update kernel with every optimizer's rule, vs its twin.

`kernels/sparse_update.py` runs each optimizer's `row_update` /
`column_update`; `reference.sparse_update` (the `xla` backend) runs the same
functions on gathered rows. In interpret mode the two are bit-exact (same
expressions; the numpy models in optimizers_test.py check the math itself);
on a GPU, Triton's division, sqrt, rsqrt, exp and pow may differ by an ulp,
so GPU runs are compared with a tolerance (one bf16 rounding, 1e-5 in f32).
Also: untouched and zero-gradient rows keep their bits, `apply=False`
changes nothing, column blocks, the in-place CUDA lowering and the twin's
compiled HLO (no table-sized copy).
"""

import functools

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import adagrad_test
import pallas_emb as pe
from pallas_emb import kernels
from pallas_emb.kernels import reference
from pallas_emb.kernels import xla
from pallas_emb.kernels.triton import sparse_update
from pallas_emb.optimizers import base
from pallas_emb.testing import hlo

BF16 = test_util.BF16
F32 = np.float32
VOCAB = adagrad_test.VOCAB
KERNEL_BACKENDS = adagrad_test.KERNEL_BACKENDS
TRITON_CALL = adagrad_test.TRITON_CALL
RANKS = 3  # emb_width = RANKS * shard width, as if psum'ed over 3 ranks

OPTIMIZERS = {
    "sgd": pe.Sgd(0.1),
    "adagrad": pe.Adagrad(0.2),
    "rowwise_adagrad_lazy": pe.RowwiseAdagrad(
        0.1, half_life_steps=5.0, weight_decay=0.01, lazy=True),
    "adam": pe.Adam(0.05, b1=0.8, b2=0.95),
    "partial_rowwise_adam": pe.PartialRowwiseAdam(0.05, b1=0.8, b2=0.95),
    "ftrl": pe.Ftrl(0.3, l1=0.02, l2=0.1),
    "ftrl_pow": pe.Ftrl(0.3, l2=0.05, lr_power=-0.7),
}
STEP = 4


def inputs(opt, seed, width, dtype):
  """Table, states and the 14 slots of adagrad_test (every token rule)."""
  table, _, _, tokens, grad_accum, _ = adagrad_test.adagrad_inputs(
      seed, width, dtype, lazy=False)
  rng = np.random.default_rng(seed + 1)
  rows, elements = [], []
  for slot in opt.slots():
    shape = (VOCAB,) if slot.kind == base.ROW else (VOCAB, width)
    if np.dtype(slot.dtype) == np.int32:
      array = rng.integers(0, STEP + 1, shape).astype(np.int32)
    elif slot.name in ("m", "linear"):  # signed state
      array = rng.standard_normal(shape).astype(F32)
    else:  # accumulators and second moments are positive
      array = rng.uniform(0.05, 2.0, shape).astype(F32)
    (rows if slot.kind == base.ROW else elements).append(array)
  row_sq = (adagrad_test.np_round(grad_accum, dtype) ** 2).sum(
      axis=1).astype(F32) * RANKS
  return table, tuple(rows), tuple(elements), tokens, grad_accum, row_sq


def run(opt, backend, args, width, apply=True, config=None):
  """One update through the dispatch (or the kernel module with config)."""
  table, rows, elements, tokens, grad_accum, row_sq = args

  def fn(table, rows, elements, tokens, grad_accum, row_sq, apply):
    step = jnp.int32(STEP)
    kw = dict(emb_width=RANKS * width)
    if config is not None:
      return sparse_update.sparse_update(
          opt, table, rows, elements, tokens, grad_accum, row_sq, apply,
          step, opt.scalars(step), interpret=backend == "interpret",
          config=config, **kw)
    return kernels.sparse_update_rows(
        opt, table, rows, elements, tokens, grad_accum, row_sq, apply, step,
        opt.scalars(step), backend=backend, **kw)

  out = jax.jit(fn)(table, rows, elements, tokens, grad_accum, row_sq,
                    jnp.asarray(apply))
  return jax.tree.map(np.asarray, out)


def assert_same(test, got, want, backend):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if backend == "interpret":
      test_util.assert_bits_equal(test, g, w)
    else:
      rtol = 1e-5 if g.dtype == F32 else 2**-7
      np.testing.assert_allclose(g.astype(F32), w.astype(F32), rtol=rtol,
                                 atol=1e-6)


# Rows the 14 slots train (5 has a zero gradient), and all the others.
TRAINED = [0, 3, 9, 17, 22, 30, 31, VOCAB - 1]
ZERO_GRAD_ROW = 5


class SparseUpdateTest(parameterized.TestCase):

  @parameterized.product(name=list(OPTIMIZERS), backend=KERNEL_BACKENDS,
                         case=((F32, 5, None), (BF16, 12, None),
                               (F32, 300, 128)))
  def test_kernel_matches_twin(self, name, backend, case):
    """Partial last block (4 rows of 14 slots); 300 = 3 column blocks."""
    dtype, width, block_cols = case
    opt = OPTIMIZERS[name]
    args = inputs(opt, width, width, dtype)
    config = sparse_update.SparseUpdateConfig(block_rows=4,
                                              block_cols=block_cols)
    got = run(opt, backend, args, width, config=config)
    twin = run(opt, "xla", args, width)
    assert_same(self, got, twin, backend)
    # Untouched rows keep their bits, in the table and every state.
    trained = TRAINED + [ZERO_GRAD_ROW] * opt.updates_zero_rows
    keep = sorted(set(range(VOCAB)) - set(trained))
    table, rows, elements = got
    test_util.assert_bits_equal(self, table[keep], args[0][keep])
    for new, old in zip(rows + elements, args[1] + args[2]):
      test_util.assert_bits_equal(self, new[keep], old[keep])
    self.assertFalse(np.array_equal(table[3], args[0][3]))

  @parameterized.product(name=list(OPTIMIZERS),
                         backend=("xla",) + KERNEL_BACKENDS)
  def test_not_applied_changes_nothing(self, name, backend):
    opt = OPTIMIZERS[name]
    args = inputs(opt, 3, 4, BF16)
    got = run(opt, backend, args, 4, apply=False)
    for g, given in zip(jax.tree.leaves(got), jax.tree.leaves(args[:3])):
      test_util.assert_bits_equal(self, g, given)

  @parameterized.product(name=list(OPTIMIZERS),
                         case=((12, jnp.bfloat16), (130, jnp.float32)))
  def test_lowers_to_triton_in_place(self, name, case):
    width, dtype = case
    opt = OPTIMIZERS[name]
    sds = jax.ShapeDtypeStruct
    rows = tuple(sds((50,), s.dtype) for s in opt.slots()
                 if s.kind == base.ROW)
    elements = tuple(sds((50, width), jnp.float32) for s in opt.slots()
                     if s.kind == base.ELEMENT)

    def fn(table, rows, elements, tokens, grad, row_sq, apply, step):
      return kernels.sparse_update_rows(
          opt, table, rows, elements, tokens, grad, row_sq, apply, step,
          opt.scalars(step), emb_width=width, backend="triton")

    text = jax.jit(fn, donate_argnums=(0, 1, 2)).trace(
        sds((50, width), dtype), rows, elements, sds((9,), jnp.int32),
        sds((9, width), jnp.float32), sds((9,), jnp.float32),
        sds((), jnp.bool_), sds((), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    self.assertIn(TRITON_CALL, text)
    self.assertIn(f'name = "{opt.kernel_name}"', text)
    # The table and every state array, updated in place.
    self.assertEqual(text.count("stablehlo.output_operand_alias<"),
                     1 + len(rows) + len(elements))

  @parameterized.product(name=list(OPTIMIZERS),
                         dtype=(jnp.float32, jnp.bfloat16, jnp.uint16))
  @absltest.skipIf(test_util.ON_GPU, test_util.CPU_ONLY)
  def test_twin_does_not_copy_the_table_or_state(self, name, dtype):
    """Compiled for CPU with donation, the twin scatters into its buffers.

    No table-sized op may remain but the in-place scatters (`hlo.
    full_table_ops`); for a bf16 table, XLA:CPU's two same-width
    `bitcast-convert`s of the table's uint16 view are the known limit
    (see `xla.sparse_update`). A bf16 table given as its uint16 bits (how a
    collection state holds it on the xla backend) is held to none.
    """
    opt = OPTIMIZERS[name]
    vocab_rows, width, num_unique = 1000, 24, 16
    rows = tuple(jnp.zeros((vocab_rows,), s.dtype) for s in opt.slots()
                 if s.kind == base.ROW)
    elements = tuple(jnp.zeros((vocab_rows, width)) for s in opt.slots()
                     if s.kind == base.ELEMENT)

    def fn(table, rows, elements, tokens, grad, row_sq):
      step = jnp.int32(3)
      return xla.sparse_update(
          opt, table, rows, elements, tokens, grad, row_sq, True, step,
          opt.scalars(step), emb_width=width)

    text = jax.jit(fn, donate_argnums=(0, 1, 2)).lower(
        jnp.zeros((vocab_rows, width), dtype), rows, elements,
        jnp.arange(num_unique, dtype=jnp.int32),
        jnp.ones((num_unique, width)), jnp.ones(num_unique)).compile(
        ).as_text()
    bad = hlo.full_table_ops(text, vocab_rows)
    if dtype == jnp.bfloat16:
      bad = [b for b in bad if "bitcast-convert" not in b.line]
    self.assertEqual([b.line.strip()[:160] for b in bad], [])

  def test_kernel_names_and_refs(self):
    names = {opt.kernel_name for opt in OPTIMIZERS.values()}
    self.assertLen(names, len(OPTIMIZERS) - 1)  # two Ftrl configurations
    self.assertIn("pallas_emb_adagrad", names)  # RowwiseAdagrad, since §4
    self.assertEqual(
        sparse_update.ref_names(OPTIMIZERS["partial_rowwise_adam"]),
        ("apply_ref", "step_ref", "scalars_ref", "tokens_ref", "grad_ref",
         "row_sq_ref", "table_ref", "v_ref", "m_ref", "table_out", "v_out",
         "m_out"))

  def test_argument_errors(self):
    opt = OPTIMIZERS["adam"]
    table, rows, elements, tokens, grad, row_sq = inputs(opt, 0, 4, F32)
    with self.assertRaisesRegex(ValueError, r"element-wise state \['m', "
                                r"'v'\], got 1 arrays"):
      reference.sparse_update(opt, table, rows, elements[:1], tokens, grad,
                              row_sq, True, 1, opt.scalars(jnp.int32(1)))


if __name__ == "__main__":
  absltest.main()
