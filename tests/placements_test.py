"""Row, table and replicated placements against the numpy model.

The model (numpy_model.py) knows nothing of placements, stacks or ranks:
every feature looks its ids up in its own logical table, and an update
step is, per table, the optimizer on the summed gradients of every entry
that trains (a pooled entry's gradient is its bag's times its combiner
weight). Owners sum a row's pieces in sender order, not in entry order, so
f32 tables after updates compare with the tolerance of reordered sums;
lookups of the current tables compare exactly, except bags pooled on
their rows' owners (per owner, then over owners in rank order: the f32
sums of another order, compared as tables after updates are).
"""

import dataclasses
import os
import re
import tempfile

import test_util

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import numpy_model
import pallas_emb as pe
from pallas_emb import checkpoint
from pallas_emb import export
from pallas_emb import flax as pe_flax
from pallas_emb import layout as layout_lib
from pallas_emb import row
from pallas_emb.testing import hlo

PLACEMENTS = ("column", "row", "table", "replicated")


def edge_ids(rng, shape, vocab):
  """Zipf-ish ids (duplicates within and across ranks) with the padding
  candidates 0 and 3, -1, -vocab (wrapped), past the end and int32
  extremes (clamped, never trained)."""
  n = int(np.prod(shape))
  ids = (np.minimum(rng.zipf(1.3, n), vocab + 3) - 1) * rng.choice([-1, 1], n)
  edges = [0, -1, vocab - 1, vocab, -vocab, -vocab - 1, 2**31 - 1, -2**31]
  k = min(len(edges), n // 3)
  ids[rng.choice(n, k, replace=False)] = edges[:k]
  return ids.reshape(shape).astype(np.int32)


def random_collection(seed, ranks, replicas=1, dedup="sort", explicit=False):
  """3-5 tables of every placement (widths 4-128, f32 / bf16, row-wise
  Adagrad or SGD, padding or not), sequence, pooled and weighted features;
  whole copies over a replica axis "r" if `replicas` > 1; a mesh of
  Explicit axes (`jax.make_mesh`'s default) if `explicit`."""
  rng = np.random.default_rng(seed)
  mesh = test_util.mesh({"r": replicas, "x": ranks} if replicas > 1
                        else {"x": ranks}, explicit=explicit)
  opts = [pe.RowwiseAdagrad(0.1), pe.Sgd(0.05)]
  tables, features, shapes = [], [], {}
  batch_size = ranks * replicas * int(rng.integers(1, 3))
  for t in range(int(rng.integers(3, 6))):
    placement = PLACEMENTS[(seed + t) % 4]
    widths = [w for w in (4, 8, 16, 32, 64, 128)
              if placement != "column" or w % ranks == 0]
    tables.append(pe.TableSpec(
        f"t{t}", int(rng.integers(5, 50)),
        int(rng.choice(widths[:3])) if rng.random() < 0.8
        else int(rng.choice(widths)),
        optimizer=opts[int(rng.integers(2))],
        dtype=[jnp.float32, jnp.bfloat16][int(rng.integers(2))],
        padding_id=[None, 0, 3][int(rng.integers(3))], placement=placement))
    for f in range(int(rng.integers(1, 3))):
      kind = int(rng.integers(3))
      combiner = None if kind == 0 else ["sum", "mean", "sqrtn"][
          int(rng.integers(3))]
      name = f"t{t}_f{f}"
      features.append(pe.FeatureSpec(name, f"t{t}", combiner=combiner,
                                     weighted=kind == 2))
      shapes[name] = ((batch_size,) if kind == 0 and rng.random() < 0.5
                      else (batch_size, int(rng.integers(1, 4))))
  coll = pe.EmbeddingCollection(tables, features, mesh, "x", backend="xla",
                                replica_axis="r" if replicas > 1 else (),
                                dedup=dedup)
  return coll, shapes, rng


def random_batch(coll, shapes, rng):
  """`(batch, {feature: (ids, weights or None)})`."""
  batch, raw = {}, {}
  for f in coll.features.values():
    ids = edge_ids(rng, shapes[f.name], coll.tables[f.table].vocab_rows)
    weights = None
    if f.weighted:
      weights = rng.choice(np.float32([0, 0.5, 1, 2]), ids.shape)
      batch[f.name] = pe.Bag(ids, weights=weights)
    else:
      batch[f.name] = ids
    raw[f.name] = (ids, weights)
  return batch, raw


class Model:
  """Per logical table, the numpy optimizer fed by all of its features."""

  def __init__(self, coll, arrays):
    self.coll = coll
    self.models = {}
    for name, table in arrays.items():
      opt = coll.tables[name].optimizer
      cls = (numpy_model.Sgd if isinstance(opt, pe.Sgd)
             else numpy_model.Adagrad)
      self.models[name] = cls(np.asarray(table), opt.learning_rate)

  def _cw(self, f, ids, weights):
    spec = self.coll.tables[f.table]
    w = np.ones(ids.shape, np.float32) if weights is None else weights
    return numpy_model.combiner_weights(ids, w, f.combiner, spec.padding_id,
                                        spec.vocab_rows)

  def lookup(self, raw):
    out = {}
    for f in self.coll.features.values():
      ids, weights = raw[f.name]
      table = self.models[f.table].table
      if f.combiner is None:
        out[f.name] = table[numpy_model.wrap_clamp(ids, table.shape[0])]
      else:
        out[f.name] = numpy_model.pool(table, ids,
                                       self._cw(f, ids, weights))
    return out

  def step(self, raw, grads):
    for name, model in self.models.items():
      spec = self.coll.tables[name]
      all_ids, all_grads = [], []
      for f in self.coll.features.values():
        if f.table != name:
          continue
        ids, weights = raw[f.name]
        g = np.asarray(grads[f.name], np.float32)
        if f.combiner is None:
          all_ids.append(ids.reshape(-1))
          all_grads.append(g.reshape(-1, g.shape[-1]))
          continue
        cw = self._cw(f, ids, weights)
        # A weight-0 entry does not train: an id outside every table.
        all_ids.append(np.where(cw != 0, ids, 2**30).reshape(-1))
        all_grads.append((g[:, None, :] * cw[:, :, None]).reshape(
            -1, g.shape[-1]))
      ids = np.concatenate(all_ids)
      model.step(ids, np.concatenate(all_grads), ids.size + 1,
                 padding_id=spec.padding_id)


def assert_tables_close(got, want, msg):
  got = test_util.as_numpy(got).astype(np.float32)
  if want.dtype == np.float32:
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6, err_msg=msg)
  else:  # f32 sums in another order: at most one bf16 rounding apart
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=2**-7,
                               atol=1e-6, err_msg=msg)


def assert_replicas_identical(test, coll, state):
  """Every device's copy of the same part of a stack (and of its state) is
  the same, bit for bit: a replicated stack's on every rank, and any
  stack's on every replica of a replica axis."""
  copies = coll.num_replicas
  for stack in coll.plan.stacks:
    for leaf in jax.tree.leaves(state.stacks[stack.name]):
      by_index = {}
      for s in leaf.addressable_shards:
        by_index.setdefault(repr(s.index), []).append(np.asarray(s.data))
      want = copies * (coll.group_size if stack.placement == "replicated"
                       or leaf.ndim == 0 else 1)
      for index, shards in by_index.items():
        if leaf.ndim and stack.placement == "column" and len(shards) != (
            want):  # row-wise state of a column stack: on every rank
          test.assertLen(shards, copies * coll.group_size)
        else:
          test.assertLen(shards, want, f"{stack.name} {index}")
        for i, shard in enumerate(shards[1:], 1):
          np.testing.assert_array_equal(
              shard.reshape(-1).view(np.uint8),
              shards[0].reshape(-1).view(np.uint8),
              err_msg=f"{stack.name} {index} copy {i}")


class SpecTest(absltest.TestCase):

  def test_bad_placements_raise(self):
    opt = pe.Sgd(0.1)
    for kw, match in (
        (dict(placement="rows"), r"placement='rows' is not a placement"),
        (dict(placement="row", rank=1), r"rank=1 is given for placement"),
        (dict(rank=0), r"rank=0 is given for placement='column'"),
        (dict(placement="table", rank=-1), r"rank=-1; expected an int"),
        (dict(max_ids_per_partition=4),
         r"only 'row' and 'table' placements"),
        (dict(placement="row", max_ids_per_partition=0),
         r"max_ids_per_partition=0 must be a positive"),
    ):
      with self.subTest(kw=kw):
        with self.assertRaisesRegex(pe.InputError,
                                    "^pallas_emb TableSpec 't' .*" + match):
          pe.TableSpec("t", 10, 8, optimizer=opt, **kw)
    tables = [pe.TableSpec("t", 10, 8, optimizer=opt, placement="table",
                           rank=4)]
    with self.assertRaisesRegex(pe.InputError,
                                r"rank=4 is outside the 4-rank"):
      pe.EmbeddingCollection(tables, [pe.FeatureSpec("f", "t")],
                             test_util.mesh({"x": 4}), "x")

  def test_single_table_api_is_column_only(self):
    """A row- or replicated-placed stack's table handed to the single-table
    API (a facade over a one-table column collection) is refused, naming
    the placements, not read as column rows."""
    mesh = test_util.mesh({"x": 4})
    ctx = pe.make_context(mesh, "x", tokens_per_batch=8, emb_width=8,
                          num_unique=9)
    for placement in ("row", "table", "replicated"):
      coll = pe.EmbeddingCollection(
          [pe.TableSpec("t", 16, 8, optimizer=pe.Sgd(0.1),
                        placement=placement)],
          [pe.FeatureSpec("f", "t")], mesh, "x")
      table = test_util.random_state(coll, 0).stacks["stack0"].table
      with self.subTest(placement=placement):
        with self.assertRaisesRegex(
            pe.ShardingError, r"single-table API holds column-placed tables "
            r"only.*TableSpec\(placement=\.\.\.\)"):
          pe.lookup(ctx, table, np.arange(8, dtype=np.int32))

  def test_stacks_group_by_placement(self):
    opt = pe.Sgd(0.1)
    tables = [pe.TableSpec(n, 10 + i, 8, optimizer=opt, placement=p)
              for i, (n, p) in enumerate([("a", "column"), ("b", "row"),
                                          ("c", "column"), ("d", "table"),
                                          ("e", "table"),
                                          ("f", "replicated")])]
    feats = [pe.FeatureSpec(t.name, t.name) for t in tables]
    coll = pe.EmbeddingCollection(tables, feats, test_util.mesh({"x": 4}),
                                  "x")
    self.assertEqual(
        [(s.placement, s.tables) for s in coll.plan.stacks],
        [("column", ("a", "c")), ("row", ("b",)), ("table", ("e", "d")),
         ("replicated", ("f",))])
    # The larger e (14 rows) on rank 0, d (13) on rank 1, in row order;
    # every block as long as the longest.
    table_stack = coll.plan.stacks[2]
    self.assertEqual(table_stack.block_rows, 14)
    self.assertEqual(table_stack.row_offsets, (0, 14))
    self.assertEqual(table_stack.total_rows, 56)
    # A width that does not split over the ranks is fine off column.
    pe.TableSpec("narrow", 10, 2, optimizer=opt, placement="row")
    other = pe.EmbeddingCollection(
        [pe.TableSpec(t.name, t.vocab_rows, 8, optimizer=opt)
         for t in tables], feats, test_util.mesh({"x": 4}), "x")
    self.assertNotEqual(coll.plan.fingerprint, other.plan.fingerprint)


class ModelCheck:
  """Lookups and three update steps of a collection against the model."""

  def _check(self, coll, shapes, rng, msg):
    state = test_util.random_state(coll, 0)
    model = Model(coll, {k: test_util.as_numpy(v)
                         for k, v in coll.table_arrays(state).items()})
    for step in range(3):
      batch, raw = random_batch(coll, shapes, rng)
      emb, routing = coll.lookup_and_route(state, batch)
      current = Model(coll, {k: test_util.as_numpy(v)
                             for k, v in coll.table_arrays(state).items()})
      want = current.lookup(raw)
      on_owner = {f.name for layout in coll.layouts(batch)
                  if layout.pool_on_owner for f in layout.features}
      for name, got in emb.items():
        if name in on_owner:
          assert_tables_close(got, want[name],
                              f"{msg}\nstep {step} lookup {name}")
          continue
        # Exact (an empty bag may pool to -0.0 on every placement).
        np.testing.assert_array_equal(
            test_util.as_numpy(got).astype(np.float32),
            np.asarray(want[name]).astype(np.float32),
            err_msg=f"{msg}\nstep {step} lookup {name}")
      grads = {name: rng.standard_normal(e.shape).astype(e.dtype)
               for name, e in emb.items()}
      model.step(raw, grads)
      state, stats = coll.apply_gradients(state, routing, grads)
      for stack_stats in stats.values():
        self.assertEqual(int(stack_stats.valid), 1, msg)
        self.assertEqual(int(stack_stats.num_overflow), 0, msg)
    for name, table in coll.table_arrays(state).items():
      assert_tables_close(table, model.models[name].table, f"{msg}\n{name}")
    assert_replicas_identical(self, coll, state)


class PlacementModelTest(ModelCheck, parameterized.TestCase):

  @parameterized.parameters((2, 4, 10), (4, 2, 13), (2, 2, 13, "slot_map"))
  def test_replica_axis(self, replicas, ranks, seed, dedup="sort"):
    """Whole copies of a mixed collection over a replica axis: every step
    sums every replica's gradients (the numpy model sees the global
    batch), and the copies stay bit-identical. With dedup="slot_map" the
    column and replicated stacks dedup through their maps."""
    coll, shapes, rng = random_collection(seed, ranks, replicas, dedup)
    self.assertEqual(
        sorted(s.placement for s in coll.plan.stacks if s.slot_map),
        [] if dedup == "sort" else ["column", "replicated"])
    self.assertEqual(sorted({s.placement for s in coll.plan.stacks}),
                     sorted(PLACEMENTS))
    self._check(coll, shapes, rng, f"seed {seed}\n{coll.plan}")

  @parameterized.parameters((2, 1), (8, 1), (2, 2))
  def test_random_collections_on_explicit_meshes(self, ranks, replicas):
    """`jax.make_mesh` gives Explicit axes: the same model check."""
    coll, shapes, rng = random_collection(ranks + 20, ranks, replicas,
                                          explicit=True)
    self.assertEqual(sorted({s.placement for s in coll.plan.stacks}),
                     sorted(PLACEMENTS))
    self._check(coll, shapes, rng, f"explicit {ranks}x{replicas}\n"
                f"{coll.plan}")

  @parameterized.parameters(1, 2, 4, 8)
  def test_random_collections(self, ranks):
    """Lookups and three update steps of random mixed collections."""
    for seed in (ranks,):
      coll, shapes, rng = random_collection(seed, ranks)
      logging.info("placements seed %d:\n%s", seed, coll.plan.describe())
      with self.subTest(seed=seed):
        self._check(coll, shapes, rng, f"seed {seed}\n{coll.plan}")


def random_pooled_collection(seed, ranks):
  """Row and table stacks of pooled features (random combiners, weights,
  widths 4-16, f32 / bf16, padding or not): bags of 2-4 ids (t0 row, t2
  table: pooled on the owners) and bags of one (t1 table: on the example's
  rank). Stacks mixing bags and sequence ids, on the example's rank, are
  `random_collection`'s."""
  rng = np.random.default_rng(seed)
  mesh = test_util.mesh({"x": ranks})
  batch_size = ranks * int(rng.integers(1, 4))
  tables, features, shapes = [], [], {}
  for t, (placement, opt, bag) in enumerate([
      ("row", pe.RowwiseAdagrad(0.1), (2, 5)), ("table", pe.Sgd(0.05), None),
      ("table", pe.RowwiseAdagrad(0.1), (2, 5))]):
    tables.append(pe.TableSpec(
        f"t{t}", int(rng.integers(30, 60)), int(rng.choice([4, 8, 16])),
        optimizer=opt, dtype=[jnp.float32, jnp.bfloat16][int(rng.integers(2))],
        padding_id=[None, 0, 3][int(rng.integers(3))], placement=placement))
    for f in range(int(rng.integers(1, 3))):
      name = f"t{t}_f{f}"
      features.append(pe.FeatureSpec(
          name, f"t{t}", combiner=["sum", "mean", "sqrtn"][
              int(rng.integers(3))], weighted=bool(rng.integers(2))))
      shapes[name] = (batch_size,
                      1 if bag is None else int(rng.integers(*bag)))
  coll = pe.EmbeddingCollection(tables, features, mesh, "x", backend="xla")
  return coll, shapes, rng


class ExplicitMeshTest(parameterized.TestCase):
  """Every public entry gives the same bits on a mesh of Explicit axes as
  on the same mesh with Auto axes: init, the step, table_arrays,
  optimizer_arrays, checkpoints (across the two), serving states, export
  and plan."""

  def _pair(self, ranks=4):
    pair = [random_collection(31, ranks, explicit=explicit)
            for explicit in (False, True)]
    self.assertEqual({s.placement for s in pair[1][0].plan.stacks},
                     set(PLACEMENTS))
    return pair

  def test_step_and_arrays(self):
    (auto, shapes, rng), (explicit, _, _) = self._pair()
    batches = [random_batch(auto, shapes, rng)[0] for _ in range(2)]
    out = []
    for coll in (auto, explicit):
      state = test_util.random_state(coll, 0)
      for batch in batches:
        emb, routing = coll.lookup_and_route(state, batch)
        grads = {k: jnp.sin(v.astype(jnp.float32)).astype(v.dtype)
                 for k, v in emb.items()}
        state, _ = coll.apply_gradients(state, routing, grads)
      out.append((emb, coll.table_arrays(state),
                  coll.optimizer_arrays(state), state))
    for got, want in zip(jax.tree.leaves(out[1][:3]),
                         jax.tree.leaves(out[0][:3])):
      test_util.assert_bits_equal(self, got, test_util.as_numpy(want))
    for coll, (_, _, _, state) in zip((auto, explicit), out):
      fresh = jax.tree.leaves(coll.init(jax.random.key(1)))
      self.assertTrue(all(np.isfinite(test_util.as_numpy(x).astype(
          np.float32)).all() for x in fresh if x.dtype.kind == "f"))
    self.assertEqual(auto.plan.describe(), explicit.plan.describe())

  def _small_pair(self):
    """One small collection on both mesh kinds, and a batch."""
    specs = [pe.TableSpec("t", 20, 8, optimizer=pe.Sgd(0.5))]
    features = [pe.FeatureSpec("f", "t")]
    return [pe.EmbeddingCollection(specs, features, test_util.mesh(
        {"x": 2}, explicit=explicit), "x", backend="xla")
            for explicit in (False, True)], {"f": np.int32([3, -1, 7, 3])}

  def test_states_and_routings_move_between_mesh_kinds(self):
    """A state, routing or serving state of the collection built on one
    mesh kind is read by the same collection on the other, relabelled (the
    same buffers, no copy)."""
    (auto, explicit), batch = self._small_pair()
    for source, target in ((auto, explicit), (explicit, auto)):
      state = test_util.random_state(source, 0)
      emb, routing = source.lookup_and_route(state, batch)
      want, _ = source.apply_gradients(state, routing, emb)
      serving = source.quantize(state, "int8")
      for got, expected in zip(
          jax.tree.leaves((target.lookup(state, batch),
                           target.apply_gradients(state, routing, emb)[0],
                           target.lookup(serving, batch))),
          jax.tree.leaves((emb, want, source.lookup(serving, batch)))):
        test_util.assert_bits_equal(self, got, test_util.as_numpy(expected))
      placed = target._tables(state)  # pylint: disable=protected-access
      for table, stack in zip(placed, source.plan.stacks):
        pointers = lambda x: [s.data.unsafe_buffer_pointer()
                              for s in x.addressable_shards]
        self.assertEqual(pointers(table),
                         pointers(state.stacks[stack.name].table))

  @parameterized.parameters(False, True)
  def test_a_batch_on_one_device_is_placed(self, explicit):
    """`jax.device_put(ids, devices[3])` (committed to a device outside
    the 2-rank mesh) is placed like any batch, on both mesh kinds."""
    colls, batch = self._small_pair()
    coll = colls[explicit]
    state = test_util.random_state(coll, 0)
    moved = {k: jax.device_put(v, jax.devices()[3]) for k, v in batch.items()}
    for got, want in zip(jax.tree.leaves(coll.lookup(state, moved)),
                         jax.tree.leaves(coll.lookup(state, batch))):
      test_util.assert_bits_equal(self, got, test_util.as_numpy(want))

  def test_checkpoint_moves_between_mesh_kinds(self):
    (auto, _, _), (explicit, _, _) = self._pair()
    for source, target in ((auto, explicit), (explicit, auto)):
      state = test_util.random_state(source, 3)
      with tempfile.TemporaryDirectory() as d:
        checkpoint.save_collection(d, source, state, step=1)
        restored, _ = checkpoint.restore_collection(d, target)
      for name, table in source.table_arrays(state).items():
        test_util.assert_bits_equal(
            self, target.table_arrays(restored)[name],
            test_util.as_numpy(table), name)
      # A serving state's checkpoint too.
      serving = source.quantize(state, "int8")
      with tempfile.TemporaryDirectory() as d:
        checkpoint.save(d, serving, step=1)
        back = checkpoint.restore_serving(d, target, "int8")
      for got, want in zip(jax.tree.leaves(back),
                           jax.tree.leaves(serving)):
        test_util.assert_bits_equal(self, got, test_util.as_numpy(want))

  def test_serving_and_export(self):
    (auto, shapes, rng), (explicit, _, _) = self._pair(2)
    batch, _ = random_batch(auto, shapes, rng)
    served = {}
    for kind, coll in (("auto", auto), ("explicit", explicit)):
      state = test_util.random_state(coll, 5)
      for dtype in ("int8", "bfloat16"):
        serving = coll.quantize(state, dtype)
        served[kind, dtype] = jax.jit(coll.lookup)(serving, batch)
      # An exported program takes arrays: bags as (ids, weights).
      ids = {k: getattr(v, "ids", v) for k, v in batch.items()}
      weights = {k: v.weights for k, v in batch.items()
                 if isinstance(v, pe.Bag)}

      def lookup(serving, ids, weights, coll=coll):
        return coll.lookup(serving, {
            k: pe.Bag(v, weights=weights[k]) if k in weights else v
            for k, v in ids.items()})

      with tempfile.TemporaryDirectory() as d:
        export.save(d, lookup, coll.quantize(state, "int8"),
                    [(ids, weights)])
        served[kind, "export"] = export.load(d)(ids, weights)
    for dtype in ("int8", "bfloat16", "export"):
      for got, want in zip(jax.tree.leaves(served["explicit", dtype]),
                           jax.tree.leaves(served["auto", dtype])):
        test_util.assert_bits_equal(self, got, test_util.as_numpy(want),
                                    dtype)


class PoolOnOwnerTest(ModelCheck, parameterized.TestCase):
  """Bags pooled on their rows' owners, against the numpy model."""

  @parameterized.parameters(1, 2, 4, 8)
  def test_random_pooled_collections(self, ranks):
    coll, shapes, rng = random_pooled_collection(10 + ranks, ranks)
    batch, _ = random_batch(coll, shapes, rng)
    chosen = {layout.features[0].name[:2]: layout.pool_on_owner
              for layout in coll.layouts(batch)}
    self.assertEqual(chosen, {"t0": True, "t1": False, "t2": True},
                     coll.plan)
    self._check(coll, shapes, rng, f"{ranks} ranks\n{coll.plan}")

  def test_the_smaller_payload_wins(self):
    """The rule: bytes per rank and step of each path (a tie: the
    example's rank; empty bags have nothing to pool on the owners)."""
    coll = pe.EmbeddingCollection(
        [pe.TableSpec("t", 1000, 1, optimizer=pe.Sgd(0.1), placement="row")],
        [pe.FeatureSpec("f", "t", combiner="sum")], test_util.mesh({"x": 1}),
        "x")
    # W 1, D 1, f32: example C (4 + 4 + 4), owner 8 P + 8 B D.
    for shape, bytes_, on_owner in (((1, 2), (24, 24), False),
                                    ((1, 3), (36, 32), True),
                                    ((2, 1), (24, 32), False),
                                    ((1, 0), (12, 8), False)):
      (layout,) = coll.layouts({"f": np.zeros(shape, np.int32)})
      self.assertEqual(layout_lib.pooling_bytes(layout, 4), bytes_, shape)
      self.assertEqual(layout.pool_on_owner, on_owner, shape)


class OverflowTest(parameterized.TestCase):

  def test_capped_buckets_overflow_loudly(self):
    """Rank 0 sends owner 0 three distinct rows (0, 2, 4) through a
    bucket of one: 2 and 4 are served as zeros, never trained, counted,
    and raise_if_overflow raises; the fitted cap holds them all."""
    mesh = test_util.mesh({"x": 2})
    spec = pe.TableSpec("t", 10, 8, optimizer=pe.Sgd(1.0), placement="row",
                        max_ids_per_partition=1)
    coll = pe.EmbeddingCollection([spec], [pe.FeatureSpec("f", "t")], mesh,
                                  "x")
    batch = {"f": np.array([0, 2, 4, 5, 0, 0], np.int32)}  # rank 0 | rank 1
    state = test_util.random_state(coll, 0)
    before = test_util.as_numpy(coll.table_arrays(state)["t"])
    emb, routing = coll.lookup_and_route(state, batch)
    got = test_util.as_numpy(emb["f"])
    np.testing.assert_array_equal(got[[0, 4, 5]], before[[0, 0, 0]])
    np.testing.assert_array_equal(got[[1, 2]], np.zeros((2, 8)))
    np.testing.assert_array_equal(got[3], before[5])
    grads = {"f": np.ones((6, 8), np.float32)}
    state, stats = coll.apply_gradients(state, routing, grads)
    self.assertEqual(int(stats["stack0"].num_overflow), 2)
    with self.assertRaisesRegex(pe.UniqueOverflowError,
                                r"tables \['t'\] had 2 more distinct ids.*"
                                r"max_ids_per_partition"):
      coll.raise_if_overflow(stats)
    after = test_util.as_numpy(coll.table_arrays(state)["t"])
    np.testing.assert_array_equal(after[[2, 4]], before[[2, 4]])
    np.testing.assert_array_equal(after[0], before[0] - 3)  # three entries
    np.testing.assert_array_equal(after[5], before[5] - 1)

    fitted = coll.fit_max_ids_per_partition([batch])
    self.assertEqual(fitted.tables["t"].max_ids_per_partition, 1)  # kept
    uncapped = pe.EmbeddingCollection(
        [dataclasses.replace(spec, max_ids_per_partition=None)],
        [pe.FeatureSpec("f", "t")], mesh, "x")
    self.assertEqual(row.ids_per_partition(uncapped, batch), {"t": 3})
    fitted = uncapped.fit_max_ids_per_partition([batch], headroom=3)
    self.assertEqual(fitted.tables["t"].max_ids_per_partition, 16)
    _, stats = fitted.apply_gradients(test_util.random_state(fitted, 0), batch,
                                      grads)
    self.assertEqual(int(stats["stack0"].num_overflow), 0)

  @parameterized.product(backend=test_util.backends())
  def test_bags_pooled_on_the_owners_overflow_loudly(self, backend):
    """Pooling on the owners, the buckets still decide overflow: rank 0
    asks owner 0 for eight distinct even rows through a bucket of six, so
    12 and 14 read zeros in their bags, never train, and are counted."""
    spec = pe.TableSpec("t", 40, 8, optimizer=pe.Sgd(1.0), placement="row",
                        max_ids_per_partition=6)
    coll = pe.EmbeddingCollection(
        [spec], [pe.FeatureSpec("f", "t", combiner="sum")],
        test_util.mesh({"x": 2}), "x", backend=backend)
    ids = np.array([[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7],
                    [0, 2, 1, 3]] + [[20, 21, 22, 23]] * 4, np.int32)
    batch = {"f": ids}
    (layout,) = coll.layouts(batch)
    self.assertTrue(layout.pool_on_owner)
    state = test_util.random_state(coll, 0)
    before = test_util.as_numpy(coll.table_arrays(state)["t"])
    emb, routing = coll.lookup_and_route(state, batch)
    served = before.copy()
    served[[12, 14]] = 0
    assert_tables_close(emb["f"], served[ids].sum(axis=1), "lookup")
    state, stats = coll.apply_gradients(
        state, routing, {"f": np.ones((8, 8), np.float32)})
    self.assertEqual(int(stats["stack0"].num_overflow), 2)
    with self.assertRaises(pe.UniqueOverflowError):
      coll.raise_if_overflow(stats)
    counts = np.bincount(ids.reshape(-1), minlength=40)
    counts[[12, 14]] = 0
    assert_tables_close(coll.table_arrays(state)["t"],
                        before - counts[:, None], "update")

  def test_the_trainer_raises_on_bucket_overflow(self):
    """The Trainer checks `max_ids_per_partition` caps by itself (as
    `max_unique` ones): the step raises; unchecked, its stats count."""
    spec = pe.TableSpec("t", 10, 8, optimizer=pe.Sgd(1.0), placement="row",
                        max_ids_per_partition=1)
    coll = pe.EmbeddingCollection([spec], [pe.FeatureSpec("f", "t")],
                                  test_util.mesh({"x": 2}), "x")
    batch = {"f": np.array([0, 2, 4, 5, 0, 0], np.int32)}  # 2 overflow
    test_util.assert_trainer_checks_overflow(
        self, coll, batch, "had 2 more distinct ids.*max_ids_per_partition", 2)

  def test_overflow_over_replicas(self):
    """Over a replica axis the buckets are per rank as without it: the
    same batch on two copies of two ranks counts each rank's sends, and
    every replica reports the overflow of all of them."""
    spec = pe.TableSpec("t", 10, 8, optimizer=pe.Sgd(1.0), placement="row",
                        max_ids_per_partition=1)
    coll = pe.EmbeddingCollection(
        [spec], [pe.FeatureSpec("f", "t")], test_util.mesh({"r": 2, "x": 2}),
        "x", replica_axis="r")
    # Ranks (r, x): (0, 0) sends owner 0 rows 0, 2, 4 (2 overflow); (1, 1)
    # sends owner 1 rows 1, 3 (1 overflows).
    batch = {"f": np.array([0, 2, 4, 5, 0, 0, 0, 0, 0, 1, 3, 1], np.int32)}
    uncapped = pe.EmbeddingCollection(
        [dataclasses.replace(spec, max_ids_per_partition=None)],
        [pe.FeatureSpec("f", "t")], coll.mesh, "x", replica_axis="r")
    self.assertEqual(row.ids_per_partition(uncapped, batch), {"t": 3})
    _, stats = coll.apply_gradients(test_util.random_state(coll, 0), batch,
                                    {"f": np.ones((12, 8), np.float32)})
    self.assertEqual(int(stats["stack0"].num_overflow), 3)
    with self.assertRaisesRegex(pe.UniqueOverflowError, "had 3 more"):
      coll.raise_if_overflow(stats)


def small_collection(placements, ranks=4, replicas=1, dedup="sort"):
  """Three tables (two widths, Adagrad and SGD) with the given placements,
  a sequence and a pooled feature (whole copies over "r" if `replicas` >
  1)."""
  mesh = test_util.mesh({"r": replicas, "x": ranks})
  specs = [("a", 30, 8, pe.RowwiseAdagrad(0.1)), ("b", 13, 8,
                                                   pe.RowwiseAdagrad(0.1)),
           ("c", 9, 16, pe.Sgd(0.2))]
  tables = [pe.TableSpec(n, rows, width, optimizer=opt, placement=p)
            for (n, rows, width, opt), p in zip(specs, placements)]
  features = [pe.FeatureSpec("fa", "a"), pe.FeatureSpec("fb", "b"),
              pe.FeatureSpec("fc", "c", combiner="mean")]
  return pe.EmbeddingCollection(tables, features, mesh, "x",
                                replica_axis="r" if replicas > 1 else (),
                                dedup=dedup, backend="xla"
                                if dedup == "slot_map" else None)


def small_batch(rng, ranks=4):
  return {"fa": rng.integers(-30, 30, (ranks, 3)).astype(np.int32),
          "fb": rng.integers(0, 13, (ranks,)).astype(np.int32),
          "fc": rng.integers(0, 9, (ranks, 2)).astype(np.int32)}


class StateTest(absltest.TestCase):

  def test_jitted_init_shards_the_optimizer_state(self):
    """Under a user's jit, init's optimizer state is sharded as eagerly
    (row, table: every slot with the table's rows; column: Adam's m and v
    like the table), not replicated on every rank."""
    mesh = test_util.mesh({"x": 2})
    coll = pe.EmbeddingCollection(
        [pe.TableSpec(n, 6, 4, optimizer=pe.Adam(0.1), placement=p)
         for n, p in (("a", "row"), ("b", "table"), ("c", "column"))],
        [pe.FeatureSpec(n, n) for n in "abc"], mesh, "x")
    eager = coll.init(jax.random.key(0))
    jitted = jax.jit(coll.init)(jax.random.key(0))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(eager),
                            jax.tree.leaves(jitted)):
      self.assertTrue(b.sharding.is_equivalent_to(a.sharding, a.ndim),
                      f"{jax.tree_util.keystr(path)}: {b.sharding} under "
                      f"jit, {a.sharding} eagerly")

  def test_checkpoint_restores_across_placements(self):
    """Trained under one placement per table, saved, restored under every
    other: the same logical tables and optimizer states, bit for bit."""
    rng = np.random.default_rng(0)
    coll = small_collection(["row", "table", "replicated"])
    state = test_util.random_state(coll, 1)
    for _ in range(2):
      batch = small_batch(rng)
      emb = coll.lookup(state, batch)
      state, _ = coll.apply_gradients(state, batch, jax.tree.map(
          lambda e: np.asarray(rng.standard_normal(e.shape), e.dtype), emb))
    want = jax.tree.map(test_util.as_numpy, (coll.table_arrays(state),
                                             coll.optimizer_arrays(state)))
    with tempfile.TemporaryDirectory() as directory:
      path = os.path.join(directory, "ckpt")
      checkpoint.save_collection(path, coll, state, step=2)
      for placements in (["column"] * 3, ["table", "replicated", "row"]):
        other = small_collection(placements)
        restored, _ = checkpoint.restore_collection(path, other)
        got = jax.tree.map(test_util.as_numpy, (
            other.table_arrays(restored), other.optimizer_arrays(restored)))
        jax.tree.map(np.testing.assert_array_equal, got, want)
        batch = small_batch(rng)
        jax.tree.map(np.testing.assert_array_equal,
                     jax.tree.map(test_util.as_numpy,
                                  other.lookup(restored, batch)),
                     jax.tree.map(test_util.as_numpy,
                                  coll.lookup(state, batch)))

  def test_checkpoint_of_tables_narrower_than_the_ranks(self):
    """A row / table / replicated table may be narrower than the ranks (no
    column split): its checkpoint restores all the same, under its own
    placement, the next one, and over another rank count."""
    others = {"row": "table", "table": "replicated", "replicated": "row"}
    make = lambda placement, ranks: pe.EmbeddingCollection(
        [pe.TableSpec("t", 10, 2, optimizer=pe.RowwiseAdagrad(0.1),
                      placement=placement)],
        [pe.FeatureSpec("f", "t")], test_util.mesh({"x": ranks}), "x")
    for placement in ("row", "table", "replicated"):
      coll = make(placement, 4)
      state = test_util.random_state(coll, 3)
      # Trained once: the row-wise state is not its initial value.
      batch = {"f": np.arange(8, dtype=np.int32)}
      state, _ = coll.apply_gradients(
          state, batch, {"f": np.ones((8, 2), np.float32)})
      want = jax.tree.map(test_util.as_numpy, (
          coll.table_arrays(state), coll.optimizer_arrays(state)))
      with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "ckpt")
        checkpoint.save_collection(path, coll, state, step=1)
        for other in (coll, make(others[placement], 4), make(placement, 2)):
          restored, _ = checkpoint.restore_collection(path, other)
          jax.tree.map(np.testing.assert_array_equal,
                       jax.tree.map(test_util.as_numpy, (
                           other.table_arrays(restored),
                           other.optimizer_arrays(restored))), want)

  def test_plan_bytes_match_the_shards(self):
    """describe()'s bytes per rank are the state arrays' shards on every
    device."""
    coll = small_collection(["row", "table", "replicated"])
    state = test_util.random_state(coll, 0)
    text = coll.plan.describe()
    total = [0, 0]
    for stack in coll.plan.stacks:
      stack_state = state.stacks[stack.name]
      for i, part in enumerate((stack_state.table, stack_state.opt_state)):
        for device in range(coll.group_size):
          on_device = sum(leaf.addressable_shards[device].data.nbytes
                          for leaf in jax.tree.leaves(part))
          self.assertEqual(on_device, stack.rank_bytes()[i], stack.name)
        total[i] += stack.rank_bytes()[i]
      self.assertIn(f"{stack.name}: {stack.placement} ", text)
    self.assertIn("  a: row rows [0, 30)", text)
    self.assertIn("  b: table rows [0, 13) on rank 0", text)
    self.assertIn("  c: replicated rows [0, 9)", text)
    self.assertIn(f"per rank (each of 4): {total[0]} table bytes + "
                  f"{total[1]} optimizer state bytes", text)
    # a: 30 rows over 4 ranks, 8 per rank; row-wise Adagrad state too.
    self.assertEqual(coll.plan.stacks[0].rank_bytes(), (8 * 8 * 4,
                                                        8 * 4 + 4))

  def test_plan_counts_the_slot_maps(self):
    """dedup="slot_map": the optimizer state bytes of describe() and of
    pe.plan_cost count each column or replicated stack's int32 map, which
    every rank holds whole."""
    coll = small_collection(["column", "row", "replicated"], dedup="slot_map")
    sort = small_collection(["column", "row", "replicated"])
    state = test_util.random_state(coll, 0)
    for stack, plain in zip(coll.plan.stacks, sort.plan.stacks):
      slot_map = state.stacks[stack.name].slot_map
      self.assertEqual(stack.map_bytes, 0 if slot_map is None else
                       slot_map.addressable_shards[0].data.nbytes)
      self.assertEqual(stack.rank_bytes()[1],
                       plain.rank_bytes()[1] + stack.map_bytes)
    self.assertEqual([s.map_bytes for s in coll.plan.stacks],
                     [4 * 30, 0, 4 * 9])
    self.assertIn("(of which 156 slot map bytes)", coll.plan.describe())
    tables = list(coll.tables.values())
    features = list(coll.features.values())
    cost = lambda **kw: pe.plan_cost(tables, features, 4, batch_size=4,
                                     **kw).memory_per_rank
    self.assertEqual(cost(dedup="slot_map") - cost(), 156)


class HloTest(absltest.TestCase):

  def test_collectives_per_placement(self):
    """Row: one all-to-all of ids and one of rows per lookup, one of
    gradients per update. Replicated: no collective in its lookup."""
    rng = np.random.default_rng(0)
    for placement, lookups, updates in (("row", 2, 1), ("replicated", 0, 0)):
      coll = small_collection([placement, "column", "column"])
      coll = pe.EmbeddingCollection(
          [coll.tables["a"]], [coll.features["fa"]], coll.mesh, "x")
      state = test_util.random_state(coll, 0)
      batch = {"fa": small_batch(rng)["fa"]}
      text = jax.jit(coll.lookup).lower(state, batch).compile().as_text()
      found = hlo.collective_bytes(text, coll.group_size)
      self.assertEqual(found.get("all-to-all", {}).get("count", 0), lookups,
                       (placement, found))
      if placement == "replicated":
        self.assertEqual(found, {})
      else:  # W x C int32 ids out, W x C f32 rows back (C = 3 ids a rank)
        self.assertEqual(found["all-to-all"]["operand_bytes"],
                         4 * 3 * 4 + 4 * 3 * 8 * 4)
      emb, routing = coll.lookup_and_route(state, batch)
      text = jax.jit(coll.apply_gradients).lower(
          state, routing, emb).compile().as_text()
      found = hlo.collective_bytes(text, coll.group_size)
      self.assertEqual(found.get("all-to-all", {}).get("count", 0), updates,
                       (placement, found))
      if placement == "row":  # [W, C, D] f32 sums, C = 3 ids per rank
        self.assertEqual(found["all-to-all"]["operand_bytes"], 4 * 3 * 8 * 4)

  def test_pooling_payloads_per_path(self):
    """A row stack of one pooled feature, 4 ranks, D 8, f32. Bags of one
    (B 2 a rank, C 2) pool on the example's rank: ids `[W, C]`, rows `[W,
    C, D]` back, sums `[W, C, D]`. Bags of four (P 8 entries, C 8) pool on
    the owners: entries and weights `[W, 2P]`, partial sums `[W, B, D]`
    back, the bags' gradients `[W, B, D]`."""
    spec = pe.TableSpec("t", 1000, 8, optimizer=pe.Sgd(0.1), placement="row")
    coll = pe.EmbeddingCollection(
        [spec], [pe.FeatureSpec("f", "t", combiner="sum")],
        test_util.mesh({"x": 4}), "x")
    state = test_util.random_state(coll, 0)

    def payloads(fn, *args):
      """Each all-to-all's per-rank blocks, as (dtype, dims) lists."""
      text = jax.jit(fn).lower(*args).compile().as_text()
      return sorted(ins.arrays() for comp in hlo.parse_hlo(text).values()
                    for ins in comp if ins.opcode.startswith("all-to-all"))

    for bag, on_owner, lookup, update in (
        (1, False, [[("f32", (2, 8))] * 4, [("s32", (2,))] * 4],
         [[("f32", (2, 8))] * 4]),
        (4, True, [[("f32", (2, 8))] * 4, [("s32", (16,))] * 4],
         [[("f32", (2, 8))] * 4])):
      batch = {"f": np.arange(8 * bag, dtype=np.int32).reshape(8, bag)}
      (layout,) = coll.layouts(batch)
      self.assertEqual(layout.pool_on_owner, on_owner, bag)
      self.assertEqual(payloads(coll.lookup, state, batch), lookup, bag)
      emb, routing = coll.lookup_and_route(state, batch)
      self.assertEqual(payloads(coll.apply_gradients, state, routing, emb),
                       update, bag)
    # Bags of four on the example's rank would move C 8: ids, rows and
    # sums 4 x 8 x (4 + 32 + 32) bytes, against 4 x (8 x 8 + 2 x 2 x 32).
    self.assertEqual(layout_lib.pooling_bytes(layout, 4),
                     (4 * 8 * (4 + 8 * 4 + 8 * 4), 4 * (8 * 8 + 2 * 2 * 8 * 4)))

  def test_bf16_gradients_travel_as_bf16(self):
    """A bf16 stack's gradients go out in bf16, pooled ones too (a bag's
    product with its entries' weights is taken after the exchange), on
    every path: the operands of the update's collectives as the program
    lowers them (XLA:CPU widens a bf16 all-to-all to f32 when it compiles,
    a GPU does not). 4 ranks, D 8, 8 examples."""

    def sent(fn, *args):
      """The operands of rows (`[N, S]`, N > 1: not the stats' totals)."""
      text = jax.jit(fn).lower(*args).as_text()
      return sorted(t for t in re.findall(
          r"stablehlo\.all_(?:to_all|gather).*?: \((tensor<[^>]*>)\)", text)
                    if re.fullmatch(r"tensor<([2-9]|\d\d+)x\d+x\w+>", t))

    for placement, bag, pool_on_owner, grads in (
        ("row", 1, False, ["tensor<8x8xf32>"]),  # f32 sums per slot
        ("row", 4, True, ["tensor<8x8xbf16>"]),
        ("column", 4, False, ["tensor<8x2xbf16>"]),
        ("table", 4, True, ["tensor<8x8xbf16>"]),
        ("replicated", 4, False, ["tensor<2x8xbf16>"])):
      spec = pe.TableSpec("t", 1000, 8, dtype=jnp.bfloat16,
                          optimizer=pe.Sgd(0.1), placement=placement)
      coll = pe.EmbeddingCollection(
          [spec], [pe.FeatureSpec("f", "t", combiner="sum")],
          test_util.mesh({"x": 4}), "x")
      state = test_util.random_state(coll, 0)
      batch = {"f": np.arange(8 * bag, dtype=np.int32).reshape(8, bag)}
      (layout,) = coll.layouts(batch)
      self.assertEqual(layout.pool_on_owner, pool_on_owner, placement)
      emb, routing = coll.lookup_and_route(state, batch)
      self.assertEqual(sent(coll.apply_gradients, state, routing, emb),
                       grads, (placement, bag))
      if pool_on_owner:
        # The cost that chose the path counts them so: entries 4 x 8 x 8,
        # f32 partial sums 4 x 2 x 8 x 4, gradients 4 x 2 x 8 x 2.
        self.assertEqual(layout_lib.pooling_bytes(layout, 2)[1],
                         4 * (8 * 8 + 2 * 8 * 4 + 2 * 8 * 2))

  def test_sparse_step_is_in_place(self):
    """Row and replicated sparse steps (lookup, route, update; the state
    donated) never materialize a table-sized array: their update writes
    the touched rows in place, as column's does; bags pooled on the
    owners too."""
    local_rows = 1031  # prime: no per-batch array is this long
    for placement, rows, bag in (("row", 4 * local_rows, None),
                                 ("row", 4 * local_rows, 4),
                                 ("replicated", local_rows, None)):
      spec = pe.TableSpec("t", rows, 8, optimizer=pe.RowwiseAdagrad(0.1),
                          placement=placement)
      coll = pe.EmbeddingCollection(
          [spec], [pe.FeatureSpec("f", "t", combiner=bag and "mean")],
          test_util.mesh({"x": 4}), "x", backend="xla")
      state = test_util.random_state(coll, 0)
      ids = np.arange(32 * (bag or 1), dtype=np.int32) * 7
      batch = {"f": ids.reshape(32, bag) if bag else ids}
      self.assertEqual(coll.layouts(batch)[0].pool_on_owner, bool(bag))
      grads = {"f": np.ones((32, 8), np.float32)}

      def step(state, batch, grads, coll=coll):
        emb, routing = coll.lookup_and_route(state, batch)
        state, stats = coll.apply_gradients(state, routing, grads)
        return state, stats, emb

      text = jax.jit(step, donate_argnums=0).lower(
          state, batch, grads).compile().as_text()
      bad = hlo.full_table_ops(text, local_rows)
      self.assertEmpty([f"{b.opcode} {b.name} {b.shape}" for b in bad],
                       placement)


class TrainerTest(absltest.TestCase):

  def test_pipelined_trainer_mixed_placements(self):
    """The pipelined Trainer over row, table and replicated tables trains
    as over column ones (f32: up to the owners' sum order)."""
    rng = np.random.default_rng(3)
    batches = [dict(small_batch(rng), y=rng.standard_normal(4).astype(
        np.float32)) for _ in range(4)]

    def loss_fn(params, emb, batch):
      x = (jnp.sum(emb["fa"], axis=1) + emb["fb"]) @ params["w"]
      pred = (x + emb["fc"] @ params["v"])[:, 0]
      return jnp.mean((pred - batch["y"]) ** 2), {}

    results = []
    mixed = ["row", "table", "replicated"]
    # Column; mixed; mixed on two copies of two ranks (the same 4 shards).
    for placements, ranks, replicas in ((["column"] * 3, 4, 1),
                                        (mixed, 4, 1), (mixed, 2, 2)):
      # Fresh: the step donates the state.
      params = {"w": jnp.full((8, 1), 0.1, jnp.float32),
                "v": jnp.full((16, 1), 0.1, jnp.float32)}
      coll = small_collection(placements, ranks, replicas)
      trainer = pe.Trainer(coll, loss_fn, optax.sgd(0.1))
      state = trainer.init(test_util.random_state(coll, 0), params, batches[0])
      step = jax.jit(trainer.step, donate_argnums=0)
      losses = []
      for batch, following in zip(batches, batches[1:] + batches[-1:]):
        state, metrics = step(state, batch, following)
        losses.append(float(metrics.loss))
      self.assertEqual(step._cache_size(), 1)  # pylint: disable=protected-access
      state, _ = trainer.flush(state)
      results.append((losses, jax.tree.map(
          test_util.as_numpy, coll.table_arrays(state.embedding))))
    for got in results[1:]:
      np.testing.assert_allclose(got[0], results[0][0], rtol=1e-5)
      jax.tree.map(lambda got, want: np.testing.assert_allclose(
          got, want, rtol=2e-6, atol=2e-6), got[1], results[0][1])


class FlaxTest(absltest.TestCase):

  def test_flax_layer_mixed_placements(self):
    """The Flax layer's params are the stacks' physical arrays, placed as
    the collection places them (not column-sharded), and it looks up what
    the collection looks up in them."""
    coll = small_collection(["row", "table", "replicated"])
    batch = small_batch(np.random.default_rng(0))
    layer = pe_flax.EmbeddingCollection(coll)
    params = nn.unbox(jax.jit(layer.init)(jax.random.key(0), batch)[
        "params"])
    for stack in coll.plan.stacks:
      self.assertTrue(params[stack.name].sharding.is_equivalent_to(
          coll.stack_sharding(stack), 2), stack.name)
    state = coll.state_from_stacks(params)
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(test_util.as_numpy,
                              layer.apply({"params": params}, batch)),
                 jax.tree.map(test_util.as_numpy, coll.lookup(state, batch)))


class DenseGradTest(parameterized.TestCase):

  @parameterized.parameters(("replicated", False, 4, 1), ("row", True, 4, 1),
                            ("replicated", False, 2, 2))
  def test_jax_grad_of_lookup(self, c_placement, on_owner, ranks, replicas):
    """Plain jax.grad of a lookup: per logical table, the scatter-add of
    every training entry's gradient (padding and clamped ids add none),
    summed over the replicas; c's bags pooled on the owners when c is
    row-placed."""
    rng = np.random.default_rng(5)
    coll = small_collection(["row", "table", c_placement], ranks, replicas)
    state = test_util.random_state(coll, 0)
    batch = small_batch(rng)
    self.assertEqual([layout.pool_on_owner for layout in coll.layouts(batch)
                      if layout.features[0].name == "fc"], [on_owner])
    batch["fa"][0, :2] = [-31, 30]  # wrapped once, still outside: no grad
    cts = jax.tree.map(
        lambda e: rng.standard_normal(e.shape).astype(np.float32),
        coll.lookup(state, batch))

    def loss(tables):
      embs = coll.lookup(coll.state_from_stacks(tables), batch)
      return sum(jnp.sum(embs[k] * cts[k]) for k in embs)

    grads = jax.grad(loss)({n: s.table for n, s in state.stacks.items()})
    got = coll.table_arrays(coll.state_from_stacks(grads))
    model = Model(coll, {k: test_util.as_numpy(v)
                         for k, v in coll.table_arrays(state).items()})
    for name, table in got.items():
      spec = coll.tables[name]
      want = np.zeros((spec.vocab_rows, spec.emb_width), np.float32)
      for f in coll.features.values():
        if f.table != name:
          continue
        ids = batch[f.name]
        g = cts[f.name]
        if f.combiner is not None:
          g = g[:, None, :] * model._cw(f, ids, None)[:, :, None]
        ok = numpy_model.trains(ids, spec.vocab_rows, spec.padding_id)
        np.add.at(want, numpy_model.wrap_clamp(ids, spec.vocab_rows)[ok],
                  g[ok])
      np.testing.assert_allclose(test_util.as_numpy(table), want, rtol=2e-6,
                                 atol=2e-6, err_msg=name)



class PaddingRowTest(parameterized.TestCase):
  """The padding row never trains, whatever id reaches it after the wrap
  and clamp (padding_id=0: -100 on 100 rows, and -150 clamped; padding_id
  99 or -1: -1, and 250 clamped), on every placement, through sequence and
  weighted pooled features, the sparse update and jax.grad; it is read
  like any row (a pooled feature weighs it 0). Against the numpy model,
  whose rule is `numpy_model.resolve`."""

  @parameterized.parameters((2, False), (8, True))
  def test_padding_row_never_trains(self, ranks, explicit):
    tables, features, batch, raw = [], [], {}, {}
    weights = np.float32([[1, 1], [0.5, 1], [1, 2], [1, 1], [1, 1], [1, 0],
                          [1, 1], [2, 1]])
    for name, padding_id in zip(PLACEMENTS, (0, 99, -1, 0)):
      pad = padding_id % 100
      tables.append(pe.TableSpec(name, 100, 8, optimizer=pe.Sgd(0.5),
                                 padding_id=padding_id, placement=name))
      features += [pe.FeatureSpec(f"{name}_seq", name),
                   pe.FeatureSpec(f"{name}_bag", name, combiner="sum",
                                  weighted=True)]
      reach = -100 if pad == 0 else -1  # wraps onto the padding row
      clamp = -150 if pad == 0 else 250  # clamps onto it
      seq = np.int32([reach, reach, pad, 5, -95, 3, clamp, -150 + pad])
      bag = np.int32([[reach, 4], [4, pad], [-96, reach], [7, 7],
                      [clamp, 2], [1, 250], [reach, reach], [9, 8]])
      batch[f"{name}_seq"], raw[f"{name}_seq"] = seq, (seq, None)
      batch[f"{name}_bag"] = pe.Bag(bag, weights=weights)
      raw[f"{name}_bag"] = (bag, weights)
    mesh = test_util.mesh({"x": ranks}, explicit=explicit)
    coll = pe.EmbeddingCollection(tables, features, mesh, "x",
                                  backend="xla")
    state = test_util.random_state(coll, 0)
    before = {k: test_util.as_numpy(v)
              for k, v in coll.table_arrays(state).items()}
    model = Model(coll, before)
    emb, routing = coll.lookup_and_route(state, batch)
    want = model.lookup(raw)
    for name, got in emb.items():
      np.testing.assert_array_equal(test_util.as_numpy(got), want[name],
                                    err_msg=name)
    cts = {k: np.ones(e.shape, np.float32) for k, e in emb.items()}

    def loss(stacks):
      embs = coll.lookup(coll.state_from_stacks(stacks), batch)
      return sum(jnp.sum(embs[k] * cts[k]) for k in embs)

    with jax.set_mesh(mesh):  # eager grads on Explicit axes need it
      dense = coll.table_arrays(coll.state_from_stacks(jax.grad(loss)(
          {n: s.table for n, s in state.stacks.items()})))
    state, _ = coll.apply_gradients(state, routing, cts)
    model.step(raw, cts)
    after = coll.table_arrays(state)
    for spec in tables:
      name, pad = spec.name, spec.padding_id % 100
      got = test_util.as_numpy(after[name])
      np.testing.assert_array_equal(got[pad], before[name][pad],
                                    err_msg=f"{name}: the padding row moved")
      self.assertFalse(np.any(test_util.as_numpy(dense[name])[pad]),
                       f"{name}: the padding row has a dense gradient")
      self.assertFalse(np.array_equal(got[[4, 5]], before[name][[4, 5]]),
                       name)  # the other rows do train
      assert_tables_close(got, model.models[name].table, name)
      # The sparse step is lr x the dense gradient.
      np.testing.assert_allclose(before[name] - got,
                                 0.5 * test_util.as_numpy(dense[name]),
                                 rtol=1e-6, atol=1e-6, err_msg=name)


if __name__ == "__main__":
  absltest.main()
