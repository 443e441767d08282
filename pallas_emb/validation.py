"""The sharding contract, checked in plain Python before tracing.

`make_context` turns a mesh and a few sizes into an `EmbeddingContext`, a
frozen, hashable description of how the table and the tokens are laid out. It
is the only place that decides whether a layout is legal, so every rule raises
here, with the sentence the contract fixes, followed by how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.errors import InputError
from pallas_emb.errors import ShardingError

AxisNames = tuple[str, ...]

# What `backend=` accepts, and what it resolves to (the kernel backends of
# `pallas_emb.kernels`).
KERNEL_BACKENDS = ("triton", "mosaic_tpu", "xla", "interpret",
                   "mosaic_tpu_interpret")
BACKENDS = ("auto", "pallas") + KERNEL_BACKENDS
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# The Pallas backend of each accelerator platform (backend="pallas").
PALLAS_BACKENDS = {**dict.fromkeys(GPU_PLATFORMS, "triton"),
                   "tpu": "mosaic_tpu"}
# The fastest backend measured per platform (backend=None / "auto"): on GPUs
# the Triton kernels (docs/gpu.md); on TPUs the Mosaic backend, whose stored
# tables and kernels ran the sequence step 1.8x-2.7x faster than XLA's ops
# on a v5e and the pooled one 1.3x-2x (bench/tpu_check.sh, docs/tpu.md); on
# CPUs the xla backend, the only compiled one.
AUTO_BACKENDS = {**dict.fromkeys(GPU_PLATFORMS, "triton"),
                 "tpu": "mosaic_tpu"}
TABLE_DTYPES = ("float32", "bfloat16")


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
  padding_id: int | None = 0

  @property
  def num_replicas(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.replica_axis)

  @property
  def token_axes(self) -> AxisNames:
    """Mesh axes the leading token dimension is sharded over."""
    return self.replica_axis + self.data_axis


def _as_axes(axes: str | Sequence[str] | None, what: str) -> AxisNames:
  if axes is None:  # as () : no axis
    return ()
  if isinstance(axes, str):
    return (axes,)
  names = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  if not all(isinstance(a, str) for a in names):
    raise InputError(
        f"pallas_emb {what} must be a mesh axis name or a tuple of names; "
        f"got {axes!r}.")
  return names


def check_positive(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise InputError(
        f"pallas_emb {name}={value!r} must be a positive integer.")


def axes_size(mesh, axes: AxisNames) -> int:
  """Number of positions of the mesh over `axes`."""
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


def check_layout(mesh, table_axis, data_axis, replica_axis, caller: str
                 ) -> tuple[AxisNames, AxisNames, AxisNames]:
  """Layout rules 1-3 (and the axis names' own sanity), in order.

  Returns the axes as tuples; `data_axis=None` means table_axis.
  """
  if not isinstance(mesh, jax.sharding.Mesh):
    raise InputError(
        f"pallas_emb {caller} needs a jax.sharding.Mesh; got "
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
  # Rule 2: token shards vary across the communicator (the reference
  # prints the missing axes as a list).
  missing = [a for a in table_axis if a not in data_axis]
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
  return table_axis, data_axis, replica_axis


def make_context(mesh: jax.sharding.Mesh,
                 table_axis: str | Sequence[str],
                 *,
                 data_axis: str | Sequence[str] | None = None,
                 tokens_per_batch: int,
                 emb_width: int,
                 num_unique: int,
                 num_devices_per_node: int | None = None,
                 replica_axis: str | Sequence[str] = (),
                 padding_id: int | None = 0) -> EmbeddingContext:
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
    padding_id: the id of the padding row (the reference's convention,
      0): the row is looked up like any other but gets no gradient,
      whatever id reaches it after the wrap and clamp (with 0, also
      -vocab_rows); None makes every id a real row.
  """
  table_axis, data_axis, replica_axis = check_layout(
      mesh, table_axis, data_axis, replica_axis, "make_context")
  for name, value in (("tokens_per_batch", tokens_per_batch),
                      ("emb_width", emb_width), ("num_unique", num_unique)):
    check_positive(name, value)
  if num_devices_per_node is None:
    num_devices_per_node = jax.local_device_count()
  check_positive("num_devices_per_node", num_devices_per_node)
  check_padding_id(padding_id)

  group_size = axes_size(mesh, table_axis)
  num_replicas = axes_size(mesh, replica_axis)
  check_tokens_shard(tokens_per_batch, group_size, num_replicas)
  check_width_shards(emb_width, group_size)

  return EmbeddingContext(
      mesh=mesh,
      table_axis=table_axis,
      data_axis=data_axis,
      group_size=group_size,
      tokens_per_batch=tokens_per_batch,
      tokens_per_rank=tokens_per_batch // (group_size * num_replicas),
      emb_width=emb_width,
      shard_width=emb_width // group_size,
      num_unique=num_unique,
      num_devices_per_node=num_devices_per_node,
      replica_axis=replica_axis,
      padding_id=padding_id,
  )


def check_padding_id(padding_id, vocab_rows: int | None = None,
                     what: str = "") -> None:
  """An int id or None; with `vocab_rows`, an id of a row of the table
  (`[-vocab_rows, vocab_rows)`: the padding row is the one it reaches)."""
  if padding_id is not None and (isinstance(padding_id, bool) or
                                 not isinstance(padding_id, (int, np.integer))):
    raise InputError(
        f"pallas_emb padding_id={padding_id!r} must be an int id or None "
        "(None: every id is a real row that trains).")
  if (padding_id is not None and vocab_rows is not None
      and not -vocab_rows <= padding_id < vocab_rows):
    raise InputError(
        f"pallas_emb {what + ' ' if what else ''}padding_id={padding_id} is "
        f"not a row of its {vocab_rows}-row table; expected an id in "
        f"[{-vocab_rows}, {vocab_rows}) (the row it reaches is the padding "
        "row), or None.")


# --- per-call checks (shapes, dtypes, shardings, backend) --------------------


def resolve_backend(mesh_or_ctx, backend: str | None) -> str:
  """The kernel backend (`KERNEL_BACKENDS`) that `backend` means on the
  platform of the mesh's devices.

  None / "auto": the fastest measured one (`AUTO_BACKENDS`); "pallas": the
  platform's Pallas backend. A Pallas backend of another accelerator is an
  error, except on a CPU, from which a step is lowered for GPU or TPU
  (`lower(lowering_platforms=...)`) without running it.
  """
  if backend is not None and backend not in BACKENDS:
    raise InputError(
        f"pallas_emb backend={backend!r} is not one of {BACKENDS}: use "
        "None for the platform's fastest, 'pallas' for its Pallas kernels, "
        "'interpret' or 'mosaic_tpu_interpret' to run the Triton or Mosaic "
        "kernels on a CPU, or 'xla' for the plain-jnp path.")
  mesh = getattr(mesh_or_ctx, "mesh", mesh_or_ctx)
  platform = mesh.devices.flat[0].platform
  if backend in (None, "auto"):
    return AUTO_BACKENDS.get(platform, "xla")
  if backend == "pallas":
    if platform not in PALLAS_BACKENDS:
      raise InputError(
          f"pallas_emb backend='pallas' has no Pallas backend on platform "
          f"{platform!r} (Pallas compiles for GPUs and TPUs): use "
          "'interpret' or 'mosaic_tpu_interpret' to run the kernels there, "
          "'triton' or 'mosaic_tpu' to lower for that accelerator, or 'xla'.")
    return PALLAS_BACKENDS[platform]
  target = {"triton": GPU_PLATFORMS, "mosaic_tpu": ("tpu",)}.get(backend)
  if target and platform not in target + ("cpu",):
    raise InputError(
        f"pallas_emb backend={backend!r} does not run on platform "
        f"{platform!r} (it is for {target[0].upper()}s): use "
        f"backend='pallas' for the {platform!r} Pallas backend or None for "
        "the platform's fastest.")
  return backend


# The Pallas backends that compile for an accelerator, and the interpreter
# that runs the same kernels on a CPU.
_COMPILED = {"triton": ("GPU", "interpret"),
             "mosaic_tpu": ("TPU", "mosaic_tpu_interpret")}


def check_runs_on(backend: str, platform: str, args, where: str) -> None:
  """InputError if `backend` compiles for an accelerator but `args` (the
  call's arrays) are concrete arrays on `platform` "cpu": they would run
  there, which Pallas cannot. Under a trace nothing runs here (a step may
  be lowered for the accelerator from a CPU), so tracers pass."""
  if backend not in _COMPILED or platform != "cpu":
    return
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
    return
  target, interpreter = _COMPILED[backend]
  raise InputError(
      f"pallas_emb {where}: backend={backend!r} compiles its kernels for "
      f"{target}s, but the arrays are on platform 'cpu', where Pallas runs "
      f"kernels in interpret mode only. Use backend={interpreter!r} to run "
      "the same kernels on the CPU (of the interpreters, 'interpret' runs "
      "the Triton kernels, 'mosaic_tpu_interpret' the Mosaic ones), or "
      "'xla'; keep "
      f"{backend!r} to lower a step for {target} from the CPU "
      "(jax.jit(step).trace(...).lower(lowering_platforms=...)).")


DEDUPS = ("sort", "slot_map")


def default_dedup(platform: str, backend: str) -> str:
  """The faster dedup measured for a platform and resolved backend: the
  slot map on XLA:CPU (3.4x / 4.0x / 5.7x faster than the sort at 16k /
  64k / 327k Zipf ids, `bench.dedup`, docs/cpu_performance.md); the sort
  elsewhere (the slot map runs on the xla backend only, and its scatters
  are not measured on accelerators)."""
  return "slot_map" if (platform, backend) == ("cpu", "xla") else "sort"


def check_dedup(dedup, backend: str, where: str, platform: str = "cpu"
                ) -> str:
  """The collection's dedup: "sort", "slot_map" (xla backend) or None /
  "auto" for `default_dedup` of the platform and resolved backend."""
  if dedup in (None, "auto"):
    return default_dedup(platform, backend)
  if dedup not in DEDUPS:
    raise InputError(
        f"pallas_emb {where} dedup={dedup!r} is not one of {DEDUPS}: use "
        "None (the platform's faster one), 'sort' or 'slot_map' (the "
        "sort-free dedup of column and replicated stacks, xla backend).")
  if dedup == "slot_map" and backend != "xla":
    raise InputError(
        f"pallas_emb {where} dedup='slot_map' runs on the xla backend only, "
        f"not backend={backend!r}; pass backend='xla' or dedup='sort'.")
  return dedup


def _shape_dtype(x):
  return tuple(x.shape), str(x.dtype)


def is_committed(x) -> bool:
  """Whether x is a concrete array that was explicitly placed."""
  return (not isinstance(x, jax.core.Tracer)) and bool(
      getattr(x, "_committed", False))


_INT32 = np.iinfo(np.int32)


def _check_fits_int32(low, high, what: str) -> None:
  """Raises unless ids in [low, high] fit int32 (a silent wrap would look up
  and train the wrong rows)."""
  if low < _INT32.min or high > _INT32.max:
    raise InputError(
        f"pallas_emb {what} holds ids in [{low}, {high}], outside int32; hash "
        "or remap ids into the table's range first.")


def _jax_ids_to_int32(ids: jax.Array, what: str) -> jax.Array:
  """Integer jax ids (concrete or traced) as int32; see `as_ids`."""
  info = jnp.iinfo(ids.dtype)
  if info.min >= _INT32.min and info.max <= _INT32.max:
    return ids.astype(jnp.int32)  # every value fits (int8, uint16, ...)
  if not isinstance(ids, jax.core.Tracer):
    if ids.size:
      _check_fits_int32(int(jnp.min(ids)), int(jnp.max(ids)), what)
    return ids.astype(jnp.int32)
  # Traced: the values are unknown until run time, so an id outside int32
  # becomes int32 max, an id outside every table, instead of wrapping onto
  # a real row.
  outside = ids > _INT32.max
  if info.min < 0:
    outside |= ids < _INT32.min
  return jnp.where(outside, _INT32.max, ids).astype(jnp.int32)


def integer_ids(ids, message):
  """`ids` as an array, or InputError(message(dtype)) unless it is integer.

  The layers' own sentence for a float id array (as flax's and haiku's
  Embed say it). numpy ids stay numpy, for `as_ids` to range-check:
  `jnp.asarray` would wrap an int64 id past int32 silently.
  """
  if not hasattr(ids, "dtype"):
    ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise InputError(message(jax.dtypes.canonicalize_dtype(ids.dtype)))
  return ids


def as_ids(ids, what: str = "token_ids") -> jax.Array:
  """Any integer array-like (list, numpy, jax) as an int32 array.

  Ids must be integers: float and bool arrays raise InputError. An id
  outside int32 cannot be cast without wrapping onto another (real) row:

  * lists, numpy arrays and concrete jax arrays (e.g. uint32, or int64 with
    x64) holding one raise InputError naming the range found;
  * traced jax arrays cannot be checked before tracing: such an id becomes
    int32 max (2**31 - 1), an id outside every table, which lookup clamps
    onto the last row, the sparse update skips, and `count_out_of_range`
    counts.

  Integer dtypes whose every value fits int32 (int8, uint16, ...) are cast.
  """
  if not isinstance(ids, (jax.Array, jax.core.Tracer)):
    try:
      host = np.asarray(ids)
    except (TypeError, ValueError, jax.errors.TracerArrayConversionError):
      try:  # e.g. a list of traced scalars
        return as_ids(jnp.asarray(ids), what)
      except (TypeError, ValueError) as e:
        raise InputError(
            f"pallas_emb {what} of type {type(ids).__name__} is not an array "
            "of integer ids; pass an int32 array (jnp.asarray(ids, "
            "jnp.int32)).") from e
    if host.dtype == np.int32:
      return jnp.asarray(host)
    if host.size == 0 and host.dtype == np.float64:
      host = host.astype(np.int32)  # np.asarray([]) is float64
    if not np.issubdtype(host.dtype, np.integer):
      raise InputError(
          f"pallas_emb {what} has dtype {host.dtype}; expected integer ids "
          "(int32). Cast them with ids.astype(jnp.int32).")
    if host.size:
      _check_fits_int32(host.min(), host.max(), what)
    return jnp.asarray(host.astype(np.int32))
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise InputError(
        f"pallas_emb {what} has dtype {ids.dtype}; expected integer ids "
        "(int32). Cast them with ids.astype(jnp.int32).")
  return ids if ids.dtype == jnp.int32 else _jax_ids_to_int32(ids, what)


def check_no_host_tables(host_tables, layers: str) -> None:
  """InputError if a collection for the Flax / Haiku layers (`layers`: the
  module) has host-tier tables: the layers hold every table as a param."""
  if host_tables:
    raise InputError(
        f"{layers}.EmbeddingCollection holds every table as a param, which "
        f"host-tier tables {list(host_tables)} are not (their rows live in "
        "host memory); train them with pallas_emb.Trainer on coll.init's "
        "state, or serve them through a ServingState.")


def check_table(ctx: EmbeddingContext, table, what: str = "table") -> None:
  """A `[vocab_rows, emb_width]` f32/bf16 table, column-sharded if committed."""
  check_table_array(table, ctx.emb_width, what)
  if is_committed(table) and len(jax.devices()) > 1:
    expected = jax.sharding.NamedSharding(
        ctx.mesh, jax.sharding.PartitionSpec(None, ctx.table_axis))
    if not table.sharding.is_equivalent_to(expected, 2):
      raise ShardingError(
          f"pallas_emb {what} is sharded as {table.sharding}; expected its "
          f"columns over table_axis {ctx.table_axis} ({expected.spec}): the "
          "single-table API holds column-placed tables only. Place it with "
          "jax.device_put(table, pallas_emb.table_sharding(ctx)), or keep a "
          "row, table or replicated table in a pallas_emb.EmbeddingCollection "
          "(TableSpec(placement=...)).")


def check_table_array(table, emb_width: int, what: str = "table") -> None:
  """A `[vocab_rows, emb_width]` f32 or bf16 array."""
  if not hasattr(table, "shape") or not hasattr(table, "dtype"):
    raise InputError(
        f"pallas_emb {what} is a {type(table).__name__}; expected a "
        f"[vocab_rows, {emb_width}] float32 or bfloat16 array.")
  shape, dtype = _shape_dtype(table)
  if len(shape) != 2 or shape[1] != emb_width or shape[0] < 1:
    raise InputError(
        f"pallas_emb {what} has shape {shape}; expected [vocab_rows, "
        f"{emb_width}] (emb_width of the context). Make the context "
        "with the table's width, or fix the table.")
  if dtype not in TABLE_DTYPES:
    raise InputError(
        f"pallas_emb {what} has dtype {dtype}; expected one of "
        f"{TABLE_DTYPES}. Cast it with table.astype(jnp.bfloat16).")


def check_tokens_shard(tokens: int, group_size: int, num_replicas: int,
                       where: str = "") -> None:
  """Rule 4: `tokens` (a batch's leading dimension) shard evenly.

  `where` (e.g. "feature 'item_id' has ids of shape (12,)") is added to the
  rule's sentence to name the input.
  """
  shards = group_size * num_replicas
  if tokens % shards == 0:
    return
  where = f" ({where})" if where else ""
  over = f"the {group_size}-rank communicator"
  if num_replicas > 1:
    over += f" times {num_replicas} replicas"
  raise ShardingError(
      f"pallas_emb tokens_per_batch={tokens} does not shard evenly over "
      f"{over}{where}. Use a batch size that is a multiple of {shards}, or "
      "pad the batch (padding ids or zero weights get no gradient).")


def check_width_shards(emb_width: int, group_size: int,
                       where: str = "") -> None:
  """Rule 5: `emb_width` columns shard evenly over the communicator."""
  if emb_width % group_size == 0:
    return
  where = f" ({where})" if where else ""
  raise ShardingError(
      f"pallas_emb emb_width={emb_width} does not shard evenly over the "
      f"{group_size}-rank communicator{where}. Use a width that is a "
      f"multiple of {group_size}, or a communicator whose size divides "
      f"{emb_width}.")


def check_leading_dim(shape, group_size: int, num_replicas: int,
                      what: str) -> None:
  """Rule 4 for one call's ids: the batch dimension shards evenly."""
  if not shape:
    raise InputError(
        f"pallas_emb {what} is a scalar; expected ids with a leading batch "
        "dimension, e.g. shape (batch,) or (batch, length).")
  check_tokens_shard(shape[0], group_size, num_replicas,
                     f"{what} has shape {tuple(shape)}")


def check_token_ids(ctx: EmbeddingContext, token_ids, what: str = "token_ids"
                   ) -> None:
  """int32 ids, `tokens_per_batch` of them, leading dim sharding evenly."""
  shape, dtype = _shape_dtype(token_ids)
  if dtype != "int32":
    raise InputError(
        f"pallas_emb {what} has dtype {dtype}; expected int32. Cast them "
        "with ids.astype(jnp.int32).")
  size = math.prod(shape)
  if size != ctx.tokens_per_batch:
    raise InputError(
        f"pallas_emb {what} has shape {shape} ({size} ids); expected "
        f"tokens_per_batch={ctx.tokens_per_batch} ids (the context's). Make "
        "the context with the batch's real size, or pad the batch with the "
        "padding id.")
  check_leading_dim(shape, ctx.group_size, ctx.num_replicas, what)


def check_grads(ctx: EmbeddingContext, grads, ids_shape) -> None:
  """Embedding gradients shaped like lookup's output."""
  check_grads_array(grads, tuple(ids_shape) + (ctx.emb_width,), "emb_grads")


def check_grads_array(grads, expected_shape, what: str) -> None:
  """f32/bf16 gradients of exactly `expected_shape`."""
  if not hasattr(grads, "shape") or not hasattr(grads, "dtype"):
    raise InputError(
        f"pallas_emb {what} is a {type(grads).__name__}; expected an array "
        f"of shape {tuple(expected_shape)}.")
  shape, dtype = _shape_dtype(grads)
  if shape != tuple(expected_shape):
    raise InputError(
        f"pallas_emb {what} has shape {shape}; expected "
        f"{tuple(expected_shape)} (the shape of lookup's output for these "
        "ids).")
  if dtype not in TABLE_DTYPES:
    raise InputError(
        f"pallas_emb {what} has dtype {dtype}; expected one of "
        f"{TABLE_DTYPES}.")
