"""Serving states (`coll.quantize`) against a numpy model of the format.

`coll.lookup(coll.quantize(state, dtype), batch)` must equal a float32
numpy model bit for bit: the rows quantized as FBGEMM's row-wise int8
(`quantize_test.np_quantize`), read back as `codes * scale + bias`, or cast
to bf16 / f16; a sequence id reads the row of its id wrapped once and
clamped into its table; a bag sums `weight * row` in entry order in f32
with the combiner's weights (`sum` / `mean` / `sqrtn`, padding 0), rounded
once to the output dtype (f32 for int8). Also: the int8 error bound, the
checks, a checkpoint round trip, and an export loaded in a fresh process.
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import pallas_emb as pe
from pallas_emb import checkpoint
from pallas_emb import export
from pallas_emb import placement as placement_lib
from pallas_emb import quantize
from pallas_emb.state import ServingState
from pallas_emb.testing import hlo
import numpy_model
import quantize_test

F32 = np.float32
U = quantize_test.U
BATCH = 16
CASTS = {"bfloat16": test_util.BF16, "float16": np.float16}


# Per table (items, genre, tags): every placement, mixed.
MIXED = ("row", "table", "replicated")


def tables(placements=("column",) * 3):
  opt = pe.Sgd(0.1)
  items, genre, tags = placements
  return [pe.TableSpec("items", 40, 16, optimizer=opt, padding_id=0,
                       placement=items),
          pe.TableSpec("genre", 12, 8, optimizer=opt, placement=genre),
          pe.TableSpec("tags", 10, 8, optimizer=opt, dtype=jnp.bfloat16,
                       placement=tags)]


def features():
  return [pe.FeatureSpec("item", table="items"),
          pe.FeatureSpec("history", table="items"),
          pe.FeatureSpec("g_sum", table="genre", combiner="sum",
                         weighted=True),
          pe.FeatureSpec("g_mean", table="genre", combiner="mean"),
          pe.FeatureSpec("i_sqrtn", table="items", combiner="sqrtn"),
          pe.FeatureSpec("tags", table="tags", combiner="mean")]


def make_collection(ranks, backend, placements=("column",) * 3):
  return pe.EmbeddingCollection(tables(placements), features(),
                                test_util.mesh({"x": ranks}), "x",
                                backend=backend)


def host_tables():
  """Random rows plus edge rows: constant rows (max == min: scale 0), a
  zero row, a row far from zero with a tiny range."""
  rng = np.random.default_rng(0)
  out = {}
  for spec in tables():
    t = rng.standard_normal((spec.vocab_rows, spec.emb_width)).astype(F32)
    t[1] = 0.75
    t[2] = 0.0
    t[3] = 1000.0 + np.linspace(0, 1e-3, spec.emb_width, dtype=F32)
    out[spec.name] = t.astype(spec.dtype)
  return out


def make_batch():
  rng = np.random.default_rng(1)
  weights = rng.integers(0, 9, (BATCH, 4)).astype(F32) / 4  # 0 .. 2, exact
  return {
      # Negative ids wrap once, ids past the table clamp, 0 is padding.
      "item": np.arange(-48, 48, 6, dtype=np.int32),
      "history": rng.integers(-45, 45, (BATCH, 3)).astype(np.int32),
      "g_sum": pe.Bag(rng.integers(0, 12, (BATCH, 4)).astype(np.int32),
                      weights=weights),
      "g_mean": pe.Bag(rng.integers(0, 12, (BATCH, 4)).astype(np.int32),
                       lengths=rng.integers(0, 5, BATCH).astype(np.int32)),
      "i_sqrtn": rng.integers(0, 6, (BATCH, 3)).astype(np.int32),
      "tags": rng.integers(0, 10, (BATCH, 2)).astype(np.int32),
  }


def np_served_table(table, dtype):
  """The f32 rows a serving copy of `table` reads back as."""
  if dtype == "int8":
    return quantize_test.np_dequantize(*quantize_test.np_quantize(table))
  return np.asarray(table).astype(CASTS[dtype]).astype(F32)


def np_rows(ids, vocab):
  return numpy_model.wrap_clamp(ids, vocab)


def np_combiner_weights(bag, combiner, padding_id, vocab):
  if isinstance(bag, pe.Bag):
    ids = np.asarray(bag.ids)
    if bag.weights is not None:
      w = np.asarray(bag.weights, F32)
    else:
      w = (np.arange(ids.shape[1])[None] < np.asarray(bag.lengths)[:, None]
           ).astype(F32)
  else:
    ids = np.asarray(bag)
    w = np.ones(ids.shape, F32)
  w = np.where(numpy_model.resolve(ids, vocab, padding_id)[2], F32(0), w)
  if combiner == "sum":
    return ids, w
  total = (w.sum(1, keepdims=True, dtype=F32) if combiner == "mean" else
           np.sqrt((w * w).sum(1, keepdims=True, dtype=F32)))
  total = np.where(total != 0, total, F32(1))
  return ids, np.where(w != 0, w / total, F32(0)).astype(F32)


def np_lookup(host, batch, dtype):
  """`{feature: embeddings}` of the serving copy, in float32 numpy."""
  specs = {t.name: t for t in tables()}
  out_dtype = F32 if dtype == "int8" else CASTS[dtype]
  out = {}
  for f in features():
    spec = specs[f.table]
    served = np_served_table(host[f.table], dtype)
    if f.combiner is None:
      out[f.name] = served[np_rows(batch[f.name], spec.vocab_rows)].astype(
          out_dtype)
      continue
    ids, w = np_combiner_weights(batch[f.name], f.combiner, spec.padding_id,
                                 spec.vocab_rows)
    rows = np_rows(ids, spec.vocab_rows)
    acc = np.zeros((ids.shape[0], spec.emb_width), F32)
    for k in range(ids.shape[1]):
      acc = acc + w[:, k:k + 1] * served[rows[:, k]]
    out[f.name] = acc.astype(out_dtype)
  return out


class ServingTest(parameterized.TestCase):

  def state(self, coll):
    return coll.state_from_arrays(host_tables())

  @parameterized.named_parameters(
      (f"_{dtype}_{backend}_{ranks}ranks", ranks, backend, dtype)
      for ranks in (1, 8) for backend in ("xla", "interpret")
      for dtype in ("int8", "bfloat16", "float16"))
  def test_lookup_matches_numpy_model(self, ranks, backend, dtype):
    coll = make_collection(ranks, backend)
    serving = coll.quantize(self.state(coll), dtype)
    self.assertIsInstance(serving, ServingState)
    self.assertEqual((serving.dtype, serving.fingerprint),
                     (dtype, coll.plan.fingerprint))
    batch = make_batch()
    got = coll.lookup(serving, batch)
    want = np_lookup(host_tables(), batch, dtype)
    self.assertEqual(sorted(got), sorted(want))
    for name in want:
      test_util.assert_bits_equal(self, got[name], want[name], name)

  @parameterized.named_parameters(
      (f"_{dtype}_{backend}_{ranks}ranks_{'_'.join(p)}", ranks, backend,
       dtype, p)
      for ranks in (1, 2, 8)
      for backend, dtype, p in (
          ("xla", "int8", MIXED), ("xla", "bfloat16", MIXED),
          ("xla", "float16", MIXED), ("xla", "int8", ("table", "column",
                                                      "row")),
          ("interpret", "int8", MIXED))
      if backend == "xla" or ranks > 1)
  def test_every_placement_matches_numpy_model(self, ranks, backend, dtype,
                                               placements):
    """Row, table and replicated stacks (mixed with column) serve the
    numpy model's dequantized / cast rows, bit for bit; each serving array
    lies where its stack's table does (scale and bias with its rows)."""
    coll = make_collection(ranks, backend, placements)
    state = self.state(coll)
    serving = coll.quantize(state, dtype)
    for stack in coll.plan.stacks:
      table = state.stacks[stack.name].table
      served = serving.stacks[stack.name]
      codes = served.codes if dtype == "int8" else served
      self.assertTrue(codes.sharding.is_equivalent_to(table.sharding, 2))
      if dtype == "int8":
        rows = quantize.rows_spec(coll.stack_sharding(stack).spec)
        for x in (served.scale, served.bias):
          self.assertEqual(x.sharding.spec, rows, stack.placement)
    batch = make_batch()
    got = coll.lookup(serving, batch)
    want = np_lookup(host_tables(), batch, dtype)
    for name in want:
      test_util.assert_bits_equal(self, got[name], want[name], name)

  def test_every_placement_over_a_replica_axis(self):
    """Serving copies of a mixed collection kept whole on two replicas of
    four ranks serve the numpy model too."""
    coll = pe.EmbeddingCollection(tables(MIXED), features(),
                                  test_util.mesh({"r": 2, "x": 4}), "x",
                                  replica_axis="r", backend="xla")
    serving = coll.quantize(self.state(coll), "int8")
    batch = make_batch()
    got = coll.lookup(serving, batch)
    want = np_lookup(host_tables(), batch, "int8")
    for name in want:
      test_util.assert_bits_equal(self, got[name], want[name], name)

  def test_int8_rows_travel_fused(self):
    """A row stack's owner sends int8 rows as fused uint8 rows (codes, then
    scale and bias: D + 8 bytes), not as f32."""
    spec = pe.TableSpec("t", 40, 16, optimizer=None, placement="row")
    coll = pe.EmbeddingCollection([spec], [pe.FeatureSpec("f", "t")],
                                  test_util.mesh({"x": 4}), "x",
                                  backend="xla")
    serving = coll.quantize(test_util.random_state(coll, 0), "int8")
    batch = {"f": np.arange(12, dtype=np.int32)}  # 3 ids per rank: C = 3
    text = jax.jit(coll.lookup).lower(serving, batch).compile().as_text()
    found = hlo.collective_bytes(text, 4)
    self.assertEqual((found["all-to-all"]["count"],
                      found["all-to-all"]["operand_bytes"]),
                     (2, 4 * 3 * 4 + 4 * 3 * (16 + 8)), str(found))

  @parameterized.parameters(("int8", ("column", "row", "replicated")),
                            ("bfloat16", ("table", "column", "row")))
  def test_jax_grad_through_a_serving_lookup(self, dtype, placements):
    """Gradients w.r.t. the serving copies: per table, the dense cotangent
    G of the rows read (every entry that trains adds its embedding's
    cotangent times its combiner weight); an int8 row's scale gets
    sum(codes * G), its bias sum(G); a cast copy gets G."""
    coll = make_collection(2, "xla", placements)
    serving = coll.quantize(self.state(coll), dtype)
    batch = make_batch()
    rng = np.random.default_rng(7)
    out_dtype = F32 if dtype == "int8" else CASTS[dtype]
    cts = {k: rng.standard_normal(v.shape).astype(out_dtype)
           for k, v in coll.lookup(serving, batch).items()}

    def loss(stacks):
      out = coll.lookup(dataclasses.replace(serving, stacks=stacks), batch)
      return sum(jnp.sum(out[k].astype(F32) * cts[k].astype(F32))
                 for k in out)

    grads = jax.grad(loss, allow_int=True)(serving.stacks)
    specs = {t.name: t for t in tables(placements)}
    dense = {name: np.zeros((t.vocab_rows, t.emb_width), np.float64)
             for name, t in specs.items()}
    for f in features():
      spec = specs[f.table]
      ct = cts[f.name].astype(np.float64)
      if f.combiner is None:
        ids, g = np.asarray(batch[f.name]), ct
      else:
        ids, w = np_combiner_weights(batch[f.name], f.combiner,
                                     spec.padding_id, spec.vocab_rows)
        g = w[..., None] * ct[:, None, :]
      rows, trains, _ = numpy_model.resolve(ids, spec.vocab_rows,
                                            spec.padding_id)
      np.add.at(dense[f.table], rows[trains], g[trains])
    for stack in coll.plan.stacks:
      got = jax.tree.map(
          lambda x, stack=stack: placement_lib.from_physical(
              stack, test_util.as_numpy(x).astype(np.float64))
          if x.dtype != jax.dtypes.float0 else None, grads[stack.name])
      served = jax.tree.map(
          lambda x, stack=stack: placement_lib.from_physical(
              stack, test_util.as_numpy(x)), serving.stacks[stack.name])
      for i, name in enumerate(stack.tables):
        if dtype == "int8":
          self.assertEqual(grads[stack.name].codes.dtype, jax.dtypes.float0)
          codes = served.codes[i].astype(np.float64)
          want = ((codes * dense[name]).sum(1), dense[name].sum(1))
          for x, y in zip((got.scale[i], got.bias[i]), want):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5,
                                       err_msg=name)
        else:
          np.testing.assert_allclose(got[i], dense[name], rtol=2**-7,
                                     atol=1e-6, err_msg=name)

  def test_int8_sequence_error_bound(self):
    """|served - f32 lookup| <= scale / 2 + 16 u max(|min|, |max|)."""
    coll = make_collection(8, "xla")
    state = self.state(coll)
    batch = make_batch()
    served = coll.lookup(coll.quantize(state, "int8"), batch)
    exact = coll.lookup(state, batch)
    table = host_tables()["items"]
    _, scale, _ = quantize_test.np_quantize(table)
    bound = scale / 2 + 16 * U * np.abs(table).max(1)
    for name in ("item", "history"):
      rows = np_rows(batch[name], 40)
      err = np.abs(np.asarray(served[name], np.float64) -
                   np.asarray(exact[name], np.float64))
      self.assertTrue(np.all(err <= bound[rows][..., None]), name)
      # The bound is not vacuous: the int8 rows do differ from f32.
      self.assertGreater(err.max(), 0, name)

  def test_training_entry_points_refuse_a_serving_state(self):
    coll = make_collection(8, "xla")
    state = self.state(coll)
    serving = coll.quantize(state, "int8")
    batch = make_batch()
    grads = coll.lookup(state, batch)
    refused = "is a ServingState .* only coll.lookup reads"
    with self.assertRaisesRegex(pe.InputError, refused):
      coll.apply_gradients(serving, batch, grads)
    with self.assertRaisesRegex(pe.InputError, refused):
      coll.lookup_and_route(serving, batch)
    with self.assertRaisesRegex(pe.InputError, refused):
      coll.table_arrays(serving)
    with self.assertRaisesRegex(pe.InputError, "not a serving dtype"):
      coll.quantize(state, "int4")

  def test_serving_state_checks(self):
    coll = make_collection(8, "xla")
    serving = coll.quantize(self.state(coll), "int8")
    batch = make_batch()
    other = pe.EmbeddingCollection(
        tables()[:2], features()[:5], coll.mesh, "x", backend="xla")
    with self.assertRaisesRegex(pe.InputError, "serving state has stacks"):
      other.lookup(serving, batch)
    foreign = ServingState(serving.stacks, "int8", "0123456789abcdef")
    with self.assertRaisesRegex(pe.InputError, "made by another collection"):
      coll.lookup(foreign, batch)
    cast = coll.quantize(self.state(coll), "bfloat16")
    mixed = ServingState(cast.stacks, "int8", coll.plan.fingerprint)
    with self.assertRaisesRegex(pe.InputError, r"stack0 is None; the plan "
                                r"and dtype 'int8' say"):
      coll.lookup(mixed, batch)
    short = dict(serving.stacks)
    short["stack0"] = quantize.QuantizedRows(
        *(x[:20] for x in serving.stacks["stack0"]))
    with self.assertRaisesRegex(pe.InputError, r"\('uint8', \(20, 16\)\)"):
      coll.lookup(ServingState(short, "int8", coll.plan.fingerprint), batch)

  @parameterized.parameters(("int8", ("column",) * 3),
                            ("bfloat16", ("column",) * 3), ("int8", MIXED))
  def test_checkpoint_round_trip(self, dtype, placements):
    coll = make_collection(8, "xla", placements)
    serving = coll.quantize(self.state(coll), dtype)
    directory = tempfile.mkdtemp(prefix="pallas_emb_serving_")
    checkpoint.save(directory, serving, step=3)
    coll4 = make_collection(4, "xla", placements)
    if placements == MIXED:
      # Row and table stacks place their rows by the rank count (items:
      # 40 rows, as many over 4 ranks as over 8, in another order).
      with self.assertRaisesRegex(
          pe.CheckpointError,
          r"laid out as \['stack0_ranks8', 'stack1_ranks8'\].* as "
          r"\['stack0_ranks4', 'stack1_ranks4'\]"):
        checkpoint.restore_serving(directory, coll4, dtype)
      coll4 = make_collection(8, "xla", placements)
    # Restored onto another mesh (4 ranks) of the same tables.
    back = checkpoint.restore_serving(directory, coll4, dtype)
    self.assertEqual((back.dtype, back.fingerprint),
                     (dtype, coll4.plan.fingerprint))
    batch = make_batch()
    want = coll.lookup(serving, batch)
    got = coll4.lookup(back, batch)
    for name in want:
      test_util.assert_bits_equal(self, got[name],
                                  test_util.as_numpy(want[name]), name)
    other = "bfloat16" if dtype == "int8" else "int8"
    with self.assertRaisesRegex(
        pe.CheckpointError, rf"holds an? {dtype} serving state .*, not an? "
        rf"{other} serving state; restore it with dtype='{dtype}'"):
      checkpoint.restore_serving(directory, coll, other)



# Unservable rows: every placement in one collection, two tables per stack
# (so that a stack's physical rows are not a table's logical rows).
PLACEMENTS = ("column", "row", "table", "replicated")
BAD_ROWS = {7: np.nan, 12: np.inf, 13: -np.inf}  # at columns 1, 5, 6
SPAN_ROW = 17  # 3e38 and -3e38: max - min overflows float32


def unservable_collection(ranks, explicit):
  specs = [pe.TableSpec(f"{p}{i}", 20 + 10 * i, 8, optimizer=None,
                        placement=p) for p in PLACEMENTS for i in (1, 2)]
  return pe.EmbeddingCollection(
      specs, [pe.FeatureSpec(t.name, t.name) for t in specs],
      test_util.mesh({"x": ranks}, explicit=explicit), "x", backend="xla")


def unservable_tables(coll, bad):
  """Random logical tables; the second table of each placement with `bad`
  values (`{row: value}`) at columns 1, 5 and 6 in turn."""
  rng = np.random.default_rng(3)
  out = {}
  for name, spec in coll.tables.items():
    t = rng.standard_normal((spec.vocab_rows, spec.emb_width)).astype(F32)
    if name.endswith("2"):
      for (row, value), column in zip(bad.items(), (1, 5, 6)):
        t[row, column] = value
    out[name] = t
  return out


class UnservableRowsTest(parameterized.TestCase):
  """`coll.quantize` names every logical row a serving copy cannot hold,
  on every placement, both mesh kinds and 1, 2 or 8 ranks; the rows it
  serves are the numpy model's."""

  @parameterized.product(ranks=(1, 2, 8), explicit=(False, True))
  def test_int8_names_every_bad_row_of_every_table(self, ranks, explicit):
    coll = unservable_collection(ranks, explicit)
    host = unservable_tables(coll, BAD_ROWS)
    for p in PLACEMENTS:
      host[f"{p}2"][SPAN_ROW, [2, 3]] = 3e38, -3e38
    state = coll.state_from_arrays(host)
    with self.assertRaises(pe.InputError) as raised:
      coll.quantize(state, "int8")
    message = str(raised.exception)
    self.assertIn(f"{4 * 4} table rows cannot be served as int8", message)
    for p in PLACEMENTS:
      self.assertIn(f"table '{p}2' rows [7, 12, 13]: a NaN or an infinity",
                    message)
      self.assertIn(f"table '{p}2' row 17: max - min overflows float32",
                    message)
      self.assertNotIn(f"'{p}1'", message)

  @parameterized.product(ranks=(2, 8), explicit=(False, True))
  def test_int8_rows_of_every_placement_match_numpy_model(self, ranks,
                                                          explicit):
    """Finite tables: scale and bias equal the numpy model's bit for bit,
    and every value reads back within scale / 2 (+ f32 rounding)."""
    coll = unservable_collection(ranks, explicit)
    host = unservable_tables(coll, {})
    serving = coll.quantize(coll.state_from_arrays(host), "int8")
    for stack in coll.plan.stacks:
      served = [placement_lib.from_physical(stack, test_util.as_numpy(x))
                for x in serving.stacks[stack.name]]
      for name, codes, scale, bias in zip(stack.tables, *served):
        want_codes, want_scale, want_bias = quantize_test.np_quantize(
            host[name])
        test_util.assert_bits_equal(self, scale, want_scale, name)
        test_util.assert_bits_equal(self, bias, want_bias, name)
        test_util.assert_bits_equal(self, codes, want_codes, name)
        back = quantize_test.np_dequantize(codes, scale, bias)
        x = host[name].astype(np.float64)
        bound = (want_scale[:, None] / 2 +
                 16 * U * np.abs(x).max(1, keepdims=True))
        self.assertTrue(np.all(np.abs(back - x) <= bound), name)

  @parameterized.product(ranks=(1, 8), explicit=(False, True))
  def test_float16_names_values_beyond_its_range(self, ranks, explicit):
    """1e5 would be served as inf by float16: an error naming the rows;
    bfloat16 holds it, and NaN / inf stay what they are in a cast."""
    coll = unservable_collection(ranks, explicit)
    host = unservable_tables(coll, {3: 1e5, 4: -7e4, 5: np.nan})
    state = coll.state_from_arrays(host)
    with self.assertRaises(pe.InputError) as raised:
      coll.quantize(state, "float16")
    message = str(raised.exception)
    self.assertIn("8 table rows cannot be served as float16", message)
    for p in PLACEMENTS:
      self.assertIn(f"table '{p}2' rows [3, 4]: a finite value beyond "
                    "float16's range (largest 65504)", message)
    serving = coll.quantize(state, "bfloat16")
    got = test_util.as_numpy(serving.stacks[coll.plan.stacks[0].name])
    table = placement_lib.from_physical(coll.plan.stacks[0], got)[1]
    test_util.assert_bits_equal(
        self, table, host[coll.plan.stacks[0].tables[1]].astype(
            test_util.BF16))


# Runs in the fresh process: argv[1] the export, argv[2] the batch (.npz).
LOADER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import pallas_emb
    from pallas_emb import export
    served = export.load(sys.argv[1])
    with np.load(sys.argv[2]) as batch:
      out = served({k: batch[k] for k in batch.files})
    np.save(sys.argv[3], np.asarray(out))
    loaded = sorted(m for m in sys.modules
                    if m.split(".")[0] in ("flax", "optax", "orbax", "haiku"))
    print(json.dumps(loaded))
""")


class ServingLayersTest(parameterized.TestCase):
  """The Flax and Haiku EmbeddingCollection layers serve a ServingState:
  the same outputs as `lookup` on it, against the numpy model."""

  @parameterized.product(dtype=("int8", "bfloat16", "float16"),
                         placements=(("column",) * 3, MIXED))
  def test_layers_serve_quantized_tables(self, dtype, placements):
    import flax.linen as nn  # pylint: disable=g-import-not-at-top
    import haiku as hk  # pylint: disable=g-import-not-at-top
    from pallas_emb import flax as pe_flax  # pylint: disable=g-import-not-at-top
    from pallas_emb import haiku as pe_hk  # pylint: disable=g-import-not-at-top
    coll = make_collection(2, "xla", placements)
    serving = coll.quantize(coll.state_from_arrays(host_tables()), dtype)
    batch = make_batch()
    want = np_lookup(host_tables(), batch, dtype)

    class Model(nn.Module):  # a dense layer on top: params beside serving
      @nn.compact
      def __call__(self, b):
        emb = pe_flax.EmbeddingCollection(coll, name="embed")(b)
        return emb, nn.Dense(1)(emb["item"].astype(jnp.float32))

    model = Model()
    dense = {"Dense_0": {"kernel": jnp.ones((16, 1)), "bias": jnp.zeros(1)}}
    flax_out, _ = jax.jit(model.apply)(
        {"params": dense, **pe_flax.serving_variables(serving, "embed")},
        batch)
    hk_fn = hk.without_apply_rng(hk.transform(
        lambda b, s: pe_hk.EmbeddingCollection(coll, name="embed")(b, s)))
    hk_out = jax.jit(hk_fn.apply)({}, batch, serving)
    for name in want:
      test_util.assert_bits_equal(self, flax_out[name], want[name], name)
      test_util.assert_bits_equal(self, hk_out[name], want[name], name)

  def test_wrong_serving_values_are_named(self):
    from pallas_emb import flax as pe_flax  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(pe.InputError, "serving_variables got a dict;"
                                " expected a ServingState"):
      pe_flax.serving_variables({"stack0": jnp.zeros((4, 4))}, "embed")


class ServingExportTest(absltest.TestCase):

  def test_exported_scores_match_in_a_fresh_process(self):
    """A serving state of every placement (column, row, table and
    replicated stacks) exports and serves in a fresh process."""
    opt = pe.Sgd(0.1)
    coll = pe.EmbeddingCollection(
        [pe.TableSpec("users", 30, 16, optimizer=opt),
         pe.TableSpec("items", 50, 16, optimizer=opt, placement="row"),
         pe.TableSpec("ages", 7, 16, optimizer=opt, placement="table"),
         pe.TableSpec("cities", 9, 16, optimizer=opt,
                      placement="replicated")],
        [pe.FeatureSpec("user", table="users"),
         pe.FeatureSpec("item", table="items"),
         pe.FeatureSpec("history", table="items", combiner="mean"),
         pe.FeatureSpec("age", table="ages"),
         pe.FeatureSpec("city", table="cities")],
        test_util.mesh({"x": 8}), "x", backend="xla")
    train = test_util.random_state(coll, 0)
    state = {"emb": coll.quantize(train, "int8"),
             "w": jax.random.normal(jax.random.key(1), (16, 16))}

    def score(state, batch):
      emb = coll.lookup(state["emb"], batch)
      user = jnp.tanh((emb["user"] + emb["history"] + emb["age"]
                       + emb["city"]) @ state["w"])
      return jnp.sum(user * emb["item"], axis=-1)

    rng = np.random.default_rng(2)
    batch = {"user": rng.integers(0, 30, 32).astype(np.int32),
             "item": rng.integers(0, 50, 32).astype(np.int32),
             "history": rng.integers(0, 50, (32, 5)).astype(np.int32),
             "age": rng.integers(0, 7, 32).astype(np.int32),
             "city": rng.integers(0, 9, 32).astype(np.int32)}
    want = np.asarray(jax.jit(score)(state, batch))
    directory = tempfile.mkdtemp(prefix="pallas_emb_serving_export_")
    export.save(os.path.join(directory, "fn"), score, state, [(batch,)])
    np.savez(os.path.join(directory, "batch.npz"), **batch)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (test_util.ROOT, env.get("PYTHONPATH")) if p)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    out = os.path.join(directory, "scores.npy")
    proc = subprocess.run(
        [sys.executable, "-c", LOADER, os.path.join(directory, "fn"),
         os.path.join(directory, "batch.npz"), out], env=env,
        capture_output=True, text=True, timeout=300, check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr[-5000:])
    self.assertEqual(json.loads(proc.stdout.strip().splitlines()[-1]), [])
    test_util.assert_bits_equal(self, np.load(out), want)


class ServeProgramTest(absltest.TestCase):

  def test_tiny_config(self):
    """examples.serve on the tiny synthetic config, 10 steps: the fresh
    process scores the test split with every table dtype."""
    directory = tempfile.mkdtemp(prefix="pallas_emb_serve_program_")
    out = os.path.join(directory, "serve.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (test_util.ROOT, env.get("PYTHONPATH")) if p)
    env.pop("XLA_FLAGS", None)  # The program simulates its 8 devices.
    proc = subprocess.run(
        [sys.executable, "-m", "examples.serve", "--config=configs/tiny.py",
         "--num_steps=10", f"--export_dir={directory}/export",
         f"--serve_out={out}"], cwd=test_util.ROOT, env=env,
        capture_output=True, text=True, timeout=300, check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr[-5000:])
    with open(out) as f:
      figures = json.load(f)
    rmse = figures["test_rmse"]
    # The exported f32 scorer is the trained model (up to f32 sums).
    self.assertAlmostEqual(rmse["float32"], figures["trained_test_rmse"],
                           delta=1e-5)
    for dtype in ("bfloat16", "int8"):
      self.assertAlmostEqual(rmse[dtype], rmse["float32"], delta=0.01)
    # 501 user and 301 item rows of width 16 (configs/tiny.py).
    rows, width = 501 + 301, 16
    self.assertEqual(figures["table_bytes"],
                     {"float32": rows * width * 4, "bfloat16": rows * width * 2,
                      "int8": rows * width + rows * 8})
    self.assertIn("served test RMSE (fresh process", proc.stdout)


if __name__ == "__main__":
  absltest.main()
