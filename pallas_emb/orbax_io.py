"""The orbax checkpointer behind `checkpoint.py`: host arrays written and
read without a second copy of them in host memory.

Orbax's default handler for numpy leaves deep-copies each array before
writing it and reads each array whole into a new one. For a host-tier
table of tens of GB (docs/host_tier.md) either is a second copy of the
table in host memory. This checkpointer writes numpy leaves as they are
(`checkpoint.save` returns only once the step is committed, so nothing
changes them meanwhile) in chunks of rows of about `CHUNK_BYTES`, and
reads a leaf whose target is a memory-mapped file (a `TableSpec.host_dir`
table's) straight into that file, a chunk at a time. The files on disk
are orbax's own format: any orbax reader sees plain numpy arrays.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from pallas_emb import host_memory


def _orbax():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  return ocp, ts


def checkpointer():
  """An orbax `AsyncCheckpointer` of pytrees (as `StandardCheckpointer`),
  with the numpy handling above."""
  ocp, _ = _orbax()
  return ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(
      type_handler_registry=_handlers()[1]))


# Orbax's largest chunk (its OCDBT target data file size): it cuts a larger
# array shard into chunks of rows that divide the shard's row count.
ORBAX_CHUNK_BYTES = 2 << 30


def tiny_orbax_chunks(x) -> bool:
  """Whether orbax would store the jax array (or ShapeDtypeStruct with a
  sharding) `x` in chunks of under 1/16 of `CHUNK_BYTES`: a shard of over
  2 GiB is cut by divisors of its dimensions, so a prime row count gives
  chunks of one row (10,000,019 x 64 f32 did not save in 200 s). Orbax's
  own chooser decides; where it is not found, orbax's choice stands."""
  shard = tuple(x.sharding.shard_shape(x.shape))
  itemsize = np.dtype(x.dtype).itemsize
  if itemsize * int(np.prod(shard)) <= ORBAX_CHUNK_BYTES:
    return False
  try:
    # pylint: disable-next=g-import-not-at-top
    from orbax.checkpoint._src.arrays import subchunking
    chunk = subchunking.choose_chunk_shape(
        tuple(x.shape), shard, np.dtype(x.dtype), ORBAX_CHUNK_BYTES)
  except (ImportError, AttributeError, TypeError):
    return False
  return itemsize * int(np.prod(chunk)) * 16 < host_memory.CHUNK_BYTES


def save_args(tree):
  """Orbax's save arguments for `tree`. A jax array that orbax would store
  in tiny chunks (`tiny_orbax_chunks`) is written from a host copy instead,
  in chunks of rows (below), where one process holds all of it."""
  ocp, _ = _orbax()
  tree = jax.tree.map(
      lambda x: np.asarray(x) if isinstance(x, jax.Array)
      and x.is_fully_addressable and tiny_orbax_chunks(x) else x, tree)
  return ocp.args.PyTreeSave(tree)


def restore_args(item):
  """Orbax's restore arguments for target `item` (as the standard
  checkpointer builds them); a memory-mapped leaf is read into its file."""
  ocp, _ = _orbax()
  into_file = _handlers()[0]
  args = ocp.checkpoint_utils.construct_restore_args(item)
  args = jax.tree.map(
      lambda leaf, arg: into_file(restore_type=np.memmap, out=leaf)
      if isinstance(leaf, np.memmap) else arg, item, args)
  return ocp.args.PyTreeRestore(item, restore_args=args)


@functools.cache
def _handlers():
  """`(IntoFile, registry)`: the restore arguments of a leaf read into a
  file, and the global orbax registry with numpy arrays handled here."""
  ocp, ts = _orbax()
  handlers = ocp.type_handlers

  @dataclasses.dataclass
  class IntoFile(ocp.RestoreArgs):
    """Read the leaf into `out` (its shape and dtype), chunk by chunk."""
    out: np.ndarray | None = None

  class NumpyInPlace(ocp.type_handlers.NumpyHandler):
    """Orbax's numpy handler, without its copies (module doc)."""

    def __init__(self):
      try:
        super().__init__(deepcopy_host_arrays=False)
      except TypeError:  # orbax < 0.12.5 always copies
        super().__init__()

    async def _open_and_write(self, value, tspec, ts_context):
      # Orbax stores an array of over 2 GiB in chunks of rows that divide
      # its row count: a prime count (common for hashed tables) gives
      # chunks of one row (10,000,019 x 64 f32 did not save in 7 minutes
      # on a 2-core CPU, against 7 s in the chunks here). Process 0
      # writes a numpy array whole, so its chunks need not divide it: rows
      # of about CHUNK_BYTES each, the last one short.
      chunks = tspec.get("metadata", {}).get("chunks")
      if chunks is not None and value.ndim:
        rows = host_memory.chunk_rows(int(np.prod(value.shape[1:])),
                                      value.dtype.itemsize)
        if value.shape[0] > rows:
          tspec = dict(tspec, metadata=dict(
              tspec["metadata"], chunks=[rows, *value.shape[1:]]))
      return await super()._open_and_write(value, tspec, ts_context)

    async def deserialize(self, infos, args=None):
      args = list(args or [ocp.RestoreArgs()] * len(infos))
      out = [None] * len(infos)
      files = [i for i, a in enumerate(args) if getattr(a, "out", None)
               is not None]
      others = [i for i in range(len(infos)) if i not in files]
      if others:
        read = await super().deserialize([infos[i] for i in others],
                                         [args[i] for i in others])
        for i, x in zip(others, read):
          out[i] = x
      for i in files:
        out[i] = await _read_into(ocp, ts, infos[i], args[i].out)
      return out

  numpy = NumpyInPlace()

  class Registry(ocp.type_handlers.TypeHandlerRegistry):
    """numpy arrays to `NumpyInPlace`; everything else as orbax does."""

    def add(self, ty, handler, func=None, override=False):
      raise NotImplementedError("pallas_emb's orbax registry is fixed")

    def get(self, ty):
      if isinstance(ty, type) and issubclass(ty, np.ndarray):
        return numpy
      return handlers.get_type_handler(ty)

    def has(self, ty):
      return (isinstance(ty, type) and issubclass(ty, np.ndarray)) or (
          handlers.has_type_handler(ty))

  return IntoFile, Registry()


async def _read_into(ocp, ts, info, out: np.ndarray) -> np.ndarray:
  """Reads one saved array into `out`, a whole number of its stored chunks
  of rows at a time (about `CHUNK_BYTES`, or one chunk), written by
  tensorstore straight into `out`. Tensorstore decodes a stored chunk
  whole, so a part that cut one would decode it again. (`save` stores a
  numpy array of more than `CHUNK_BYTES` in chunks of that size; orbax's
  own saves, of up to 2 GiB as one chunk, of more in chunks of rows
  dividing the row count, e.g. 5M rows of a 10M-row f32 table of width
  64.)"""
  spec = ocp.type_handlers.get_json_tspec_read(
      info, use_ocdbt=info.is_ocdbt_checkpoint)
  store = await ts.open(ts.Spec(spec), open=True, context=info.ts_context)
  if tuple(store.shape) != out.shape:
    raise ValueError(f"{info.name}: saved shape {tuple(store.shape)}, "
                     f"target {out.shape}")
  if not out.ndim:
    out[...] = await store.read()
    return out
  rows = out.shape[0]
  stored = store.chunk_layout.read_chunk.shape
  stored = rows if stored is None or stored[0] is None else stored[0]
  wanted = host_memory.chunk_rows(int(np.prod(out.shape[1:])),
                                  out.dtype.itemsize)
  step = max(stored, wanted // stored * stored)
  for start in range(0, rows, step):
    stop = min(start + step, rows)
    await ts.array(out[start:stop], copy=False, write=True).write(
        store[start:stop].translate_to[0])
  return out
