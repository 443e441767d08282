"""On CPU, pallas_emb keeps glibc from mmapping large blocks
(`pallas_emb.cpu_malloc`), unless PALLAS_EMB_SYSTEM_MALLOC=1.

Checked in a fresh process through glibc's own count of mmapped blocks
(`mallinfo2().hblks`) around a malloc of 96 MiB, from the main thread and
from a new thread (whose arena would mmap any block over 64 MiB, as
XLA:CPU's threads did every step).
"""

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

WARNING = "JAX ran before pallas_emb was imported"


@absltest.skipIf(platform.system() != "Linux"
                 or platform.libc_ver()[0] != "glibc", "glibc only")
class CpuMallocTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("default", "", "early", "0 0", False),
      ("opted_out", "1", "early", "1 1", False),
      # Too late for one arena: the thread's block is mmapped, and a
      # warning says how to avoid it.
      ("imported_late", "", "late", "0 1", True))
  def test_large_blocks_are_not_mmapped(self, opt_out, when, mmapped,
                                        warns):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PALLAS_EMB_SYSTEM_MALLOC=opt_out)
    for name in ("XLA_FLAGS", "MALLOC_ARENA_MAX"):
      env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", PROGRAM, when], env=env,
                          capture_output=True, text=True, timeout=300,
                          check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr)
    self.assertEqual(proc.stdout.strip(), mmapped)
    self.assertEqual(WARNING in proc.stderr, warns, proc.stderr)


if __name__ == "__main__":
  absltest.main()
