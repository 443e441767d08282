"""Smoke tests of `python -m bench.bench`, `bench.kernels` and the other
bench programs.

At tiny sizes, each run is a fresh process (the bench sets the simulated
device count before JAX starts, which an in-process run could not do), with
one timed round, and the JSON it writes is checked for the fields the README
and the GPU check read. Its HLO helpers (`pallas_emb.testing.hlo`) are tested
in hlo_test.py, its ids (`pallas_emb.datasets.zipf_ids`) in datasets_test.py.
"""

import os
import tempfile

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax

ON_GPU = jax.devices()[0].platform == "gpu"
DEVICES = 1 if ON_GPU else 2
TINY = ["--vocab_rows=1024", "--emb_width=16", "--tokens_per_batch=64",
        f"--num_devices={DEVICES}", "--repeats=1", "--warmup=1", "--burst=1",
        "--copy_mb=1", "--num_batches=2"]
TIMING = ("median_s", "p25_s", "p75_s", "min_s", "max_s", "n")
RECORD = TIMING + ("what", "case", "backend", "dtype", "tokens_per_s",
                   "bytes_moved", "gbps", "frac_copy_bw", "copy_gbps",
                   "memory", "collectives", "full_table_ops", "vocab_rows",
                   "tokens_per_batch", "num_devices", "distinct_ids")


def library_backends() -> list[str]:
  """The backend under test, plus the xla baseline the bench always adds."""
  chosen = test_util.backends()
  return [b for b in chosen if b != "xla"][:1] + ["xla"]


def run_bench(*args, timeout=600):
  with tempfile.TemporaryDirectory() as tmp:
    doc, stdout = test_util.run_program("bench.bench", args, tmp,
                                        timeout=timeout)
    return doc, stdout, os.listdir(tmp), tmp


class BenchCliTest(parameterized.TestCase):

  def check_records(self, doc, what):
    self.assertEqual(doc["what"], what)
    self.assertIn("jax", doc["meta"])
    self.assertIn("table", doc)
    timed = [r for r in doc["results"] if r.get("median_s")]
    self.assertNotEmpty(timed)
    for r in timed:
      missing = [k for k in RECORD if k not in r]
      self.assertEmpty(missing, f"{r['case']}[{r['backend']}] lacks "
                       f"{missing}")
      self.assertGreater(r["median_s"], 0)
      self.assertLessEqual(r["min_s"], r["median_s"])
      self.assertLessEqual(r["median_s"], r["max_s"])
      self.assertIn("temp", r["memory"])
      self.assertIn("peak", r["memory"])
    return timed

  @parameterized.parameters("lookup", "update", "step")
  def test_what(self, what):
    backends = library_backends()
    doc, stdout, _, _ = run_bench(f"--what={what}",
                                  f"--backends={','.join(backends)}",
                                  "--dtype=float32,bfloat16", *TINY)
    timed = self.check_records(doc, what)
    self.assertIn("median ms", stdout)
    cases = {(r["case"], r["backend"], r["dtype"]) for r in timed}
    for dtype in ("float32", "bfloat16"):
      self.assertIn(("dense", "dense", dtype), cases)
      for backend in backends:
        self.assertIn(("sparse", backend, dtype), cases)
    for r in timed:
      self.assertIn("speedup_vs_dense", r)
      self.assertIn("speedup_vs_xla", r)
      if r["case"] == "sparse":
        self.assertIn("collectives_min", r)
        if DEVICES > 1:
          self.assertIn("all-gather", r["collectives"])
          self.assertIn("all-to-all", r["collectives"])
        if r["dtype"] == "float32" and r["backend"] == "xla":
          # The sparse f32 paths never materialize a table-sized array.
          self.assertEqual(r["full_table_ops"], 0, r["full_table_op_names"])
      elif what != "lookup":
        # The dense baseline does write whole tables: the detector sees it.
        self.assertGreater(r["full_table_ops"], 0)
      if what == "lookup":
        self.assertIn("gathered_gbps", r)

  def test_config_and_scan_with_plot(self):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
      f.write("def get_config():\n"
              "  return dict(vocab_rows=512, emb_width=8,\n"
              "              tokens_per_batch=32, zipf=0.0)\n")
      config = f.name
    try:
      with tempfile.TemporaryDirectory() as tmp:
        plot = os.path.join(tmp, "scan.png")
        doc, _, _, _ = run_bench(
            "--what=lookup", f"--config={config}", "--scan",
            "--scan_vocab=256,512", "--scan_tokens=32",
            f"--scan_ranks=1,{DEVICES}", "--scan_repeats=1",
            "--baselines=xla", "--repeats=1", "--burst=1", "--copy_mb=1",
            f"--plot_out={plot}")
        self.assertTrue(os.path.getsize(plot) > 1000)
    finally:
      os.unlink(config)
    timed = [r for r in doc["results"] if r.get("median_s")]
    self.assertEqual({r["scan_axis"] for r in timed},
                     {"vocab_rows", "tokens_per_batch", "num_devices"})
    self.assertEqual({r["vocab_rows"] for r in timed
                      if r["scan_axis"] == "vocab_rows"}, {256, 512})
    # The config's sizes are the scan's centre.
    self.assertEqual({r["emb_width"] for r in timed}, {8})
    self.assertEqual({r["zipf"] for r in timed}, {0.0})


class KernelBenchCliTest(parameterized.TestCase):
  """`python -m bench.kernels`: the kernels vs their twins, and the sweeps."""

  def run_kernels(self, *args):
    kernel = library_backends()[0]
    backends = ["interpret" if kernel == "xla" else kernel, "xla"]
    with tempfile.TemporaryDirectory() as tmp:
      records, stdout = test_util.run_program(
          "bench.kernels", ["--rows=512", "--widths=8", "--tokens=64",
                            "--dtypes=float32", "--ids=zipf", "--reps=1",
                            "--rounds=1", "--copy_mb=1",
                            f"--backends={','.join(backends)}", *args], tmp)
    return records, stdout, backends

  def test_every_kernel_against_its_twin(self):
    records, stdout, backends = self.run_kernels(
        "--what=gather,segment_sum,update", "--inner=2")
    self.assertIn("# 6 results, 0 failed checks or errors", stdout)
    self.assertEqual({(r["what"], r["backend"]) for r in records},
                     {(what, b) for what in ("gather", "segment_sum", "update")
                      for b in backends})
    for r in records:
      self.assertEqual(r["check"], "ok", r)
      self.assertEqual(r["inner"], 2)
      for key in ("median_s", "p25_s", "p75_s", "gbps", "of_copy",
                  "of_same_copy", "speedup_vs_xla", "bytes"):
        self.assertIn(key, r)
      self.assertLessEqual(r["p25_s"], r["median_s"])
      self.assertLessEqual(r["median_s"], r["p75_s"])
    update = [r for r in records if r["what"] == "update"]
    self.assertEqual({r["optimizer"] for r in update}, {"rowwise_adagrad"})

  def test_sweep_checks_every_config_heuristic_first(self):
    records, stdout, _ = self.run_kernels("--sweep", "--max_configs=2")
    self.assertIn("xla twin", stdout)
    self.assertEqual([r["what"] for r in records],
                     ["gather"] * 2 + ["segment_sum"] * 2 + ["update"] * 2)
    for what in ("gather", "segment_sum", "update"):
      mine = [r for r in records if r["what"] == what]
      self.assertEqual([r["heuristic"] for r in mine], [True, False])
      self.assertNotEqual(mine[0]["config"], mine[1]["config"])
    for r in records:
      self.assertEqual(r["check"], "ok", r)
      self.assertGreater(r["median_s"], 0)

  def test_other_update_rules(self):
    records, _, _ = self.run_kernels("--what=update", "--optimizer=adam")
    self.assertLen(records, 2)
    for r in records:
      self.assertEqual(r["optimizer"], "adam")
      self.assertEqual(r["check"], "ok", r)



class PlacementsBenchCliTest(absltest.TestCase):

  def test_weak_scaling_records(self):
    with tempfile.TemporaryDirectory() as tmp:
      doc, stdout = test_util.run_program(
          "bench.placements", ["--ranks=1,2", "--rows=1000", "--emb_width=8",
                               "--ids_per_rank=64", "--repeats=1",
                               "--warmup=1"], tmp)
    self.assertIn("row_fit", stdout)
    by = {(r["ranks"], r["placement"]): r for r in doc["records"]}
    self.assertCountEqual(by, [(w, p) for w in (1, 2)
                               for p in ("column", "row", "row_fit")])
    for (ranks, placement), r in by.items():
      self.assertGreater(r["step_ms"], 0)
      # One rank sends nothing; two ranks exchange ids and rows.
      self.assertEqual(r["sent_bytes_per_rank"] == 0, ranks == 1, placement)
    # The default capacity (the rank's 64 ids) never overflows, and the
    # fitted one is no larger.
    for ranks in (1, 2):
      self.assertEqual(by[ranks, "row"]["capacity"], 64)
      self.assertEqual(by[ranks, "row"]["overflow"], 0)
      self.assertLessEqual(by[ranks, "row_fit"]["capacity"], 64)
      self.assertEqual(by[ranks, "column"]["sorted_keys_per_rank"],
                       64 * ranks)


class DedupBenchCliTest(absltest.TestCase):

  def test_records_every_method_per_batch_size(self):
    # The program itself checks the three dedups against each other.
    with tempfile.TemporaryDirectory() as tmp:
      doc, stdout = test_util.run_program(
          "bench.dedup", ["--rows=1000", "--tokens=64,300", "--repeats=1",
                          "--warmup=1", "--num_batches=2",
                          "--update_width=4"], tmp)
    self.assertIn("speed-up", stdout)
    self.assertEqual([r["tokens"] for r in doc], [64, 300])
    for r in doc:
      self.assertCountEqual(r["median_s"], ["sort", "map", "map_sorted"])
      self.assertTrue(all(t > 0 for t in r["median_s"].values()))
      self.assertCountEqual(r["update_median_s"],
                            ["sorted", "first_occurrence"])
      self.assertEqual(r["slot_map_bytes"], 4000)
      self.assertBetween(r["distinct"], 1, r["tokens"])


class CpuKnobsCliTest(absltest.TestCase):

  def test_every_variant_trains_the_same_table(self):
    # Updates at sizes down to 64 slots of a 1,024-slot buffer.
    with tempfile.TemporaryDirectory() as tmp:
      doc, stdout = test_util.run_program(
          "bench.cpu_knobs", ["--workload=t:3000:256:4", "--dtype=bfloat16",
                              "--rounds=1", "--steps=1",
                              "--min_tier_slots=64"], tmp)
    self.assertIn("whole_buffer", stdout)
    self.assertEqual([r["variant"] for r in doc["results"]],
                     ["default", "whole_buffer", "uint16_gather"])
    self.assertLen({r["table_digest"] for r in doc["results"]}, 1)
    self.assertTrue(all(r["median_ms"] > 0 for r in doc["results"]))


class TpuBenchTest(absltest.TestCase):
  """`bench.tpu` and `bench.tpu_profile` run (on a CPU: no device ops in
  the trace), with a knob set by `--set`."""

  def test_step_table_and_profile(self):
    knob = "--set=pallas_emb.kernels.mosaic_tpu.lookup.POOL_METHOD='xla'"
    tiny = ["--rows=500", "--widths=64", "--dtypes=float32", "--ids=32",
            "--bag=4", "--kinds=pooled", "--backends=xla", "--repeats=1",
            "--warmup=1", knob]
    with tempfile.TemporaryDirectory() as tmp:
      records, stdout = test_util.run_program("bench.tpu", tiny, tmp)
      self.assertIn("POOL_METHOD='xla'", stdout)
      self.assertEqual({r["case"] for r in records}, {"xla", "dense"})
      for r in records:
        self.assertGreater(r["ms"], 0)
        self.assertEqual((r["rows"], r["kind"]), (500, "pooled"))
      profile, stdout = test_util.run_program(
          "bench.tpu_profile", tiny + ["--steps=1"], tmp)
      self.assertEqual(profile["config"],
                       [500, 64, "float32", "pooled", "zipf", "xla"])
      self.assertIn("device ops", stdout)

  def test_bf16_conversion_table(self):
    """`bench.tpu_convert`: both pairings time and round-trip one table."""
    with tempfile.TemporaryDirectory() as tmp:
      records, stdout = test_util.run_program(
          "bench.tpu_convert", ["--rows=300", "--width=63", "--repeats=1"],
          tmp)
      self.assertEqual([r["convert"] for r in records], ["matmul", "pairs"])
      for r in records:
        self.assertTrue(r["round_trip"])
        self.assertGreater(r["to_first_s"], 0)
        self.assertGreater(r["from_s"], 0)
      self.assertIn("| pairs |", stdout)

  def test_training_profile(self):
    """`bench.train_profile` runs a whole `examples.train` program traced."""
    with tempfile.TemporaryDirectory() as tmp:
      profile, stdout = test_util.run_program(
          "bench.train_profile", [
              "--config=" + os.path.join(test_util.ROOT, "configs/tiny.py"),
              "--epochs=1", "--num_examples=2048"], tmp)
      self.assertIn("device ops of the run", stdout)
      self.assertIn("test", stdout)  # the program's own report ran
      self.assertIsInstance(profile["ms"], dict)


if __name__ == "__main__":
  absltest.main()
