"""The host side of a host-tier step, alone: random rows read from and
written to host memory, as the cache's misses and write-backs move them.

    python -m bench.host_rows                  # 1 GB, in memory and in a file
    python -m bench.host_rows --dir=DIR --rows=100000000   # a 25.6 GB file

For each `--kinds` it makes a `[--rows, --width]` f32 table the way the
host tier does (`host_memory.host_array`: "memory" a numpy array, "file" a
`host_dir` file mapped for random rows), fills it (`host_memory.fill_rows`),
then `--repeats` times reads `--misses` random rows into one buffer with
the host tier's own gather (`host_tier._gathered`, on the host's cores)
and writes them back as a write-back group does. It prints the fill's
seconds and the median milliseconds of the reads and writes, first and
later (the first touches pages that a fresh table has not mapped yet).
Where a host-tier step spends its time on the host, this says whether
moving rows is the bound, and whether a file costs more than memory.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

from pallas_emb import host_memory
from pallas_emb import host_tier
from pallas_emb import specs

_DIR = flags.DEFINE_string("dir", None, "Directory of the file (default: "
                           "a temporary one).")
_ROWS = flags.DEFINE_integer("rows", 4_000_000, "Rows of the table.")
_WIDTH = flags.DEFINE_integer("width", 64, "f32 columns.")
_MISSES = flags.DEFINE_integer("misses", 50_000,
                               "Random rows read and written a round.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Rounds, each its own rows.")
_KINDS = flags.DEFINE_list("kinds", ["memory", "file"],
                           "Host memory kinds: memory, file.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")


def _write(table: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
  """`table[rows] = values` on the host's cores, as a write-back lands."""

  def put(a, b):
    table[rows[a:b]] = values[a:b]

  host_memory.in_chunks(put, rows.size)


def _run(kind: str, directory: str) -> dict:
  spec = specs.TableSpec(
      "rows", _ROWS.value, _WIDTH.value, optimizer=None, storage="host",
      cache_rows=min(_ROWS.value, max(1, _MISSES.value)),
      host_dir=directory if kind == "file" else None)
  shape = (_ROWS.value, _WIDTH.value)
  start = time.perf_counter()
  table = host_memory.host_array(spec, "rows", shape, np.float32)
  host_memory.fill_rows(table, 0, np.float32(0.01))
  out = {"kind": kind, "fill_s": time.perf_counter() - start,
         "read_ms": [], "write_ms": []}
  rng = np.random.default_rng(0)
  for _ in range(_REPEATS.value):
    rows = np.sort(rng.choice(shape[0], min(_MISSES.value, shape[0]),
                              replace=False))
    start = time.perf_counter()
    values = host_tier._gathered([table], [rows], rows.size)  # pylint: disable=protected-access
    out["read_ms"].append(1e3 * (time.perf_counter() - start))
    start = time.perf_counter()
    _write(table, rows, values)
    out["write_ms"].append(1e3 * (time.perf_counter() - start))
  del table
  for what in ("read", "write"):
    times = out[what + "_ms"]
    out[what + "_first_ms"] = times[0]
    out[what + "_later_ms"] = statistics.median(times[1:] or times)
  print(f"{kind}: [{shape[0]}, {shape[1]}] f32 filled in "
        f"{out['fill_s']:.1f} s; {_MISSES.value} random rows read in "
        f"{out['read_first_ms']:.1f} ms first, {out['read_later_ms']:.1f} "
        f"later (median), written in {out['write_first_ms']:.1f} first, "
        f"{out['write_later_ms']:.1f} later", flush=True)
  return out


def main(argv):
  del argv
  unknown = set(_KINDS.value) - {"memory", "file"}
  if unknown:
    raise app.UsageError(f"--kinds={','.join(_KINDS.value)}: "
                         f"{sorted(unknown)} unknown; give memory, file.")
  with tempfile.TemporaryDirectory(dir=_DIR.value) as directory:
    doc = {"what": "bench.host_rows", "rows": _ROWS.value,
           "width": _WIDTH.value, "misses": _MISSES.value,
           "threads": host_memory._threads(),  # pylint: disable=protected-access
           "results": [_run(kind, directory) for kind in _KINDS.value]}
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(doc, f, indent=1)


if __name__ == "__main__":
  app.run(main)
