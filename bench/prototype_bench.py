"""Times the bf16-on-XLA:CPU prototypes of `bench/prototypes.py` in one process.

    python bench/prototype_bench.py --num_devices=1 --json_out=/tmp/proto.json

Cases (all the full sparse step of `pallas_emb.bench --what=step`, xla
backend, interleaved round by round):

  lib f32                  the library, f32 table (the reference point)
  lib bf16                 the library, bf16 table
  lib bf16 no-norm         the library, compiled with float-normalization-bf16
                           off (its uint16 view still costs two passes)
  plain-scatter no-norm    plain bf16 scatter + normalization off
  bits bf16                table carried as uint16 bits (no flag)

It also checks that every bf16 variant produces bit-identical tables and row
state after the timed steps (they all ran the same number of steps on the
same batch).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from pallas_emb import bench  # pylint: disable=g-import-not-at-top

NO_NORM = {"xla_disable_hlo_passes": "float-normalization-bf16"}


def build(work: bench.Workload):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  import prototypes  # pylint: disable=g-import-not-at-top

  v, e, n = work.vocab_rows, work.emb_width, work.tokens_per_batch
  devices = jax.devices()[:work.num_devices]
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  ctx = pe.make_context(mesh, "x", tokens_per_batch=n, emb_width=e,
                        num_unique=pe.default_num_unique(n, v))
  opt = pe.RowwiseAdagrad(work.learning_rate)
  rng = np.random.default_rng(work.seed)
  ids = jax.device_put(bench.zipf_ids(rng, n, v, work.zipf, True),
                       pe.token_sharding(ctx))

  def make_lib_step():
    # A fresh function per case: jax caches traces by function, and a
    # prototype installed by monkeypatching must be traced anew.
    def lib_step(t, s, i):
      emb = pe.lookup(ctx, t, i, backend="xla")
      g = jax.grad(bench._loss)(emb)  # pylint: disable=protected-access
      d = pe.dedup(ctx, i, vocab_rows=v)
      t, s, stats = pe.apply_gradients(ctx, opt, t, s, g, d, backend="xla")
      return t, s, stats.norm
    return lib_step

  fb = lambda out, a: [out[0], out[1]] + a[2:]
  moved = (2.0 * n * e + 4 * n) * 2  # just for a GB/s column (bf16)
  cases = []

  def lib_case(label, dtype, options=None, proto=None):
    table = bench._put_table((v, e), dtype, pe.table_sharding(ctx), 0)  # pylint: disable=protected-access
    state = opt.init(ctx, table)
    fn = jax.jit(make_lib_step(), donate_argnums=(0, 1))
    if proto:
      prototypes.install(proto)
    try:
      lowered = fn.lower(table, state, ids)
    finally:
      prototypes.uninstall()
    compiled = (lowered.compile(compiler_options=options) if options
                else lowered.compile())
    cases.append(bench.Case("step", label, "xla", jnp.dtype(dtype).name,
                            compiled, [table, state, ids], fb, moved))

  lib_case("lib f32", jnp.float32)
  lib_case("lib bf16", jnp.bfloat16)
  lib_case("lib bf16 no-norm", jnp.bfloat16, NO_NORM)
  lib_case("plain-scatter no-norm", jnp.bfloat16, NO_NORM, "plain_scatter")

  table = bench._put_table((v, e), jnp.bfloat16, pe.table_sharding(ctx), 0)  # pylint: disable=protected-access
  bits = jax.jit(prototypes.to_bits)(table)
  state = opt.init(ctx, table)
  del table
  step_fn = jax.jit(prototypes.make_bits_step(ctx, opt, v, bench._loss),  # pylint: disable=protected-access
                    donate_argnums=(0, 1, 2))
  args = [bits, state.row_state, state.step, ids]
  cases.append(bench.Case(
      "step", "bits bf16", "xla", "bfloat16",
      step_fn.lower(*args).compile(), args,
      lambda out, a: [out[0], out[1], out[2], a[3]], moved))
  return cases, ctx


def main(argv):
  del argv
  bench.configure_jax(bench._NUM_DEVICES.value)  # pylint: disable=protected-access
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  work = bench.Workload(
      vocab_rows=bench._VOCAB.value, emb_width=bench._WIDTH.value,  # pylint: disable=protected-access
      tokens_per_batch=bench._TOKENS.value, zipf=bench._ZIPF.value,  # pylint: disable=protected-access
      num_devices=bench._NUM_DEVICES.value, dtype="bfloat16")  # pylint: disable=protected-access
  cases, ctx = build(work)
  copy = bench.copy_case(jax.devices(), bench._COPY_MB.value)  # pylint: disable=protected-access
  bench.time_cases(cases + [copy], bench._REPEATS.value, bench._WARMUP.value,  # pylint: disable=protected-access
                   bench._BURST.value)  # pylint: disable=protected-access
  copy_gbps = copy.bytes_moved / bench._stats(copy.times)["median_s"] / 1e9  # pylint: disable=protected-access
  info = {"group_size": ctx.group_size, "shard_width": ctx.shard_width}
  records = []
  for c in cases:
    rec = bench.summarize(c, copy_gbps, work, info, work.vocab_rows)
    rec["dtype"] = c.dtype
    records.append(rec)
  base = records[0]["median_s"]
  print(f"{'case':24s} {'median ms':>10s} {'IQR ms':>8s} {'vs lib f32':>10s} "
        f"{'temp':>9s} {'table ops':>9s}")
  for r in records:
    print(f"{r['case']:24s} {1e3 * r['median_s']:10.3f} "
          f"{1e3 * (r['p75_s'] - r['p25_s']):8.3f} "
          f"{r['median_s'] / base:9.2f}x "
          f"{bench._fmt_bytes(r['memory'].get('temp')):>9s} "  # pylint: disable=protected-access
          f"{r['full_table_ops']:9d}  {r['full_table_op_names'][:2]}")
  # Bit-identity of the bf16 variants (same number of steps, same batch).
  ref = None
  for c in cases[1:]:
    table = c.args[0]
    if c.name.startswith("bits"):
      table = jax.lax.bitcast_convert_type(table, jax.numpy.bfloat16)
    state = c.args[1]
    state = getattr(state, "row_state", state)
    got = (np.asarray(table).view(np.uint16), np.asarray(state))
    if ref is None:
      ref = got
    else:
      same = all(np.array_equal(a, b) for a, b in zip(got, ref))
      print(f"{c.name}: bit-identical to lib bf16: {same}")
      records[cases.index(c)]["bit_identical_to_lib_bf16"] = bool(same)
  if bench._JSON_OUT.value:  # pylint: disable=protected-access
    import json  # pylint: disable=g-import-not-at-top
    with open(bench._JSON_OUT.value, "w") as f:  # pylint: disable=protected-access
      json.dump({"meta": bench._meta(), "results": records}, f, indent=1,  # pylint: disable=protected-access
                default=str)


if __name__ == "__main__":
  flags.FLAGS.set_default("repeats", 15)
  app.run(main)
