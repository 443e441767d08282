"""Tests for pallas_emb.checkpoint: resharding round trips, atomicity, errors."""

import os
import tempfile

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

import pallas_emb as pe
from pallas_emb import checkpoint as ckpt

VOCAB, WIDTH = 64, 16


def _mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("x",))


def _host_state():
  rng = np.random.default_rng(0)
  # Every bf16 bit pattern class: random bits (incl. NaN payloads, -0, inf).
  bf16_bits = rng.integers(0, 2**16, (VOCAB, WIDTH), dtype=np.uint16)
  return {
      "table_bf16": bf16_bits.view(jnp.bfloat16),
      "table_f32": rng.standard_normal((VOCAB, WIDTH)).astype(np.float32),
      "row_state": rng.standard_normal((WIDTH,)).astype(np.float32),
      "step": np.int32(1234567),
  }


def _specs():
  return {"table_bf16": P(None, "x"), "table_f32": P(None, "x"),
          "row_state": P(), "step": P()}


def _put(host, mesh):
  return {k: jax.device_put(v, NamedSharding(mesh, _specs()[k]))
          for k, v in host.items()}


def _target(mesh, host=None):
  host = host or _host_state()
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                  sharding=NamedSharding(mesh, _specs()[k]))
          for k, v in host.items()}


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint16) if x.dtype == jnp.bfloat16 else x.view(
      {4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize])


class CheckpointTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    assert jax.device_count() >= 8, jax.devices()
    cls._tmp = tempfile.TemporaryDirectory()
    cls.host = _host_state()
    # Saved once per source mesh size; the round trips only restore.
    cls.dirs = {}
    for n in (8, 2):
      d = os.path.join(cls._tmp.name, f"from{n}")
      ckpt.save(d, _put(cls.host, _mesh(n)), step=3)
      cls.dirs[n] = d

  @classmethod
  def tearDownClass(cls):
    cls._tmp.cleanup()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    # tempfile, not create_tempdir(): absl flags are unparsed under pytest.
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = tmp.name

  @parameterized.parameters((8, 8), (8, 4), (8, 2), (8, 1), (2, 8))
  def test_round_trip_reshards_bit_exact(self, src, dst):
    mesh = _mesh(dst)
    out = ckpt.restore(self.dirs[src], _target(mesh))
    self.assertEqual(out.keys(), self.host.keys())
    for k, v in self.host.items():
      with self.subTest(k):
        self.assertEqual(out[k].dtype, v.dtype)
        self.assertEqual(out[k].shape, v.shape)
        np.testing.assert_array_equal(_bits(out[k]), _bits(v))
        self.assertTrue(out[k].sharding.is_equivalent_to(
            NamedSharding(mesh, _specs()[k]), out[k].ndim))
        self.assertEqual(out[k].sharding.mesh.size, dst)

  def test_concrete_array_target_and_python_scalars(self):
    mesh = _mesh(4)
    state = {"w": _put(self.host, _mesh(8))["table_f32"], "lr": 0.5, "n": 7}
    ckpt.save(self.dir, state, step=0)
    target = {"w": jnp.zeros((VOCAB, WIDTH), jnp.float32,
                             device=NamedSharding(mesh, P(None, "x"))),
              "lr": 0.0, "n": 0}
    out = ckpt.restore(self.dir, target, step=0)
    np.testing.assert_array_equal(np.asarray(out["w"]),
                                  self.host["table_f32"])
    self.assertEqual(out["w"].sharding.mesh.size, 4)
    self.assertEqual((out["lr"], out["n"]), (0.5, 7))

  def test_latest_step_ignores_half_written(self):
    self.assertIsNone(ckpt.latest_step(self.dir))
    self.assertIsNone(ckpt.latest_step(os.path.join(self.dir, "nope")))
    small = {"v": jnp.arange(4.0), "s": jnp.int32(0)}
    for step in (1, 10, 2):
      ckpt.save(self.dir, {**small, "s": jnp.int32(step)}, step=step)
    self.assertEqual(ckpt.latest_step(self.dir), 10)
    # What an interrupted save leaves behind: orbax's temporary directory
    # (atomic-rename mode) and a final-named step without the commit marker
    # (in-place commit-file mode, or a partial copy). Plus unrelated clutter.
    for name in ("99.orbax-checkpoint-tmp", "98.orbax-checkpoint-tmp-17000",
                 "97", "step_96", "notes"):
      os.makedirs(os.path.join(self.dir, name))
    with open(os.path.join(self.dir, "97", "_METADATA"), "w") as f:
      f.write("{}")
    self.assertEqual(ckpt.latest_step(self.dir), 10)
    target = {"v": jax.ShapeDtypeStruct((4,), jnp.float32,
                                        sharding=NamedSharding(_mesh(1), P())),
              "s": jax.ShapeDtypeStruct((), jnp.int32,
                                        sharding=NamedSharding(_mesh(1), P()))}
    self.assertEqual(int(ckpt.restore(self.dir, target)["s"]), 10)
    self.assertEqual(int(ckpt.restore(self.dir, target, step=2)["s"]), 2)
    with self.assertRaisesRegex(
        ckpt.CheckpointError,
        r"step 97 is not a complete checkpoint in .*; complete steps are "
        r"\[1, 2, 10\]"):
      ckpt.restore(self.dir, target, step=97)

  def test_error_missing_directory(self):
    missing = os.path.join(self.dir, "missing")
    with self.assertRaisesRegex(
        ckpt.CheckpointError,
        r"^pallas_emb checkpoint directory .*missing does not exist; pass the "
        r"directory given to save\(\)"):
      ckpt.restore(missing, _target(_mesh(1)))

  def test_error_empty_directory(self):
    with self.assertRaisesRegex(
        ckpt.CheckpointError, r"holds no complete checkpoint; save one first"):
      ckpt.restore(self.dir, _target(_mesh(1)))

  def test_error_unknown_step(self):
    with self.assertRaisesRegex(
        ckpt.CheckpointError,
        r"step 4 is not a complete checkpoint in .*from8; complete steps are "
        r"\[3\], so pass one of those or step=None for the latest\."):
      ckpt.restore(self.dirs[8], _target(_mesh(1)), step=4)

  def test_error_wrong_width(self):
    target = _target(_mesh(2))
    target["table_bf16"] = jax.ShapeDtypeStruct(
        (VOCAB, 2 * WIDTH), jnp.bfloat16,
        sharding=NamedSharding(_mesh(2), P(None, "x")))
    with self.assertRaisesRegex(
        ckpt.CheckpointError,
        r"leaf 'table_bf16': target is bfloat16\[64, 32\] but the checkpoint "
        r"holds bfloat16\[64, 16\]; make the target match"):
      ckpt.restore(self.dirs[8], target)

  def test_error_wrong_dtype(self):
    # Orbax itself would silently cast; we refuse.
    target = _target(_mesh(2))
    target["table_f32"] = jax.ShapeDtypeStruct(
        (VOCAB, WIDTH), jnp.bfloat16,
        sharding=NamedSharding(_mesh(2), P(None, "x")))
    with self.assertRaisesRegex(
        ckpt.CheckpointError,
        r"leaf 'table_f32': target is bfloat16\[64, 16\] but the checkpoint "
        r"holds float32\[64, 16\]"):
      ckpt.restore(self.dirs[8], target)

  def test_error_tree_mismatch(self):
    target = _target(_mesh(2))
    del target["row_state"]
    target["extra"] = target["step"]
    with self.assertRaisesRegex(
        ckpt.CheckpointError,
        r"target tree does not match the saved tree \(saved but not in "
        r"target: \['row_state'\]; in target but not saved: \['extra'\]\)"):
      ckpt.restore(self.dirs[8], target)

  def test_error_target_without_sharding(self):
    target = _target(_mesh(2))
    target["table_f32"] = jax.ShapeDtypeStruct((VOCAB, WIDTH), jnp.float32)
    with self.assertRaisesRegex(
        ckpt.CheckpointError,
        r"leaf 'table_f32': target ShapeDtypeStruct has no sharding"):
      ckpt.restore(self.dirs[8], target)

  def test_error_save_existing_step_and_bad_step(self):
    with self.assertRaisesRegex(
        ckpt.CheckpointError, r"from8.3 already exists; save under a new step"):
      ckpt.save(self.dirs[8], {"s": jnp.int32(0)}, step=3)
    for bad in (-1, 1.5, True):
      with self.assertRaisesRegex(ckpt.CheckpointError,
                                  r"step=.* must be a non-negative integer"):
        ckpt.save(self.dir, {"s": jnp.int32(0)}, step=bad)


def _collection(ranks, tables, lazy=True):
  opt = pe.RowwiseAdagrad(0.1, half_life_steps=3.0, lazy=lazy)
  specs = {"items": pe.TableSpec("items", 40, 16, optimizer=opt),
           "users": pe.TableSpec("users", 24, 16, optimizer=opt),
           "genre": pe.TableSpec("genre", 8, 16, optimizer=opt,
                                 dtype=jnp.bfloat16),
           "city": pe.TableSpec("city", 12, 16, optimizer=opt)}
  return pe.EmbeddingCollection(
      [specs[t] for t in tables], [pe.FeatureSpec(t, t) for t in tables],
      test_util.mesh({"x": ranks}), "x")


class CollectionCheckpointTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = tmp.name

  def _trained(self, coll):
    """A state whose tables and optimizer state are not at their init."""
    state = coll.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = {f: rng.integers(0, 8, 8).astype(np.int32) for f in coll.features}
    grads = {f: rng.standard_normal((8, 16)).astype(np.float32)
             for f in coll.features}
    for _ in range(2):
      state, _ = coll.apply_gradients(state, batch, grads)
    return state

  def test_restore_under_other_ranks_and_stacking(self):
    saved_coll = _collection(8, ["items", "users", "genre"])
    state = self._trained(saved_coll)
    ckpt.save_collection(self.dir, saved_coll, state, step=5,
                         extra={"step": 5})
    # 4 ranks, a table added in the middle: items+users+city now stack.
    coll = _collection(4, ["items", "city", "users", "genre"])
    self.assertEqual(coll.plan.stacks[0].tables, ("items", "city", "users"))
    with self.assertRaisesRegex(pe.CheckpointError, r"has no tables "
                                r"\['city'\]; pass init_key="):
      ckpt.restore_collection(self.dir, coll, extra={"step": 0})
    restored, extra = ckpt.restore_collection(
        self.dir, coll, extra={"step": 0}, init_key=jax.random.key(1))
    self.assertEqual(int(extra["step"]), 5)
    want_tables = saved_coll.table_arrays(state)
    want_opt = saved_coll.optimizer_arrays(state)
    got_tables = coll.table_arrays(restored)
    got_opt = coll.optimizer_arrays(restored)
    for name in want_tables:
      self.assertTrue(got_tables[name].sharding.is_equivalent_to(
          coll.table_sharding(), 2))
      np.testing.assert_array_equal(_bits(got_tables[name]),
                                    _bits(want_tables[name]))
      for a, b in zip(jax.tree.leaves(got_opt[name]),
                      jax.tree.leaves(want_opt[name])):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    fresh = coll.table_arrays(coll.init(jax.random.key(1)))["city"]
    np.testing.assert_array_equal(_bits(got_tables["city"]), _bits(fresh))
    # And it trains on.
    restored, _ = coll.apply_gradients(
        restored, {f: np.ones(8, np.int32) for f in coll.features},
        {f: np.ones((8, 16), np.float32) for f in coll.features})

  def test_unknown_saved_table(self):
    saved_coll = _collection(2, ["items", "users"])
    ckpt.save_collection(self.dir, saved_coll,
                         saved_coll.init(jax.random.key(0)), step=1)
    with self.assertRaisesRegex(pe.CheckpointError, r"holds tables "
                                r"\['users'\] that the collection does not "
                                "have"):
      ckpt.restore_collection(self.dir, _collection(2, ["items"]))


if __name__ == "__main__":
  absltest.main()
