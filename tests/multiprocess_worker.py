"""One process of the 2-process test (see multiprocess_test.py).

Usage: multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_NPZ
Without arguments it runs the same computation in one process on 8 devices.
"""

import os
import sys

LOCAL_DEVICES = 4


def _setup(num_local):
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (
      f"--xla_force_host_platform_device_count={num_local}")
  sys.path.insert(0, os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))


def compute():
  """lookup, dedup and 3 update steps on an 8-device mesh; host results."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  tokens, width, vocab = 64, 16, 53
  ctx = pe.make_context(mesh, "x", tokens_per_batch=tokens, emb_width=width,
                        num_unique=tokens + 1)
  rng = np.random.default_rng(0)

  def put(host, sharding):
    return jax.make_array_from_callback(host.shape, sharding,
                                        lambda idx: host[idx])

  table = put(rng.standard_normal((vocab, width)).astype(np.float32),
              pe.table_sharding(ctx))
  opt = pe.RowwiseAdagrad(0.1, half_life_steps=3.0, weight_decay=0.01,
                          lazy=True)
  state = opt.init(ctx, table)

  @jax.jit
  def step(table, state, ids, grads):
    emb = pe.lookup(ctx, table, ids)
    dd = pe.dedup(ctx, ids, vocab_rows=vocab)
    table, state, stats = pe.apply_gradients(ctx, opt, table, state,
                                             grads * 0.5 + emb, dd)
    return table, state, emb, dd.unique_tokens, stats.norm

  outputs = {}
  for i in range(3):
    ids = put((np.minimum(rng.zipf(1.3, tokens), vocab + 2) - 1).astype(
        np.int32), pe.token_sharding(ctx))
    grads = put(rng.standard_normal((tokens, width)).astype(np.float32),
                pe.token_sharding(ctx))
    table, state, emb, uniq, norm = step(table, state, ids, grads)
    outputs[f"emb{i}"] = emb
    outputs[f"unique{i}"] = uniq
    outputs[f"norm{i}"] = norm
  outputs["table"] = table
  outputs["row_state"] = state.row_state
  outputs["last_step"] = state.last_step
  return {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
          for k, v in outputs.items()}


def main(argv):
  if len(argv) == 1:
    _setup(8)
    return compute()
  process_id, num_processes, port, out = argv[1:]
  _setup(LOCAL_DEVICES)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=int(num_processes),
                             process_id=int(process_id),
                             initialization_timeout=60)
  results = compute()
  if jax.process_index() == 0:
    np.savez(out, **results)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv)
