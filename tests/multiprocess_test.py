"""2 processes x 4 CPU devices (gloo) == 1 process x 8 devices, bit for bit
(the single-table API, and one collection with a table of every placement)."""

import os
import socket
import subprocess
import sys
import tempfile

import test_util

from absl.testing import absltest
import numpy as np

import multiprocess_worker

TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class MultiProcessTest(absltest.TestCase):

  def test_two_processes_match_one(self):
    worker = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "result.npz")
      port = _free_port()
      env = dict(os.environ)
      env.pop("XLA_FLAGS", None)
      procs = [subprocess.Popen(
          [sys.executable, worker, str(i), "2", str(port), out], env=env,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(2)]
      logs = []
      try:
        for p in procs:
          logs.append(p.communicate(timeout=TIMEOUT_S)[0])
      except subprocess.TimeoutExpired:
        self.fail(f"multi-process run did not finish in {TIMEOUT_S} s")
      finally:
        for p in procs:
          if p.poll() is None:
            p.kill()
            p.wait()
      for p, log in zip(procs, logs):
        self.assertEqual(p.returncode, 0, f"worker failed:\n{log[-3000:]}")
      multi = dict(np.load(out))
    single = multiprocess_worker.compute()  # this process: 8 devices
    self.assertEqual(sorted(multi), sorted(single))
    for key in single:
      test_util.assert_bits_equal(self, multi[key], single[key], key)


if __name__ == "__main__":
  absltest.main()
