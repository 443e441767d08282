"""Fault injection for pallas_emb.checkpoint: what a crash or a damaged disk
does to a restore.

`kill -9` during saves, random byte flips in the data files, and every kind
of checkpoint file truncated or deleted. Each restore must give the saved
values bit-exactly or raise CheckpointError; wrong values or any other
exception fail. The counts are printed (run with -s to see them).

Run as `python tests/checkpoint_fault_test.py save_forever DIR`, the file is
the worker the kill test starts: it saves steps to DIR until killed.
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import test_util

from absl.testing import absltest
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

import pallas_emb as pe
from pallas_emb import checkpoint as ckpt

_SPECS = {"f32": P(None, "x"), "bf16": P("x", None), "i32": P("x"),
          "mask": P(None, "x"), "count": P()}


def _host(step: int):
  """The state saved at `step`: arrays of every kind, all distinct, the
  tables large enough (64 KiB, 16 KiB) to be stored out of the b-tree."""
  rng = np.random.default_rng(step)
  return {
      "f32": rng.standard_normal((1024, 16)).astype(np.float32),
      "bf16": rng.standard_normal((512, 16)).astype(test_util.BF16),
      "i32": rng.integers(-2**31, 2**31, 24, dtype=np.int64).astype(np.int32),
      "mask": rng.random((8, 8)) < 0.5,
      "count": np.int32(step),
  }


def _state(step: int, mesh):
  host = _host(step)
  state = {k: jax.device_put(v, NamedSharding(mesh, _SPECS[k]))
           for k, v in host.items()}
  state["step"] = step  # A python scalar leaf.
  return state


def _target(mesh):
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                    sharding=NamedSharding(mesh, _SPECS[k]))
            for k, v in _host(0).items()}
  target["step"] = 0
  return target


def _collection():
  opt = pe.RowwiseAdagrad(0.1)
  tables = [pe.TableSpec("items", 2048, 8, optimizer=opt),
            pe.TableSpec("genre", 8, 8, optimizer=opt, dtype=jnp.bfloat16)]
  return pe.EmbeddingCollection(
      tables, [pe.FeatureSpec(t.name, t.name) for t in tables],
      test_util.mesh({"x": 8}), "x")


def _save_forever(directory: str) -> None:
  """The kill test's worker: saves step after step until it is killed."""
  mesh = test_util.mesh({"x": 8})
  last = ckpt.latest_step(directory)
  step = 0 if last is None else last + 1
  while True:
    ckpt.save(directory, _state(step, mesh), step=step)
    print(f"saved {step}", flush=True)
    step += 1


def _files(step_dir: str) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, f), step_dir)
                for d, _, files in os.walk(step_dir) for f in files)


def _data_files(step_dir: str) -> list[str]:
  # Tensorstore's OCDBT files live in `d/` folders: each process's own
  # (`ocdbt.process_<i>/d/`, the chunk data) and the step's (the b-tree
  # orbax merges them under; arrays under ~100 bytes inline there).
  return [f for f in _files(step_dir)
          if os.path.basename(os.path.dirname(f)) == "d"]


class FaultTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._tmp = tempfile.TemporaryDirectory()
    cls.mesh = test_util.mesh({"x": 8})
    # A dict of sharded arrays (step 3) and a collection (step 4); every
    # damage test works on a fresh copy.
    cls.state_dir = os.path.join(cls._tmp.name, "state")
    ckpt.save(cls.state_dir, _state(3, cls.mesh), step=3)
    cls.coll = _collection()
    cls.coll_state = cls.coll.init(jax.random.key(0))
    cls.coll_dir = os.path.join(cls._tmp.name, "coll")
    ckpt.save_collection(cls.coll_dir, cls.coll, cls.coll_state, step=4,
                         extra={"step": 4})

  @classmethod
  def tearDownClass(cls):
    cls._tmp.cleanup()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = tmp.name

  def _assert_state(self, restored, step):
    want = _host(step)
    self.assertEqual(restored["step"], step)
    for k, v in want.items():
      test_util.assert_bits_equal(self, restored[k], v, k)

  def _restore_state(self, directory):
    out = ckpt.restore(directory, _target(self.mesh))
    self._assert_state(out, 3)

  def _restore_coll(self, directory):
    restored, extra = ckpt.restore_collection(directory, self.coll,
                                              extra={"step": 0})
    self.assertEqual(extra["step"], 4)
    want = (self.coll.table_arrays(self.coll_state),
            self.coll.optimizer_arrays(self.coll_state))
    got = (self.coll.table_arrays(restored),
           self.coll.optimizer_arrays(restored))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      test_util.assert_bits_equal(self, a, b)

  def _damaged_copy(self, source, name, damage):
    """A copy of checkpoint `source` with `damage(path)` done to the file
    `name` of its step; returns the copy's directory."""
    copy = os.path.join(self.dir, f"copy{len(os.listdir(self.dir))}")
    shutil.copytree(source, copy)
    (step,) = os.listdir(copy)
    damage(os.path.join(copy, step, name))
    return copy

  def _attempt(self, restore, directory, what):
    """'checksum' or 'unreadable' (a CheckpointError naming the step: values
    that differ from their checksum, or files that cannot be read) or
    'exact'; fails on anything else."""
    try:
      restore(directory)
    except pe.CheckpointError as e:
      self.assertRegex(str(e), r"^pallas_emb checkpoint ", what)
      self.assertIn(directory, str(e), what)
      return "checksum" if "does not match the checksum" in str(e) else (
          "unreadable")
    return "exact"

  def test_kill_during_save(self):
    rng = random.Random(0)
    env = dict(os.environ, PYTHONPATH=test_util.ROOT + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    kills, mid_save, last = 5, 0, None
    for kill in range(kills):
      proc = subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), "save_forever",
           self.dir], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
          text=True, env=env)
      # The first save compiles and starts orbax; the later ones take
      # ~0.2 s each here, so this lands in and between them.
      first = proc.stdout.readline()
      self.assertRegex(first, r"^saved \d+$")
      time.sleep(rng.uniform(0.0, 1.0))
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      saved = [int(line.split()[1]) for line in (
          first + proc.stdout.read()).split("\n") if line.startswith("saved ")]
      proc.stdout.close()
      # orbax writes a step into `<step>.orbax-checkpoint-tmp*` first.
      mid_save += any(".orbax-checkpoint-tmp" in n
                      for n in os.listdir(self.dir))
      before, last = last, ckpt.latest_step(self.dir)
      # A save that returned is committed; the one killed is not visible
      # unless it was killed after its commit.
      self.assertIn(last, (saved[-1], saved[-1] + 1), kill)
      self.assertEqual(saved[0], 0 if before is None else before + 1, kill)
      self._assert_state(ckpt.restore(self.dir, _target(self.mesh)), last)
    # The next save removes what the killed ones left half-written.
    step = last + 1
    ckpt.save(self.dir, _state(step, self.mesh), step=step)
    self.assertEqual([n for n in os.listdir(self.dir) if not n.isdigit()], [])
    print(f"\nkill -9 during save: {kills} kills ({mid_save} left a "
          "half-written temporary directory), after each the last complete "
          f"step restored bit-exactly; last step {last}")

  def _flips(self, source, restore, count, seed):
    """Outcomes of `count` single-byte flips, each in a fresh copy of
    `source`, at uniformly random bytes of its data files."""
    rng = np.random.default_rng(seed)
    step_dir = os.path.join(source, os.listdir(source)[0])
    files = _data_files(step_dir)
    sizes = np.array([os.path.getsize(os.path.join(step_dir, f))
                      for f in files])
    outcomes = []
    for _ in range(count):
      # A uniformly random byte of all the data, XORed with a nonzero byte.
      at = int(rng.integers(sizes.sum()))
      i = int(np.searchsorted(np.cumsum(sizes), at, side="right"))
      offset, mask = at - int(sizes[:i].sum()), int(rng.integers(1, 256))

      def flip(path, offset=offset, mask=mask):
        with open(path, "r+b") as f:
          f.seek(offset)
          byte = f.read(1)[0]
          f.seek(offset)
          f.write(bytes([byte ^ mask]))

      copy = self._damaged_copy(source, files[i], flip)
      outcomes.append(self._attempt(restore, copy,
                                    f"{files[i]}@{offset}^{mask}"))
    return outcomes

  def test_byte_flips_in_data_files(self):
    flips = {
        "state": self._flips(self.state_dir, self._restore_state, 20, 0),
        "collection": self._flips(self.coll_dir, self._restore_coll, 10, 1)}
    for name, outcomes in flips.items():
      print(f"\nbyte flips in data files ({name}): {len(outcomes)} flips, "
            f"{outcomes.count('checksum')} caught by checksum, "
            f"{outcomes.count('unreadable')} unreadable, "
            f"{outcomes.count('exact')} restored bit-exactly")
    # Most bytes are chunk data: a flip there changes values (which orbax
    # alone returned) or breaks their decoding.
    for outcomes in flips.values():
      self.assertGreaterEqual(outcomes.count("checksum"), len(outcomes) // 4)
      self.assertLessEqual(outcomes.count("exact"), len(outcomes) // 2)

  def test_truncated_and_deleted_files(self):
    def truncate(path):
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)

    def empty(path):
      open(path, "wb").close()

    step_dir = os.path.join(self.state_dir, "3")
    names = _files(step_dir)
    for required in ("manifest.ocdbt", "_METADATA", "_CHECKPOINT_METADATA",
                     "commit_success.txt"):
      self.assertIn(required, names)
    counts = {}
    for name in names:
      for damage in (truncate, empty, os.remove):
        copy = self._damaged_copy(self.state_dir, name, damage)
        outcome = self._attempt(self._restore_state, copy,
                                f"{damage.__name__} {name}")
        counts[outcome] = counts.get(outcome, 0) + 1
        # Files whose loss cannot leave the values readable (a truncated
        # commit marker still marks the step complete: exact values).
        if name in ("manifest.ocdbt", "_METADATA") or (
            name == "commit_success.txt" and damage is os.remove):
          self.assertNotEqual(outcome, "exact", f"{damage.__name__} {name}")
    print(f"\ntruncated/emptied/deleted files: {sum(counts.values())} "
          f"damaged copies ({len(names)} files x 3): {counts}")

  def test_collection_missing_data_file(self):
    step_dir = os.path.join(self.coll_dir, "4")
    for name in _data_files(step_dir):
      copy = self._damaged_copy(self.coll_dir, name, os.remove)
      self._attempt(self._restore_coll, copy, name)


if __name__ == "__main__":
  if sys.argv[1:2] == ["save_forever"]:
    _save_forever(sys.argv[2])
  else:
    absltest.main()
