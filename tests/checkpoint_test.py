"""Tests for pallas_emb.checkpoint: resharding round trips, atomicity,
checksums, errors."""

import os
import tempfile
from unittest import mock

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import tensorstore

import pallas_emb as pe
from pallas_emb import checkpoint as ckpt
from pallas_emb import checksums as checksums_lib
from pallas_emb import host_memory
from pallas_emb import orbax_io
from pallas_emb.dedup import MAP_SENTINEL

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
      {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}[
          x.dtype.itemsize])


class _DirTest(parameterized.TestCase):
  """A fresh directory per test in `self.dir`."""

  def setUp(self):
    super().setUp()
    # tempfile, not create_tempdir(): absl flags are unparsed under pytest.
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = tmp.name


class CheckpointTest(_DirTest):

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

  def test_error_a_file_is_not_a_directory(self):
    path = os.path.join(self.dir, "state.ckpt")
    with open(path, "w") as f:
      f.write("not a checkpoint")
    message = (r"^pallas_emb checkpoint directory .*state.ckpt is a file, "
               r"not a directory; pass the directory given to save\(\)")
    for call in (lambda: ckpt.restore(path, _target(_mesh(1))),
                 lambda: ckpt.latest_step(path),
                 lambda: ckpt.save(path, {"v": jnp.ones(2)}, step=1)):
      with self.assertRaisesRegex(ckpt.CheckpointError, message):
        call()

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


_MASK = 2**32 - 1


def _fmix32(h: int) -> int:
  h ^= h >> 16
  h = (h * 0x85EBCA6B) & _MASK
  h ^= h >> 13
  h = (h * 0xC2B2AE35) & _MASK
  return h ^ (h >> 16)


def _model_checksum(x) -> list[int]:
  """The documented checksum, element by element: for seeds s in
  (0x243F6A88, 0x85A308D3), sum over row-major positions i of
  fmix32(bits_i ^ fmix32(i * 0x9E3779B9 + 1) ^ s) mod 2^32, where bits_i
  are an element's bits zero-extended to 32 (a bool is 0 or 1)."""
  x = np.asarray(x)
  words = (x.reshape(-1).astype(np.uint32) if x.dtype == np.bool_ else
           _bits(x.reshape(-1)).astype(np.uint32))
  return [sum(_fmix32(int(w) ^ _fmix32((i * 0x9E3779B9 + 1) & _MASK) ^ s)
              for i, w in enumerate(words)) & _MASK
          for s in (0x243F6A88, 0x85A308D3)]


class ChecksumTest(parameterized.TestCase):

  def _arrays(self):
    rng = np.random.default_rng(1)
    return {
        "f32": rng.standard_normal((16, 8)).astype(np.float32),
        "bf16": rng.integers(0, 2**16, (16, 8), dtype=np.uint16).view(
            jnp.bfloat16),
        "f16": rng.standard_normal((8, 16)).astype(np.float16),
        "i32": rng.integers(-2**31, 2**31, (16, 8)).astype(np.int32),
        "u32": rng.integers(0, 2**32, (8, 16)).astype(np.uint32),
        "i8": rng.integers(-128, 128, (16, 8)).astype(np.int8),
        "bool": rng.random((16, 8)) < 0.5,
        "scalar": np.float32(-2.5),
    }

  @parameterized.parameters(8, 2, 1)
  def test_matches_model_on_any_sharding(self, devices):
    mesh = _mesh(devices)
    for name, x in self._arrays().items():
      spec = P() if np.ndim(x) == 0 else P("x", None)
      on_device = jax.device_put(x, NamedSharding(mesh, spec))
      with self.subTest(name):
        want = _model_checksum(x)
        got_device, got_host = checksums_lib.checksums([on_device, np.asarray(x)])
        self.assertEqual(got_device.tolist(), want)
        self.assertEqual(got_host.tolist(), want)

  def test_any_changed_or_moved_element_changes_it(self):
    rng = np.random.default_rng(2)
    for name, x in self._arrays().items():
      if np.ndim(x) == 0:
        continue
      base = checksums_lib.checksums([x])[0].tolist()
      bits = _bits(x)
      for _ in range(20):
        changed = bits.copy().reshape(-1)
        i = rng.integers(changed.size)
        if x.dtype == np.bool_:
          changed[i] ^= 1
        else:
          changed[i] ^= rng.integers(1, 2**(8 * x.dtype.itemsize),
                                     dtype=np.uint64).astype(changed.dtype)
        moved = bits.copy().reshape(-1)
        j = (i + 1 + rng.integers(moved.size - 1)) % moved.size
        while moved[i] == moved[j]:
          j = (j + 1) % moved.size
        moved[[i, j]] = moved[[j, i]]
        for what, y in (("changed", changed), ("moved", moved)):
          with self.subTest(f"{name} {what} {i}"):
            self.assertNotEqual(
                checksums_lib.checksums([y.view(x.dtype).reshape(x.shape)])[0].tolist(),
                base)


class OrbaxIoTest(_DirTest):
  """`orbax_io`: host arrays saved as they are in chunks of rows, read into
  memory-mapped files in whole stored chunks."""

  @parameterized.parameters((jnp.float32, 30), (jnp.bfloat16, 7),
                            (jnp.int32, 1000))
  def test_read_into_a_file_in_stored_chunks(self, dtype, part_rows):
    rng = np.random.default_rng(0)
    # 61 rows (a prime: orbax would cut a large array into chunks of one
    # row), stored in chunks of 12 rows, the last of 1.
    tree = {"x": rng.standard_normal((61, 8)).astype(dtype),
            "y": np.arange(5, dtype=np.int32), "z": 3}
    path = ckpt._dir(self.dir) / "1"  # pylint: disable=protected-access
    with mock.patch.object(host_memory, "chunk_rows", return_value=12), \
        orbax_io.checkpointer() as ckptr:
      ckptr.save(path, args=orbax_io.save_args(tree))
      ckptr.wait_until_finished()
    out = np.memmap(os.path.join(self.dir, "x.rows"), dtype=tree["x"].dtype,
                    mode="w+", shape=(61, 8))
    parts = []
    real_array = tensorstore.array

    def ts_array(x, **kw):  # the parts written into the file
      parts.append(x.shape[0])
      return real_array(x, **kw)
    with mock.patch.object(host_memory, "chunk_rows",
                           return_value=part_rows), \
        mock.patch.object(tensorstore, "array", ts_array), \
        orbax_io.checkpointer() as ckptr:
      item = {"x": out, "y": np.zeros(5, np.int32), "z": 0}
      back = ckptr.restore(path, args=orbax_io.restore_args(item))
    self.assertIs(back["x"], out)
    test_util.assert_bits_equal(self, np.asarray(out), tree["x"], "x")
    np.testing.assert_array_equal(back["y"], tree["y"])
    self.assertEqual(back["z"], 3)
    # Whole stored chunks of 12 rows, as many as fit part_rows (at least 1).
    per_part = max(12, part_rows // 12 * 12)
    self.assertEqual(parts, [min(per_part, 61 - a)
                             for a in range(0, 61, per_part)])


  def test_tiny_orbax_chunks(self):
    """The arrays orbax stores in chunks of a few rows or columns: over
    2 GiB a shard, cut by divisors of its dimensions (the sharded ones
    first, then the largest)."""
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    cols = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)),
                         P(None, "x"))
    for rows, width, sharding, tiny in [
        (10_000_019, 64, one, True),       # prime rows: chunks of 1 row
        (20_000_038, 64, one, True),       # 2 x prime: chunks of 2 rows
        (100_000_007, 64, one, True),
        (64, 20_000_039, one, True),       # the largest dimension is cut
        (10_000_000, 64, one, False),      # 5M rows a chunk
        (2**27, 64, one, False),
        (1_000_003, 64, one, False),       # under 2 GiB: one chunk
        (100_000_007, 1, one, False),
        (10_000_019, 64, cols, False),     # shards of 1.28 GB
        (20_000_039, 64, cols, False)]:    # columns cut: 16 of 32
      x = jax.ShapeDtypeStruct((rows, width), jnp.float32, sharding=sharding)
      self.assertEqual(orbax_io.tiny_orbax_chunks(x), tiny,
                       (rows, width, sharding))

  def test_tiny_chunked_arrays_saved_from_the_host(self):
    """Such a jax array is saved from a host copy and restores as a jax
    array, bit for bit, under any sharding."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x = jax.device_put(
        np.random.default_rng(1).standard_normal((62, 8)).astype(np.float32),
        NamedSharding(mesh, P(None, "x")))
    with mock.patch.object(orbax_io, "tiny_orbax_chunks", return_value=True):
      ckpt.save(self.dir, {"t": x}, step=1)
    ckpt.save(self.dir, {"t": x}, step=2)
    # Saved from numpy (no sharding recorded), and by orbax's array handler.
    saved = lambda step: ckpt._saved_tree(self.dir, step)[1]["t"]  # pylint: disable=protected-access
    self.assertIsNone(saved(1).sharding)
    self.assertIsNotNone(saved(2).sharding)
    target = {"t": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=(
        NamedSharding(mesh, P("x", None))))}
    back = ckpt.restore(self.dir, target, step=1)
    self.assertIsInstance(back["t"], jax.Array)
    self.assertEqual(back["t"].sharding, target["t"].sharding)
    test_util.assert_bits_equal(self, back["t"], x, "t")


class IntegrityTest(_DirTest):

  def _state(self):
    host = _host_state()
    state = _put(host, _mesh(8))
    state.update({"b": True, "f": 0.25, "i": -3, "n32": np.int32(5),
                  "h64": np.arange(3.0)})
    target = _target(_mesh(2), host)
    target.update({"b": False, "f": 0.0, "i": 0,
                   "n32": np.zeros((), np.int32), "h64": np.zeros(3)})
    return state, target

  def _write_raw(self, directory, tree):
    """Writes `tree` with orbax as step 3, bypassing checkpoint.save."""
    ocp, epath = ckpt._orbax()
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(epath.Path(directory).absolute() / "3", tree)
      ckptr.wait_until_finished()

  def test_value_changed_after_save_is_caught(self):
    state, target = self._state()
    ckpt.save(self.dir, state, step=1)
    sums = jax.tree.unflatten(jax.tree.structure(state),
                              checksums_lib.checksums(jax.tree.leaves(state)))
    changes = {
        "table_f32": lambda x: x.at[5, 3].set(x[5, 3] + 1),
        "table_bf16": lambda x: x.at[0, 0].set(jnp.nan),
        "step": lambda x: x + 1,
        "b": lambda x: not x,
        "i": lambda x: x - 1,
        "n32": lambda x: np.asarray(x + 1, np.int32),
        "h64": lambda x: x * 2,
    }
    for leaf, change in changes.items():
      with self.subTest(leaf):
        directory = os.path.join(self.dir, leaf)
        self._write_raw(directory, {
            "pallas_emb_state": {**state, leaf: change(state[leaf])},
            "pallas_emb_checksums": sums})
        with self.assertRaisesRegex(
            ckpt.CheckpointError,
            rf"^pallas_emb checkpoint .*{leaf}.3 is damaged: array "
            rf"'{leaf}' does not match the checksum saved with it, so its "
            r"files changed after the save; do not use it, save the state "
            r"again \(no other complete step is there\)\.$"):
          ckpt.restore(directory, target)
    # Unchanged: exact, every kind of leaf verified without false alarms.
    out = ckpt.restore(self.dir, target)
    for k, v in state.items():
      np.testing.assert_array_equal(_bits(out[k]), _bits(v), err_msg=k)
    self.assertEqual((out["b"], out["f"], out["i"]), (True, 0.25, -3))

  def test_damaged_metadata_names_step_and_fix(self):
    small = {"v": jnp.arange(4.0)}
    target = {"v": jax.ShapeDtypeStruct(
        (4,), jnp.float32, sharding=NamedSharding(_mesh(1), P()))}
    for step in (1, 2):
      ckpt.save(self.dir, small, step=step)
    os.remove(os.path.join(self.dir, "2", "_METADATA"))
    with self.assertRaisesRegex(
        ckpt.CheckpointError,
        r"^pallas_emb checkpoint .*.2 is damaged: its metadata cannot be read "
        r"\(.*\); do not use it, restore another complete step with "
        r"step=\.\.\. \(there are \[1\]\)\.$"):
      ckpt.restore(self.dir, target)
    np.testing.assert_array_equal(
        ckpt.restore(self.dir, target, step=1)["v"], np.arange(4.0))
    coll = _collection(2, ["items"])
    ckpt.save_collection(self.dir, coll, test_util.random_state(coll, 0),
                         step=3)
    os.remove(os.path.join(self.dir, "3", "manifest.ocdbt"))
    with self.assertRaisesRegex(ckpt.CheckpointError,
                                r"3 is damaged: .*; do not use it"):
      ckpt.restore_collection(self.dir, coll)

  def test_missing_data_names_array(self):
    # 64 KiB: stored in the process's own data file, outside the b-tree.
    ckpt.save(self.dir, {"w": {"table": jnp.arange(16384.0)}}, step=0)
    data = os.path.join(self.dir, "0", "ocdbt.process_0", "d")
    for name in os.listdir(data):
      os.remove(os.path.join(data, name))
    target = {"w": {"table": jax.ShapeDtypeStruct(
        (16384,), jnp.float32, sharding=NamedSharding(_mesh(1), P()))}}
    with self.assertRaisesRegex(
        ckpt.CheckpointError,
        r"^pallas_emb checkpoint .*0 is damaged: array 'w/table' cannot be "
        r"read \(.*\); do not use it, save the state again"):
      ckpt.restore(self.dir, target)

  def test_unsavable_leaves_rejected_before_writing(self):
    coll = _collection(2, ["items"])
    state = test_util.random_state(coll, 0)
    for extra, what in (({"s": "hello"}, "a str"),
                        ({"o": [object()]}, "an object"),
                        ({"a": np.array(["x"])}, "a numpy array of dtype <U1"),
                        ({"k": jax.random.key(0)}, "a PRNG key array"),
                        ({"n": 2**64}, "the int 18446744073709551616")):
      with self.subTest(what):
        with self.assertRaisesRegex(
            ckpt.CheckpointError,
            rf"^pallas_emb checkpoint leaf 'extra/.*' is {what}.*, which a "
            "checkpoint cannot hold; save only"):
          ckpt.save_collection(self.dir, coll, state, step=0, extra=extra)
        self.assertEqual(os.listdir(self.dir), [])

  def test_save_removes_stale_temporary_directories(self):
    ckpt.save(self.dir, {"v": jnp.zeros(2)}, step=4)
    # What a save killed mid-write leaves (the name orbax gives it).
    for name in ("5.orbax-checkpoint-tmp-1764780000", "6.orbax-checkpoint-tmp"):
      os.makedirs(os.path.join(self.dir, name, "d"))
    self.assertEqual(ckpt.latest_step(self.dir), 4)
    ckpt.save(self.dir, {"v": jnp.ones(2)}, step=5)
    self.assertEqual(sorted(os.listdir(self.dir)), ["4", "5"])

  def test_checkpoint_without_checksums_restores_with_warning(self):
    host = _host_state()
    self._write_raw(self.dir, _put(host, _mesh(8)))
    with self.assertLogs(level="WARNING") as logs:
      out = ckpt.restore(self.dir, _target(_mesh(2)))
    self.assertTrue(any("predates checksums" in m for m in logs.output))
    for k, v in host.items():
      np.testing.assert_array_equal(_bits(out[k]), _bits(v))


def _collection(ranks, tables, lazy=True, dedup="sort"):
  opt = pe.RowwiseAdagrad(0.1, half_life_steps=3.0, lazy=lazy)
  specs = {"items": pe.TableSpec("items", 40, 16, optimizer=opt),
           "users": pe.TableSpec("users", 24, 16, optimizer=opt),
           "genre": pe.TableSpec("genre", 8, 16, optimizer=opt,
                                 dtype=jnp.bfloat16),
           "city": pe.TableSpec("city", 12, 16, optimizer=opt)}
  return pe.EmbeddingCollection(
      [specs[t] for t in tables], [pe.FeatureSpec(t, t) for t in tables],
      test_util.mesh({"x": ranks}), "x", dedup=dedup,
      backend="xla" if dedup == "slot_map" else None)


class CollectionCheckpointTest(_DirTest):

  def _trained(self, coll):
    """A state whose tables and optimizer state are not at their init."""
    state = test_util.random_state(coll, 0)
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

  def test_bf16_tables_are_saved_and_shown_as_bf16(self):
    """The xla backend's state holds a bf16 table as its uint16 bits; every
    view of it is bf16 with the same bits: table_arrays, a checkpoint
    (restored by a collection whose state holds bf16, and the other way
    round, checksums verified) and a bf16 serving copy."""
    rng = np.random.default_rng(3)
    # Every bf16 bit pattern class: random bits (incl. NaN payloads, -0).
    bits = rng.integers(0, 2**16, (8, 16), dtype=np.uint16)
    host = {"genre": bits.view(jnp.bfloat16),
            "items": rng.standard_normal((40, 16)).astype(np.float32)}

    def collection(backend):
      return pe.EmbeddingCollection(
          [pe.TableSpec(n, *host[n].shape, dtype=host[n].dtype,
                        optimizer=pe.RowwiseAdagrad(0.1)) for n in host],
          [pe.FeatureSpec(n, n) for n in host], test_util.mesh({"x": 2}),
          "x", backend=backend)

    def assert_shows(coll, state):
      tables = coll.table_arrays(state)
      for name, want in host.items():
        self.assertEqual(tables[name].dtype, want.dtype)
        np.testing.assert_array_equal(_bits(tables[name]), _bits(want))

    xla, interpret = collection("xla"), collection("interpret")
    state = xla.state_from_arrays(host)
    assert_shows(xla, state)
    # The Pallas kernels read bf16: the bits do not pass as a table there.
    with self.assertRaisesRegex(pe.InputError, r"table is uint16\[8, 16\]; "
                                r"the plan says bfloat16\[8, 16\]\."):
      interpret.table_arrays(state)
    (genre,) = [s.name for s in xla.plan.stacks if s.tables == ("genre",)]
    served = xla.quantize(state, "bfloat16").stacks[genre]
    self.assertEqual(served.dtype, jnp.bfloat16)
    np.testing.assert_array_equal(_bits(served), bits)
    # Saved by the xla collection, restored where the state holds bf16 (the
    # layout of checkpoints written before), and back.
    ckpt.save_collection(self.dir, xla, state, step=1)
    restored, _ = ckpt.restore_collection(self.dir, interpret)
    assert_shows(interpret, restored)
    ckpt.save_collection(self.dir, interpret, restored, step=2)
    assert_shows(xla, ckpt.restore_collection(self.dir, xla, step=2)[0])

  def test_slot_maps_are_not_saved(self):
    """dedup="slot_map": neither checkpoint holds the maps; both restores
    rebuild them, and the restored state trains on as the saved one."""
    coll = _collection(2, ["items", "genre"], dedup="slot_map")
    state = self._trained(coll)
    ckpt.save_collection(self.dir, coll, state, step=1)
    ckpt.save(self.dir, state, step=2)
    saved = ckpt._flat(ckpt._saved_tree(self.dir, 2)[1])
    self.assertEmpty([k for k in saved if "slot_map" in k])
    restored = [ckpt.restore_collection(self.dir, coll, step=1)[0],
                ckpt.restore(self.dir, coll.init(jax.random.key(1)),
                             step=2)]
    batch = {f: np.arange(8, dtype=np.int32) for f in coll.features}
    grads = {f: np.ones((8, 16), np.float32) for f in coll.features}
    want, _ = coll.apply_gradients(state, batch, grads)
    for got in restored:
      for s in coll.plan.stacks:
        np.testing.assert_array_equal(got.stacks[s.name].slot_map,
                                      np.full(s.total_rows, MAP_SENTINEL))
      got, _ = coll.apply_gradients(got, batch, grads)
      for a, b in zip(jax.tree.leaves(coll.table_arrays(got)),
                      jax.tree.leaves(coll.table_arrays(want))):
        np.testing.assert_array_equal(_bits(a), _bits(b))

  def test_each_restore_says_what_another_checkpoint_holds(self):
    """restore_collection of a serving or plain orbax checkpoint and
    restore_serving of a training one name what the directory holds and
    the restore that reads it."""
    coll = _collection(2, ["items", "users"])
    state = test_util.random_state(coll, 0)
    kinds = {"training": os.path.join(self.dir, "training"),
             "serving": os.path.join(self.dir, "serving"),
             "other": os.path.join(self.dir, "other")}
    ckpt.save_collection(kinds["training"], coll, state, step=1)
    ckpt.save(kinds["serving"], coll.quantize(state, "int8"), step=2)
    ocp, epath = ckpt._orbax()  # pylint: disable=protected-access
    with ocp.StandardCheckpointer() as ckptr:  # orbax's own, not ours
      ckptr.save(epath.Path(kinds["other"]) / "3",
                 {"params": {"w": np.ones(3, np.float32)}, "step": 3})
      ckptr.wait_until_finished()
    for kind, message in (
        ("serving", r"restore_collection: checkpoint .*serving/2 holds an "
         r"int8 serving state \(save\(\) of coll.quantize\(state, "
         r"'int8'\)\), not the logical tables that save_collection writes; "
         r"restore it with restore_serving\(directory, coll, 'int8'\)"),
        ("other", r"other/3 holds a tree of 2 arrays that no pallas_emb "
         r"collection function wrote \(top-level keys \['params', "
         r"'step'\]\), not the logical tables .*restore\(directory, "
         r"target\)")):
      with self.assertRaisesRegex(pe.CheckpointError, message):
        ckpt.restore_collection(kinds[kind], coll)
    with self.assertRaisesRegex(
        pe.CheckpointError,
        r"restore_serving: checkpoint .*training/1 holds a training "
        r"checkpoint \(save_collection: logical tables \['items', "
        r"'users'\] and their optimizer states\), not a bfloat16 serving "
        r"state; restore it with restore_collection\(directory, coll\), "
        r"then serve coll.quantize\(state, 'bfloat16'\)"):
      ckpt.restore_serving(kinds["training"], coll, "bfloat16")

  def test_unknown_saved_table(self):
    saved_coll = _collection(2, ["items", "users"])
    ckpt.save_collection(self.dir, saved_coll,
                         test_util.random_state(saved_coll, 0), step=1)
    with self.assertRaisesRegex(pe.CheckpointError, r"holds tables "
                                r"\['users'\] that the collection does not "
                                "have"):
      ckpt.restore_collection(self.dir, _collection(2, ["items"]))


if __name__ == "__main__":
  absltest.main()
