"""Segment-sum and row-wise Adagrad kernels against an independent numpy model.

Both backends of each operation (the jnp twin, `xla`, and the Pallas kernel,
`interpret` on CPU, plus `pallas` on a GPU) are checked against loops written
here in numpy, then against each other; the Triton lowering is checked on CPU
through `lower(lowering_platforms=("cuda",))`.
"""

import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import re  # pylint: disable=g-import-not-at-top,wrong-import-position
import sys  # pylint: disable=g-import-not-at-top,wrong-import-position

from absl.testing import absltest  # pylint: disable=g-import-not-at-top
from absl.testing import parameterized  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import ml_dtypes  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

try:
  from pallas_emb import kernels  # pylint: disable=g-import-not-at-top
except ImportError:  # run from a checkout without PYTHONPATH
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  from pallas_emb import kernels  # pylint: disable=g-import-not-at-top
from pallas_emb.kernels import adagrad  # pylint: disable=g-import-not-at-top
from pallas_emb.kernels import reference  # pylint: disable=g-import-not-at-top
from pallas_emb.kernels import segment_sum  # pylint: disable=g-import-not-at-top
from pallas_emb.kernels.hparams import AdagradHParams  # pylint: disable=g-import-not-at-top

BF16 = ml_dtypes.bfloat16
F32 = np.float32
INT32_MAX = np.iinfo(np.int32).max
ON_GPU = jax.devices()[0].platform == "gpu"
# The Pallas backends under test: the interpreter everywhere, Triton on GPU.
KERNEL_BACKENDS = ("interpret", "pallas") if ON_GPU else ("interpret",)
TRITON_CALL = "__gpu$xla.gpu.triton"


def np_round(x, dtype):
  """Rounds float32 values to `dtype` and back (identity for float32)."""
  x = np.asarray(x, F32)
  return x if np.dtype(dtype) == F32 else x.astype(BF16).astype(F32)


# --------------------------------------------------------------------------
# numpy models
# --------------------------------------------------------------------------


def np_segment_sum(grads, segment_ids, num_segments, round_dtype):
  """float64 row loop: `grad_accum[U, S]` and `row_sq[U + 1]`."""
  grads = np.asarray(grads).astype(np.float64)
  accum = np.zeros((num_segments, grads.shape[1]), np.float64)
  for row, seg in enumerate(np.asarray(segment_ids)):
    if 0 <= seg < num_segments:
      accum[seg] += grads[row]
  accum = accum.astype(F32)
  row_sq = (np_round(accum, round_dtype).astype(np.float64) ** 2).sum(axis=1)
  return accum, np.append(row_sq, row_sq.sum())


def np_adagrad(table, row_state, last_step, tokens, grad_accum, row_sq,
               apply, step, lr, hp):
  """DESIGN §4.5 one slot at a time, in float32 scalars."""
  table, row_state = table.copy(), row_state.copy()
  last_step = None if last_step is None else last_step.copy()
  vocab_rows = table.shape[0]
  if not apply:
    return table, row_state, last_step
  for u, token in enumerate(tokens):
    t = token + vocab_rows if token < 0 else token
    if not 0 <= t < vocab_rows:
      continue
    if hp.lazy:
      delta = F32(max(0, step - last_step[t]))
      factor = np.exp(F32(-hp.accum_decay_rate) * delta)
      wd = np.exp(F32(-hp.weight_decay_rate) * delta)
      last_step[t] = step
    else:
      factor, wd = F32(hp.decay_factor), F32(hp.weight_decay_factor)
    wd = wd if row_sq[u] > 0 else F32(1)
    accum = row_state[t] * factor + row_sq[u] * F32(hp.inv_width)
    row_state[t] = accum
    lr_scale = -F32(lr) / (np.sqrt(accum) + F32(hp.eps))
    values = table[t].astype(F32)
    rounded = lambda x: np_round(x, table.dtype)
    table[t] = rounded(rounded(values * wd)
                       + rounded(lr_scale * rounded(grad_accum[u])))
  return table, row_state, last_step


# --------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------


def segment_inputs(seed, num_rows, width, num_segments, dtype, integer=False):
  """Rows with dropped ids (-1, U, beyond), a hot segment and empty ones."""
  rng = np.random.default_rng(seed)
  # Segment 0 is hot (~half the rows); the last two segments stay empty.
  ids = np.where(rng.random(num_rows) < 0.5, 0,
                 rng.integers(0, max(1, num_segments - 2), num_rows))
  drops = rng.random(num_rows)
  ids = np.where(drops < 0.08, -1, ids)
  ids = np.where((drops >= 0.08) & (drops < 0.12), num_segments, ids)
  ids = np.where((drops >= 0.12) & (drops < 0.14), num_segments + 7, ids)
  if integer:
    grads = rng.integers(-4, 5, (num_rows, width))
  else:
    grads = rng.standard_normal((num_rows, width))
  return grads.astype(dtype), ids.astype(np.int32)


VOCAB = 40


def adagrad_inputs(seed, width, dtype, lazy):
  """A table, state and 14 unique slots covering every token rule."""
  rng = np.random.default_rng(seed)
  table = rng.standard_normal((VOCAB, width)).astype(dtype)
  table[5, 0] = -0.0  # signed zeros must survive a zero update bit for bit
  row_state = rng.uniform(0, 2, VOCAB).astype(F32)
  last_step = rng.integers(0, 6, VOCAB).astype(np.int32) if lazy else None
  # Valid (unique after wrapping once): 3 17 30 31 39 0 5 22 9. Skipped:
  # -41 (wraps to -1), 40 and 43 (past the table), two int32-max fills.
  tokens = np.array([3, 17, 30, 31, -1, -VOCAB, 5, -VOCAB - 1, VOCAB,
                     VOCAB + 3, INT32_MAX, INT32_MAX, 22, 9], np.int32)
  num_unique = tokens.shape[0]
  grad_accum = rng.standard_normal((num_unique, width)).astype(F32)
  grad_accum[6] = 0  # token 5: no gradient, so row_sq == 0
  # As if psum'ed over three ranks of the same width.
  row_sq = (np_round(grad_accum, dtype) ** 2).sum(axis=1).astype(F32) * 3
  return table, row_state, last_step, tokens, grad_accum, row_sq


HPARAMS = {
    "eager_plain": AdagradHParams(eps=1e-3, inv_width=1 / 24),
    "eager_decay": AdagradHParams(eps=1e-2, inv_width=1 / 36,
                                  decay_factor=float(np.exp(-np.log(2) / 7)),
                                  weight_decay_factor=float(np.exp(-0.01))),
    "lazy_decay": AdagradHParams(eps=1e-3, inv_width=1 / 24, lazy=True,
                                 accum_decay_rate=float(np.log(2) / 7),
                                 weight_decay_rate=0.01),
    "lazy_wd": AdagradHParams(eps=1e-3, inv_width=1 / 3, lazy=True,
                              weight_decay_rate=0.05),
}


def run_adagrad(backend, args, hp, apply=True, step=9, lr=0.1, config=None):
  table, row_state, last_step, tokens, grad_accum, row_sq = args
  if config is not None:
    fn = lambda *a: adagrad.adagrad_apply(
        *a, hparams=hp, interpret=backend == "interpret", config=config)
  else:
    fn = lambda *a: kernels.adagrad_apply(*a, hparams=hp, backend=backend)
  out = jax.jit(fn)(jnp.asarray(table), jnp.asarray(row_state),
                    None if last_step is None else jnp.asarray(last_step),
                    jnp.asarray(tokens), jnp.asarray(grad_accum),
                    jnp.asarray(row_sq), jnp.asarray(apply), jnp.int32(step),
                    jnp.float32(lr))
  return tuple(None if x is None else np.asarray(x) for x in out)


def bits(x):
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


# --------------------------------------------------------------------------
# segment sum
# --------------------------------------------------------------------------


class SegmentSumTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (f"{backend}_{np.dtype(dtype).name}_w{width}_n{rows}_u{segs}", backend,
       (width, dtype, rows, segs))
      for backend in ("xla",) + KERNEL_BACKENDS
      for width, dtype, rows, segs in ((1, F32, 128, 7), (3, BF16, 100, 10),
                                       (8, F32, 64, 5), (12, BF16, 96, 20),
                                       (64, F32, 48, 6)))
  def test_matches_numpy(self, backend, case):
    width, dtype, num_rows, num_segments = case
    grads, ids = segment_inputs(width, num_rows, width, num_segments, dtype)
    round_dtype = jnp.bfloat16 if dtype == BF16 else jnp.float32
    accum, row_sq = jax.jit(
        lambda g, i: kernels.segment_sum_rows(
            g, i, num_segments, round_dtype=round_dtype, backend=backend))(
                grads, ids)
    want_accum, want_sq = np_segment_sum(grads, ids, num_segments,
                                         round_dtype)
    self.assertEqual(accum.dtype, jnp.float32)
    self.assertEqual(accum.shape, (num_segments, width))
    self.assertEqual(row_sq.shape, (num_segments + 1,))
    scale = np.abs(np.asarray(grads, F32)).sum(axis=0).max()
    np.testing.assert_allclose(accum, want_accum, rtol=1e-6,
                               atol=1e-6 * scale)
    np.testing.assert_allclose(row_sq, want_sq, rtol=1e-5, atol=1e-6)
    # Empty segments are exact zeros.
    np.testing.assert_array_equal(accum[-2:], 0)

  @parameterized.product(backend=("xla",) + KERNEL_BACKENDS,
                         unique=(False, True))
  def test_exact(self, backend, unique):
    """Integer-valued rows, or one row per segment: every backend is exact."""
    num_segments, width = 24, 5
    grads, ids = segment_inputs(1, 64, width, num_segments, F32,
                                integer=not unique)
    if unique:
      ids = np.random.default_rng(2).permutation(64)[:64].astype(np.int32) - 8
    accum, row_sq = kernels.segment_sum_rows(
        grads, ids, num_segments, round_dtype=jnp.float32, backend=backend)
    want_accum, want_sq = np_segment_sum(grads, ids, num_segments, F32)
    np.testing.assert_array_equal(accum, want_accum)
    if not unique:  # small integers: the squares sum exactly too
      np.testing.assert_array_equal(row_sq, want_sq)

  @parameterized.product(backend=KERNEL_BACKENDS)
  def test_kernel_matches_twin_and_is_deterministic(self, backend):
    num_segments = 9
    grads, ids = segment_inputs(3, 128, 12, num_segments, BF16)
    # Tiny tiles: several programs, a partial last block, many chunks for the
    # hot segment.
    config = segment_sum.SegmentSumConfig(block_segments=4, chunk_rows=4)
    run = jax.jit(lambda g, i: segment_sum.segment_sum_rows(
        g, i, num_segments, round_dtype=jnp.bfloat16,
        interpret=backend == "interpret", config=config))
    accum, row_sq = run(grads, ids)
    again = run(grads, ids)
    np.testing.assert_array_equal(bits(accum), bits(again[0]))
    np.testing.assert_array_equal(bits(row_sq), bits(again[1]))
    twin_accum, twin_sq = reference.segment_sum_rows(
        jnp.asarray(grads), jnp.asarray(ids), num_segments,
        round_dtype=jnp.bfloat16)
    np.testing.assert_allclose(accum, twin_accum, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(row_sq, twin_sq, rtol=1e-5)

  @parameterized.product(backend=("xla",) + KERNEL_BACKENDS)
  def test_all_dropped(self, backend):
    grads = np.ones((16, 3), F32)
    ids = np.array([-1, 4, 9, -7] * 4, np.int32)
    accum, row_sq = kernels.segment_sum_rows(
        grads, ids, 4, round_dtype=jnp.float32, backend=backend)
    np.testing.assert_array_equal(accum, np.zeros((4, 3)))
    np.testing.assert_array_equal(row_sq, np.zeros(5))

  def test_twin_does_not_sort(self):
    """On CPU the twin is a scatter-add: no O(N log N) sort."""
    grads, ids = segment_inputs(0, 64, 8, 10, F32)
    hlo = jax.jit(lambda g, i: reference.segment_sum_rows(
        g, i, 10, round_dtype=jnp.bfloat16)).lower(grads, ids).as_text()
    self.assertNotIn("stablehlo.sort", hlo)

  def test_config_must_be_powers_of_two(self):
    with self.assertRaisesRegex(ValueError, "chunk_rows must be a positive"):
      segment_sum.SegmentSumConfig(chunk_rows=3)
    self.assertEqual(segment_sum.SegmentSumConfig().rows_per_chunk(2048), 2)

  @parameterized.parameters((12, jnp.float32), (3, jnp.bfloat16),
                            (130, jnp.bfloat16))
  def test_lowers_to_triton(self, width, dtype):
    grads = jax.ShapeDtypeStruct((40, width), dtype)
    ids = jax.ShapeDtypeStruct((40,), jnp.int32)
    fn = lambda g, i: kernels.segment_sum_rows(
        g, i, 11, round_dtype=dtype, backend="pallas")
    text = jax.jit(fn).trace(grads, ids).lower(
        lowering_platforms=("cuda",)).as_text()
    self.assertIn(TRITON_CALL, text)


# --------------------------------------------------------------------------
# Adagrad
# --------------------------------------------------------------------------


class AdagradTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (f"{backend}_{hp}_{np.dtype(dtype).name}_w{width}", backend, hp, dtype,
       width)
      for backend in ("xla",) + KERNEL_BACKENDS
      for hp, dtype, width in (("eager_plain", F32, 3),
                               ("eager_decay", BF16, 12),
                               ("lazy_decay", F32, 8),
                               ("lazy_wd", BF16, 1),
                               ("eager_decay", F32, 64)))
  def test_matches_numpy(self, backend, hp_name, dtype, width):
    hp = HPARAMS[hp_name]
    args = adagrad_inputs(width, width, dtype, hp.lazy)
    table, row_state, last_step = run_adagrad(backend, args, hp)
    want_table, want_state, want_last = np_adagrad(
        *args, apply=True, step=9, lr=0.1, hp=hp)
    self.assertEqual(table.dtype, dtype)
    if hp.lazy:
      np.testing.assert_array_equal(last_step, want_last)
    else:
      self.assertIsNone(last_step)
    # Rows outside the unique list keep their bits (the alias is in place).
    touched = [0, 3, 5, 9, 17, 22, 30, 31, VOCAB - 1]
    untouched = np.setdiff1d(np.arange(VOCAB), touched)
    np.testing.assert_array_equal(bits(table[untouched]),
                                  bits(args[0][untouched]))
    np.testing.assert_array_equal(bits(row_state[untouched]),
                                  bits(args[1][untouched]))
    # Signed zeros and untouched values survive the zero-gradient row.
    self.assertTrue(np.signbit(table[5, 0]))
    if hp.lazy or backend == "pallas":
      # numpy's exp (and on GPU, Triton's division and exp) may differ from
      # XLA's by an ulp; a bf16 table can then round one step differently.
      np.testing.assert_allclose(row_state, want_state, rtol=4e-7)
      rtol = 1e-6 if dtype == F32 else 2**-7
      np.testing.assert_allclose(table.astype(F32), want_table.astype(F32),
                                 rtol=rtol, atol=1e-7)
    else:
      np.testing.assert_array_equal(bits(row_state), bits(want_state))
      np.testing.assert_array_equal(bits(table), bits(want_table))

  @parameterized.product(backend=KERNEL_BACKENDS)
  def test_kernel_matches_twin_bit_exactly(self, backend):
    """Same expressions in the same order: identical bits (on CPU)."""
    for hp_name, dtype, width in (("eager_decay", BF16, 12),
                                  ("lazy_decay", F32, 5),
                                  ("lazy_wd", BF16, 3)):
      hp = HPARAMS[hp_name]
      args = adagrad_inputs(7, width, dtype, hp.lazy)
      config = adagrad.AdagradConfig(block_rows=4)  # a partial last block
      got = run_adagrad(backend, args, hp, step=4, config=config)
      twin = run_adagrad("xla", args, hp, step=4)
      for g, t in zip(got, twin):
        if t is None:
          self.assertIsNone(g)
        elif backend == "interpret":
          np.testing.assert_array_equal(bits(g), bits(t))
        else:
          np.testing.assert_allclose(g.astype(F32), t.astype(F32),
                                     rtol=2**-7)
      again = run_adagrad(backend, args, hp, step=4, config=config)
      for g, a in zip(got, again):
        if g is not None:
          np.testing.assert_array_equal(bits(g), bits(a))

  @parameterized.product(backend=("xla",) + KERNEL_BACKENDS,
                         hp_name=("eager_decay", "lazy_decay"))
  def test_not_applied_changes_nothing(self, backend, hp_name):
    hp = HPARAMS[hp_name]
    args = adagrad_inputs(3, 4, BF16, hp.lazy)
    out = run_adagrad(backend, args, hp, apply=False)
    for got, given in zip(out, args[:3]):
      if given is None:
        self.assertIsNone(got)
      else:
        np.testing.assert_array_equal(bits(got), bits(given))

  def test_zero_row_sq_gets_no_weight_decay(self):
    """Slot 6 (token 5) has no gradient: its row is not decayed at all."""
    hp = AdagradHParams(eps=1e-3, inv_width=0.25, weight_decay_factor=0.5)
    args = adagrad_inputs(4, 4, F32, False)
    for backend in ("xla",) + KERNEL_BACKENDS:
      table, row_state, _ = run_adagrad(backend, args, hp)
      np.testing.assert_array_equal(bits(table[5]), bits(args[0][5]))
      self.assertEqual(row_state[5], args[1][5])  # decay_factor 1, no grad
      self.assertFalse(np.allclose(table[3], args[0][3]))

  def test_argument_errors(self):
    args = [jnp.asarray(a) for a in adagrad_inputs(0, 4, F32, True)]
    lazy, eager = HPARAMS["lazy_wd"], HPARAMS["eager_plain"]
    tail = (True, 1, 0.1)
    with self.assertRaisesRegex(ValueError, "lazy hparams need a last_step"):
      reference.adagrad_apply(args[0], args[1], None, *args[3:], *tail,
                              hparams=lazy)
    with self.assertRaisesRegex(ValueError, "take last_step=None"):
      adagrad.adagrad_apply(*args, *tail, hparams=eager, interpret=True)
    with self.assertRaisesRegex(ValueError, "block_rows must be a positive"):
      adagrad.AdagradConfig(block_rows=6)

  def test_row_sq_with_total_slot_is_accepted(self):
    hp = HPARAMS["eager_plain"]
    args = list(adagrad_inputs(0, 4, F32, False))
    with_total = args[:5] + [np.append(args[5], 123.0).astype(F32)]
    for backend in ("xla",) + KERNEL_BACKENDS:
      want = run_adagrad(backend, args, hp)
      got = run_adagrad(backend, with_total, hp)
      np.testing.assert_array_equal(bits(got[0]), bits(want[0]))

  @parameterized.parameters((12, jnp.bfloat16, "lazy_decay"),
                            (3, jnp.float32, "eager_decay"),
                            (130, jnp.bfloat16, "eager_plain"))
  def test_lowers_to_triton_in_place(self, width, dtype, hp_name):
    hp = HPARAMS[hp_name]
    vocab_rows, num_unique = 50, 9
    specs = (jax.ShapeDtypeStruct((vocab_rows, width), dtype),
             jax.ShapeDtypeStruct((vocab_rows,), jnp.float32),
             jax.ShapeDtypeStruct((vocab_rows,), jnp.int32) if hp.lazy
             else None,
             jax.ShapeDtypeStruct((num_unique,), jnp.int32),
             jax.ShapeDtypeStruct((num_unique, width), jnp.float32),
             jax.ShapeDtypeStruct((num_unique,), jnp.float32),
             jax.ShapeDtypeStruct((), jnp.bool_),
             jax.ShapeDtypeStruct((), jnp.int32),
             jax.ShapeDtypeStruct((), jnp.float32))
    fn = lambda *a: kernels.adagrad_apply(*a, hparams=hp, backend="pallas")
    text = jax.jit(fn, donate_argnums=(0, 1, 2)).trace(*specs).lower(
        lowering_platforms=("cuda",)).as_text()
    self.assertIn(TRITON_CALL, text)
    self.assertIn("output_operand_aliases", text)

  @parameterized.product(dtype=(jnp.float32, jnp.bfloat16),
                         hp_name=("eager_decay", "lazy_decay"))
  def test_twin_does_not_copy_the_table(self, dtype, hp_name):
    """Compiled for CPU with donation, the twin scatters into the table.

    No `convert` (XLA:CPU's bf16 upcast) or `copy` of the whole table may
    remain. The bf16 table goes through a uint16 view: the remaining
    same-width `bitcast-convert`s are allowed here (XLA:CPU still runs them
    as loops over the table; see the twin's docstring).
    """
    hp = HPARAMS[hp_name]
    vocab_rows, width, num_unique = 1000, 24, 16
    args = (jnp.zeros((vocab_rows, width), dtype), jnp.zeros(vocab_rows),
            jnp.zeros(vocab_rows, jnp.int32) if hp.lazy else None,
            jnp.arange(num_unique, dtype=jnp.int32),
            jnp.zeros((num_unique, width)), jnp.zeros(num_unique),
            jnp.asarray(True), jnp.int32(3), jnp.float32(0.1))
    fn = lambda *a: reference.adagrad_apply(*a, hparams=hp)
    hlo = jax.jit(fn, donate_argnums=(0, 1, 2)).lower(*args).compile(
    ).as_text()
    bad = full_table_copies(hlo, (vocab_rows, width),
                            jnp.dtype(dtype).itemsize * 8)
    self.assertEqual(bad, [], msg=hlo)


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* "
                    r"([\w\-]+)\(")
_COMP = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_BITS = {"f32": 32, "s32": 32, "u32": 32, "bf16": 16, "u16": 16, "s16": 16,
         "f16": 16}


def full_table_copies(hlo: str, shape, table_bits):
  """Top-level instructions of compiled HLO producing a new table-sized array.

  Allowed: parameters, bitcasts, and fusions rooted at a scatter, a
  dynamic-update-slice or a bitcast(-convert) whose element width is the
  table's (a bf16 table scattered as f32 was upcast).
  """
  dims = ",".join(map(str, shape))
  roots, entry, current = {}, [], None
  for line in hlo.splitlines():
    comp = _COMP.match(line)
    if comp:
      current = "ENTRY" if comp.group(1) else comp.group(2)
      continue
    instr = _INSTR.match(line)
    if not instr:
      continue
    name, dtype, shape_dims, opcode = instr.groups()
    if current == "ENTRY":
      entry.append((name, dtype, shape_dims, opcode, line))
    if line.lstrip().startswith("ROOT"):
      roots[current] = opcode
  bad = []
  for name, dtype, shape_dims, opcode, line in entry:
    if shape_dims != dims or opcode in ("parameter", "bitcast"):
      continue
    if opcode == "fusion":
      called = re.search(r"calls=%([\w.\-]+)", line).group(1)
      if (roots.get(called) in ("scatter", "dynamic-update-slice",
                                "bitcast-convert", "bitcast")
          and _BITS.get(dtype) == table_bits):
        continue
    bad.append(line.strip()[:200])
  return bad


if __name__ == "__main__":
  absltest.main()
