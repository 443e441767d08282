"""Saving and restoring a host-tier table: seconds and host memory.

    python -m bench.host_checkpoint --rows=10000000 --host_dir=DIR
    python -m bench.host_checkpoint --rows=10000019 --storage=device

One host-tier table (`--rows` x `--width` f32, row-wise Adagrad) with its
rows and state in files of `--host_dir` (or, with `--host_dir=`, in host
memory) is saved with `checkpoint.save_collection` and restored with
`checkpoint.restore_collection`. For each it prints the seconds and the
peak growth of the process's anonymous memory (`RssAnon` of
/proc/self/status, sampled every few milliseconds: the file-backed pages of
the table's files are the page cache's, not the process's), beside the
table's bytes. Anonymous memory near the table's bytes means a second copy
of the table in host memory. `--storage=device` times the same table
held on the device instead.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

from absl import app
from absl import flags

import jax
import jax.numpy as jnp
import numpy as np

import pallas_emb as pe
from pallas_emb import checkpoint

_ROWS = flags.DEFINE_integer("rows", 10_000_000, "table rows")
_WIDTH = flags.DEFINE_integer("width", 64, "table width")
_HOST_DIR = flags.DEFINE_string(
    "host_dir", None, "directory of the table's files (empty: host memory; "
    "default: a temporary directory)")
_CKPT_DIR = flags.DEFINE_string(
    "checkpoint_dir", None, "checkpoint directory (default: temporary)")
_STORAGE = flags.DEFINE_enum("storage", "host", ["host", "device"],
                             "where the table lives")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")


def _anon_bytes() -> int:
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("RssAnon:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no RssAnon in /proc/self/status")


def _measured(fn):
  """`(result, seconds, peak growth of anonymous memory in bytes)`."""
  start_bytes, peak, done = _anon_bytes(), [0], threading.Event()

  def sample():
    while not done.wait(0.005):
      peak[0] = max(peak[0], _anon_bytes() - start_bytes)

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  start = time.perf_counter()
  try:
    out = fn()
  finally:
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
  return out, seconds, max(peak[0], _anon_bytes() - start_bytes)


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    host_dir = _HOST_DIR.value
    if host_dir is None:
      host_dir = os.path.join(tmp, "tables")
      os.makedirs(host_dir)
    ckpt_dir = _CKPT_DIR.value or os.path.join(tmp, "checkpoint")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    host = _STORAGE.value == "host"
    storage = dict(storage="host", cache_rows=min(65536, _ROWS.value // 2),
                   host_dir=host_dir or None) if host else {}
    table = pe.TableSpec(
        "t", _ROWS.value, _WIDTH.value, optimizer=pe.RowwiseAdagrad(0.05),
        initializer=lambda key, shape, dtype: jnp.full(shape, 0.5, dtype),
        **storage)
    coll = pe.EmbeddingCollection([table], [pe.FeatureSpec("f", "t")],
                                  mesh, "x")
    state = coll.init(jax.random.key(0))
    gb = _ROWS.value * _WIDTH.value * 4 / 1e9
    where = ("the device" if not host else
             f"files of {host_dir}" if host_dir else "host memory")
    print(f"table {_ROWS.value} x {_WIDTH.value} f32: {gb:.2f} GB, in "
          f"{where}", flush=True)
    record = {"rows": _ROWS.value, "width": _WIDTH.value,
              "table_bytes": _ROWS.value * _WIDTH.value * 4,
              "storage": _STORAGE.value, "host_dir": host and bool(host_dir)}
    _, seconds, grew = _measured(lambda: checkpoint.save_collection(
        ckpt_dir, coll, state, step=1))
    record["save"] = {"seconds": seconds, "anonymous_growth_bytes": grew}
    print(f"save:    {seconds:7.1f} s, anonymous memory +{grew / 1e9:.2f} GB",
          flush=True)
    del state
    (state, _), seconds, grew = _measured(
        lambda: checkpoint.restore_collection(ckpt_dir, coll))
    record["restore"] = {"seconds": seconds, "anonymous_growth_bytes": grew}
    print(f"restore: {seconds:7.1f} s, anonymous memory +{grew / 1e9:.2f} GB",
          flush=True)
    rows = np.asarray(coll.table_arrays(state)["t"])
    if not (rows == 0.5).all():
      raise AssertionError("the restored table is not the saved one")
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(record, f, indent=1)


if __name__ == "__main__":
  app.run(main)
