"""A Flax model whose embedding table trains with pallas_emb's sparse step.

    python examples/flax_example.py    # 8 simulated CPU devices without a GPU
"""
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pallas_emb as pe
from pallas_emb import flax as pe_flax


def main(steps=100):
  batch, vocab, width = 512, 1000, 8 * jax.device_count()
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  ctx = pe.make_context(mesh, "x", tokens_per_batch=batch, emb_width=width,
                        num_unique=pe.default_num_unique(batch, vocab))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, b):
      x = pe_flax.Embed(vocab, width, ctx, name="embed")(b["ids"])
      return nn.Dense(1)(nn.relu(nn.Dense(32)(x)))[:, 0]

  rng = np.random.default_rng(0)
  ids = [rng.integers(1, vocab, batch, dtype=np.int32) for _ in range(steps)]
  batches = [jax.device_put({"ids": i, "y": np.sin(i).astype(np.float32)},
                            pe.token_sharding(ctx)) for i in ids]
  model = Model()
  trainer = pe_flax.FlaxTrainer(   # the table: sparse RowwiseAdagrad; the rest: adam
      model, {"embed": pe.TableSpec(ctx, pe.RowwiseAdagrad(0.1), "ids")},
      loss=lambda pred, b: jnp.mean((pred - b["y"]) ** 2),
      dense_optimizer=optax.adam(1e-2))
  state = trainer.init(model.init(jax.random.key(0), batches[0])["params"],
                       batches[0])
  step = jax.jit(trainer.step, donate_argnums=0)
  for t in range(steps):  # pipelined: also pass the next batch
    state, metrics = step(state, batches[t], batches[min(t + 1, steps - 1)])
    jax.block_until_ready(metrics.loss)  # XLA:CPU, see examples/train.py
  state, _ = trainer.flush(state)  # the last staged update
  print(f"loss after {steps} steps: {float(metrics.loss):.5f}")
  return float(metrics.loss), trainer.params(state)  # a flax params tree


if __name__ == "__main__":
  main()
