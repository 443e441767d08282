"""The collectives of every placement.

Everything here runs per rank, inside `shard_map` over the context's mesh;
`shard` builds that `shard_map`. With W = group_size, T = tokens_per_rank and
S = shard_width, a rank all-gathers the W*T ids of its communicator
(source-rank major), serves S columns of each, and an all-to-all brings every
rank the W*S columns of its own T tokens. Gradients travel the reverse way.
Row and table placements send each owner a bucket of ids and get its rows
back through `all_to_all` (`row.py`).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_emb import validation
from pallas_emb.validation import EmbeddingContext


# --- shardings -------------------------------------------------------------


def table_spec(ctx: EmbeddingContext) -> P:
  """Rows replicated, columns over the communicator (replicated over replicas)."""
  return P(None, ctx.table_axis)


def token_spec(ctx: EmbeddingContext) -> P:
  """Leading token dimension over replica_axis + data_axis."""
  return P(ctx.token_axes)


def table_sharding(ctx: EmbeddingContext) -> NamedSharding:
  """The `NamedSharding` a `[vocab_rows, emb_width]` table must have."""
  return NamedSharding(ctx.mesh, table_spec(ctx))


def token_sharding(ctx: EmbeddingContext) -> NamedSharding:
  """The `NamedSharding` of token ids (and of lookup outputs)."""
  return NamedSharding(ctx.mesh, token_spec(ctx))


def replicated_sharding(ctx: EmbeddingContext) -> NamedSharding:
  """Row optimizer state and unique tokens: the same on every device."""
  return NamedSharding(ctx.mesh, P())


def place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """Puts x on `sharding`, eagerly or inside jit, Auto or Explicit axes.

  Eagerly (a concrete array, wherever it is: on one device, on another
  mesh's devices) `device_put` moves it; inside jit on Auto axes a sharding
  constraint places it.
  """
  if not isinstance(x, jax.core.Tracer):
    return jax.device_put(x, sharding)
  axis_types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
  names = [a for part in sharding.spec if part is not None
           for a in ((part,) if isinstance(part, str) else part)]
  if any(axis_types[a] == jax.sharding.AxisType.Explicit for a in names):
    return jax.device_put(x, sharding)
  # Inside jit on Auto axes device_put does not fix the output's sharding;
  # a sharding constraint does (and works eagerly too).
  return jax.lax.with_sharding_constraint(x, sharding)


def place_state(tree, specs, mesh, what: str):
  """State leaves (tables, optimizer state) onto their `specs`.

  Tracers and arrays that were not placed are placed; a committed array on
  another sharding is an error (moving a huge table silently is not our
  call). One laid out the same on another mesh of the same devices (a
  state of the same collection built on a mesh of Auto axes, given to one
  on Explicit axes, or back) is relabelled, without a copy. `specs` is a
  pytree prefix of `tree` (None leaves match None).
  """
  def one(path, x, spec):
    sharding = NamedSharding(mesh, spec)
    # An empty array (a stack without pooled weights) holds nothing to
    # move, whatever sharding jit gave it.
    if not validation.is_committed(x) or x.size == 0:
      return place(x, sharding)
    return relabel(x, sharding, lambda: (
        f"pallas_emb {what}{jax.tree_util.keystr(path)} is sharded as "
        f"{x.sharding}; expected {spec}. Place it with jax.device_put(x, "
        f"NamedSharding(mesh, {spec})), or pass the state the collection "
        "returned."))
  return jax.tree_util.tree_map_with_path(
      lambda path, spec, x: one(path, x, spec), specs, tree,
      is_leaf=lambda v: isinstance(v, P))


def relabel(x: jax.Array, sharding: NamedSharding, message) -> jax.Array:
  """A committed `x` as `sharding` if it is laid out so already (no copy:
  the same shards on the same devices, e.g. the same spec over a mesh of
  other axis types, which `shard_map` tells apart); else a ShardingError
  with `message()`."""
  if x.sharding == sharding:
    return x
  if not x.sharding.is_equivalent_to(sharding, x.ndim):
    if len(jax.devices()) > 1:
      raise validation.ShardingError(message())
    return x  # one device: where it must be
  return jax.device_put(x, sharding)  # the same shards: relabelled


def place_table(ctx: EmbeddingContext, table: jax.Array) -> jax.Array:
  """A table that was not placed (fresh array, tracer) onto its sharding,
  one laid out so already on another mesh relabelled (`relabel`).

  A committed table on another sharding was rejected by
  `validation.check_table`: moving a huge table silently is not our call.
  """
  sharding = table_sharding(ctx)
  if validation.is_committed(table):
    return relabel(table, sharding, lambda: (
        f"pallas_emb table is sharded as {table.sharding}; expected "
        f"{sharding.spec}."))
  return place(table, sharding)


def place_tokens(ctx: EmbeddingContext, x: jax.Array) -> jax.Array:
  """Ids (or per-token values) onto the token sharding, placed or not.

  Cheap (one batch), and what keeps an uncommitted array on an Explicit
  mesh from reaching `shard_map` with the wrong sharding type.
  """
  return place(x, token_sharding(ctx))


def shard(ctx: EmbeddingContext, fn, in_specs, out_specs):
  """`shard_map` over the context's mesh, jitted.

  Jitted so that a call outside `jit` runs compiled: an eager `shard_map`
  dispatches every op to every device one by one (one collection update on
  8 CPU devices: 15 s instead of 6 ms). Inside a user's `jit` it is
  inlined. The jitted function is cached on `fn`'s value (a
  `functools.partial` of static, hashable arguments) and the specs, so
  repeated eager calls compile once; arguments equal by value share an
  entry, as `jit`'s static arguments do. check_vma is off: `pallas_call`
  does not carry varying-axis types.
  """
  try:
    return _jitted_shard(ctx.mesh, _Static(fn), _Static(in_specs),
                         _Static(out_specs))
  except TypeError:  # an unhashable argument: jitted, not cached
    return _jitted_shard.__wrapped__(ctx.mesh, fn, in_specs, out_specs)


class _Static:
  """A function (partial) or a spec tree, hashed and compared by value."""

  def __init__(self, value):
    self.value = value
    if isinstance(value, functools.partial):
      self.key = (value.func, value.args, tuple(sorted(value.keywords.items())))
    else:
      leaves, treedef = jax.tree.flatten(
          value, is_leaf=lambda x: x is None or isinstance(x, P))
      self.key = (tuple(leaves), treedef)
    hash(self.key)  # TypeError now, not inside the cache

  def __hash__(self):
    return hash(self.key)

  def __eq__(self, other):
    return isinstance(other, _Static) and self.key == other.key


@functools.lru_cache(maxsize=256)
def _jitted_shard(mesh, fn, in_specs, out_specs):
  unwrap = lambda x: x.value if isinstance(x, _Static) else x
  return jax.jit(jax.shard_map(unwrap(fn), mesh=mesh,
                               in_specs=unwrap(in_specs),
                               out_specs=unwrap(out_specs), check_vma=False))


# --- per-rank collectives ----------------------------------------------------


def axis_name(axes: tuple[str, ...]):
  """The `axis_name` argument of a collective over mesh axes `axes`."""
  return axes[0] if len(axes) == 1 else axes


def all_gather_ids(ctx: EmbeddingContext, ids: jax.Array) -> jax.Array:
  """`[T]` local ids -> `[W*T]` ids of the communicator, source-rank major."""
  if ctx.group_size == 1:
    return ids
  return lax.all_gather(ids, axis_name(ctx.table_axis), axis=0, tiled=True)


def all_to_all(ctx: EmbeddingContext, x: jax.Array) -> jax.Array:
  """Block w of the leading dim goes to rank w; block w back is from rank w.

  Padded blocks of equal size: `lax.ragged_all_to_all` is not implemented
  on XLA:CPU (jax 0.10.2).
  """
  if ctx.group_size == 1:
    return x
  return lax.all_to_all(x, axis_name(ctx.table_axis), 0, 0, tiled=True)


def exchange_rows(ctx: EmbeddingContext, rows: jax.Array) -> jax.Array:
  """Served rows `[W*T, S]` (destination major) -> my tokens `[T, W*S]`."""
  w, t, s = ctx.group_size, ctx.tokens_per_rank, ctx.shard_width
  received = all_to_all(ctx, rows).reshape(w, t, s)  # [column shard, T, S]
  return received.transpose(1, 0, 2).reshape(t, w * s)


def route_gradients(ctx: EmbeddingContext, grads: jax.Array) -> jax.Array:
  """My tokens' gradients `[T, W*S]` -> `[W*T, S]`: my columns of every token.

  The order matches `all_gather_ids`, so row i belongs to gathered id i.
  """
  w, t, s = ctx.group_size, ctx.tokens_per_rank, ctx.shard_width
  by_column_shard = grads.reshape(t, w, s).transpose(1, 0, 2)  # [W, T, S]
  return all_to_all(ctx, by_column_shard.reshape(w * t, s))
