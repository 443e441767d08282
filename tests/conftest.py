"""pytest set-up: one JAX compilation cache for the whole run.

The directory is made here, in the process that starts the pytest-xdist
workers, so that all of them share it (see `test_util.use_compilation_cache`),
and removed when the run ends.
"""

import os
import shutil
import tempfile

_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config):
  if _CACHE_ENV in os.environ:  # an xdist worker, or set by the user
    return
  directory = tempfile.mkdtemp(prefix="pallas_emb_jax_cache_")
  os.environ[_CACHE_ENV] = directory
  config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))
