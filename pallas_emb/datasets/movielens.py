"""MovieLens-100k: found on disk (or inside the RecBole 1.2.1 wheel) and parsed.

ML-100k ships inside the `recbole` wheel
(recbole/dataset_example/ml-100k/ml-100k.inter), so one
`pip download --no-deps recbole==1.2.1 -d ~/.cache/pallas_emb` (no
dependencies, recbole is never imported or installed) brings it;
`download_movielens()` runs exactly that (and `find_movielens(download=True)`
when the search finds nothing).
"""

from __future__ import annotations

import dataclasses
import os
import re
import zipfile
import zlib
from typing import Mapping, Sequence

import numpy as np

from pallas_emb.datasets import files
from pallas_emb.datasets import recbole
from pallas_emb.datasets.dataset import Dataset
from pallas_emb.datasets.dataset import DataError

# Where the RecBole wheel keeps its copy of MovieLens-100k.
RECBOLE_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
RECBOLE_REQUIREMENT = "recbole==1.2.1"
_UDATA = "u.data"
_INTER = "ml-100k.inter"

_EXPECTED = ("expected u.data (user\\titem\\trating\\ttimestamp) or "
             "ml-100k.inter (RecBole atomic file)")
_HINT = ("pass --data_path or `pip download --no-deps recbole==1.2.1 "
         "-d ~/.cache/pallas_emb`")

_MIN_RATING, _MAX_RATING = 0.5, 5.0


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
    raise DataError(f"{origin}:1: RecBole header {recbole.short(header)} lacks "
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
                      f"{len(fields)}: {recbole.short(line)}.")
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


SOURCE = files.Source(
    name="MovieLens-100k", requirement=RECBOLE_REQUIREMENT,
    member=RECBOLE_MEMBER, file_names=(_UDATA, _INTER), subdir="ml-100k",
    zip_names=(_INTER, _UDATA), wheel_glob="recbole-*.whl",
    expected=_EXPECTED, hint=_HINT)


def default_candidates() -> list[str]:
  """Where `load_movielens(None)` looks, in order (globs for wheels).

  $PALLAS_EMB_DATA_DIR (ratings files or a recbole wheel), an installed
  recbole on sys.path / site-packages, then a recbole wheel in the current
  directory or ~/.cache/pallas_emb (or ratings files there).
  """
  return SOURCE.default_candidates()


def find_movielens(path: str | None = None, *, download: bool = False) -> str:
  """The file `load_movielens(path)` would read; raises `DataError`.

  With `download` and no `path`, a search that finds nothing runs
  `download_movielens()` (into ~/.cache/pallas_emb) and returns the wheel;
  its `DataError` says why when that fails too.
  """
  return SOURCE.find(path, download=download)


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
  text, origin = SOURCE.read(find_movielens(path))
  users, items, ratings = parse_ratings(text, origin)
  user_ids, user_vocab = _dense_ids(users)
  item_ids, item_vocab = _dense_ids(items)
  return Dataset(
      features={"user": user_ids, "item": item_ids},
      labels=ratings,
      vocab_sizes={"user": user_vocab, "item": item_vocab},
      name="movielens-100k")


def download_movielens(directory: str | None = None, *,
                       timeout: float = 300.0) -> str:
  """Fetches ML-100k: `pip download --no-deps recbole==1.2.1 -d DIRECTORY`.

  Only the recbole wheel is downloaded (no dependencies; nothing is
  installed or imported); the loader reads ML-100k from inside it.

  Args:
    directory: where the wheel goes; default ~/.cache/pallas_emb, one of the
      places `load_movielens(None)` searches.
    timeout: seconds pip may take.

  Returns:
    The wheel's path (`find_movielens(directory)`).

  Raises:
    DataError: pip failed (no network, no pip, ...), with its last lines.
  """
  return SOURCE.download(directory, timeout=timeout)


# ----------------------------------------------------------------------------
# Side features: ml-100k.user and ml-100k.item (RecBole atomic files).

_SIDE_SUFFIXES = {"user": ".user", "item": ".item"}
_USER_COLUMNS = ("user_id", "age", "gender", "occupation", "zip_code")
_ITEM_COLUMNS = ("item_id", "movie_title", "release_year", "class")
# ML-1M's age groups: under 18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+.
AGE_BOUNDS = (18, 25, 35, 45, 50, 56)
_TITLE_YEAR = re.compile(r"\((\d{4})\)")
_WORD = re.compile(r"\w+")


@dataclasses.dataclass(frozen=True, eq=False)
class SideFeatures:
  """Categorical features of the users (or items) of a ratings Dataset.

  Row k describes the dense id k of the Dataset's "user" (or "item")
  feature; row 0 (padding) is all zeros.

  Attributes:
    values: feature name -> int32 ids, `[rows]` for a feature with one value
      per row (age, gender, ...) or `[rows, max_len]` for a bag (genres,
      title words), padded with 0. Real ids are in [1, vocab).
    vocab_sizes: feature name -> rows of its table, padding row included.
    names: feature name -> the value each id stands for (index = id; entry
      0 is "<pad>"), for reading learned tables; hashed features list their
      buckets.
  """
  values: Mapping[str, np.ndarray]
  vocab_sizes: Mapping[str, int]
  names: Mapping[str, tuple[str, ...]]

  @property
  def bags(self) -> tuple[str, ...]:
    """The multi-valued features (2-D values)."""
    return tuple(k for k, v in self.values.items() if v.ndim == 2)


def _side_member(names: Sequence[str], ratings_member: str,
                 suffix: str) -> str | None:
  stem, ext = os.path.splitext(ratings_member)
  if ext != ".inter":
    return None
  return stem + suffix if stem + suffix in names else None


def _side_missing(kind: str, tried: str) -> DataError:
  return DataError(
      f"pallas_emb could not find the MovieLens-100k {kind} features: tried "
      f"{tried}; they are the RecBole atomic file ml-100k"
      f"{_SIDE_SUFFIXES[kind]} beside ml-100k.inter; pass the recbole wheel "
      "or a directory holding both as --data_path, or `pip download "
      "--no-deps recbole==1.2.1 -d ~/.cache/pallas_emb`.")


def _read_side(source: str, kind: str) -> tuple[str, str]:
  """(text, origin) of the `.user`/`.item` file beside the ratings `source`.

  Beside a RecBole `<name>.inter` (a file, or a member of a wheel / zip) the
  side files are `<name>.user` and `<name>.item`.
  """
  suffix = _SIDE_SUFFIXES[kind]
  if zipfile.is_zipfile(source):
    try:
      with zipfile.ZipFile(source) as archive:
        names = archive.namelist()
        ratings_member = SOURCE.zip_member(names) or _UDATA
        member = _side_member(names, ratings_member, suffix)
        if member is None:
          stem, ext = os.path.splitext(ratings_member)
          raise _side_missing(kind, f"{source}!" + (
              stem + suffix if ext == ".inter" else f"*/ml-100k{suffix}"))
        raw = archive.read(member)
    except (zipfile.BadZipFile, OSError) as e:
      raise DataError(f"pallas_emb could not read zip file {source}: "
                      f"{e}.") from e
    origin = f"{source}!{member}"
    return files.decode(raw, origin, _EXPECTED), origin
  stem, ext = os.path.splitext(source)
  path = (stem if ext == ".inter" else
          os.path.join(os.path.dirname(source), "ml-100k")) + suffix
  if not os.path.isfile(path):
    raise _side_missing(kind, path)
  return files.read_text(path, _EXPECTED)


def _parse_atomic(text: str, origin: str, wanted: Sequence[str]
                  ) -> list[tuple[int, dict[str, str]]]:
  """(line number, {column: token}) of each row of a RecBole atomic file."""
  lines, body, names = recbole.header(text, origin, wanted)
  cols = [names.index(w) for w in wanted]
  rows = []
  for n in body:
    fields = lines[n].rstrip("\r\n").split("\t")
    if len(fields) != len(names):
      raise DataError(f"{origin}:{n + 1}: expected {len(names)} tab-separated "
                      f"columns as in the header, got {len(fields)}: "
                      f"{recbole.short(lines[n])}.")
    rows.append((n + 1, {w: fields[c].strip() for w, c in zip(wanted, cols)}))
  return rows


def _index_rows(rows, key: str, origin: str, what: str,
                wanted_ids: np.ndarray
                ) -> tuple[list[tuple[str, dict[str, str]]], list[int]]:
  """(every row as ("origin:line", row), the positions of `wanted_ids`).

  `wanted_ids`: the raw ids of the ratings, sorted (dense id k is
  wanted_ids[k - 1]); each must have exactly one row.
  """
  by_id, out = {}, []
  for lineno, row in rows:
    where = f"{origin}:{lineno}"
    raw_id = _parse_int_id(row[key], f"{what} id", where)
    if raw_id in by_id:
      first = out[by_id[raw_id]][0].rsplit(":", 1)[1]
      raise DataError(f"{where}: {what} {raw_id} appears twice (first at "
                      f"line {first}).")
    by_id[raw_id] = len(out)
    out.append((where, row))
  absent = [int(i) for i in wanted_ids if int(i) not in by_id]
  if absent:
    raise DataError(f"{origin}: no row for {what}(s) {absent[:5]}"
                    f"{' ...' if len(absent) > 5 else ''} of the ratings "
                    f"({len(absent)} missing).")
  return out, [by_id[int(i)] for i in wanted_ids]


def _column(tokens: Sequence[str], order: Sequence[int]
            ) -> tuple[np.ndarray, tuple[str, ...]]:
  """One id per wanted row (row 0 padding) and the id -> token names.

  The vocabulary is every row's token, sorted (ids 1..n).
  """
  distinct = sorted(set(tokens))
  ids = {t: k + 1 for k, t in enumerate(distinct)}
  return (np.asarray([0] + [ids[tokens[k]] for k in order], np.int32),
          ("<pad>",) + tuple(distinct))


def _bag_column(bags: Sequence[Sequence[int]], order: Sequence[int]
                ) -> np.ndarray:
  """[wanted rows + 1, max_len] 0-padded ids (row 0 padding)."""
  width = max(1, max(len(bags[k]) for k in order))
  out = np.zeros((len(order) + 1, width), np.int32)
  for row, k in enumerate(order, start=1):
    out[row, :len(bags[k])] = bags[k]
  return out


def _user_features(rows, order, zip_prefix_len: int,
                   age_bounds: Sequence[int]) -> SideFeatures:
  edges = (0,) + tuple(age_bounds)
  age_names = tuple(f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])) + (
      f"{edges[-1]}+",)
  ages = [_parse_int_id(row["age"], "age", where) for where, row in rows]
  buckets = np.searchsorted(np.asarray(age_bounds), ages, side="right")
  values = {"age": np.asarray([0] + [buckets[k] + 1 for k in order],
                              np.int32)}
  names = {"age": ("<pad>",) + age_names}
  for key, column in (("gender", "gender"), ("occupation", "occupation"),
                      ("zip", "zip_code")):
    tokens = [row[column] for _, row in rows]
    if key == "zip":
      tokens = [t[:zip_prefix_len].upper() for t in tokens]
    for (where, _), token in zip(rows, tokens):
      if not token:
        raise DataError(f"{where}: empty {column}.")
    values[key], names[key] = _column(tokens, order)
  return SideFeatures(values, {k: len(v) for k, v in names.items()}, names)


def _year(token: str, title: str, where: str) -> int | None:
  """The release year, or None when unknown.

  A token that is not a number is unknown, except that a "(1995)" in the
  title is taken (RecBole's file has "V" for one video release whose title
  ends in "(1995)").
  """
  if not token.isdigit():
    years = _TITLE_YEAR.findall(title)
    if not years:
      return None
    token = years[-1]
  year = int(token)
  if not 1800 <= year <= 2100:
    raise DataError(f"{where}: release_year {year} is outside 1800..2100.")
  return year


def _item_features(rows, order, year_bucket: int,
                   title_buckets: int) -> SideFeatures:
  years = [_year(row["release_year"], row["movie_title"], where)
           for where, row in rows]
  year_tokens = ["unknown" if y is None else
                 f"{y // year_bucket * year_bucket}" for y in years]
  values, names = {}, {}
  values["year"], names["year"] = _column(year_tokens, order)
  genre_lists = [row["class"].split() for _, row in rows]
  genre_names = sorted({g for gs in genre_lists for g in gs})
  genre_ids = {g: k + 1 for k, g in enumerate(genre_names)}
  values["genres"] = _bag_column(
      [sorted({genre_ids[g] for g in gs}) for gs in genre_lists], order)
  names["genres"] = ("<pad>",) + tuple(genre_names)
  title_bags = []
  for _, row in rows:
    words = set(_WORD.findall(row["movie_title"].lower()))
    title_bags.append(sorted({zlib.crc32(w.encode("utf-8")) % title_buckets
                              + 1 for w in words}))
  values["title"] = _bag_column(title_bags, order)
  names["title"] = ("<pad>",) + tuple(
      f"hash{k}" for k in range(1, title_buckets + 1))
  return SideFeatures(values, {k: len(v) for k, v in names.items()}, names)


def load_movielens_features(
    path: str | None = None, *, zip_prefix_len: int = 1,
    year_bucket: int = 5, title_buckets: int = 1024,
    age_bounds: Sequence[int] = AGE_BOUNDS
) -> tuple[Dataset, SideFeatures, SideFeatures]:
  """MovieLens-100k ratings with the users' and the items' side features.

  The ratings are `load_movielens(path)`'s Dataset (same ids, same order).
  The side features come from the RecBole atomic files beside its
  `ml-100k.inter` (in the recbole wheel, or the same directory):

  * users (`ml-100k.user`): "age" (bucketed by `age_bounds`), "gender",
    "occupation", "zip" (the first `zip_prefix_len` characters);
  * items (`ml-100k.item`): "year" (release year in `year_bucket`-year
    buckets; unknown years get their own id), "genres" (a bag),
    "title" (a bag of the title's lower-cased words, hashed by crc32 into
    `title_buckets` ids).

  Vocabularies are built from all users / items of the files (they are not
  interactions); only rows of ids occurring in the ratings are kept.

  Raises:
    DataError: a missing file or a malformed one (naming file and line).
  """
  for name, value, low in (("zip_prefix_len", zip_prefix_len, 1),
                           ("year_bucket", year_bucket, 1),
                           ("title_buckets", title_buckets, 1)):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError(f"pallas_emb load_movielens_features {name}={value!r} "
                       "must be a positive integer.")
  source = find_movielens(path)
  text, origin = SOURCE.read(source)
  users, items, ratings = parse_ratings(text, origin)
  user_ids, user_vocab = _dense_ids(users)
  item_ids, item_vocab = _dense_ids(items)
  dataset = Dataset(
      features={"user": user_ids, "item": item_ids}, labels=ratings,
      vocab_sizes={"user": user_vocab, "item": item_vocab},
      name="movielens-100k")
  sides = {}
  for kind, columns, raw in (("user", _USER_COLUMNS, users),
                             ("item", _ITEM_COLUMNS, items)):
    side_text, side_origin = _read_side(source, kind)
    rows, order = _index_rows(
        _parse_atomic(side_text, side_origin, columns), columns[0],
        side_origin, kind, np.unique(raw))
    sides[kind] = (
        _user_features(rows, order, zip_prefix_len, tuple(age_bounds))
        if kind == "user" else
        _item_features(rows, order, year_bucket, title_buckets))
  return dataset, sides["user"], sides["item"]
