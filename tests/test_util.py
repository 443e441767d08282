"""Shared test set-up: 8 simulated CPU devices, meshes, the backend flag.

Import this before jax in every test binary.
"""

import os
import sys

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                             _FLAG).strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import ml_dtypes  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

_BACKEND = flags.DEFINE_string(
    "backend", None,
    "Run the tests on this backend only (pallas, interpret, xla); default: "
    "xla and interpret, plus pallas on a GPU. Under pytest, set "
    "PALLAS_EMB_TEST_BACKEND instead.")

BF16 = ml_dtypes.bfloat16


def backends() -> list[str]:
  """The backends the tests run on."""
  chosen = _BACKEND.value if flags.FLAGS.is_parsed() else None
  chosen = chosen or os.environ.get("PALLAS_EMB_TEST_BACKEND")
  if chosen:
    return [chosen]
  found = ["xla", "interpret"]
  if jax.devices()[0].platform == "gpu":
    found.append("pallas")
  return found


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
