"""Where a run's wall time goes, and the persistent compilation cache.

`Clock` adds up wall time per phase (load, init, batching, steps,
evaluation) and, apart, the time JAX spends lowering programs and
compiling them with XLA (or reading them from the persistent cache),
from `jax.monitoring`'s events: a phase's share is its wall time less the
compiling done inside it. Tracing (running the Python of a jitted
function) is not an event of its own and stays in its phase.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from typing import Callable, Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

# jax._src.dispatch's event names: lowering to StableHLO, then XLA's
# compile (or the persistent cache's read, inside it). Neither nests.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_MISS = "/jax/compilation_cache/cache_misses"


class Clock:
  """Wall seconds per phase plus "compile"; a context manager that listens
  to JAX's compile events while entered."""

  def __init__(self):
    self.phases: dict[str, float] = collections.defaultdict(float)
    self.compile = 0.0
    self.cache_hits = 0
    self.cache_misses = 0
    self._start = None
    self.wall = 0.0

  def _on_duration(self, event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
      self.compile += duration

  def _on_event(self, event: str, **_) -> None:
    if event == _CACHE_HIT:
      self.cache_hits += 1
    elif event == _CACHE_MISS:
      self.cache_misses += 1

  def __enter__(self) -> Clock:
    self._start = time.perf_counter()
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_duration)
    jax.monitoring.unregister_event_listener(self._on_event)
    self.wall = time.perf_counter() - self._start

  @contextlib.contextmanager
  def phase(self, name: str) -> Iterator[None]:
    """Adds the block's wall time, less its compiling, to `name`."""
    start, compiled = time.perf_counter(), self.compile
    try:
      yield
    finally:
      self.phases[name] += (time.perf_counter() - start
                            - (self.compile - compiled))

  def seconds(self) -> dict[str, float]:
    """{phase: s, "compile": s, "other": the rest, "wall": s} (wall so
    far while entered)."""
    wall = self.wall or time.perf_counter() - self._start
    out = dict(self.phases)
    out["compile"] = self.compile
    out["other"] = wall - sum(out.values())
    out["wall"] = wall
    return out

  def summary(self) -> str:
    """One line: the wall time and its parts, largest first."""
    parts = self.seconds()
    wall = parts.pop("wall")
    shares = ", ".join(f"{name} {value:.1f}" for name, value in
                       sorted(parts.items(), key=lambda kv: -kv[1]))
    cache = ""
    if self.cache_hits or self.cache_misses:
      cache = (f"; persistent cache: {self.cache_hits} programs read, "
               f"{self.cache_misses} compiled")
    return f"time: {wall:.1f} s = {shares} (s){cache}"


@contextlib.contextmanager
def compile_cache(directory: str,
                  log: Callable[[str], None] = print) -> Iterator[str]:
  """Programs compiled inside are saved to (and read from) `directory`
  ('' leaves the cache as it is); JAX's own settings come back after."""
  if not directory:
    yield ""
    return
  path = os.path.abspath(os.path.expanduser(directory))
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    log(f"warning: no compilation cache ({path}: {e}); compiling anew.")
    yield ""
    return
  names = ("jax_compilation_cache_dir",
           "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  before = {name: getattr(jax.config, name) for name in names}
  jax.config.update("jax_compilation_cache_dir", path)
  # Every program, however quick to compile: a run has few, and the many
  # small ones add up to seconds on an accelerator.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  compilation_cache.reset_cache()
  try:
    yield path
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()
