"""On CPU, pallas_emb keeps glibc from mmapping large blocks
(`pallas_emb.cpu_malloc`), unless PALLAS_EMB_SYSTEM_MALLOC says yes, and
never overrides a malloc setting the user made in the environment.

Checked in a fresh process through glibc's own count of mmapped blocks
(`mallinfo2().hblks`) around a malloc of 96 MiB, from the main thread and
from a new thread (whose arena would mmap any block over 64 MiB, as
XLA:CPU's threads did every step); and by the mallopt calls the import
makes, recorded on their way to glibc.
"""

import json
import os
import platform
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

PROGRAM = """
import ctypes, ctypes.util, sys, threading
import jax
if sys.argv[1] == "late":
  jax.devices()  # JAX starts (its threads take arenas) before the import
import pallas_emb as pe

class MallInfo2(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
      "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
pe.EmbeddingCollection(
    [pe.TableSpec("t", 10, 8, optimizer=pe.Sgd(0.1))],
    [pe.FeatureSpec("f", "t")], jax.make_mesh((1,), ("x",)), "x")
mmapped = []

def count():
  before = libc.mallinfo2().hblks
  block = libc.malloc(96 << 20)
  mmapped.append(libc.mallinfo2().hblks - before)
  libc.free(ctypes.c_void_p(block))

count()
thread = threading.Thread(target=count)
thread.start()
thread.join()
print(*mmapped)
"""

# Records every mallopt call the import makes (then makes it), for each
# environment in argv[1] (a JSON list of {variable: value}).
SPY = """
import ctypes, json, os, sys
calls = []
real = ctypes.CDLL

class Libc:
  def __init__(self, *args, **kwargs):
    self._libc = real(*args, **kwargs)
  def mallopt(self, parameter, value):
    calls.append(parameter)
    return self._libc.mallopt(parameter, value)

ctypes.CDLL = Libc
from pallas_emb import cpu_malloc
names = {-8: "M_ARENA_MAX", -4: "M_MMAP_MAX", -1: "M_TRIM_THRESHOLD"}
out = []
for env in json.loads(sys.argv[1]):
  os.environ.update(env)
  calls.clear()
  cpu_malloc._kept = None  # as in a fresh process
  cpu_malloc.at_import()
  out.append(sorted(names[c] for c in calls))
  for name in env:
    del os.environ[name]
print(json.dumps(out))
"""

WARNING = "JAX ran before pallas_emb was imported"
# Every variable through which the environment sets malloc, left out of
# the tests' own environment.
MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "MALLOC_MMAP_MAX_",
              "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
              "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def run(program, *args, **env):
  clean = dict(os.environ, JAX_PLATFORMS="cpu", **env)
  for name in ("XLA_FLAGS",) + MALLOC_ENV:
    if name not in env:
      clean.pop(name, None)
  return subprocess.run([sys.executable, "-c", program, *args], env=clean,
                        capture_output=True, text=True, timeout=300,
                        check=False)


@absltest.skipIf(platform.system() != "Linux"
                 or platform.libc_ver()[0] != "glibc", "glibc only")
class CpuMallocTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("default", {}, "early", "0 0", False),
      ("opted_out", {"PALLAS_EMB_SYSTEM_MALLOC": "1"}, "early", "1 1", False),
      ("opted_out_yes", {"PALLAS_EMB_SYSTEM_MALLOC": " Yes"}, "early", "1 1",
       False),
      # "false" means no: the settings are kept (it used to opt out).
      ("not_opted_out_false", {"PALLAS_EMB_SYSTEM_MALLOC": "FALSE"}, "early",
       "0 0", False),
      # Too late for one arena: the thread's block is mmapped, and a
      # warning says how to avoid it.
      ("imported_late", {}, "late", "0 1", True),
      # The user's arenas: the thread mmaps in its own (no warning). As
      # many as XLA's threads never fill, so the thread is not given the
      # main arena back.
      ("user_arena_max", {"MALLOC_ARENA_MAX": "64"}, "early", "0 1", False),
      ("user_arena_max_late", {"MALLOC_ARENA_MAX": "64"}, "late", "0 1",
       False),
      # The user's mmap limit (glibc's default): large blocks are mmapped.
      ("user_mmap_max", {"MALLOC_MMAP_MAX_": "65536"}, "early", "1 1", False),
      ("user_tunable_mmap_max",
       {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=65536"}, "early", "1 1",
       False))
  def test_large_blocks_are_not_mmapped(self, env, when, mmapped, warns):
    proc = run(PROGRAM, when, **env)
    self.assertEqual(proc.returncode, 0, proc.stderr)
    self.assertEqual(proc.stdout.strip(), mmapped)
    self.assertEqual(WARNING in proc.stderr, warns, proc.stderr)

  def test_what_the_user_set_is_left_alone(self):
    """Each glibc variable or tunable keeps the mallopt it governs from
    being made; the others still are."""
    every = ["M_ARENA_MAX", "M_MMAP_MAX", "M_TRIM_THRESHOLD"]
    cases = [({}, every),
             ({"MALLOC_ARENA_MAX": "2"}, every[1:]),
             ({"MALLOC_ARENA_TEST": "2"}, every[1:]),
             ({"MALLOC_MMAP_MAX_": "0"}, [every[0], every[2]]),
             ({"MALLOC_MMAP_THRESHOLD_": "1048576"}, [every[0], every[2]]),
             ({"MALLOC_TRIM_THRESHOLD_": "0"}, every[:2]),
             ({"MALLOC_TOP_PAD_": "0"}, every[:2]),
             ({"MALLOC_ARENA_MAX": ""}, every),  # empty: unset
             ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0:"
                                 "glibc.malloc.arena_max=8"}, every[1:2]),
             ({"GLIBC_TUNABLES": "glibc.malloc.top_pad=0:"
                                 "glibc.malloc.mmap_threshold=4096:"
                                 "glibc.malloc.arena_test=1"}, []),
             ({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}, every)]
    proc = run(SPY, json.dumps([env for env, _ in cases]))
    self.assertEqual(proc.returncode, 0, proc.stderr)
    got = json.loads(proc.stdout)
    for (env, want), calls in zip(cases, got):
      self.assertEqual(calls, sorted(want), env)

  @parameterized.parameters("2", "on", "nope")
  def test_opt_out_is_parsed_strictly(self, value):
    proc = run("import pallas_emb", PALLAS_EMB_SYSTEM_MALLOC=value)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn(
        f"pallas_emb PALLAS_EMB_SYSTEM_MALLOC={value!r} is not a yes or no; "
        "expected one of 1, true, yes (leave glibc malloc as it is) or 0, "
        "false, no, empty", proc.stderr)


if __name__ == "__main__":
  absltest.main()
