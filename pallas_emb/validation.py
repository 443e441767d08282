"""The sharding contract (DESIGN §2), checked in plain Python before tracing.

`make_context` turns a mesh and a few sizes into an `EmbeddingContext`, a
frozen, hashable description of how the table and the tokens are laid out. It
is the only place that decides whether a layout is legal, so every rule raises
here, with the sentence DESIGN §2 fixes, followed by how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax

AxisNames = tuple[str, ...]


class ShardingError(ValueError):
  """A layout that breaks the pallas_emb sharding contract."""


@dataclasses.dataclass(frozen=True)
class EmbeddingContext:
  """How one embedding table and its tokens are laid out over a mesh.

  Hashable, so it can be a static argument of `jax.jit`.
  """

  mesh: jax.sharding.Mesh
  table_axis: AxisNames
  data_axis: AxisNames
  group_size: int
  tokens_per_batch: int
  tokens_per_rank: int
  emb_width: int
  shard_width: int
  num_unique: int
  num_devices_per_node: int
  replica_axis: AxisNames = ()

  @property
  def num_replicas(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.replica_axis)

  @property
  def token_axes(self) -> AxisNames:
    """Mesh axes the leading token dimension is sharded over."""
    return self.replica_axis + self.data_axis


def _as_axes(axes: str | Sequence[str], what: str) -> AxisNames:
  if isinstance(axes, str):
    return (axes,)
  axes = tuple(axes)
  if not all(isinstance(a, str) for a in axes):
    raise ShardingError(
        f"pallas_emb {what} must be a mesh axis name or a tuple of names; "
        f"got {axes!r}.")
  return axes


def _check_positive(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ShardingError(
        f"pallas_emb {name}={value!r} must be a positive integer.")


def _group_size(mesh, axes: AxisNames) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _check_axes_exist(mesh, *axis_tuples: AxisNames) -> None:
  for axes in axis_tuples:
    for axis in axes:
      if axis not in mesh.shape:
        raise ShardingError(
            f"pallas_emb axis {axis!r} is not a mesh axis of {mesh}. "
            f"Use one of the mesh's axes {tuple(mesh.axis_names)!r}, or build "
            "the mesh with that axis name.")


def _off_communicator_positions(mesh, table_axis, data_axis) -> int:
  return math.prod(mesh.shape[a] for a in data_axis if a not in table_axis)


def single_shard_per_rank(mesh, table_axis, data_axis) -> bool:
  """Whether each communicator rank holds exactly one token shard (rule 3)."""
  table_axis = _as_axes(table_axis, "table_axis")
  data_axis = _as_axes(data_axis, "data_axis")
  _check_axes_exist(mesh, table_axis, data_axis)
  return _off_communicator_positions(mesh, table_axis, data_axis) == 1


def check_single_shard_per_rank(mesh, table_axis, data_axis) -> None:
  """Raises `ShardingError` unless each rank holds one token shard (rule 3)."""
  table_axis = _as_axes(table_axis, "table_axis")
  data_axis = _as_axes(data_axis, "data_axis")
  _check_axes_exist(mesh, table_axis, data_axis)
  off = _off_communicator_positions(mesh, table_axis, data_axis)
  if off != 1:
    extra = tuple(a for a in data_axis
                  if a not in table_axis and mesh.shape[a] > 1)
    raise ShardingError(
        "pallas_emb requires exactly one token shard per communicator rank: "
        f"data_axis {data_axis} shards tokens over {off} positions outside "
        f"table_axis {table_axis}. "
        f"To fix it, add {extra} to table_axis (a larger communicator), or "
        f"drop {extra} from data_axis, or pass replica_axis={extra} to "
        "make_context to replicate the table over it, or run one job per "
        "replica.")


def make_context(mesh: jax.sharding.Mesh,
                 table_axis: str | Sequence[str],
                 *,
                 data_axis: str | Sequence[str] | None = None,
                 tokens_per_batch: int,
                 emb_width: int,
                 num_unique: int,
                 num_devices_per_node: int | None = None,
                 replica_axis: str | Sequence[str] = ()) -> EmbeddingContext:
  """Validates a layout and returns its `EmbeddingContext`.

  Args:
    mesh: the device mesh.
    table_axis: mesh axis name(s) forming the communicator; the table's
      columns are sharded over them, row-major in the order given.
    data_axis: mesh axis name(s) the tokens' leading dimension is sharded
      over; defaults to table_axis.
    tokens_per_batch: token ids per global batch (all ranks together, and
      all replicas together when replica_axis is given).
    emb_width: full embedding width (columns of the table).
    num_unique: size of the static unique-token buffer of one batch (see
      `dedup`); `min(tokens_per_batch, vocab_rows) + 1` is always safe.
    num_devices_per_node: devices per host (defaults to the local device
      count); informs collective placement only.
    replica_axis: optional mesh axis name(s) over which the whole table is
      replicated; tokens are then sharded over replica_axis + data_axis.
  """
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ShardingError(
        f"pallas_emb make_context needs a jax.sharding.Mesh; got "
        f"{type(mesh).__name__}. Build one with jax.make_mesh(...) or "
        "jax.sharding.Mesh(devices, axis_names).")
  table_axis = _as_axes(table_axis, "table_axis")
  data_axis = table_axis if data_axis is None else _as_axes(data_axis,
                                                            "data_axis")
  replica_axis = _as_axes(replica_axis, "replica_axis")
  if not table_axis:
    raise ShardingError("pallas_emb table_axis must name at least one mesh "
                        "axis; got ().")
  for name, axes in (("table_axis", table_axis), ("data_axis", data_axis),
                     ("replica_axis", replica_axis)):
    if len(set(axes)) != len(axes):
      raise ShardingError(
          f"pallas_emb {name} {axes} names an axis twice; name each once.")

  # Rule 1: every axis exists.
  _check_axes_exist(mesh, table_axis, data_axis, replica_axis)
  # Rule 2: token shards vary across the communicator.
  missing = tuple(a for a in table_axis if a not in data_axis)
  if missing:
    raise ShardingError(
        "pallas_emb requires token shards to vary across the communicator: "
        f"table_axis {missing} missing from data_axis {data_axis}. "
        f"Add {missing} to data_axis (tokens must be sharded over every "
        "communicator axis), or remove them from table_axis.")
  overlap = tuple(a for a in replica_axis if a in table_axis + data_axis)
  if overlap:
    raise ShardingError(
        f"pallas_emb replica_axis {replica_axis} overlaps table_axis "
        f"{table_axis} / data_axis {data_axis} in {overlap}. A replica axis "
        "holds whole copies of the table, so name it in replica_axis only.")
  # Rule 3: exactly one token shard per rank.
  check_single_shard_per_rank(mesh, table_axis, data_axis)

  for name, value in (("tokens_per_batch", tokens_per_batch),
                      ("emb_width", emb_width), ("num_unique", num_unique)):
    _check_positive(name, value)
  if num_devices_per_node is None:
    num_devices_per_node = jax.local_device_count()
  _check_positive("num_devices_per_node", num_devices_per_node)

  group_size = _group_size(mesh, table_axis)
  num_replicas = _group_size(mesh, replica_axis)
  token_shards = group_size * num_replicas
  # Rule 4: tokens shard evenly.
  if tokens_per_batch % token_shards:
    if num_replicas == 1:
      raise ShardingError(
          f"pallas_emb tokens_per_batch={tokens_per_batch} does not shard "
          f"evenly over the {group_size}-rank communicator. Use a multiple "
          f"of {group_size} (pad the batch with id 0, which gets no "
          "gradient).")
    raise ShardingError(
        f"pallas_emb tokens_per_batch={tokens_per_batch} does not shard "
        f"evenly over the {group_size}-rank communicator times "
        f"{num_replicas} replicas. Use a multiple of {token_shards} (pad the "
        "batch with id 0, which gets no gradient).")
  # Rule 5: columns shard evenly.
  if emb_width % group_size:
    raise ShardingError(
        f"pallas_emb emb_width={emb_width} does not shard evenly over the "
        f"{group_size}-rank communicator. Use a width that is a multiple of "
        f"{group_size}, or a communicator whose size divides {emb_width}.")

  return EmbeddingContext(
      mesh=mesh,
      table_axis=table_axis,
      data_axis=data_axis,
      group_size=group_size,
      tokens_per_batch=tokens_per_batch,
      tokens_per_rank=tokens_per_batch // token_shards,
      emb_width=emb_width,
      shard_width=emb_width // group_size,
      num_unique=num_unique,
      num_devices_per_node=num_devices_per_node,
      replica_axis=replica_axis,
  )


# --- per-call checks (shapes, dtypes, shardings, backend) --------------------

BACKENDS = ("pallas", "interpret", "xla")
TABLE_DTYPES = ("float32", "bfloat16")


def resolve_backend(ctx: EmbeddingContext, backend: str | None) -> str:
  """The explicit backend, or pallas on a GPU mesh and xla elsewhere."""
  if backend is None:
    platform = ctx.mesh.devices.flat[0].platform
    return "pallas" if platform in ("gpu", "cuda", "rocm") else "xla"
  if backend not in BACKENDS:
    raise ShardingError(
        f"pallas_emb backend={backend!r} is not one of {BACKENDS}: use "
        "'pallas' on GPUs, 'interpret' to run the same kernels on CPU, or "
        "'xla' for the plain-jnp path.")
  return backend


def _shape_dtype(x):
  return tuple(x.shape), str(x.dtype)


def _sharding_of(x):
  """The sharding of a committed concrete array, else None.

  Tracers and uncommitted arrays (e.g. a fresh `jnp.zeros`) are placed by
  `shard_map` itself, so only a committed placement can be wrong.
  """
  if isinstance(x, jax.core.Tracer) or not getattr(x, "_committed", False):
    return None
  return getattr(x, "sharding", None)


def check_table(ctx: EmbeddingContext, table, what: str = "table") -> None:
  """A `[vocab_rows, emb_width]` f32/bf16 table, column-sharded if concrete."""
  shape, dtype = _shape_dtype(table)
  if len(shape) != 2 or shape[1] != ctx.emb_width or shape[0] < 1:
    raise ShardingError(
        f"pallas_emb {what} has shape {shape}; expected [vocab_rows, "
        f"{ctx.emb_width}] (emb_width of the context). Make the context "
        "with the table's width, or fix the table.")
  if dtype not in TABLE_DTYPES:
    raise ShardingError(
        f"pallas_emb {what} has dtype {dtype}; expected one of "
        f"{TABLE_DTYPES}. Cast it with table.astype(jnp.bfloat16).")
  sharding = _sharding_of(table)
  if sharding is not None and len(jax.devices()) > 1:
    expected = jax.sharding.NamedSharding(
        ctx.mesh, jax.sharding.PartitionSpec(None, ctx.table_axis))
    if not sharding.is_equivalent_to(expected, 2):
      raise ShardingError(
          f"pallas_emb {what} is sharded as {sharding}; expected its columns "
          f"over table_axis {ctx.table_axis} ({expected.spec}). Place it with "
          "jax.device_put(table, pallas_emb.table_sharding(ctx)).")


def check_token_ids(ctx: EmbeddingContext, token_ids, what: str = "token_ids"
                   ) -> None:
  """int32 ids, `tokens_per_batch` of them, leading dim sharding evenly."""
  shape, dtype = _shape_dtype(token_ids)
  if dtype != "int32":
    raise ShardingError(
        f"pallas_emb {what} has dtype {dtype}; expected int32. Cast them "
        "with ids.astype(jnp.int32).")
  size = math.prod(shape)
  shards = ctx.group_size * ctx.num_replicas
  if not shape or size != ctx.tokens_per_batch or shape[0] % shards:
    raise ShardingError(
        f"pallas_emb {what} has shape {shape} ({size} ids); expected "
        f"tokens_per_batch={ctx.tokens_per_batch} ids whose leading dimension "
        f"divides over {shards} token shards. Make the context with the "
        "batch's real size, or pad the batch with id 0.")


def check_grads(ctx: EmbeddingContext, grads, ids_shape) -> None:
  """Embedding gradients shaped like lookup's output."""
  shape, dtype = _shape_dtype(grads)
  expected = tuple(ids_shape) + (ctx.emb_width,)
  if shape != expected:
    raise ShardingError(
        f"pallas_emb emb_grads has shape {shape}; expected {expected} "
        "(the shape of lookup's output for these token ids).")
  if dtype not in TABLE_DTYPES:
    raise ShardingError(
        f"pallas_emb emb_grads has dtype {dtype}; expected one of "
        f"{TABLE_DTYPES}.")
