"""The pipelined step against a synchronous loop that applies late."""


import os
import subprocess
import sys

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb import pipeline

VOCAB = 41
TOKENS = 32


def make_setup(lazy, dtype, ranks=8, backend=None, dedup="sort"):
  """A collection of two tables (two stacks) read by three features."""
  mesh = test_util.mesh({"x": ranks})
  opt = (pe.RowwiseAdagrad(0.1, half_life_steps=2.0, weight_decay=0.01,
                           lazy=True) if lazy else
         pe.RowwiseAdagrad(0.1, half_life_steps=4.0))
  coll = pe.EmbeddingCollection(
      [pe.TableSpec("t", VOCAB, 2 * ranks, optimizer=opt, dtype=dtype,
                    padding_id=0),
       pe.TableSpec("s", 7, ranks, optimizer=opt)],
      [pe.FeatureSpec("ids", "t"), pe.FeatureSpec("hist", "t"),
       pe.FeatureSpec("small", "s")], mesh, "x", backend=backend,
      dedup=dedup)
  rng = np.random.default_rng(0)
  state = test_util.random_state(coll, 0)
  params = {"w": jnp.asarray(rng.standard_normal((2 * ranks, 1)),
                             jnp.float32) * 0.3,
            "v": jnp.asarray(rng.standard_normal((ranks, 1)),
                             jnp.float32) * 0.3,
            "b": jnp.zeros((1,), jnp.float32)}
  batches = []
  for _ in range(6):
    ids = (np.minimum(rng.zipf(1.4, TOKENS), VOCAB) - 1).astype(np.int32)
    batches.append(jax.device_put({
        "ids": ids,
        "hist": rng.integers(-VOCAB, VOCAB, (TOKENS, 2)).astype(np.int32),
        "small": rng.integers(0, 7, TOKENS).astype(np.int32),
        "y": rng.standard_normal(TOKENS).astype(np.float32)},
        coll.token_sharding()))
  return coll, state, params, batches


def loss_fn(params, embeddings, batch):
  x = (embeddings["ids"].astype(jnp.float32)
       + jnp.mean(embeddings["hist"].astype(jnp.float32), axis=1))
  pred = (x @ params["w"] + embeddings["small"] @ params["v"]
          + params["b"])[:, 0]
  loss = jnp.mean((pred - batch["y"]) ** 2)
  return loss, {"pred_mean": jnp.mean(pred)}


def late_loop(coll, state, params, batches, dense_opt):
  """Synchronous reference: look up, then apply the previous step's grads."""
  dense_state = dense_opt.init(params)
  staged = None
  losses = []

  @jax.jit
  def step(state, params, dense_state, staged, batch):
    emb = coll.lookup(state, batch)
    (loss, _), (g_params, g_emb) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(params, emb, batch)
    updates, dense_state = dense_opt.update(g_params, dense_state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
    if staged is not None:
      grads, prev = staged
      state, _ = coll.apply_gradients(state, prev, grads)
    return state, params, dense_state, (g_emb, batch), loss

  for batch in batches:
    state, params, dense_state, staged, loss = step(
        state, params, dense_state, staged, batch)
    losses.append(loss)
  return state, params, losses


def copies(tree):
  return jax.tree.map(jnp.copy, tree)


class PipelineTest(parameterized.TestCase):

  @parameterized.product(lazy=[False, True],
                         dtype=[np.float32, test_util.BF16])
  def test_equals_late_synchronous_loop(self, lazy, dtype):
    dense_opt = optax.adam(1e-2)
    for backend in test_util.backends_for(self):
      with self.subTest(backend=backend):
        self._check_late_loop(*make_setup(lazy, dtype, backend=backend),
                              dense_opt)

  def test_slot_maps_train_as_the_sort(self):
    """dedup="slot_map": the pipelined step equals the late loop of the same
    collection with the sort, bit for bit. (The synchronous step's routing
    carries the maps to the update: placements_test's replica_axis case
    with slot maps checks that flow against the model.)"""
    dense_opt = optax.adam(1e-2)
    coll, state0, params, batches = make_setup(True, np.float32, ranks=2,
                                               backend="xla",
                                               dedup="slot_map")
    sort, sort_state0, _, _ = make_setup(True, np.float32, ranks=2,
                                         backend="xla")
    self._check_late_loop(coll, state0, params, batches, dense_opt,
                          reference=(sort, sort_state0))

  def _check_late_loop(self, coll, state0, params, batches, dense_opt,
                       reference=None):
    """The pipelined Trainer against `late_loop` of `reference` (a
    collection and its initial state; default: the same)."""
    trainer = pipeline.Trainer(coll, loss_fn, dense_opt, pipelined=True)
    # Copies: the step donates the state, the reference needs the inputs.
    state = trainer.init(copies(state0), copies(params), batches[0])
    step = jax.jit(trainer.step, donate_argnums=0)
    losses, valid = [], []
    for t, batch in enumerate(batches):
      nxt = batches[min(t + 1, len(batches) - 1)]
      state, metrics = step(state, batch, nxt)
      losses.append(metrics.loss)
      valid.append([int(s.valid) for s in metrics.updates.values()])
    self.assertEqual(valid, [[0, 0]] + [[1, 1]] * 5)  # first: no-op
    # One compile: init places the dense state as the step returns it.
    self.assertEqual(step._cache_size(), 1)  # pylint: disable=protected-access
    ref_coll, ref_state0 = reference or (coll, state0)
    ref_state, ref_params, ref_losses = late_loop(
        ref_coll, ref_state0, params, batches, dense_opt)
    for a, b in zip(jax.tree.leaves((coll.table_arrays(state.embedding),
                                     coll.optimizer_arrays(
                                         state.embedding))),
                    jax.tree.leaves((ref_coll.table_arrays(ref_state),
                                     ref_coll.optimizer_arrays(
                                         ref_state)))):
      test_util.assert_bits_equal(self, a, test_util.as_numpy(b))
    np.testing.assert_array_equal(np.asarray(losses),
                                  np.asarray(ref_losses))
    for a, b in zip(jax.tree.leaves(state.dense_params),
                    jax.tree.leaves(ref_params)):
      test_util.assert_bits_equal(self, a, test_util.as_numpy(b))

  def test_first_update_is_a_no_op(self):
    coll, state0, params, batches = make_setup(False, np.float32)
    trainer = pipeline.Trainer(coll, loss_fn, optax.sgd(0.1))
    before = jax.tree.map(test_util.as_numpy, state0)
    state = trainer.init(state0, params, batches[0])
    state, metrics = jax.jit(trainer.step)(state, batches[0], batches[1])
    for stats in metrics.updates.values():
      self.assertEqual(int(stats.valid), 0)
      self.assertEqual(int(stats.pending), 0)
    for a, b in zip(jax.tree.leaves(state.embedding), jax.tree.leaves(before)):
      test_util.assert_bits_equal(self, a, b)

  def test_flush_applies_last_update(self):
    coll, state0, params, batches = make_setup(False, np.float32)
    trainer = pipeline.Trainer(coll, loss_fn, optax.sgd(0.1))
    state = trainer.init(state0, params, batches[0])
    state, _ = jax.jit(trainer.step)(state, batches[0], batches[1])
    flush = jax.jit(trainer.flush)
    state, stats = flush(state)
    self.assertEqual(int(stats["stack0"].valid), 1)
    self.assertEqual(int(state.embedding.stacks["stack0"].opt_state.step), 1)
    _, stats = flush(state)  # nothing left staged
    self.assertEqual(int(stats["stack0"].valid), 0)

  def test_synchronous_mode_learns(self):
    coll, state0, params, batches = make_setup(False, np.float32)
    trainer = pipeline.Trainer(coll, loss_fn, optax.sgd(0.05),
                               pipelined=False)
    state = trainer.init(state0, params)
    step = jax.jit(trainer.step, donate_argnums=0)
    first = None
    for _ in range(20):
      state, metrics = step(state, batches[0])
      first = first if first is not None else float(metrics.loss)
      self.assertEqual(int(metrics.updates["stack0"].valid), 1)
    self.assertLess(float(metrics.loss), 0.5 * first)

  def test_train_and_eval_batch_sizes_differ(self):
    coll, state0, params, batches = make_setup(False, np.float32)
    trainer = pipeline.Trainer(coll, loss_fn, optax.sgd(0.05),
                               pipelined=False)
    state, _ = jax.jit(trainer.step)(trainer.init(state0, params),
                                     batches[0])
    small = jax.tree.map(lambda x: x[:8], batches[1])  # 8, not 32 examples
    emb = jax.jit(coll.lookup)(state.embedding, small)
    self.assertEqual(emb["hist"].shape, (8, 2, 16))
    full = jax.jit(coll.lookup)(state.embedding, batches[1])
    np.testing.assert_array_equal(np.asarray(emb["hist"]),
                                  np.asarray(full["hist"])[:8])

  def test_misuse(self):
    coll, state0, params, batches = make_setup(False, np.float32)
    piped = pipeline.Trainer(coll, loss_fn, optax.sgd(0.1))
    sync = pipeline.Trainer(coll, loss_fn, optax.sgd(0.1), pipelined=False)
    with self.assertRaisesRegex(pe.PipelineMisuse, "needs first_batch"):
      piped.init(state0, params)
    sync_state = sync.init(state0, params)
    with self.assertRaisesRegex(pe.PipelineMisuse,
                                "nothing prefetched or staged"):
      jax.jit(piped.step)(sync_state, batches[0], batches[1])
    piped_state = piped.init(state0, params, batches[0])
    with self.assertRaisesRegex(pe.PipelineMisuse, "needs next_batch"):
      jax.jit(piped.step)(piped_state, batches[0])
    with self.assertRaisesRegex(pe.PipelineMisuse,
                                "staged update would be dropped"):
      jax.jit(sync.step)(piped_state, batches[0])
    with self.assertRaisesRegex(pe.PipelineMisuse, "got a dict"):
      jax.jit(sync.step)({"embedding": state0}, batches[0])


OVERFLOW_PROGRAM = """
import jax, jax.numpy as jnp, numpy as np, optax
import pallas_emb as pe
coll = pe.EmbeddingCollection(
    [pe.TableSpec("t", 100, 8, optimizer=pe.Sgd(0.1), max_unique=3)],
    [pe.FeatureSpec("f", "t")], jax.make_mesh((1,), ("x",)), "x")
trainer = pe.Trainer(coll, lambda p, e, b: (jnp.sum(e["f"] * p["w"]), {}),
                     optax.sgd(0.1), pipelined=False)
state = trainer.init(coll.init(jax.random.key(0)), {"w": jnp.ones((8,))})
try:
  jax.block_until_ready(jax.jit(trainer.step)(
      state, {"f": np.arange(1, 9, dtype=np.int32)}))
except Exception as e:
  print("raised", "UniqueOverflowError" in str(e), "5 more distinct" in str(e))
"""


class OverflowExitTest(absltest.TestCase):

  def test_overflow_raises_once_and_exits_quietly(self):
    """The Trainer's overflow check raises in the step; a program that
    catches it exits with nothing on stderr (no traceback from JAX's own
    log of the failed callback, at the step or at interpreter exit)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", OVERFLOW_PROGRAM],
                          capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr)
    self.assertEqual(proc.stdout.strip(), "raised True True")
    self.assertEqual(proc.stderr.strip(), "")


if __name__ == "__main__":
  absltest.main()
