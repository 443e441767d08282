"""The parts a TPU sparse step is built from, each timed alone.

    python -m bench.tpu_parts --json_out=parts.json     # on a TPU
    python -m bench.tpu_parts --smoke                   # CPU, interpreter

Row DMAs (one-row copies from a `[V/2, 128]` f32 table: a dynamic start
loop with a wait per row, an unrolled loop with one wait per tile, and the
same double-buffered across grid steps), rows read and read-modify-written
at dynamic offsets in VMEM, XLA's gather of 128-lane and 64-lane rows, its
sorts, scatter-adds, segment sums and in-place scatters, and a dense
optax-like Adagrad step over a 1M x 64 table, for 16,384 and 327,680 Zipf
ids of 1M and 10M rows. Each is a jitted call timed alone (median of 10
after 2), so each figure includes one dispatch (about 0.6 ms on a v5e: the
difference between two sizes is the per-row cost). docs/tpu.md quotes
them; the Mosaic backend's choices follow from them.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
import traceback

from absl import app
from absl import flags
import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import numpy as np

_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny sizes, interpreter.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Results file.")
_ONLY = flags.DEFINE_list("only", [], "Probe name prefixes to run.")

RESULTS = []


def timeit(fn, *args, repeats=10, warmup=2, donate_first=False):
  if donate_first:
    state = args[0]
    rest = args[1:]
    for _ in range(warmup):
      state = jax.block_until_ready(fn(state, *rest))
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      state = jax.block_until_ready(fn(state, *rest))
      times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times), state
  out = None
  for _ in range(warmup):
    out = jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return 1e3 * statistics.median(times), out


def record(name, ms, **kw):
  r = {"name": name, "ms": ms, **kw}
  RESULTS.append(r)
  extra = " ".join(f"{k}={v}" for k, v in kw.items())
  print(f"{name:48s} {ms:9.3f} ms  {extra}", flush=True)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(RESULTS, f, indent=1)


def zipf_ids(rng, n, vocab, a=1.05):
  ranks = np.arange(1, vocab + 1, dtype=np.float64)
  p = ranks ** -a
  p /= p.sum()
  ids = rng.choice(vocab, size=n, p=p)
  perm = rng.permutation(vocab)
  return perm[ids].astype(np.int32)


# --- Mosaic row-DMA gathers of lines [L, 128] -----------------------------


def _gather_v1(ids_ref, table, out_ref, sem, *, block):
  def start(r, c):
    pltpu.make_async_copy(table.at[pl.ds(ids_ref[0, r], 1)],
                          out_ref.at[pl.ds(r, 1)], sem.at[0]).start()
    return c

  def wait(r, c):
    pltpu.make_async_copy(table.at[pl.ds(0, 1)], out_ref.at[pl.ds(r, 1)],
                          sem.at[0]).wait()
    return c
  lax.fori_loop(0, block, start, 0)
  lax.fori_loop(0, block, wait, 0)


def _gather_v2(ids_ref, table, out_ref, sem, *, block, unroll):
  def start(j, c):
    for u in range(unroll):
      r = j * unroll + u
      pltpu.make_async_copy(table.at[pl.ds(ids_ref[0, r], 1)],
                            out_ref.at[pl.ds(r, 1)], sem.at[0]).start()
    return c
  lax.fori_loop(0, block // unroll, start, 0)
  # One wait for the whole tile: DMA semaphores count bytes.
  pltpu.make_async_copy(table.at[pl.ds(0, block)], out_ref, sem.at[0]).wait()


def _gather_v3(ids_ref, next_ref, table, out_ref, buf, sem, *, block, unroll):
  i = pl.program_id(0)
  n = pl.num_programs(0)
  slot = i % 2

  def start_block(ids, into):
    def body(j, c):
      for u in range(unroll):
        r = j * unroll + u
        pltpu.make_async_copy(table.at[pl.ds(ids[0, r], 1)],
                              buf.at[into, pl.ds(r, 1)], sem.at[into]).start()
      return c
    lax.fori_loop(0, block // unroll, body, 0)

  @pl.when(i == 0)
  def _():
    start_block(ids_ref, 0)

  @pl.when(i + 1 < n)
  def _():
    start_block(next_ref, 1 - slot)

  pltpu.make_async_copy(table.at[pl.ds(0, block)], buf.at[slot],
                        sem.at[slot]).wait()
  out_ref[...] = buf[slot]


def dma_gather(table, ids, *, version, block=512, unroll=8, interpret=False):
  n = ids.shape[0]
  nb = n // block
  ids3 = ids.reshape(nb, 1, block)
  smem = lambda f: pl.BlockSpec((None, 1, block), f, memory_space=pltpu.SMEM)
  width = table.shape[1]
  out_shape = jax.ShapeDtypeStruct((n, width), table.dtype)
  ip = pltpu.InterpretParams() if interpret else False
  if version == 1:
    return pl.pallas_call(
        functools.partial(_gather_v1, block=block), out_shape=out_shape,
        grid=(nb,), in_specs=[smem(lambda i: (i, 0, 0)),
                              pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((block, width), lambda i: (i, 0)),
        scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",)), interpret=ip)(ids3, table)
  if version == 2:
    return pl.pallas_call(
        functools.partial(_gather_v2, block=block, unroll=unroll),
        out_shape=out_shape,
        grid=(nb,), in_specs=[smem(lambda i: (i, 0, 0)),
                              pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((block, width), lambda i: (i, 0)),
        scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",)), interpret=ip)(ids3, table)
  return pl.pallas_call(
      functools.partial(_gather_v3, block=block, unroll=unroll),
      out_shape=out_shape,
      grid=(nb,), in_specs=[smem(lambda i: (i, 0, 0)),
                            smem(lambda i: (jnp.minimum(i + 1, nb - 1), 0, 0)),
                            pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((block, width), lambda i: (i, 0)),
      scratch_shapes=[pltpu.VMEM((2, block, width), table.dtype),
                      pltpu.SemaphoreType.DMA((2,))],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("arbitrary",)),
      interpret=ip)(ids3, ids3, table)


# --- Mosaic dynamic row access in VMEM --------------------------------------


def _vmem_gather(ids_ref, src_ref, out_ref, *, block, unroll):
  def body(j, c):
    for u in range(unroll):
      r = j * unroll + u
      out_ref[pl.ds(r, 1), :] = src_ref[pl.ds(ids_ref[0, r], 1), :]
    return c
  lax.fori_loop(0, block // unroll, body, 0)


def vmem_gather(src, ids, *, block=1024, unroll=8, interpret=False):
  n = ids.shape[0]
  nb = n // block
  rows = src.shape[0]
  return pl.pallas_call(
      functools.partial(_vmem_gather, block=block, unroll=unroll),
      out_shape=jax.ShapeDtypeStruct((n, 128), src.dtype),
      grid=(nb,),
      in_specs=[pl.BlockSpec((None, 1, block), lambda i: (i, 0, 0),
                             memory_space=pltpu.SMEM),
                pl.BlockSpec((rows, 128), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((block, 128), lambda i: (i, 0)),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("arbitrary",),
          vmem_limit_bytes=100 * 2**20),
      interpret=pltpu.InterpretParams() if interpret else False,
  )(ids.reshape(nb, 1, block), src)


def _vmem_scatter_add(seg_ref, g_ref, acc_ref, *, block, unroll):
  @pl.when(pl.program_id(0) == 0)
  def _():
    acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

  def body(j, c):
    for u in range(unroll):
      r = j * unroll + u
      s = seg_ref[0, r]
      acc_ref[pl.ds(s, 1), :] += g_ref[pl.ds(r, 1), :]
    return c
  lax.fori_loop(0, block // unroll, body, 0)


def vmem_scatter_add(grads, seg, rows, *, block=1024, unroll=8,
                     interpret=False):
  n = seg.shape[0]
  nb = n // block
  return pl.pallas_call(
      functools.partial(_vmem_scatter_add, block=block, unroll=unroll),
      out_shape=jax.ShapeDtypeStruct((rows, 128), jnp.float32),
      grid=(nb,),
      in_specs=[pl.BlockSpec((None, 1, block), lambda i: (i, 0, 0),
                             memory_space=pltpu.SMEM),
                pl.BlockSpec((block, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((rows, 128), lambda i: (0, 0)),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("arbitrary",),
          vmem_limit_bytes=100 * 2**20),
      interpret=pltpu.InterpretParams() if interpret else False,
  )(seg.reshape(nb, 1, block), grads)


# --- Mosaic row write-back by DMA (in place) ----------------------------------


def _dma_scatter(ids_ref, rows_ref, table_in, table_out, sem, *, block,
                 unroll):
  del table_in
  def start(j, c):
    for u in range(unroll):
      r = j * unroll + u
      pltpu.make_async_copy(rows_ref.at[pl.ds(r, 1)],
                            table_out.at[pl.ds(ids_ref[0, r], 1)],
                            sem.at[0]).start()
    return c
  lax.fori_loop(0, block // unroll, start, 0)
  pltpu.make_async_copy(rows_ref, table_out.at[pl.ds(0, block)],
                        sem.at[0]).wait()


def dma_scatter(table, ids, rows, *, block=512, unroll=8, interpret=False):
  n = ids.shape[0]
  nb = n // block
  return pl.pallas_call(
      functools.partial(_dma_scatter, block=block, unroll=unroll),
      out_shape=jax.ShapeDtypeStruct(table.shape, table.dtype),
      grid=(nb,),
      in_specs=[pl.BlockSpec((None, 1, block), lambda i: (i, 0, 0),
                             memory_space=pltpu.SMEM),
                pl.BlockSpec((block, 128), lambda i: (i, 0)),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
      input_output_aliases={2: 0},
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",)),
      interpret=pltpu.InterpretParams() if interpret else False,
  )(ids.reshape(nb, 1, block), rows, table)


# --- the probes ----------------------------------------------------------------


def wanted(name):
  return not _ONLY.value or any(name.startswith(p) for p in _ONLY.value)


def probe(name, fn, *args, check=None, **kw):
  if not wanted(name):
    return None
  try:
    ms, out = timeit(fn, *args, **kw)
    extra = {}
    if check is not None:
      extra["ok"] = bool(check(out))
    record(name, ms, **extra)
    return out
  except Exception as e:  # pylint: disable=broad-except
    msg = f"{type(e).__name__}: {e}"
    print(f"{name:48s} FAILED {msg[:1500]}", flush=True)
    RESULTS.append({"name": name, "error": msg[:3000]})
    return None


def main(argv):
  del argv
  smoke = _SMOKE.value
  interp = smoke
  print(jax.devices(), flush=True)
  rng = np.random.default_rng(0)
  if smoke:
    sizes = [(4096, (1024, 4096))]
  else:
    sizes = [(1_000_000, (16384, 327680)), (10_000_000, (16384, 327680))]
  rep = dict(repeats=2, warmup=1) if smoke else {}
  for vocab, counts in sizes:
    lines = vocab // 2
    table = jax.random.normal(jax.random.key(0), (lines, 128), jnp.float32)
    narrow = (jax.random.normal(jax.random.key(1), (vocab, 64), jnp.float32)
              if vocab <= 1_000_000 else None)
    for n in counts:
      ids = zipf_ids(rng, n, vocab)
      line_ids = jnp.asarray(ids // 2)
      tag = f"V={vocab} n={n}"
      ref = jax.jit(lambda t, i: jnp.take(t, i, axis=0))
      want = ref(table, line_ids)
      probe(f"xla_take_lines {tag}", ref, table, line_ids, **rep)
      if narrow is not None:
        probe(f"xla_take_narrow64 {tag}", ref, narrow, jnp.asarray(ids),
              **rep)
      eq = lambda out: jnp.array_equal(out, want)
      odd = jnp.asarray(ids % 2 == 1)
      probe(f"xla_take_lines_select {tag}",
            jax.jit(lambda t, i, o: jnp.where(o[:, None], jnp.take(
                t, i, axis=0)[:, 64:], jnp.take(t, i, axis=0)[:, :64])),
            table, line_ids, odd, **rep)
      if narrow is not None:
        wantn = jnp.take(narrow, jnp.asarray(ids), axis=0)
        probe(f"dma_gather_v2_narrow64 b512 {tag}",
              jax.jit(functools.partial(dma_gather, version=2, block=512,
                                        interpret=interp)),
              narrow, jnp.asarray(ids),
              check=lambda o: jnp.array_equal(o, wantn), **rep)
      for v in (1, 2, 3):
        for block in ((512,) if v == 1 else (256, 512, 1024)):
          probe(f"dma_gather_v{v} b{block} {tag}",
                jax.jit(functools.partial(dma_gather, version=v, block=block,
                                          interpret=interp)),
                table, line_ids, check=eq, **rep)
      # sort: keys with their positions
      keys = jnp.asarray(ids)
      probe(f"sort_pairs {tag}",
            jax.jit(lambda k: lax.sort((k, lax.iota(jnp.int32, k.shape[0])),
                                       num_keys=1)), keys, **rep)
      probe(f"sort_keys {tag}", jax.jit(jnp.sort), keys, **rep)
      uniq = np.unique(ids)
      u = len(uniq)
      seg = np.searchsorted(uniq, ids).astype(np.int32)
      ulines = u // 2 * 2 // 2 + 1
      g = jax.random.normal(jax.random.key(2), (n, 64), jnp.float32)
      probe(f"xla_segsum_scatter64 {tag} u={u}",
            jax.jit(lambda g, s: jnp.zeros((n + 1, 64)).at[s].add(g)),
            g, jnp.asarray(seg), **rep)
      probe(f"xla_segment_sum_sorted64 {tag}",
            jax.jit(lambda g, s: jax.ops.segment_sum(
                g, s, n + 1, indices_are_sorted=True)),
            g, jnp.asarray(np.sort(seg)), **rep)
      g128 = jnp.concatenate([g, g], axis=1)
      src = jax.random.normal(jax.random.key(3), (min(u, 40960) // 8 * 8 + 8,
                                                  128), jnp.float32)
      sids = jnp.asarray(rng.integers(0, src.shape[0], n).astype(np.int32))
      wantv = jnp.take(src, sids, axis=0)
      probe(f"vmem_gather {tag} src={src.shape[0]}",
            jax.jit(functools.partial(vmem_gather, interpret=interp)),
            src, sids, check=lambda o: jnp.array_equal(o, wantv), **rep)
      accrows = src.shape[0]
      sseg = jnp.asarray(rng.integers(0, accrows, n).astype(np.int32))
      wants = jnp.zeros((accrows, 128)).at[sseg].add(g128)
      probe(f"vmem_scatter_add {tag} rows={accrows}",
            jax.jit(functools.partial(vmem_scatter_add, rows=accrows,
                                      interpret=interp)),
            g128, sseg,
            check=lambda o: bool(jnp.allclose(o, wants, atol=1e-4)), **rep)
      # in-place writes of unique lines
      ul = jnp.asarray(np.unique(ids // 2).astype(np.int32))
      m = ul.shape[0] // 512 * 512
      ul = ul[:m]
      newrows = jax.random.normal(jax.random.key(4), (m, 128), jnp.float32)
      probe(f"xla_scatter_set_lines {tag} m={m}",
            jax.jit(lambda t, i, r: t.at[i].set(r, unique_indices=True,
                                                indices_are_sorted=True,
                                                mode="drop"),
                    donate_argnums=0), table, ul, newrows,
            donate_first=True, **rep)
      table = jax.random.normal(jax.random.key(0), (lines, 128), jnp.float32)
      probe(f"dma_scatter {tag} m={m}",
            jax.jit(functools.partial(dma_scatter, interpret=interp),
                    donate_argnums=0), table, ul, newrows,
            donate_first=True, **rep)
      table = jax.random.normal(jax.random.key(0), (lines, 128), jnp.float32)
      state = jnp.zeros((vocab,), jnp.float32)
      uu = jnp.asarray(uniq.astype(np.int32))
      probe(f"xla_rowstate_gather_scatter {tag}",
            jax.jit(lambda s, i: s.at[i].set(s[i] + 1.0, mode="drop"),
                    donate_argnums=0), state, uu, donate_first=True, **rep)
      # The same `[V]` writes and reads, a chunk of the update's row-wise
      # part (8,192 slots) and all of them, told the indices are unique
      # (and sorted) or not.
      state = jnp.zeros((vocab,), jnp.float32)
      for m in (8192, u):
        part = uu[:m]
        for hint, kw in (("", {}), ("_unique", dict(unique_indices=True)),
                         ("_unique_sorted", dict(unique_indices=True,
                                                 indices_are_sorted=True))):
          state = probe(
              f"xla_rowstate_scatter{hint} {tag} m={m}",
              jax.jit(lambda s, i, kw=kw: s.at[i].set(
                  i.astype(s.dtype), mode="drop", **kw), donate_argnums=0),
              state, part, donate_first=True, **rep)
          state = jnp.zeros((vocab,), jnp.float32) if state is None else (
              state)
          probe(f"xla_rowstate_gather{hint} {tag} m={m}",
                jax.jit(lambda s, i, kw=kw: s.at[i].get(
                    mode="fill", fill_value=0, **kw)), state, part, **rep)
    del table, narrow
  # dense reference: optax-like adagrad over a 1M x 64 table
  if not smoke:
    for vocab in (1_000_000,):
      t = jax.random.normal(jax.random.key(0), (vocab, 64), jnp.float32)
      a = jnp.zeros_like(t)
      ids = jnp.asarray(zipf_ids(rng, 16384, vocab))

      def dense(state, ids):
        t, a = state
        g = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) ** 2))(t)
        a = a + g * g
        return t - 0.01 * g / (jnp.sqrt(a) + 1e-7), a
      probe(f"dense_adagrad V={vocab} n=16384",
            jax.jit(dense, donate_argnums=0), (t, a), ids, donate_first=True)
  print("done", flush=True)


if __name__ == "__main__":
  app.run(main)
