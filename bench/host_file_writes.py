"""What a host-tier table's write-backs send to the disk, by how its file
was filled (Linux: the bytes from /proc/vmstat's `nr_written`).

    python -m bench.host_file_writes --dir=DIR    # a 4.1 GB file in DIR

For each `--fills` advice it fills a `[--rows, --width]` f32 file through
a memory map under that advice (`random`: MADV_RANDOM, as
`host_memory.host_array` maps a `host_dir` table; `sequential`:
MADV_SEQUENTIAL, the OS reading ahead), syncs it, then writes `--writes`
random rows through the map under MADV_RANDOM (an eviction group's
write-backs) and syncs again. It prints the fill's seconds, the writes'
milliseconds and the bytes the second sync wrote beside the rows' own.
A page cache of large folios (Linux 6.x, e.g. ext4 from 6.16) writes a
whole folio back for one changed row. The machine should be otherwise
idle: `nr_written` counts every process's writes.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

_DIR = flags.DEFINE_string("dir", None, "Directory of the file (default: "
                           "a temporary one).")
_ROWS = flags.DEFINE_integer("rows", 16_000_000, "Rows of the file.")
_WIDTH = flags.DEFINE_integer("width", 64, "f32 columns.")
_WRITES = flags.DEFINE_integer("writes", 20_000, "Random rows written.")
_FILLS = flags.DEFINE_list("fills", ["sequential", "random"],
                           "Advice while the file is filled, in order.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")

_ADVICE = {"sequential": "MADV_SEQUENTIAL", "random": "MADV_RANDOM"}


def _written_bytes() -> int:
  with open("/proc/vmstat", encoding="ascii") as f:
    for line in f:
      if line.startswith("nr_written "):
        return int(line.split()[1]) * mmap.PAGESIZE
  raise RuntimeError("no nr_written in /proc/vmstat")


def _run(directory: str, fill: str) -> dict:
  path = os.path.join(directory, "host_file_writes.rows")
  shape = (_ROWS.value, _WIDTH.value)
  table = np.memmap(path, np.float32, "w+", shape=shape)
  try:
    table._mmap.madvise(getattr(mmap, _ADVICE[fill]))  # pylint: disable=protected-access
    start = time.perf_counter()
    chunk = max(1, (1 << 28) // (4 * _WIDTH.value))
    for a in range(0, shape[0], chunk):
      table[a:a + chunk] = 0.01
    table.flush()
    os.sync()
    fill_s = time.perf_counter() - start
    table._mmap.madvise(mmap.MADV_RANDOM)  # pylint: disable=protected-access
    rows = np.sort(np.random.default_rng(0).choice(
        shape[0], min(_WRITES.value, shape[0]), replace=False))
    before = _written_bytes()
    start = time.perf_counter()
    table[rows] = 1.0
    write_s = time.perf_counter() - start
    table.flush()
    os.sync()
    out = {"fill": fill, "fill_s": fill_s, "write_s": write_s,
           "sync_s": time.perf_counter() - start - write_s,
           "written_bytes": _written_bytes() - before,
           "row_bytes": rows.size * _WIDTH.value * 4}
  finally:
    del table
    os.remove(path)
  print(f"filled under {_ADVICE[fill]}: fill {out['fill_s']:.1f} s; "
        f"{rows.size} random rows written in {1e3 * out['write_s']:.1f} ms, "
        f"synced in {out['sync_s']:.2f} s: {out['written_bytes'] / 1e6:.1f} "
        f"MB to the disk for {out['row_bytes'] / 1e6:.2f} MB of rows",
        flush=True)
  return out


def main(argv):
  del argv
  with tempfile.TemporaryDirectory(dir=_DIR.value) as directory:
    doc = {"what": "bench.host_file_writes", "rows": _ROWS.value,
           "width": _WIDTH.value, "writes": _WRITES.value,
           "results": [_run(directory, fill) for fill in _FILLS.value]}
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(doc, f, indent=1)


if __name__ == "__main__":
  app.run(main)
