"""pe.plan against a numpy model of its documented cost model.

The model below restates docs/planner.md for tables that each sit in a
stack of their own (every width differs): bytes per rank of the table and
its row-wise Adagrad state, and bytes a rank sends per step.
"""

import dataclasses
import itertools
import math

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

import pallas_emb as pe
from pallas_emb import stacking

BATCH = 16  # examples per rank
# (name, rows, width): rows divide by 8, so row and column placements store
# the same table bytes; widths differ, so each table is its own stack.
SPECS = (("big", 4000, 32), ("mid", 800, 16), ("small", 64, 24),
         ("tiny", 8, 8))
# (feature, table, combiner, ids per example)
FEATURES = (("history", "big", None, 3), ("item", "big", None, 1),
            ("tags", "mid", "sum", 4), ("kind", "small", None, 1),
            ("flag", "tiny", "mean", 2))


def specs(opt=None):
  opt = opt or pe.RowwiseAdagrad(0.1)
  tables = [pe.TableSpec(n, r, d, optimizer=opt) for n, r, d in SPECS]
  features = [pe.FeatureSpec(f, t, combiner=c) for f, t, c, _ in FEATURES]
  stats = {f: pe.FeatureStats(float(k)) for f, _, _, k in FEATURES}
  return tables, features, stats


def model_memory(name, placement, w):
  """f32 table + row-wise Adagrad accumulator (f32 per row) + step."""
  _, r, d = next(s for s in SPECS if s[0] == name)
  if placement == "column":
    return r * d // w * 4 + r * 4 + 4
  if placement == "row":
    return math.ceil(r / w) * (d * 4 + 4) + 4
  return r * (d * 4 + 4) + 4  # replicated; a lone table-placed table


def model_sent(name, placement, w):
  _, r, d = next(s for s in SPECS if s[0] == name)
  e = t = g = 0
  for _, table, combiner, k in FEATURES:
    if table == name:
      e += BATCH * k
      rows = BATCH * k if combiner is None else BATCH
      t += rows
      g += rows * 4  # f32 tables: sequence and pooled gradients are f32
  if placement == "column":
    return (w - 1) * (e * 4 + t * d * 4 / w + g * d / w)
  if placement == "replicated":
    return (w - 1) * (e * 4 + g * d)
  return (w - 1) * min(e, r) * (4 + d * 4 + d * 4)


def model_cost(placements, w):
  names = [s[0] for s in SPECS]
  return (round(sum(model_sent(n, p, w) for n, p in zip(names, placements))),
          sum(model_memory(n, p, w) for n, p in zip(names, placements)))


def run_plan(ranks, budget, **kw):
  """`pe.plan` of SPECS; the sort dedup (no slot maps), as the model above
  counts, unless `dedup=` says otherwise."""
  tables, features, stats = specs()
  kw.setdefault("dedup", "sort")
  return pe.plan(tables, features, test_util.mesh({"x": ranks}),
                 table_axis="x", batch_size=BATCH, device_memory=budget,
                 reserve=0, stats=stats, **kw)


class PlanTest(parameterized.TestCase):

  @parameterized.product(ranks=(1, 2, 4, 8),
                         budget=("ample", "between", "tight", "short"))
  def test_budgets(self, ranks, budget):
    """Ample or between all-row and all-column memory: the least bytes sent
    of any placements that fit; tight (the least memory, every table
    row-placed): fits exactly; one byte short: PlanInfeasibleError."""
    least = model_cost(["row"] * len(SPECS), ranks)[1]
    column = model_cost(["column"] * len(SPECS), ranks)[1]
    mem = {"ample": 10**9, "between": (least + column) // 2, "tight": least,
           "short": least - 1}[budget]
    if budget == "short":
      with self.assertRaises(pe.PlanInfeasibleError):
        run_plan(ranks, mem)
      return
    tables, report = run_plan(ranks, mem)
    chosen = [t.placement for t in tables]
    sent, memory = model_cost(chosen, ranks)
    self.assertEqual(report.memory_per_rank, (memory,) * ranks)
    self.assertEqual(report.sent_per_rank, (sent,) * ranks)
    self.assertLessEqual(memory, mem)
    # No assignment of placements that fits sends less (brute force).
    best = min(model_cost(c, ranks)[0]
               for c in itertools.product(pe.PLACEMENTS, repeat=len(SPECS))
               if model_cost(c, ranks)[1] <= mem)
    if budget == "tight" and ranks > 1:
      self.assertEqual(chosen, ["row"] * len(SPECS))
    self.assertEqual(sent, best)

  @parameterized.parameters(1, 2, 4, 8)
  def test_beats_every_single_placement(self, ranks):
    """The plan's (bytes sent, memory) is at most each feasible plan with
    one placement for every table, under the model's own objective."""
    budget = model_cost(["column"] * len(SPECS), ranks)[1]
    tables, report = run_plan(ranks, budget)
    got = (report.sent_per_rank[0], report.memory_per_rank[0])
    self.assertEqual(got, model_cost([t.placement for t in tables], ranks))
    for p in pe.PLACEMENTS:
      cost = model_cost([p] * len(SPECS), ranks)
      if cost[1] <= budget:
        self.assertLessEqual(got, cost, p)
    self.assertEqual(report.column_only_memory, budget)
    self.assertEqual(report.column_only_sent,
                     model_cost(["column"] * len(SPECS), ranks)[0])

  def test_infeasible_message(self):
    least = model_cost(["row"] * len(SPECS), 4)[1]
    with self.assertRaises(pe.PlanInfeasibleError) as cm:
      run_plan(4, least // 3)
    text = str(cm.exception)
    self.assertTrue(text.startswith("pallas_emb plan cannot fit"), text)
    self.assertIn(f"in {least // 3} bytes per rank", text)
    self.assertIn(f"least memory of any plan tried is {least} bytes", text)
    self.assertIn(f"'big' ({model_memory('big', 'row', 4)} bytes per rank",
                  text)
    self.assertIn(f"give about {math.ceil(4 * least / (least // 3))} ranks",
                  text)
    self.assertIn("bfloat16", text)
    self.assertIsInstance(cm.exception, pe.Error)

  def test_report(self):
    tables, report = run_plan(2, 10**9)
    text = str(report)
    for t, row in zip(tables, report.tables):
      self.assertEqual((row.name, row.placement), (t.name, t.placement))
      self.assertIn(f"  {t.name}: {t.placement}", text)
    self.assertIn(f"rank 1: {report.memory_per_rank[1]} bytes", text)
    d = report.as_dict()
    self.assertEqual(d["tables"][0]["name"], "big")
    self.assertEqual(d["sent_per_rank"], report.sent_per_rank)

  def test_small_tables_go_to_one_rank_each(self):
    """Eight 8-row tables of width 6 (no column over 4 ranks), 16 ids each
    per rank: a table stack's bucket is its busiest owner's two tables
    (16 rows) where a row stack's is all eight (64); replicated sends
    every id and full-width gradient. Table placement, two per rank."""
    opt = pe.RowwiseAdagrad(0.1)
    tables = [pe.TableSpec(f"t{i}", 8, 6, optimizer=opt) for i in range(8)]
    features = [pe.FeatureSpec(f"f{i}", f"t{i}") for i in range(8)]
    planned, report = pe.plan(tables, features, test_util.mesh({"x": 4}),
                              table_axis="x", batch_size=16,
                              device_memory=10**6)
    self.assertEqual([t.placement for t in planned], ["table"] * 8)
    self.assertEqual(sorted(t.rank for t in planned), [0, 0, 1, 1, 2, 2, 3, 3])
    self.assertEqual([r.rank for r in report.tables], [t.rank for t in planned])
    self.assertEqual(report.sent_per_rank, (3 * 16 * (4 + 6 * 4 + 6 * 4),) * 4)
    self.assertEqual(report.memory_per_rank, (16 * (6 * 4 + 4) + 4,) * 4)
    self.assertEqual((report.reserve, report.budget), (200_000, 800_000))
    self.assertIsNone(report.column_only_memory)
    self.assertIn("column-only: impossible", str(report))
    self.assertIn("  t0: table on rank ", str(report))

  def test_plan_cost(self):
    """plan_cost scores a plan as the report does, and placements as given:
    eight 8-row tables of width 6 all on rank 0 pad every rank to them."""
    tables, features, stats = specs()
    planned, report = run_plan(4, model_cost(["row"] * 4, 4)[1])
    cost = pe.plan_cost(planned, features, 4, batch_size=BATCH, stats=stats)
    self.assertEqual((cost.memory_per_rank, cost.sent_per_rank),
                     (report.memory_per_rank[0], report.sent_per_rank[0]))
    self.assertTrue(cost.addressable)
    opt = pe.RowwiseAdagrad(0.1)
    tables = [pe.TableSpec(f"t{i}", 8, 6, optimizer=opt, placement="table",
                           rank=0) for i in range(8)]
    features = [pe.FeatureSpec(f"f{i}", f"t{i}") for i in range(8)]
    cost = pe.plan_cost(tables, features, 4, batch_size=16)
    one = 8 * (6 * 4 + 4) + 4  # a table, its accumulator and step alone
    self.assertEqual(cost.memory_per_rank, 64 * (6 * 4 + 4) + 4)
    self.assertEqual(cost.shard_bytes_per_rank, (8 * one, 0, 0, 0))
    # Rank 0 owns all 8 x 16 ids: its bucket from each rank is 64 ids.
    self.assertEqual(cost.sent_per_rank, 3 * 64 * (4 + 6 * 4 + 6 * 4))

  def test_stacks_stay_within_int32_rows(self):
    """Two 600M-row tables on 4 ranks: whole on a rank each would send
    least (a bucket of 16 ids, not a row stack's 32), but a table stack is
    4 blocks of 600M rows, more than int32 ids address, so the plan is
    row (1.2B rows), within the budget replicated misses."""
    opt = pe.RowwiseAdagrad(0.1)
    rows = 600_000_000
    tables = [pe.TableSpec(n, rows, 6, optimizer=opt) for n in "ab"]
    features = [pe.FeatureSpec(n, n) for n in "ab"]
    planned, report = pe.plan(tables, features, test_util.mesh({"x": 4}),
                              table_axis="x", batch_size=16,
                              device_memory=10 * 10**9, reserve=0)
    self.assertEqual([t.placement for t in planned], ["row", "row"])
    self.assertEqual(report.memory_per_rank,
                     (2 * rows // 4 * (6 * 4 + 4) + 4,) * 4)
    self.assertEqual(report.sent_per_rank, (3 * 32 * (4 + 6 * 4 + 6 * 4),) * 4)
    whole = [dataclasses.replace(t, placement="table") for t in tables]
    with self.assertRaisesRegex(pe.InputError, "stack into 2400000000 rows"):
      stacking.stack_tables(whole, features, 4)
    self.assertEqual(
        stacking.stack_tables(whole, features, 4, max_rows=None)
        .stacks[0].total_rows, 4 * rows)
    self.assertFalse(pe.plan_cost(whole, features, 4,
                                  batch_size=16).addressable)

  def test_bad_inputs(self):
    tables, features, _ = specs()
    mesh = test_util.mesh({"x": 2})
    if jax.devices()[0].memory_stats() is None:
      with self.assertRaisesRegex(pe.InputError, "device_memory="):
        pe.plan(tables, features, mesh, table_axis="x", batch_size=4)
    with self.assertRaisesRegex(pe.InputError, "table_axis='y'"):
      pe.plan(tables, features, mesh, table_axis="y", batch_size=4,
              device_memory=10**9)
    for stats in ({"nope": pe.FeatureStats()}, {"item": 2.0},
                  {"item": pe.FeatureStats(0.0)}):
      with self.assertRaisesRegex(pe.InputError, "stats"):
        pe.plan(tables, features, mesh, table_axis="x", batch_size=4,
                device_memory=10**9, stats=stats)
    with self.assertRaisesRegex(pe.InputError, "reserve=2000000000"):
      pe.plan(tables, features, mesh, table_axis="x", batch_size=4,
              device_memory=10**9, reserve=2 * 10**9)


class DefaultDedupTest(absltest.TestCase):

  def test_plan_counts_the_dedup_a_default_collection_takes(self):
    """On CPU meshes a default collection dedups through slot maps, so the
    default plan counts their 4 bytes a row (column and replicated)."""
    default = run_plan(8, 10**9, dedup=None)[1]
    maps = run_plan(8, 10**9, dedup="slot_map")[1]
    self.assertEqual(default.as_dict(), maps.as_dict())
    sort = run_plan(8, 10**9)[1]
    self.assertGreater(max(default.memory_per_rank),
                       max(sort.memory_per_rank))


class TinyTablesTest(absltest.TestCase):
  """Why a tiny table is not replicated, in numbers (docs/planner.md)."""

  def test_report_shows_every_placement_of_a_table(self):
    for ranks in (2, 8):
      _, report = run_plan(ranks, 10**9)
      for t in report.tables:
        allowed = ("row", "table", "replicated") + (
            ("column",) if dict((n, d) for n, _, d in SPECS)[t.name] % ranks
            == 0 else ())
        self.assertEqual(sorted(t.alternatives), sorted(allowed), t.name)
        for p, (mem, sent) in t.alternatives.items():
          if p != "table":  # a lone table-placed table: its rank's bytes
            self.assertEqual(mem, model_memory(t.name, p, ranks), (t, p))
          self.assertEqual(sent, round(model_sent(t.name, p, ranks)), (t, p))
        self.assertEqual((t.bytes_per_rank, t.sent_per_step),
                         t.alternatives[t.placement])

  def test_tiny_tables_go_where_they_send_least(self):
    """8 ranks, 0.75x the column-only memory, 3 big
    tables and twelve of 3-1,000 rows. A row-placed tiny table's bucket
    holds at most its rows, so it sends less than the per-id gradients a
    replicated one all-gathers; the report prints both figures."""
    opt = pe.RowwiseAdagrad(0.1)
    sizes = [(3_000_000, 8), (200_000, 128), (500_000, 32)] + [
        (r, 16) for r in (3, 5, 10, 20, 50, 80, 100, 200, 300, 500, 700,
                          1000)]
    tables = [pe.TableSpec(f"t{i}", r, w, optimizer=opt)
              for i, (r, w) in enumerate(sizes)]
    features = [pe.FeatureSpec(f"f{i}", f"t{i}") for i in range(len(sizes))]
    mesh = test_util.mesh({"x": 8})
    _, free = pe.plan(tables, features, mesh, table_axis="x",
                      batch_size=1024, device_memory=10**12, reserve=0)
    budget = int(0.75 * free.column_only_memory)
    _, report = pe.plan(tables, features, mesh, table_axis="x",
                        batch_size=1024, device_memory=budget, reserve=0)
    text = str(report)
    for t, (rows, _) in zip(report.tables, sizes):
      if rows > 100:
        continue
      mem, sent = t.alternatives["replicated"]
      self.assertLess(t.sent_per_step, sent, t)
      self.assertIn(f"replicated it would store {mem} bytes per rank and "
                    f"send {sent} bytes per step", text)
    self.assertLessEqual(max(report.memory_per_rank), budget)


class BatchStatsTest(absltest.TestCase):

  def test_counts(self):
    features = [pe.FeatureSpec("seq", "a"),
                pe.FeatureSpec("bag", "a", combiner="sum")]
    batches = [{"seq": np.array([[1, 1, 2], [3, 1, 1]]),
                "bag": pe.Bag(np.array([[5], [5]]))},
               {"seq": np.array([[7, 7, 7], [7, 7, 7]]),
                "bag": pe.Bag(np.array([[1], [2]]))}]
    stats = pe.batch_stats(batches, features)
    self.assertEqual(stats["seq"], pe.FeatureStats(3.0, (3 + 1) / 2))
    self.assertEqual(stats["bag"], pe.FeatureStats(1.0, (1 + 2) / 2))
    with self.assertRaisesRegex(pe.InputError, "without feature 'bag'"):
      pe.batch_stats([{"seq": np.zeros((2, 1))}], features)
    self.assertEqual(pe.FeatureStats(), pe.FeatureStats(1.0, None))


class PlannedCollectionTest(absltest.TestCase):

  def _planned(self, ranks, opt):
    tables, features, stats = specs(opt)
    # Budget between all-row and all-column: a mix of placements.
    budget = (model_cost(["row"] * len(SPECS), ranks)[1] +
              model_cost(["column"] * len(SPECS), ranks)[1]) // 2
    planned, report = pe.plan(
        tables, features, test_util.mesh({"x": ranks}), table_axis="x",
        batch_size=BATCH, device_memory=budget, reserve=0, stats=stats)
    coll = pe.EmbeddingCollection(planned, features,
                                  test_util.mesh({"x": ranks}), "x",
                                  backend="xla")
    return coll, report

  def test_memory_is_the_shards(self):
    coll, report = self._planned(4, None)
    self.assertGreater(len({s.placement for s in coll.plan.stacks}), 1,
                       coll.plan.describe())
    state = test_util.random_state(coll, 0)
    for device in range(4):
      on_device = sum(leaf.addressable_shards[device].data.nbytes
                      for leaf in jax.tree.leaves(state.stacks))
      self.assertEqual(on_device, report.memory_per_rank[device])

  def test_planned_collection_trains(self):
    """Three SGD steps of a planned 2-rank collection against numpy."""
    lr, ranks = 0.5, 2
    coll, _ = self._planned(ranks, pe.Sgd(lr))
    rng = np.random.default_rng(0)
    state = test_util.random_state(coll, 0)
    want = {k: np.asarray(v, np.float64)
            for k, v in coll.table_arrays(state).items()}
    for _ in range(3):
      batch = {}
      for f, t, c, k in FEATURES:
        rows = next(s[1] for s in SPECS if s[0] == t)
        shape = (ranks * BATCH, k) if c or k > 1 else (ranks * BATCH,)
        batch[f] = rng.integers(0, rows, shape).astype(np.int32)
      emb, routing = coll.lookup_and_route(state, batch)
      for f, t, c, _ in FEATURES:
        rows = want[t][batch[f]]
        expect = rows if c is None else (rows.sum(1) if c == "sum"
                                         else rows.mean(1))
        np.testing.assert_allclose(np.asarray(emb[f]), expect, rtol=1e-6,
                                   atol=1e-6, err_msg=f)
      grads = {f: rng.standard_normal(e.shape).astype(np.float32)
               for f, e in emb.items()}
      state, stats = coll.apply_gradients(state, routing, grads)
      coll.raise_if_overflow(stats)
      for f, t, c, _ in FEATURES:
        g = np.asarray(grads[f], np.float64)
        ids = batch[f]
        if c is not None:  # a bag's gradient reaches each of its ids
          scale = 1.0 if c == "sum" else 1.0 / ids.shape[1]
          g = np.repeat(g[:, None] * scale, ids.shape[1], axis=1)
        np.add.at(want[t], ids.reshape(-1), -lr * g.reshape(-1, g.shape[-1]))
    for name, table in coll.table_arrays(state).items():
      np.testing.assert_allclose(np.asarray(table), want[name], rtol=1e-5,
                                 atol=1e-5, err_msg=name)


if __name__ == "__main__":
  absltest.main()
