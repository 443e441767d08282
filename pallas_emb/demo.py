"""A lookup demo on simulated devices: `python -m pallas_emb.demo`.

Builds a column-sharded table over every device, looks a batch up with each
backend and checks the result against `table[ids]`.
"""

import os

os.environ.setdefault("XLA_FLAGS",
                      "--xla_force_host_platform_device_count=8")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import pallas_emb as pe

_VOCAB = flags.DEFINE_integer("vocab_rows", 10_000, "Table rows.")
_WIDTH = flags.DEFINE_integer("emb_width", 64, "Embedding width.")
_TOKENS = flags.DEFINE_integer("tokens_per_batch", 4096, "Ids per batch.")


def main(argv):
  del argv
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  ctx = pe.make_context(mesh, "x", tokens_per_batch=_TOKENS.value,
                        emb_width=_WIDTH.value,
                        num_unique=_TOKENS.value + 1)
  rng = np.random.default_rng(0)
  table = jax.device_put(
      rng.standard_normal((_VOCAB.value, _WIDTH.value), np.float32),
      pe.table_sharding(ctx))
  ids = jax.device_put(
      rng.integers(0, _VOCAB.value, _TOKENS.value, dtype=np.int32),
      pe.token_sharding(ctx))
  expected = np.asarray(table)[np.asarray(ids)]
  print(f"{len(devices)} {devices[0].platform} devices, table "
        f"{table.shape} sharded {ctx.shard_width} columns per rank")
  for backend in ("xla", "interpret") + (
      ("pallas",) if devices[0].platform == "gpu" else ()):
    out = jax.jit(lambda t, i, b=backend: pe.lookup(ctx, t, i, backend=b))(
        table, ids)
    ok = np.array_equal(np.asarray(out), expected)
    print(f"  backend={backend:9s} out {out.shape} bit-exact: {ok}")


if __name__ == "__main__":
  app.run(main)
