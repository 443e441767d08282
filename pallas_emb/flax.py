"""Flax linen layers: `from pallas_emb import flax as pe_flax; pe_flax.Embed`.

Inside the package, `import flax` still means the real Flax: Python 3 imports
are absolute, so this module is only ever `pallas_emb.flax`.
"""

# Imported as the top-level `flax`: pallas_emb/ itself is on sys.path.
if __name__ == "flax":
  raise ImportError(
      "pallas_emb/flax.py was imported as the top-level module `flax`, "
      "which means the pallas_emb/ package directory itself is on sys.path "
      "(e.g. a script run as `python pallas_emb/some_binary.py`). Run "
      "binaries as modules instead: `python -m pallas_emb.some_binary`.")

# pylint: disable=g-importing-member,unused-import
from pallas_emb.layers.flax import default_embed_init
from pallas_emb.layers.flax import Embed
from pallas_emb.layers.training import FlaxTrainer

__all__ = ["Embed", "FlaxTrainer", "default_embed_init"]
