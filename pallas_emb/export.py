"""Serving without training code: an exported function and its arrays.

    pallas_emb.export.save(path, fn, state, [(batch_64,), (batch_256,)])
    ...
    served = pallas_emb.export.load(path)     # a fresh process
    out = served(batch_64)                    # == fn(state, batch_64)

`save` serializes `fn(state, *args)` with `jax.export`, once per example
argument tuple, and writes the leaves of `state` to a numpy `.npz`; `state`
is any pytree of arrays (a training state, a quantized serving state, a
dict of dense weights), and `fn` any jit-able function of it. `load` needs
jax, numpy and pallas_emb only (plus flatbuffers, which jax.export's
serializer imports: the `serve` extra): no flax, optax or orbax, and none of
the Python classes of `state` (the program takes the flat list of leaves).

One program per batch shape: `EmbeddingCollection.lookup` sizes its
unique-id buffers from the batch shape while tracing (`min(ids,
vocab_rows)` per table), so a symbolic batch dimension fails with
`InconclusiveDimensionOperation: Symbolic dimension comparison '8*b' >
'100' is inconclusive` (a collection with a 100-row table). Export every
batch size you serve (pad a batch up to the next one). A function that
supports them may still take `jax.ShapeDtypeStruct`s with symbolic
dimensions (`jax.export.symbolic_shape`).

Each program is lowered for `platforms` (default: this machine's): with
`backend="xla"` one export can serve on "cpu" and "cuda"; Pallas kernels
lower for "cuda" only, as Triton custom calls that jax.export refuses by
default: `save` allows that one call target, so an artifact with Pallas
kernels loads with the jax / jaxlib it was exported with (the Triton IR
inside is compiled at load time); export with `backend="xla"` for an
artifact that outlives an upgrade. The state's shardings are kept: `load` rebuilds the
mesh from the saved axis names and sizes over `jax.devices()`, which must
be as many devices as at export.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import export as jax_export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_emb.errors import CheckpointError
from pallas_emb.errors import InputError

FORMAT = "pallas_emb.export/1"
_MANIFEST = "manifest.json"
_ARRAYS = "state.npz"
# The Pallas Triton kernels' call target (backend="pallas" on a GPU).
_PALLAS_CALLS = (jax_export.DisabledSafetyCheck.custom_call(
    "__gpu$xla.gpu.triton"),)


def _check_serializer(what: str) -> None:
  """jax.export's (de)serializer needs the flatbuffers package."""
  try:
    import flatbuffers  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise ImportError(
        f"pallas_emb export.{what} needs the flatbuffers package, which "
        "jax.export serializes programs with; install it with pip install "
        "'pallas_emb[serve]' (or pip install flatbuffers).") from e


def _program_file(i: int) -> str:
  return f"program_{i}.jax"


def _leaf_mesh(leaves) -> jax.sharding.Mesh | None:
  """The one mesh of the state's NamedShardings (None if there are none)."""
  meshes = {x.sharding.mesh for x in leaves
            if isinstance(getattr(x, "sharding", None), NamedSharding)}
  if len(meshes) > 1:
    raise InputError(
        f"pallas_emb export.save state is placed on {len(meshes)} different "
        "meshes; expected one mesh for every sharded leaf. Place the state "
        "on a single mesh.")
  return meshes.pop() if meshes else None


def _host(path, x) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    raise InputError(
        f"pallas_emb export.save state{jax.tree_util.keystr(path)} spans "
        "several processes; expected arrays this process can read whole. "
        "Export from a single-process copy of the state.")
  return np.asarray(jax.device_get(x))


def save(path: str, fn: Callable[..., Any], state: Any,
         example_args: Sequence[Sequence[Any]], *,
         platforms: Sequence[str] | None = None) -> None:
  """Writes `fn(state, *args)` for each `args` of `example_args`, and state.

  Args:
    path: a directory (created; existing files of the same names are
      replaced).
    fn: `fn(state, *args)`, jit-able; its outputs a pytree of standard
      containers (dict, list, tuple, None) of arrays.
    state: a pytree of arrays; its shardings are kept.
    example_args: one tuple of arguments (arrays or ShapeDtypeStructs; dicts
      and lists of them) per program, e.g. one per batch size.
    platforms: lowering platforms (e.g. ("cpu", "cuda")); default the
      current backend's.
  """
  _check_serializer("save")
  example_args = [tuple(a) for a in example_args]
  if not example_args:
    raise InputError("pallas_emb export.save example_args is empty; "
                     "expected one tuple of arguments per program, e.g. "
                     "[(batch,)].")
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  paths = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
  leaves = [x for _, x in paths_leaves]
  for p, x in zip(paths, leaves):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise InputError(
          f"pallas_emb export.save state{p} is a {type(x).__name__}; "
          "expected every leaf of the state to be an array.")
  mesh = _leaf_mesh(leaves)
  # With a mesh, a leaf on one device (e.g. a dense weight) is replicated:
  # the program runs on every device of the mesh anyway.
  shardings = [x.sharding if isinstance(getattr(x, "sharding", None),
                                        NamedSharding) else
               None if mesh is None else NamedSharding(mesh, P())
               for x in leaves]

  def flat_fn(flat_state, *args):
    return fn(jax.tree_util.tree_unflatten(treedef, flat_state), *args)

  # Only the state's placement is fixed; the arguments' is fn's business.
  jitted = jax.jit(flat_fn, in_shardings=(shardings,) + (None,) * len(
      example_args[0]) if mesh is not None else None)
  specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  programs = []
  for args in example_args:
    if len(args) != len(example_args[0]):
      raise InputError(
          f"pallas_emb export.save example_args hold {len(args)} and "
          f"{len(example_args[0])} arguments; expected the same number of "
          "arguments in every tuple.")
    exported = jax_export.export(
        jitted, platforms=tuple(platforms) if platforms else None,
        disabled_checks=_PALLAS_CALLS)(specs, *args)
    programs.append(exported.serialize())

  os.makedirs(path, exist_ok=True)
  host = [_host(p, x) for (p, _), x in zip(paths_leaves, leaves)]
  # Raw bits: npz has no bfloat16; the dtype name restores it.
  np.savez(os.path.join(path, _ARRAYS), **{
      f"leaf_{i}": a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "V"
      or a.dtype.name == "bfloat16" else a for i, a in enumerate(host)})
  for i, blob in enumerate(programs):
    with open(os.path.join(path, _program_file(i)), "wb") as f:
      f.write(blob)
  manifest = {
      "format": FORMAT,
      "num_devices": mesh.size if mesh is not None else 1,
      "mesh": (None if mesh is None else
               {"axis_names": list(mesh.axis_names),
                "axis_sizes": [int(s) for s in mesh.devices.shape],
                # Explicit axes (`jax.make_mesh`'s default) are part of the
                # programs' types: the loader's mesh must have the same.
                "axis_types": [t.name for t in mesh.axis_types]}),
      "state": [{"path": p, "dtype": a.dtype.name, "shape": list(a.shape)}
                for p, a in zip(paths, host)],
      "programs": len(programs),
  }
  with open(os.path.join(path, _MANIFEST), "w") as f:
    json.dump(manifest, f, indent=1)


class Served:
  """A loaded export: `served(*args)` runs the program for the args' shapes.

  Attributes:
    state: the state's leaves, placed as they were at export.
    state_paths: their pytree paths (`jax.tree_util.keystr`) at export.
    programs: the `jax.export.Exported` programs, in `example_args` order.
  """

  def __init__(self, state, state_paths, programs):
    self.state = state
    self.state_paths = state_paths
    self.programs = programs
    self._calls = [jax.jit(p.call) for p in programs]

  def _matches(self, program, args) -> bool:
    avals = program.in_avals[len(self.state):]
    flat = jax.tree_util.tree_leaves(args)
    if len(flat) != len(avals):
      return False
    for x, aval in zip(flat, avals):
      shape, dtype = np.shape(x), getattr(x, "dtype", None)
      if dtype is None or np.dtype(dtype) != aval.dtype or len(shape) != len(
          aval.shape):
        return False
      if any(isinstance(d, int) and d != s for d, s in zip(aval.shape,
                                                            shape)):
        return False
    return True

  def signatures(self) -> list[str]:
    """The argument shapes of each program, for messages."""
    return [", ".join(f"{a.dtype.name}{list(a.shape)}"
                      for a in p.in_avals[len(self.state):])
            for p in self.programs]

  def __call__(self, *args):
    for program, call in zip(self.programs, self._calls):
      if self._matches(program, args):
        return call(self.state, *args)
    given = ", ".join(
        f"{np.dtype(getattr(x, 'dtype', np.float64)).name}{list(np.shape(x))}"
        for x in jax.tree_util.tree_leaves(args))
    raise InputError(
        f"pallas_emb served function got arguments ({given}); it was "
        f"exported for {self.signatures()}. Pad the batch to an exported "
        "shape, or export this one too.")


def load(path: str) -> Served:
  """The function and state `save` wrote to `path`, ready to call."""
  try:
    with open(os.path.join(path, _MANIFEST)) as f:
      manifest = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(
        f"pallas_emb export.load found no readable {_MANIFEST} in {path!r} "
        f"({e}); expected a directory written by pallas_emb.export.save.") \
        from e
  _check_serializer("load")
  if manifest.get("format") != FORMAT:
    raise CheckpointError(
        f"pallas_emb export.load {path!r} has format "
        f"{manifest.get('format')!r}; expected {FORMAT!r}.")
  devices = jax.devices()
  if manifest["num_devices"] > len(devices):
    raise CheckpointError(
        f"pallas_emb export.load {path!r} was exported for "
        f"{manifest['num_devices']} devices; this process has "
        f"{len(devices)}. Load it where as many devices are visible.")
  programs = []
  for i in range(manifest["programs"]):
    with open(os.path.join(path, _program_file(i)), "rb") as f:
      programs.append(jax_export.deserialize(bytearray(f.read())))
  with np.load(os.path.join(path, _ARRAYS)) as arrays:
    host = [arrays[f"leaf_{i}"].view(np.dtype(jax.numpy.dtype(leaf["dtype"])))
            for i, leaf in enumerate(manifest["state"])]
  mesh_info = manifest["mesh"]
  if mesh_info is None:
    state = [jax.numpy.asarray(a) for a in host]
  else:
    # Files written before axis types were saved had Auto axes.
    axis_types = tuple(
        jax.sharding.AxisType[name] for name in mesh_info.get(
            "axis_types", ["Auto"] * len(mesh_info["axis_names"])))
    mesh = jax.sharding.Mesh(
        np.array(devices[:manifest["num_devices"]]).reshape(
            mesh_info["axis_sizes"]), tuple(mesh_info["axis_names"]),
        axis_types=axis_types)
    # jax.export keeps no sharding for a replicated input (None).
    replicated = NamedSharding(mesh, P())
    shardings = programs[0].in_shardings_jax(mesh)[:len(host)]
    state = [jax.device_put(a, replicated if s is None else s)
             for a, s in zip(host, shardings)]
  return Served(state, [leaf["path"] for leaf in manifest["state"]],
                programs)
