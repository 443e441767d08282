"""A Flax model whose embedding tables train with pallas_emb's sparse step.

    python examples/flax_example.py    # 8 simulated CPU devices without a GPU

Two tables ("users", "items") serve three features: "user" and "item" ids
`[B]`, and each example's "history" of items `[B, L]`, which shares the items
table. Tables of one width, dtype and optimizer are stored as one stack and
looked up with one exchange per step (`print(coll.plan)`).
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
  batch, length, users, items = 512, 4, 1000, 500
  width = 8 * jax.device_count()  # column-sharded: 8 columns per device
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  opt = pe.RowwiseAdagrad(0.1)  # the tables' sparse optimizer
  coll = pe.EmbeddingCollection(
      [pe.TableSpec("users", users, width, optimizer=opt),
       pe.TableSpec("items", items, width, optimizer=opt)],
      [pe.FeatureSpec("user", table="users"),
       pe.FeatureSpec("item", table="items"),
       pe.FeatureSpec("history", table="items")],  # [B, L] -> [B, L, width]
      mesh, table_axis="x")

  class Model(nn.Module):
    @nn.compact
    def __call__(self, b):
      e = pe_flax.EmbeddingCollection(coll, name="embed")(b)  # {feature: emb}
      x = jnp.concatenate([e["user"], e["item"], e["history"].mean(1)], -1)
      return nn.Dense(1)(nn.relu(nn.Dense(32)(x)))[:, 0]

  rng = np.random.default_rng(0)
  batches = []
  for _ in range(steps):
    b = {"user": rng.integers(0, users, batch, dtype=np.int32),
         "item": rng.integers(0, items, batch, dtype=np.int32),
         "history": rng.integers(0, items, (batch, length), dtype=np.int32)}
    b["y"] = (np.sin(b["user"]) + np.cos(b["item"]) +
              np.sin(b["history"]).mean(1)).astype(np.float32) / 2
    batches.append(jax.device_put(b, coll.token_sharding()))
  model = Model()
  trainer = pe_flax.FlaxTrainer(  # tables: sparse RowwiseAdagrad; rest: adam
      model, coll, loss=lambda pred, b: jnp.mean((pred - b["y"]) ** 2),
      dense_optimizer=optax.adam(1e-2))
  state = trainer.init(model.init(jax.random.key(0), batches[0])["params"],
                       batches[0])
  step = jax.jit(trainer.step, donate_argnums=0)
  for t in range(steps):  # pipelined: also pass the next batch
    state, metrics = step(state, batches[t], batches[min(t + 1, steps - 1)])
    jax.block_until_ready(metrics.loss)  # XLA:CPU, see examples/loop.py
  state, _ = trainer.flush(state)  # the last staged update
  print(coll.plan)
  print(f"loss after {steps} steps: {float(metrics.loss):.5f}")
  return float(metrics.loss), trainer.params(state)  # a flax params tree


if __name__ == "__main__":
  main()
