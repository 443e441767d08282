"""pad_ragged rejects what is not an id or a weight, naming the row."""

import re

import test_util  # pylint: disable=unused-import  (sets up 8 CPU devices)

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

import pallas_emb as pe


class PadRaggedInputsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("fraction", [[1, 2], [1.5, 2.7]], "row 1 holds float64 values [1.5, "
       "2.7]; expected integer ids"),
      # A whole float is still not an id, as for lookup.
      ("whole_float", [[1.0, 2.0]], "row 0 holds float64 values [1.0, 2.0]"),
      ("float32", [np.array([3], np.float32)], "row 0 holds float32 values"),
      ("bool", [[3], [True, False]], "row 1 holds bool values [True, False]"),
      ("tuple_form", (np.array([1, 2, 0.5]), np.array([2, 1])),
       "row 0 holds float64 values [1.0, 2.0]"),
      ("uint64_past_int64", [np.array([2**64 - 1], np.uint64)],
       "row 0 holds ids in [18446744073709551615, 18446744073709551615], "
       "outside int32"),
      ("int64_past_int32", [[0], [2**31]], "row 1 holds ids in [2147483648, "
       "2147483648], outside int32"),
      ("nested", [[1, [2, 3]]], "row 0 is not a flat list of numbers"),
  )
  def test_bad_ids(self, rows, message):
    with self.assertRaisesRegex(pe.InputError,
                                "^pallas_emb pad_ragged " + re.escape(message)):
      pe.pad_ragged(rows)

  @parameterized.named_parameters(
      ("nan", [[1.0, float("nan")]], "row 1 has weights [nan]"),
      ("inf", [[-np.inf, 1.0]], "row 1 has weights [-inf]"),
      ("f32_overflow", [[1e39, 1.0]], "row 1 has weights [1e+39]"),
      ("strings", [["a", "b"]], "row 1 has weights of dtype <U1"),
  )
  def test_bad_weights(self, bad_row, message):
    with self.assertRaisesRegex(pe.InputError,
                                "^pallas_emb pad_ragged " + re.escape(message)):
      pe.pad_ragged([[1], [2, 3]], weights=[[1.0]] + bad_row)

  @parameterized.parameters(1.5, True, 2**31, "0")
  def test_bad_pad_id(self, pad_id):
    with self.assertRaisesRegex(pe.InputError, re.escape(
        f"pallas_emb pad_ragged pad_id={pad_id!r} must be an int32 id")):
      pe.pad_ragged([[1]], max_len=2, pad_id=pad_id)

  def test_float_lengths(self):
    with self.assertRaisesRegex(pe.InputError, "non-negative integer "
                                "lengths"):
      pe.pad_ragged((np.array([1, 2, 3]), np.array([1.5, 1.5])))

  def test_integer_ids_of_any_dtype(self):
    """Model: the bags written row by row into a pad_id-filled int32 array;
    weight 1 per id, 0 per padding slot."""
    rows = [np.array([3, 255], np.uint8), np.array([-2**31], np.int64),
            np.array([], np.float64), np.array([2**31 - 1], np.uint32),
            [7, -1]]
    ids, weights = pe.pad_ragged(rows, max_len=3, pad_id=-5)
    want = np.full((5, 3), -5, np.int64)
    want_w = np.zeros((5, 3), np.float32)
    for i, row in enumerate(rows):
      want[i, :len(row)] = np.asarray(row, np.int64)
      want_w[i, :len(row)] = 1
    self.assertEqual(ids.dtype, np.int32)
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_array_equal(weights, want_w)


if __name__ == "__main__":
  absltest.main()
