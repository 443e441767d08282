"""Shared test set-up: 8 simulated CPU devices, meshes, the backend flag.

Import this before jax in every test binary.
"""

import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from unittest import mock

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                             _FLAG).strip()

CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def use_compilation_cache() -> None:
  """Every program compiled once per test run.

  Many tests compile the same programs (the same small collections and
  configs, in several test processes and in the programs they start); JAX's
  persistent cache, kept in a directory that lives as long as the run
  (tests/conftest.py makes one shared by the pytest-xdist workers), turns
  the repeats into reads. Cached executables are the compiler's own output,
  so the tests run the same code. Set before jax is imported; the programs
  the tests start inherit it.
  """
  if CACHE_ENV not in os.environ:  # a test file run on its own
    directory = tempfile.mkdtemp(prefix="pallas_emb_jax_cache_")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ[CACHE_ENV] = directory
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


use_compilation_cache()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import ml_dtypes  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

_BACKEND = flags.DEFINE_string(
    "backend", None,
    "Run the tests on this backend only (xla, interpret, triton, "
    "mosaic_tpu, or pallas: the platform's); default: xla and interpret, "
    "plus triton on a GPU. Under pytest, set "
    "PALLAS_EMB_TEST_BACKEND instead.")

BF16 = ml_dtypes.bfloat16
# On a GPU, XLA's and Triton's division, sqrt and exp may differ from numpy's
# by an ulp: tests that compare bits on CPU state a tolerance there.
ON_GPU = jax.devices()[0].platform == "gpu"
ON_TPU = jax.devices()[0].platform == "tpu"
# The xla backend and the interpreter's store hazard are XLA:CPU's business.
CPU_ONLY = ("checks XLA:CPU's compiled program or interpreter; a GPU runs "
            "the pallas kernels")
# Tests of the whole library run the kernel backends on one case in this
# many (see `backends_for`); this variable set to 1 runs them on every case.
KERNEL_CASE_EVERY = 3
EVERY_CASE_ENV = "PALLAS_EMB_TEST_KERNELS_EVERY_CASE"


@contextlib.contextmanager
def update_in_chunks(size: int, rows: int | None = None):
  """The xla backend's loops run in chunks of `size` in what is traced
  inside: over a unique buffer's used slots (`kernels.xla.CHUNK_SLOTS`,
  32768) and over the rows a scatter-add makes f32 (`CHUNK_ROWS`, 8192;
  `rows` if given), both more than a test's; and a stack's update runs at
  the smallest size that holds the batch's rows down to `size`
  (`stack.MIN_TIER_SLOTS`, 4096). Jitted functions trace once per
  signature, so JAX's in-memory caches are cleared on entry and exit."""
  from pallas_emb import stack  # pylint: disable=g-import-not-at-top
  from pallas_emb.kernels import xla  # pylint: disable=g-import-not-at-top
  jax.clear_caches()
  try:
    with mock.patch.object(xla, "CHUNK_SLOTS", size), \
         mock.patch.object(xla, "CHUNK_ROWS", rows or size), \
         mock.patch.object(stack, "MIN_TIER_SLOTS", size):
      yield
  finally:
    jax.clear_caches()


def backends() -> list[str]:
  """The backends the tests run on."""
  chosen = _BACKEND.value if flags.FLAGS.is_parsed() else None
  chosen = chosen or os.environ.get("PALLAS_EMB_TEST_BACKEND")
  if chosen == "pallas":  # the platform's Pallas backend
    chosen = "triton" if ON_GPU else "mosaic_tpu" if ON_TPU else chosen
  if chosen:
    return [chosen]
  # The Mosaic TPU kernels (interpreted, or on a TPU) run in
  # tests/mosaic_tpu_test.py.
  found = ["xla", "interpret"]
  if ON_GPU:
    found.append("triton")
  return found


def backends_for(case) -> list[str]:
  """The backends of one case of a parameterized test of the whole library.

  The interpreter runs a kernel's body op by op, at ~2.5x the CPU time of
  the xla twin, and each kernel is proven equal to its twin case by case in
  the kernel tests (gather, pool, segment_sum, adagrad, optimizer_kernels,
  xla_backend). So a library test runs the xla twins on every case and the
  kernel backends too on cases 0, 3, 6, ... of its grid (an odd stride, so
  the innermost parameters alternate); `PALLAS_EMB_TEST_KERNELS_EVERY_CASE=1`
  or one chosen backend (`PALLAS_EMB_TEST_BACKEND`) runs them everywhere.

  Args:
    case: the test (`self`: its absl parameterized index is read from the
      method name; a test without one gets every backend) or a case number.
  """
  chosen = backends()
  if not isinstance(case, int):
    digits = re.search(r"(\d+)$", case._testMethodName)  # pylint: disable=protected-access
    case = int(digits.group(1)) if digits else 0
  if case % KERNEL_CASE_EVERY == 0 or os.environ.get(EVERY_CASE_ENV) == "1":
    return chosen
  return [b for b in chosen if b == "xla"] or chosen


def all_pairs(**axes) -> list[dict]:
  """Cases of a test grid that hold every pair of values of two axes.

  A product grid of three or more axes repeats each pair many times; the
  bugs it finds come from one value or from two interacting (a rank count
  with a dtype, an optimizer with a rank count), so a case list that holds
  every pair (greedy: each next case covers the most pairs not yet seen,
  ties to the earliest in product order) keeps that coverage with a fraction
  of the compiles. Deterministic; for `parameterized.parameters`.
  """
  names = list(axes)
  values = [list(v) for v in axes.values()]
  def pairs(case):  # case: one value index per axis
    return {(a, case[a], b, case[b])
            for a, b in itertools.combinations(range(len(names)), 2)}
  candidates = [tuple(c) for c in itertools.product(
      *[range(len(v)) for v in values])]
  uncovered = set().union(*(pairs(c) for c in candidates))
  chosen = []
  while uncovered:
    best = max(candidates, key=lambda c: len(pairs(c) & uncovered))
    chosen.append(best)
    uncovered -= pairs(best)
  return [{n: v[i] for n, v, i in zip(names, values, c)} for c in chosen]


def mesh(shape: dict[str, int], explicit: bool = False) -> jax.sharding.Mesh:
  """A mesh over the first prod(shape) devices, Auto or Explicit axes."""
  names = tuple(shape)
  sizes = tuple(shape.values())
  devices = jax.devices()[:int(np.prod(sizes))]
  if explicit:
    return jax.make_mesh(sizes, names, devices=devices,
                         axis_types=(jax.sharding.AxisType.Explicit,) *
                         len(names))
  return jax.sharding.Mesh(np.array(devices).reshape(sizes), names)


def on_mesh_of(tree, params):
  """`tree` (an optimizer state) with its single-device leaves replicated on
  the mesh of `params`, where a jitted step returns them: the step's first
  call then compiles the program the later ones run (once, not twice)."""
  meshes = [leaf.sharding.mesh for leaf in jax.tree.leaves(params)
            if isinstance(leaf.sharding, jax.sharding.NamedSharding)]
  if not meshes:
    return tree
  replicated = jax.sharding.NamedSharding(meshes[0],
                                          jax.sharding.PartitionSpec())
  return jax.tree.map(
      lambda leaf: jax.device_put(leaf, replicated) if isinstance(
          leaf.sharding, jax.sharding.SingleDeviceSharding) else leaf, tree)


def as_numpy(x) -> np.ndarray:
  """A host copy; bf16 stays bf16 (ml_dtypes)."""
  return np.asarray(jax.device_get(x))


def assert_bits_equal(test, actual, expected, msg=""):
  """Bit-exact comparison that treats NaNs with equal bits as equal."""
  actual, expected = as_numpy(actual), np.asarray(expected)
  test.assertEqual(actual.shape, expected.shape, msg)
  test.assertEqual(actual.dtype, expected.dtype, msg)
  view = {2: np.uint16, 4: np.uint32, 1: np.uint8}[actual.dtype.itemsize]
  np.testing.assert_array_equal(actual.view(view), expected.view(view),
                                err_msg=msg)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_program(module: str, args, directory: str, *, drop_env=(),
                timeout: float = 600):
  """`python -m MODULE ARGS --json_out=DIR/out.json` from `directory`, with
  the repository on the path and without XLA_FLAGS (the programs set their
  own). Returns `(the JSON it wrote, its stdout)`; fails with its output."""
  out = os.path.join(directory, "out.json")
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  for name in ("XLA_FLAGS",) + tuple(drop_env):
    env.pop(name, None)
  cmd = [sys.executable, "-m", module, *args, f"--json_out={out}"]
  proc = subprocess.run(cmd, cwd=directory, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)
  if proc.returncode:
    raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}"
                         f"\n{proc.stderr[-5000:]}")
  with open(out) as f:
    return json.load(f), proc.stdout


def random_state(coll, seed: int = 0):
  """A collection state of random logical tables, N(0, 1 / width) like the
  default initializer, with fresh optimizer state.

  For tests of the dataflow, which need some tables and then follow them
  with a numpy model: made in numpy and placed by `state_from_arrays`, it
  compiles no random-number program (`coll.init` compiles one per stack,
  ~0.6 s each on this CPU). Tests of `init` itself call `init`.
  """
  rng = np.random.default_rng(seed)
  return coll.state_from_arrays({
      name: (rng.standard_normal((spec.vocab_rows, spec.emb_width))
             / np.sqrt(spec.emb_width)).astype(spec.dtype)
      for name, spec in coll.tables.items()})


def assert_trainer_checks_overflow(test, coll, batch, message: str,
                                   num_overflow: int) -> None:
  """One unpipelined Trainer step over a batch that overflows a cap: by
  default it raises (`message` matches), and with check_overflow=False its
  stats count `num_overflow` ids in stack0."""
  import optax  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  loss = lambda params, emb, b: (sum(jax.numpy.sum(e) for e in emb.values()),
                                 ())
  for check in (True, False):
    trainer = pe.Trainer(coll, loss, optax.sgd(0.1), pipelined=False,
                         check_overflow=check)
    state = trainer.init(random_state(coll), {})
    step = jax.jit(trainer.step)
    if check:
      with test.assertRaisesRegex(Exception, message):
        jax.block_until_ready(step(state, batch))
    else:
      _, metrics = step(state, batch)
      test.assertEqual(int(metrics.updates["stack0"].num_overflow),
                       num_overflow)
