"""MovieLens-100k: found on disk (or inside the RecBole 1.2.1 wheel) and parsed.

ML-100k ships inside the `recbole` wheel
(recbole/dataset_example/ml-100k/ml-100k.inter), so one
`pip download --no-deps recbole==1.2.1 -d ~/.cache/pallas_emb` (no
dependencies, recbole is never imported or installed) brings it;
`download_movielens()` runs exactly that (and `find_movielens(download=True)`
when the search finds nothing).
"""

from __future__ import annotations

import glob
import os
import site
import subprocess
import sys
import zipfile
from typing import Sequence

import numpy as np

from pallas_emb.datasets.dataset import Dataset
from pallas_emb.datasets.dataset import DataError

# Where the RecBole wheel keeps its copy of MovieLens-100k.
RECBOLE_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
RECBOLE_REQUIREMENT = "recbole==1.2.1"
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


def find_movielens(path: str | None = None, *, download: bool = False) -> str:
  """The file `load_movielens(path)` would read; raises `DataError`.

  With `download` and no `path`, a search that finds nothing runs
  `download_movielens()` (into ~/.cache/pallas_emb) and returns the wheel;
  its `DataError` says why when that fails too.
  """
  if path is None:
    candidates = default_candidates()
  elif os.path.isdir(path):
    candidates = _dir_candidates(path)
  else:
    candidates = [path]
  found = _first_existing(candidates)
  if found is None and download and path is None:
    return download_movielens()
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
  directory = os.path.expanduser(directory or _CACHE_DIR)
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
         RECBOLE_REQUIREMENT, "-d", directory]
  where = f"pallas_emb could not download MovieLens-100k: `{' '.join(cmd)}`"
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=timeout, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise DataError(f"{where} failed: {e}") from e
  if proc.returncode:
    lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    raise DataError(f"{where} exited with status {proc.returncode}: "
                    f"{' | '.join(lines[-3:])}")
  return find_movielens(directory)
