"""Prototype fixes for the bf16-on-XLA:CPU slowdown, measured by the bench.

Not library code: each prototype is a drop-in for one library function,
installed by monkeypatching, so `pallas_emb.bench` times it next to the
library as it is. Run through `python bench/prototype_bench.py`.

Why a bf16 step is slow on XLA:CPU (jax 0.10): the CPU compiler runs
`float-normalization-bf16` with the default `FloatSupport`, which supports
bf16 only for convert / tuple / while / call / custom-call. Every other bf16
op -- including the data-movement ones, `scatter` and `dynamic-update-slice`
-- is rewritten as `convert(op(convert(x, f32)), bf16)`, i.e. two passes over
the whole table. `reference.adagrad_apply` dodges that with a uint16 view,
but XLA:CPU lowers a same-width `bitcast-convert` as a loop fusion, not as a
bitcast, so the view costs the same two table-sized passes (one copy into a
temporary, one back into the donated buffer).

Prototypes:

`plain_scatter`  `reference.adagrad_apply` with a plain bf16 scatter (no
    uint16 view). In place only when the normalization pass is off, e.g.
    `XLA_FLAGS=--xla_disable_hlo_passes=float-normalization-bf16` or
    `jax.jit(..., compiler_options={"xla_disable_hlo_passes":
    "float-normalization-bf16"})`.

`bits_step`  a sparse step whose carried table is the uint16 bit pattern of
    the bf16 table (`lax.bitcast_convert_type(table, jnp.uint16)` once, at
    init). Every table-sized op is then an integer gather / scatter, which
    the normalization pass leaves alone, and only the gathered / updated
    rows are bit-cast to bf16. No flag needed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_emb import exchange
from pallas_emb import optim
from pallas_emb.kernels import common
from pallas_emb.kernels import reference

NO_BF16_NORMALIZATION = "--xla_disable_hlo_passes=float-normalization-bf16"


def plain_scatter_adagrad(table, row_state, last_step, unique_tokens,
                          grad_accum, row_sq, apply, step, learning_rate, *,
                          hparams):
  """`reference.adagrad_apply` with one plain scatter for both dtypes."""
  vocab_rows, _ = table.shape
  row_sq = common.check_adagrad_args(table, row_state, last_step,
                                     unique_tokens, grad_accum, row_sq,
                                     hparams)
  tokens = common.wrap_once(unique_tokens, vocab_rows)
  ok = (jnp.asarray(apply, jnp.bool_) & (tokens >= 0)
        & (tokens < vocab_rows))
  rows = jnp.where(ok, tokens, 0)
  dest = jnp.where(ok, tokens, vocab_rows)
  last = None if last_step is None else last_step[rows]
  accum, wd, lr_scale = common.adagrad_row_update(
      row_state[rows], last, row_sq, step, learning_rate, hparams)
  new_rows = common.adagrad_new_values(
      table[rows].astype(jnp.float32), wd[:, None], lr_scale[:, None],
      grad_accum, table.dtype)
  row_state = row_state.at[dest].set(accum, mode="drop")
  if last_step is not None:  # as in reference.py: depends on the gather
    last_step = last_step.at[dest].set(
        jnp.where(ok, jnp.asarray(step, jnp.int32), last), mode="drop")
  return table.at[dest].set(new_rows, mode="drop"), row_state, last_step


_ORIGINAL = {}


def install(name: str) -> None:
  """Monkeypatches one prototype in ('plain_scatter')."""
  _ORIGINAL.setdefault("adagrad_apply", reference.adagrad_apply)
  if name == "plain_scatter":
    reference.adagrad_apply = plain_scatter_adagrad
  else:
    raise ValueError(f"unknown prototype {name!r}")


def uninstall() -> None:
  if "adagrad_apply" in _ORIGINAL:
    reference.adagrad_apply = _ORIGINAL.pop("adagrad_apply")


# --- bits_step: the table carried as its uint16 bit pattern -----------------


def to_bits(table):
  return lax.bitcast_convert_type(table, jnp.uint16)


def _bits_lookup_per_rank(ctx, vocab_rows, bits, ids):
  """lookup on the uint16 bits: integer gather and all-to-all, bf16 only on
  the `[T, E]` result."""
  ids_all = exchange.all_gather_ids(ctx, ids.reshape(-1))
  rows = jnp.take(bits, common.wrap_and_clamp(ids_all, vocab_rows), axis=0)
  return lax.bitcast_convert_type(exchange.exchange_rows(ctx, rows),
                                  jnp.bfloat16)


def _bits_update_per_rank(ctx, opt, vocab_rows, bits, row_state, step,
                          grads, segment_ids, unique_tokens):
  """optim._apply_per_rank + reference.adagrad_apply on the uint16 bits."""
  w, t, s = ctx.group_size, ctx.tokens_per_rank, ctx.shard_width
  segments = exchange.all_gather_ids(ctx, segment_ids.reshape(-1))
  routed = exchange.route_gradients(ctx, grads.reshape(t, w * s))
  grad_accum, row_sq = reference.segment_sum_rows(
      routed, segments, ctx.num_unique, round_dtype=jnp.bfloat16)
  if w > 1:
    row_sq = optim._ordered_sum(row_sq, ctx.table_axis)  # pylint: disable=protected-access
  norm = jnp.sqrt(row_sq[ctx.num_unique])
  apply = jnp.isfinite(norm)
  tokens = common.wrap_once(unique_tokens, vocab_rows)
  ok = apply & (tokens >= 0) & (tokens < vocab_rows)
  safe = jnp.where(ok, tokens, 0)
  dest = jnp.where(ok, tokens, vocab_rows)
  hp = opt.hparams(ctx.emb_width)
  accum, wd, lr_scale = common.adagrad_row_update(
      row_state[safe], None, row_sq[:ctx.num_unique], step,
      opt.learning_rate_at(step), hp)
  old = lax.bitcast_convert_type(bits[safe], jnp.bfloat16).astype(
      jnp.float32)
  new = common.adagrad_new_values(old, wd[:, None], lr_scale[:, None],
                                  grad_accum, jnp.bfloat16)
  bits = bits.at[dest].set(lax.bitcast_convert_type(new, jnp.uint16),
                           mode="drop")
  row_state = row_state.at[dest].set(accum, mode="drop")
  return bits, row_state, step + apply.astype(jnp.int32), norm


def make_bits_step(ctx, opt, vocab_rows, loss):
  """jit-able `(bits, row_state, step, ids) -> (bits, row_state, step, norm)`.

  Same math as lookup -> grad -> dedup -> apply_gradients on a bf16 table
  (eager Adagrad, xla twins), with the table carried as uint16 bits.
  """
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  tok = exchange.token_spec(ctx)
  table_spec = exchange.table_spec(ctx)

  def step_fn(bits, row_state, step, ids):
    emb = exchange.shard(
        ctx, functools.partial(_bits_lookup_per_rank, ctx, vocab_rows),
        in_specs=(table_spec, tok), out_specs=tok)(bits, ids)
    grads = jax.grad(loss)(emb)
    d = pe.dedup(ctx, ids, vocab_rows=vocab_rows)
    fn = functools.partial(_bits_update_per_rank, ctx, opt, vocab_rows)
    return exchange.shard(
        ctx, fn,
        in_specs=(table_spec, P(), P(), tok, tok, P()),
        out_specs=(table_spec, P(), P(), P()),
    )(bits, row_state, step, grads, d.segment_ids, d.unique_tokens)
  return step_fn
