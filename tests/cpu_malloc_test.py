"""A collection on CPU devices keeps glibc from mmapping large blocks
(`pallas_emb.cpu_malloc`), unless PALLAS_EMB_SYSTEM_MALLOC=1.

Checked in a fresh process through glibc's own count of mmapped blocks
(`mallinfo2().hblks`) around a 64 MiB malloc.
"""

import os
import platform
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

PROGRAM = """
import ctypes, ctypes.util
import jax
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
before = libc.mallinfo2().hblks
block = libc.malloc(64 << 20)
print(libc.mallinfo2().hblks - before)
libc.free(ctypes.c_void_p(block))
"""


@absltest.skipIf(platform.system() != "Linux"
                 or platform.libc_ver()[0] != "glibc", "glibc only")
class CpuMallocTest(parameterized.TestCase):

  @parameterized.parameters(("", "0"), ("1", "1"))
  def test_large_blocks_are_not_mmapped(self, opt_out, mmapped):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PALLAS_EMB_SYSTEM_MALLOC=opt_out)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env,
                          capture_output=True, text=True, timeout=300,
                          check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr)
    self.assertEqual(proc.stdout.strip(), mmapped)


if __name__ == "__main__":
  absltest.main()
