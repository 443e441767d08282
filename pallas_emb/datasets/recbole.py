"""RecBole atomic files: tab-separated text under a `name:type` header.

Both MovieLens loaders read them; this module finds the header's columns
and says, naming the file and line, what is wrong with one that does not
have them.
"""

from __future__ import annotations

from typing import Sequence

from pallas_emb.datasets.dataset import DataError


def short(line: str, limit: int = 80) -> str:
  """`line` quoted for a message, cut after `limit` characters."""
  return repr(line if len(line) <= limit else line[:limit] + "...")


def header(text: str, origin: str, wanted: Sequence[str], *,
           rows: str = "rows", expected: str | None = None
           ) -> tuple[list[str], list[int], list[str]]:
  """(lines, indices of the row lines, column names) of atomic `text`.

  The first non-blank line is the header; blank lines are skipped. Raises
  `DataError` naming `origin` when there is nothing, when the header lacks
  a `wanted` column, or when it has no row after it; `rows` names the rows
  and `expected` (default: the wanted columns) ends those messages.
  """
  expected = expected or ("expected a RecBole atomic file with columns "
                          f"{', '.join(wanted)}")
  lines = text.splitlines()
  rows_at = [n for n, line in enumerate(lines) if line.strip()]
  if not rows_at:
    raise DataError(f"{origin}: no {rows}; {expected}.")
  head = lines[rows_at[0]]
  names = [field.split(":", 1)[0].strip() for field in head.split("\t")]
  missing = [w for w in wanted if w not in names]
  if ":" not in head or missing:
    raise DataError(
        f"{origin}:{rows_at[0] + 1}: RecBole header {short(head)} lacks "
        f"column(s) {', '.join(missing or wanted)}; {expected}.")
  if len(rows_at) == 1:
    raise DataError(f"{origin}: header but no {rows}; {expected}.")
  return lines, rows_at[1:], names
