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

  # CPU devices, also when the one-process reference runs on a GPU machine.
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",))
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
  outputs.update(_collection_steps(mesh, put, rng))
  host = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
          for k, v in outputs.items()}
  # As bits: np.savez cannot store bfloat16.
  return {k: v.view(np.uint16) if v.dtype.itemsize == 2 else v
          for k, v in host.items()}


def _collection_steps(mesh, put, rng):
  """3 pipelined Trainer steps of a collection with a table of every
  placement (f32 and bf16 columns); its final tables and loss."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top

  opt = pe.RowwiseAdagrad(0.1, half_life_steps=3.0, lazy=True)
  coll = pe.EmbeddingCollection(
      [pe.TableSpec("a", 40, 16, optimizer=opt, placement="column"),
       pe.TableSpec("b", 23, 16, optimizer=opt, padding_id=0,
                    placement="row"),
       pe.TableSpec("c", 11, 8, optimizer=opt, dtype=jnp.bfloat16,
                    placement="table"),
       pe.TableSpec("d", 17, 8, optimizer=opt, placement="replicated"),
       pe.TableSpec("e", 13, 8, optimizer=opt, dtype=jnp.bfloat16,
                    placement="column")],
      [pe.FeatureSpec("fa", "a"), pe.FeatureSpec("hist", "a"),
       pe.FeatureSpec("fb", "b"), pe.FeatureSpec("fc", "c"),
       pe.FeatureSpec("fd", "d"), pe.FeatureSpec("fe", "e")], mesh, "x")

  def loss_fn(w, emb, batch):
    del batch
    return sum(jnp.sum(jnp.square(e.astype(jnp.float32) - w))
               for e in emb.values()), ()

  # The dense gradient is XLA's all-reduce, whose f32 order is the
  # collective's (gloo here, in-process in the reference): w may move by an
  # ulp between the two and carry into every f32 row. The library's own
  # sums are ordered; a frozen w keeps the comparison to those.
  trainer = pe.Trainer(coll, loss_fn, optax.set_to_zero())
  sharding = coll.token_sharding()
  batches = [{
      "fa": put(rng.integers(-40, 45, 32).astype(np.int32), sharding),
      "hist": put(rng.integers(0, 40, (32, 3)).astype(np.int32), sharding),
      "fb": put(rng.integers(-3, 23, 32).astype(np.int32), sharding),
      "fc": put(rng.integers(0, 11, 32).astype(np.int32), sharding),
      "fd": put(rng.integers(-17, 17, 32).astype(np.int32), sharding),
      "fe": put(rng.integers(0, 13, 32).astype(np.int32), sharding)}
             for _ in range(4)]
  init = jax.jit(coll.init)(jax.random.key(0))
  state = trainer.init(init, jnp.float32(0.25), batches[0])
  step = jax.jit(trainer.step, donate_argnums=0)
  for t in range(3):
    state, metrics = step(state, batches[t], batches[t + 1])
    jax.block_until_ready(metrics.loss)
  state, _ = jax.jit(trainer.flush)(state)
  out = {f"coll_{k}": v for k, v in
         coll.table_arrays(state.embedding).items()}
  out.update({f"coll_{k}_row_state": v.row_state for k, v in
              coll.optimizer_arrays(state.embedding).items()})
  out["coll_loss"] = metrics.loss
  return out


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
  _shutdown()


def _shutdown():
  """jax.distributed.shutdown(), with the coordinator's service stopped last.

  The clients' shutdown is a barrier; right after it the coordinator used to
  destroy its gRPC service while the other process's client was still
  closing its calls, and gRPC aborted the process (once in many CI runs:
  "Check failed: queue.Pop() == nullptr" in grpc::Server::~Server). So the
  coordinator waits a moment between its client and its service.
  """
  import time  # pylint: disable=g-import-not-at-top
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  state = distributed.global_state
  service, state.service = state.service, None
  state.shutdown()
  if service is not None:
    time.sleep(2.0)
    service.shutdown()


if __name__ == "__main__":
  main(sys.argv)
