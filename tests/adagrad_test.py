"""Row-wise Adagrad's rule in the update kernel vs a numpy model and the twin.

Backends: the twin (`xla`), the kernel through the interpreter everywhere,
and the Triton kernel on a GPU. The interpreter is bit-exact against the
twin (same expressions in the same order, `common.adagrad_row_update` /
`adagrad_new_values`); on a GPU, Triton's division, sqrt and exp may differ
by an ulp, so GPU runs are compared with a tolerance (stated per check).
Also: eager and lazy modes, column blocks (wide shards), the interpreter's
masked-store hazard in this kernel, config and int32 checks, the in-place
CUDA lowering and the twin's compiled HLO.
"""

import functools
import re
from unittest import mock

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import kernels
from pallas_emb.kernels.triton import sparse_update
from pallas_emb.kernels import common
from pallas_emb.kernels.hparams import AdagradHParams

BF16 = test_util.BF16
F32 = np.float32
INT32_MAX = np.iinfo(np.int32).max
# The kernel backends under test: interpret, plus pallas on a GPU, or the one
# PALLAS_EMB_TEST_BACKEND names (the interpreter when that is "xla").
KERNEL_BACKENDS = tuple(
    b for b in test_util.backends() if b != "xla") or ("interpret",)
TRITON_CALL = "__gpu$xla.gpu.triton"


def np_round(x, dtype):
  """Rounds float32 values to `dtype` and back (identity for float32)."""
  x = np.asarray(x, F32)
  return x if np.dtype(dtype) == F32 else x.astype(BF16).astype(F32)


def np_decay_exp(x):
  """numpy model of `common.decay_exp`, op for op in float32: exp(x) =
  2**k exp(r), x = k ln2 + r, exp(r) by its degree-7 Taylor polynomial."""
  x = F32(x)
  if x < F32(-87):
    return F32(0)
  k = np.floor(x * F32(1.4426950408889634) + F32(0.5))
  r = (x - k * F32(0.693145751953125)) - k * F32(1.428606765330187e-06)
  p = F32(1 / 5040)
  for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1, 1):
    p = F32(p * r) + F32(c)
  return F32(p * np.ldexp(F32(1), int(k)))


def np_adagrad(table, row_state, last_step, tokens, grad_accum, row_sq,
               apply, step, lr, hp):
  """Row-wise Adagrad, one slot at a time, in float32 scalars."""
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
      factor = np_decay_exp(F32(-hp.accum_decay_rate) * delta)
      wd = np_decay_exp(F32(-hp.weight_decay_rate) * delta)
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


def adagrad_apply(table, row_state, last_step, unique_tokens, grad_accum,
                  row_sq, apply, step, learning_rate, *, hparams, backend,
                  config=None):
  """Row-wise Adagrad's rule through the generic sparse update (what
  `pe.RowwiseAdagrad` runs): `(table, row_state, last_step or None)`."""
  rows = (row_state,) + (() if last_step is None else (last_step,))
  table, rows, _ = kernels.sparse_update_rows(
      common.AdagradRule(hparams), table, rows, (), unique_tokens,
      grad_accum, row_sq, apply, step, (learning_rate,), emb_width=None,
      backend=backend, config=config)
  return table, rows[0], rows[1] if hparams.lazy else None


def run_adagrad(backend, args, hp, apply=True, step=9, lr=0.1, config=None,
                dispatch_config=None):
  """One update; `config` calls the kernel module, else the dispatch."""
  table, row_state, last_step, tokens, grad_accum, row_sq = args
  if config is not None:
    fn = lambda *a: adagrad_apply(*a, hparams=hp, backend=backend,
                                  config=config)
  else:
    fn = lambda *a: adagrad_apply(*a, hparams=hp, backend=backend,
                                          config=dispatch_config)
  out = jax.jit(fn)(jnp.asarray(table), jnp.asarray(row_state),
                    None if last_step is None else jnp.asarray(last_step),
                    jnp.asarray(tokens), jnp.asarray(grad_accum),
                    jnp.asarray(row_sq), jnp.asarray(apply), jnp.int32(step),
                    jnp.float32(lr))
  return tuple(None if x is None else np.asarray(x) for x in out)


def bits(x):
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


class DecayExpTest(absltest.TestCase):
  """`common.decay_exp`, the lazy decays' exp: + and x only."""

  def _arguments(self):
    grid = -np.geomspace(1e-30, 90, 20000).astype(F32)
    edges = [0.0, -0.0, -1e-38, -np.log(2) / 2, -np.log(2), -86.99, -87.0,
             -87.0001, -100.0, -1e30, -np.inf]
    return np.concatenate([grid, np.asarray(edges, F32)])

  def test_within_two_ulps_of_exp(self):
    x = self._arguments()
    got = np.asarray(jax.jit(common.decay_exp)(jnp.asarray(x)))
    normal = x >= -87
    want = np.exp(x[normal].astype(np.float64)).astype(F32)
    ulps = np.abs(got[normal].view(np.int32) - want.view(np.int32))
    self.assertLessEqual(int(ulps.max()), 2)
    np.testing.assert_array_equal(got[~normal], 0)
    self.assertEqual(got[x == 0].tolist(), [1.0, 1.0])
    self.assertTrue(np.all(np.diff(got[:20000]) <= 0))  # x decreases

  def test_matches_numpy_model_bit_for_bit(self):
    x = self._arguments()
    got = np.asarray(jax.jit(common.decay_exp)(jnp.asarray(x)))
    want = np.asarray([np_decay_exp(v) for v in x], F32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


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
    if hp.lazy or test_util.ON_GPU:
      # numpy's exp (and on GPU, XLA's and Triton's division and exp) may
      # differ from XLA:CPU's by an ulp; a bf16 table can then round one step
      # differently.
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
      config = sparse_update.SparseUpdateConfig(block_rows=4)  # a partial last block
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
    with self.assertRaisesRegex(ValueError, "block_rows must be a positive"):
      sparse_update.SparseUpdateConfig(block_rows=6)

  def test_row_sq_with_total_slot_is_accepted(self):
    hp = HPARAMS["eager_plain"]
    args = list(adagrad_inputs(0, 4, F32, False))
    with_total = args[:5] + [np.append(args[5], 123.0).astype(F32)]
    for backend in ("xla",) + KERNEL_BACKENDS:
      want = run_adagrad(backend, args, hp)
      got = run_adagrad(backend, with_total, hp)
      np.testing.assert_array_equal(bits(got[0]), bits(want[0]))

  @parameterized.product(backend=KERNEL_BACKENDS,
                         case=(("eager_decay", F32, 300, 128),
                               ("lazy_decay", BF16, 200, 64),
                               ("lazy_wd", F32, 520, None)))
  def test_wide_shards_column_blocks(self, backend, case):
    """Several column blocks (a loop inside the program), last one padded."""
    hp_name, dtype, width, block_cols = case
    hp = HPARAMS[hp_name]
    args = adagrad_inputs(5, width, dtype, hp.lazy)
    config = sparse_update.SparseUpdateConfig(block_rows=4, block_cols=block_cols)
    got = run_adagrad(backend, args, hp, step=6, config=config)
    if block_cols is None:  # the heuristic splits a 520-wide f32 row too
      resolved = sparse_update.resolve_config(None, len(args[3]), width)
      self.assertLess(resolved.block_cols, width)
    twin = run_adagrad("xla", args, hp, step=6)
    want = np_adagrad(*args, apply=True, step=6, lr=0.1, hp=hp)
    for g, t, w in zip(got, twin, want):
      if t is None:
        continue
      if backend == "interpret":
        np.testing.assert_array_equal(bits(g), bits(t))
      # numpy's exp may differ from XLA's by an ulp (lazy), and so may a
      # GPU's division / sqrt / exp: one bf16 step, or 1e-6 in f32.
      rtol = 1e-6 if g.dtype == F32 else 2**-7
      np.testing.assert_allclose(np.asarray(g, F32), np.asarray(w, F32),
                                 rtol=rtol, atol=1e-7)

  @absltest.skipIf(test_util.ON_GPU, test_util.CPU_ONLY)
  def test_interpret_needs_the_store_guard(self):
    """Without `common.store_offsets`, an interpreted update loses rows.

    Width 3 in a 4-column tile: the padding column of a row's lane points at
    the next row's first element. Tokens 8 then 7 in one program: the masked
    padding lane of row 7 writes the OLD value of row 8, column 0, back
    after row 8's real lane wrote it (see gather_test.MaskedStoreTest). The
    guarded kernel is bit-exact against the twin; unguarded, it is not.
    """
    hp = HPARAMS["eager_plain"]
    table, row_state, _, _, _, _ = adagrad_inputs(8, 3, F32, False)
    tokens = np.array([8, 7, 20, 21], np.int32)
    rng = np.random.default_rng(9)
    grad = rng.standard_normal((4, 3)).astype(F32)
    row_sq = (grad.astype(np.float64) ** 2).sum(axis=1).astype(F32)
    args = (table, row_state, None, tokens, grad, row_sq)
    config = sparse_update.SparseUpdateConfig(block_rows=4, block_cols=4)
    twin = run_adagrad("xla", args, hp)
    guarded = run_adagrad("interpret", args, hp, config=config)
    np.testing.assert_array_equal(bits(guarded[0]), bits(twin[0]))
    with mock.patch.object(common, "store_offsets",
                           lambda offsets, mask, size, interpret: offsets):
      unguarded = run_adagrad("interpret", args, hp, config=config)
    self.assertFalse(np.array_equal(unguarded[0][8], twin[0][8]))
    np.testing.assert_array_equal(unguarded[0][8, 0], table[8, 0])  # stale

  def test_dispatch_passes_config(self):
    hp = HPARAMS["lazy_decay"]
    args = adagrad_inputs(2, 6, F32, True)
    config = sparse_update.SparseUpdateConfig(block_rows=2, block_cols=2, num_warps=1)
    via_dispatch = run_adagrad("interpret", args, hp, dispatch_config=config)
    direct = run_adagrad("interpret", args, hp, config=config)
    for a, b in zip(via_dispatch, direct):
      np.testing.assert_array_equal(bits(a), bits(b))

  def test_config_checks(self):
    with self.assertRaisesRegex(ValueError, "block_rows must be a positive "
                                "power of two, got 6"):
      sparse_update.SparseUpdateConfig(block_rows=6)
    with self.assertRaisesRegex(ValueError, "tile 64 x 512"):
      sparse_update.SparseUpdateConfig(block_rows=64, block_cols=512)

  @parameterized.product(width=(1, 3, 8, 64, 128, 512, 4096),
                         num_unique=(1, 5000, 262145))
  def test_heuristic_tiles_fit(self, width, num_unique):
    """<= 1024 f32 per tile: with 4 warps, at most 8 elements per thread."""
    c = sparse_update.resolve_config(None, num_unique, width)
    self.assertLessEqual(c.block_rows * c.block_cols, 1024)
    self.assertLessEqual(c.block_rows * c.block_cols // (32 * c.num_warps), 8)
    self.assertLessEqual(c.block_cols, common.next_pow2(width))

  def test_int32_checks(self):
    hp = HPARAMS["eager_plain"]
    fn = functools.partial(adagrad_apply, hparams=hp,
                           backend="triton")
    sds = jax.ShapeDtypeStruct
    def args(vocab_rows, num_unique, width):
      return (sds((vocab_rows, width), jnp.bfloat16),
              sds((vocab_rows,), jnp.float32), None,
              sds((num_unique,), jnp.int32),
              sds((num_unique, width), jnp.float32),
              sds((num_unique,), jnp.float32), True, 1, 0.1)
    with self.assertRaisesRegex(ValueError, r"adagrad: table shard "
                                r"\(134217728, 16\)"):
      jax.eval_shape(fn, *args(2**27, 8, 16))
    with self.assertRaisesRegex(ValueError, r"adagrad: grad_accum "
                                r"\(33554432, 64\)"):
      jax.eval_shape(fn, *args(1000, 2**25, 64))

  @parameterized.parameters((12, jnp.bfloat16, "lazy_decay"),
                            (3, jnp.float32, "eager_decay"),
                            (130, jnp.bfloat16, "eager_plain"),
                            (1000, jnp.float32, "lazy_wd"))
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
    fn = lambda *a: adagrad_apply(*a, hparams=hp, backend="triton")
    text = jax.jit(fn, donate_argnums=(0, 1, 2)).trace(*specs).lower(
        lowering_platforms=("cuda",)).as_text()
    self.assertIn(TRITON_CALL, text)
    self.assertIn("output_operand_aliases", text)

  @parameterized.product(dtype=(jnp.float32, jnp.bfloat16),
                         hp_name=("eager_decay", "lazy_decay"))
  @absltest.skipIf(test_util.ON_GPU, test_util.CPU_ONLY)
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
    fn = lambda *a: adagrad_apply(*a, hparams=hp, backend="xla")
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
