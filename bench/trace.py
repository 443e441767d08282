"""Device op times from a `jax.profiler` trace (no flags: any program may
import it)."""

from __future__ import annotations

import collections
import glob
import os


def device_op_times(trace_dir: str, line_name: str = "XLA Ops"
                    ) -> dict[str, float]:
  """Total ns per event name over the `line_name` lines of the device
  planes of the trace written under `trace_dir`: ops ("XLA Ops") or whole
  programs ("XLA Modules")."""
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  totals = collections.Counter()
  for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                        recursive=True):
    data = ProfileData.from_file(path)
    for plane in data.planes:
      if not plane.name.startswith("/device:"):
        continue
      for line in plane.lines:
        if line.name != line_name:
          continue
        for event in line.events:
          totals[event.name] += event.duration_ns
  return dict(totals)
