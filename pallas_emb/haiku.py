"""Haiku layers: `from pallas_emb import haiku as pe_haiku; pe_haiku.Embed`.

Inside the package, `import haiku` still means the real Haiku: Python 3
imports are absolute, so this module is only ever `pallas_emb.haiku`.
"""

# Imported as the top-level `haiku`: pallas_emb/ itself is on sys.path.
if __name__ == "haiku":
  raise ImportError(
      "pallas_emb/haiku.py was imported as the top-level module `haiku`, "
      "which means the pallas_emb/ package directory itself is on sys.path "
      "(e.g. a script run as `python pallas_emb/some_binary.py`). Run "
      "binaries as modules instead: `python -m pallas_emb.some_binary`.")

# pylint: disable=g-importing-member,unused-import
from pallas_emb.layers.haiku import Embed
from pallas_emb.layers.haiku import shard_params

__all__ = ["Embed", "shard_params"]
