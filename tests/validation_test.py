"""make_context and the per-call checks: every rule and its message."""

import re

import test_util  # pylint: disable=unused-import  (sets up 8 CPU devices)

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import pallas_emb as pe
from pallas_emb import validation

mesh = test_util.mesh


def _ctx(m, table_axis, **kw):
  args = dict(tokens_per_batch=16, emb_width=8, num_unique=17)
  args.update(kw)
  return pe.make_context(m, table_axis, **args)


class MakeContextTest(parameterized.TestCase):

  def test_fields(self):
    ctx = _ctx(mesh({"x": 4}), "x", emb_width=12, tokens_per_batch=32,
               num_devices_per_node=4)
    self.assertEqual(ctx.table_axis, ("x",))
    self.assertEqual(ctx.data_axis, ("x",))
    self.assertEqual(ctx.group_size, 4)
    self.assertEqual(ctx.tokens_per_rank, 8)
    self.assertEqual(ctx.shard_width, 3)
    self.assertEqual(ctx.emb_width, 12)
    self.assertEqual(ctx.num_unique, 17)
    self.assertEqual(ctx.num_devices_per_node, 4)
    # Frozen and hashable: usable as a static jit argument.
    hash(ctx)
    with self.assertRaises(Exception):
      ctx.emb_width = 4  # pytype: disable=attribute-error
    f = jax.jit(lambda c, x: x * c.group_size, static_argnums=0)
    self.assertEqual(int(f(ctx, jnp.int32(2))), 8)

  def test_two_axis_communicator(self):
    ctx = _ctx(mesh({"a": 2, "b": 4}), ("b", "a"), data_axis=("a", "b"))
    self.assertEqual(ctx.group_size, 8)
    self.assertEqual(ctx.table_axis, ("b", "a"))
    self.assertEqual(ctx.shard_width, 1)

  def test_size_one_extra_data_axis_is_fine(self):
    m = mesh({"x": 4, "r": 1})
    ctx = _ctx(m, "x", data_axis=("x", "r"))
    self.assertEqual(ctx.group_size, 4)
    self.assertTrue(pe.single_shard_per_rank(m, ("x",), ("x", "r")))

  def test_rule1_axis_not_in_mesh(self):
    m = mesh({"x": 4})
    with self.assertRaisesRegex(
        ValueError,
        "^" + re.escape(f"pallas_emb axis 'y' is not a mesh axis of {m}")):
      _ctx(m, "y", data_axis=("x",))
    with self.assertRaisesRegex(
        ValueError, re.escape(f"pallas_emb axis 'z' is not a mesh axis of {m}")):
      _ctx(m, "x", data_axis=("x", "z"))

  def test_rule2_table_axis_missing_from_data_axis(self):
    m = mesh({"x": 2, "y": 4})
    with self.assertRaisesRegex(
        ValueError, "^" + re.escape(
            "pallas_emb requires token shards to vary across the "
            "communicator: table_axis ['y'] missing from data_axis ('x',)")):
      _ctx(m, ("x", "y"), data_axis=("x",))
    # The reference prints the missing axes as a list, whatever their count.
    with self.assertRaisesRegex(
        pe.ShardingError, re.escape("table_axis ['x', 'y'] missing from "
                                    "data_axis ('z',)")):
      _ctx(mesh({"x": 2, "y": 2, "z": 2}), ("x", "y"), data_axis=("z",))

  def test_rule3_replica_axis_in_data_axis_only(self):
    # The commonest mistake: scaling out with a data-parallel axis.
    m = mesh({"replica": 2, "x": 4})
    expected = ("pallas_emb requires exactly one token shard per "
                "communicator rank: data_axis ('replica', 'x') shards tokens "
                "over 2 positions outside table_axis ('x',)")
    with self.assertRaisesRegex(ValueError, "^" + re.escape(expected)) as cm:
      _ctx(m, "x", data_axis=("replica", "x"))
    self.assertIn("replica_axis", str(cm.exception))  # the remedy
    with self.assertRaisesRegex(ValueError, "^" + re.escape(expected)):
      pe.check_single_shard_per_rank(m, ("x",), ("replica", "x"))
    self.assertFalse(pe.single_shard_per_rank(m, ("x",), ("replica", "x")))
    self.assertTrue(pe.single_shard_per_rank(m, ("x",), ("x",)))
    pe.check_single_shard_per_rank(m, ("x",), ("x",))

  def test_rule4_uneven_tokens(self):
    with self.assertRaisesRegex(
        ValueError, "^" + re.escape(
            "pallas_emb tokens_per_batch=10 does not shard evenly over the "
            "4-rank communicator")):
      _ctx(mesh({"x": 4}), "x", tokens_per_batch=10)

  def test_rule5_uneven_width(self):
    with self.assertRaisesRegex(
        ValueError, "^" + re.escape(
            "pallas_emb emb_width=6 does not shard evenly over the 4-rank "
            "communicator")):
      _ctx(mesh({"x": 4}), "x", emb_width=6)

  def test_rules_apply_in_order(self):
    # Both rule 3 and rule 4 are broken: rule 3 is reported.
    m = mesh({"replica": 2, "x": 4})
    with self.assertRaisesRegex(ValueError, "exactly one token shard"):
      _ctx(m, "x", data_axis=("replica", "x"), tokens_per_batch=10)

  @parameterized.parameters(
      dict(tokens_per_batch=0), dict(emb_width=-8), dict(num_unique=0),
      dict(num_unique=2.5), dict(num_devices_per_node=0),
      dict(tokens_per_batch=True))
  def test_non_positive_sizes(self, **kw):
    name = next(iter(kw))
    with self.assertRaisesRegex(pe.InputError, f"pallas_emb {name}=.*positive"):
      _ctx(mesh({"x": 2}), "x", **kw)

  def test_not_a_mesh(self):
    with self.assertRaisesRegex(pe.InputError, "needs a jax.sharding.Mesh"):
      _ctx(jax.devices(), "x")

  def test_padding_id(self):
    self.assertEqual(_ctx(mesh({"x": 2}), "x").padding_id, 0)  # reference's
    self.assertIsNone(_ctx(mesh({"x": 2}), "x", padding_id=None).padding_id)
    self.assertEqual(_ctx(mesh({"x": 2}), "x", padding_id=-1).padding_id, -1)
    with self.assertRaisesRegex(pe.InputError, "padding_id='0' must be an "
                                "int id or None"):
      _ctx(mesh({"x": 2}), "x", padding_id="0")

  def test_error_family(self):
    # One base class; layout rules are ShardingErrors, the rest are not.
    self.assertTrue(issubclass(pe.ShardingError, pe.Error))
    self.assertTrue(issubclass(pe.InputError, pe.Error))
    self.assertTrue(issubclass(pe.Error, ValueError))
    for cls in (pe.HyperParameterError, pe.UniqueOverflowError,
                pe.IdOutOfRangeError, pe.PipelineMisuse, pe.CheckpointError):
      self.assertTrue(issubclass(cls, pe.Error), cls)
      self.assertFalse(issubclass(cls, pe.ShardingError), cls)

  def test_axis_named_twice(self):
    with self.assertRaisesRegex(ValueError, "names an axis twice"):
      _ctx(mesh({"x": 2}), ("x", "x"))

  def test_replica_axis_overlap(self):
    with self.assertRaisesRegex(ValueError, "overlaps"):
      _ctx(mesh({"x": 2}), "x", replica_axis="x")


class CallChecksTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.ctx = _ctx(mesh({"x": 4}), "x")

  def test_table_shape_and_dtype(self):
    with self.assertRaisesRegex(
        pe.InputError, re.escape("table has shape (10, 6); expected "
                                 "[vocab_rows, 8]")):
      validation.check_table(self.ctx, jnp.zeros((10, 6)))
    with self.assertRaisesRegex(pe.InputError, "table has dtype int32"):
      validation.check_table(self.ctx, jnp.zeros((10, 8), jnp.int32))

  def test_table_sharding(self):
    wrong = jax.device_put(jnp.zeros((16, 8)),
                           jax.sharding.NamedSharding(
                               self.ctx.mesh, jax.sharding.PartitionSpec("x")))
    with self.assertRaisesRegex(pe.ShardingError, "expected its columns over "
                                "table_axis"):
      validation.check_table(self.ctx, wrong)
    validation.check_table(
        self.ctx, jax.device_put(jnp.zeros((16, 8)),
                                 pe.table_sharding(self.ctx)))

  def test_token_ids(self):
    with self.assertRaisesRegex(pe.InputError, "token_ids has dtype float32; "
                                "expected int32"):
      validation.check_token_ids(self.ctx, jnp.zeros((16,)))
    with self.assertRaisesRegex(pe.InputError, re.escape(
        "token_ids has shape (8,) (8 ids); expected tokens_per_batch=16")):
      validation.check_token_ids(self.ctx, jnp.zeros((8,), jnp.int32))
    with self.assertRaisesRegex(pe.ShardingError, "^" + re.escape(
        "pallas_emb tokens_per_batch=2 does not shard evenly over the 4-rank "
        "communicator (token_ids has shape (2, 8))")):
      validation.check_token_ids(self.ctx, jnp.zeros((2, 8), jnp.int32))
    validation.check_token_ids(self.ctx, jnp.zeros((4, 4), jnp.int32))

  def test_as_ids(self):
    self.assertEqual(validation.as_ids([1, 2, 3]).dtype, jnp.int32)
    self.assertEqual(validation.as_ids(jnp.arange(3, dtype=jnp.uint8)).dtype,
                     jnp.int32)
    with self.assertRaisesRegex(pe.InputError, "dtype float32; expected "
                                "integer ids"):
      validation.as_ids(jnp.zeros(3))
    with self.assertRaisesRegex(pe.InputError, "outside int32"):
      validation.as_ids([2**31])
    with self.assertRaisesRegex(pe.InputError, "dtype <U1; expected integer"):
      validation.as_ids(["a"])

  def test_backend(self):
    with self.assertRaisesRegex(pe.InputError, "backend='cuda' is not one of"):
      validation.resolve_backend(self.ctx, "cuda")
    self.assertEqual(validation.resolve_backend(self.ctx, None), "xla")



class WideIdsTest(parameterized.TestCase):
  """Ids of an integer dtype wider than int32 never wrap onto a real row."""

  INT32_MAX = 2**31 - 1

  @parameterized.parameters(2**32 - 1, 2**31 + 5, 2**31)
  def test_concrete_uint32_outside_int32_raises(self, value):
    ids = jnp.full(8, value, jnp.uint32)
    with self.assertRaisesRegex(pe.InputError, "^" + re.escape(
        f"pallas_emb token_ids holds ids in [{value}, {value}], outside "
        "int32; hash or remap ids into the table's range first.")):
      validation.as_ids(ids)

  def test_concrete_uint32_inside_int32_is_cast(self):
    values = np.array([0, 5, 63, 2**31 - 1], np.uint32)
    out = validation.as_ids(jnp.asarray(values))
    self.assertEqual(out.dtype, jnp.int32)
    np.testing.assert_array_equal(np.asarray(out), values.astype(np.int64))

  def test_traced_uint32_outside_int32_is_outside_every_table(self):
    values = np.array([0, 7, 2**31 - 1, 2**31, 2**31 + 5, 2**32 - 1],
                      np.uint32)
    out = jax.jit(validation.as_ids)(jnp.asarray(values))
    want = np.where(values.astype(np.int64) > self.INT32_MAX, self.INT32_MAX,
                    values.astype(np.int64))
    self.assertEqual(out.dtype, jnp.int32)
    np.testing.assert_array_equal(np.asarray(out), want)

  def test_int64_ids_with_x64(self):
    values = np.array([-2**40, -2**31, -3, 9, 2**31 - 1, 2**31, 2**40],
                      np.int64)
    with jax.enable_x64(True):
      ids = jnp.asarray(values)
      self.assertEqual(ids.dtype, jnp.int64)
      with self.assertRaisesRegex(pe.InputError, re.escape(
          f"holds ids in [{-2**40}, {2**40}], outside int32")):
        validation.as_ids(ids)
      out = np.asarray(jax.jit(validation.as_ids)(ids))
    outside = (values < -2**31) | (values > self.INT32_MAX)
    np.testing.assert_array_equal(
        out, np.where(outside, self.INT32_MAX, values))

  def test_bool_ids_raise(self):
    for ids in ([True, False], np.array([True]), jnp.array([True, False])):
      with self.assertRaisesRegex(pe.InputError, "dtype bool; expected "
                                  "integer ids"):
        validation.as_ids(ids)

  def test_traced_uint32_max_neither_trains_nor_moves_a_row(self):
    """`2**32 - 1` is an id past the table, not -1 wrapped onto the last
    row: lookup clamps it (the last row's values), the update skips it,
    and count_out_of_range counts it."""
    vocab, width = 64, 8
    ctx = pe.make_context(mesh({"x": 4}), "x", tokens_per_batch=8,
                          emb_width=width, num_unique=9)
    table = jax.device_put(
        jnp.arange(vocab * width, dtype=jnp.float32).reshape(vocab, width),
        pe.table_sharding(ctx))
    opt = pe.Sgd(0.5)
    ids = jnp.full(8, 2**32 - 1, jnp.uint32)

    @jax.jit
    def step(table, opt_state, ids):
      emb = pe.lookup(ctx, table, ids)
      dd = pe.dedup(ctx, ids, vocab_rows=vocab)
      new_table, _, stats = pe.apply_gradients(
          ctx, opt, table, opt_state, jnp.ones_like(emb), dd)
      return emb, new_table, stats, pe.count_out_of_range(
          validation.as_ids(ids), vocab)

    emb, new_table, _, count = step(table, opt.init(ctx, table), ids)
    np.testing.assert_array_equal(np.asarray(emb),
                                  np.tile(np.asarray(table)[-1], (8, 1)))
    np.testing.assert_array_equal(np.asarray(new_table), np.asarray(table))
    self.assertEqual(int(count), 8)
    with self.assertRaisesRegex(pe.InputError, "outside int32"):
      pe.lookup(ctx, table, ids)  # concrete: checked before tracing


if __name__ == "__main__":
  absltest.main()
