"""Checkpoints of embedding state, restorable onto a different mesh.

    save(directory, state, step=7)      # writes <directory>/7
    latest_step(directory)              # -> 7, or None
    restore(directory, target)          # latest complete step, onto target

`state` is any pytree of (possibly sharded) global `jax.Array`s and python
ints/floats. `target` has the same structure; each leaf is a `jax.Array` or a
`jax.ShapeDtypeStruct(shape, dtype, sharding=...)` whose sharding says where
to put the restored array. The mesh may have a different number of devices
than at save time (e.g. save column-sharded over 8, restore over 2): orbax
stores each array as one global tensorstore array and every device reads just
the slice its target sharding asks for, so restores are bit-exact.

Format and atomicity come from orbax-checkpoint (`pip install
orbax-checkpoint`, the `checkpoint` extra), not from us. Orbax writes a step
into a temporary directory and, once every file is written, writes
`commit_success.txt` and renames it onto `<directory>/<step>` (on
object stores without atomic rename it writes in place and the
`commit_success.txt` marker is the commit). So a step counts as complete here
only if its directory name is a plain integer *and* it holds that marker;
anything else (orbax's `<step>.orbax-checkpoint-tmp*` directories, an
interrupted in-place write, a stray folder) is ignored by `latest_step` and
refused by `restore`. `save` blocks until the step is committed.

Multi-process (`jax.distributed`): every process must call `save` and
`restore` with the same arguments, on a directory all processes can see
(shared filesystem or object store); orbax coordinates the processes, each
writes and reads only its addressable shards, and process 0 commits.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pallas_emb.errors import CheckpointError

# Orbax's commit marker (written last in both of its atomicity modes).
_COMMIT_MARKER = "commit_success.txt"


def _orbax():
  # Optional dependency: only checkpointing needs it.
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    from etils import epath  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "pallas_emb.checkpoint needs orbax-checkpoint; install it with "
        "`pip install orbax-checkpoint` (or `pip install pallas_emb"
        "[checkpoint]`).") from e
  return ocp, epath


def _dir(directory):
  _, epath = _orbax()
  # Orbax wants absolute paths; epath keeps gs:// and friends as they are.
  path = epath.Path(directory)
  return path if "://" in str(directory) else path.absolute()


def _check_step(step) -> int:
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or (
      step < 0):
    raise CheckpointError(
        f"pallas_emb checkpoint step={step!r} must be a non-negative "
        "integer; pass e.g. step=int(train_step).")
  return int(step)


def _complete_steps(path) -> list[int]:
  if not path.is_dir():
    return []
  return sorted(
      int(p.name) for p in path.iterdir()
      if p.name.isdigit() and (p / _COMMIT_MARKER).exists())


def latest_step(directory) -> int | None:
  """Highest complete step saved under `directory`, or None if there is none."""
  steps = _complete_steps(_dir(directory))
  return steps[-1] if steps else None


def save(directory, state, *, step: int) -> None:
  """Saves pytree `state` as `<directory>/<step>`; returns once committed."""
  ocp, _ = _orbax()
  step = _check_step(step)
  path = _dir(directory) / str(step)
  if path.exists():
    raise CheckpointError(
        f"pallas_emb checkpoint {path} already exists; save under a new step "
        "or delete that directory first.")
  # StandardCheckpointer saves asynchronously; closing it waits for the
  # commit, so a returned `save` is a finished checkpoint.
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state)
    ckptr.wait_until_finished()


def _key(path) -> str:
  # Orbax stores containers as nested dicts/lists: normalise every key kind
  # (dict key, attribute, index) to its plain name so the two trees compare.
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts) or "<root>"


def _flat(tree) -> dict[str, Any]:
  return {_key(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _abstract(name: str, leaf, saved):
  """The orbax restore target for one leaf, after checking it fits `saved`."""
  saved_shape = tuple(saved.shape)
  saved_dtype = np.dtype(saved.dtype) if saved.dtype is not None else None
  if isinstance(leaf, (int, float)):
    if saved_shape != ():
      raise CheckpointError(
          f"pallas_emb checkpoint leaf {name!r}: target is a python scalar "
          f"but the saved value has shape {saved_shape}; give a "
          "jax.ShapeDtypeStruct with that shape instead.")
    return leaf
  if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
    raise CheckpointError(
        f"pallas_emb checkpoint leaf {name!r}: target leaf of type "
        f"{type(leaf).__name__} is neither an array nor a ShapeDtypeStruct; "
        "give jax.ShapeDtypeStruct(shape, dtype, sharding=...).")
  shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
  if shape != saved_shape or dtype != saved_dtype:
    raise CheckpointError(
        f"pallas_emb checkpoint leaf {name!r}: target is {dtype}{list(shape)} "
        f"but the checkpoint holds {saved_dtype}{list(saved_shape)}; make the "
        "target match the saved shape and dtype (cast or reshape after "
        "restoring if you need another).")
  if isinstance(leaf, np.ndarray):
    return leaf
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    # Orbax would silently put the whole array on one device.
    raise CheckpointError(
        f"pallas_emb checkpoint leaf {name!r}: target ShapeDtypeStruct has "
        "no sharding; pass sharding=NamedSharding(mesh, spec) to say where "
        "the restored array goes.")
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _resolve_step(directory, step: int | None):
  """`(root, step)`: the checkpoint root and a complete step in it (`step`,
  or the latest one when None); a clear error otherwise."""
  root = _dir(directory)
  if not root.is_dir():
    raise CheckpointError(
        f"pallas_emb checkpoint directory {root} does not exist; pass the "
        "directory given to save(), or save a checkpoint there first.")
  steps = _complete_steps(root)
  if step is None:
    if not steps:
      raise CheckpointError(
          f"pallas_emb checkpoint directory {root} holds no complete "
          "checkpoint; save one first, or pass the directory save() wrote to.")
    step = steps[-1]
  step = _check_step(step)
  if step not in steps:
    raise CheckpointError(
        f"pallas_emb checkpoint step {step} is not a complete checkpoint in "
        f"{root}; complete steps are {steps}, so pass one of those or "
        "step=None for the latest.")
  return root, step


def restore(directory, target, *, step: int | None = None):
  """Restores step `step` (default: the latest complete one) onto `target`.

  Returns a pytree shaped like `target` whose arrays carry the target
  shardings. Shapes, dtypes and tree structure are checked against the saved
  metadata before any array is read.
  """
  ocp, _ = _orbax()
  root, step = _resolve_step(directory, step)
  path = root / str(step)

  with ocp.StandardCheckpointer() as ckptr:
    meta = ckptr.metadata(path)
    # orbax 0.12 wraps the tree in StepMetadata.item_metadata.tree.
    meta = getattr(meta, "item_metadata", meta)
    meta = getattr(meta, "tree", meta)
    saved = _flat(meta)
    wanted = _flat(target)
    if saved.keys() != wanted.keys():
      missing = sorted(saved.keys() - wanted.keys())
      extra = sorted(wanted.keys() - saved.keys())
      raise CheckpointError(
          f"pallas_emb checkpoint {path}: target tree does not match the "
          f"saved tree (saved but not in target: {missing}; in target but "
          f"not saved: {extra}); give a target with the saved structure.")
    abstract = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(target),
        [_abstract(k, v, saved[k]) for k, v in wanted.items()])
    return ckptr.restore(path, abstract)


# --- collections: logical tables -------------------------------------------------


def _saved_tree(directory, step: int | None):
  """`(step, saved metadata tree)` of a complete step (default: latest)."""
  ocp, _ = _orbax()
  root, step = _resolve_step(directory, step)
  with ocp.StandardCheckpointer() as ckptr:
    meta = ckptr.metadata(root / str(step))
  meta = getattr(meta, "item_metadata", meta)
  return step, getattr(meta, "tree", meta)


def save_collection(directory, coll, state, *, step: int, extra=None) -> None:
  """Saves a collection's state as logical tables (and `extra`, any pytree).

  Stored per table (`coll.table_arrays` / `coll.optimizer_arrays`), so the
  checkpoint restores under another stacking, rank count or mesh.
  """
  save(directory, {"tables": coll.table_arrays(state),
                   "opt_states": coll.optimizer_arrays(state),
                   "extra": extra if extra is not None else {}}, step=step)


def _table_target(coll, name: str):
  spec = coll.tables[name]
  table = jax.ShapeDtypeStruct((spec.vocab_rows, spec.emb_width), spec.dtype,
                               sharding=coll.table_sharding())
  opt = spec.optimizer
  replicated = jax.sharding.NamedSharding(coll.mesh,
                                          jax.sharding.PartitionSpec())
  shapes = jax.eval_shape(lambda: opt.init_state(
      spec.vocab_rows, replicated, coll.table_sharding(),
      emb_width=spec.emb_width))
  specs = opt.state_specs(jax.sharding.PartitionSpec(None, coll.table_axis))
  opt_state = jax.tree.map(
      lambda s, p: jax.ShapeDtypeStruct(
          s.shape, s.dtype, sharding=jax.sharding.NamedSharding(coll.mesh, p)),
      shapes, specs)
  return table, opt_state


def restore_collection(directory, coll, *, step: int | None = None,
                       extra=None, init_key=None):
  """`(state, extra)` of a `save_collection` checkpoint, onto `coll`.

  `coll` may stack its tables differently and live on another mesh than at
  save time. Tables of `coll` that the checkpoint lacks (a table added
  since) are initialized from `init_key`, which is then required; a saved
  table that `coll` lacks is an error. `extra` is the target of the saved
  extra pytree (as for `restore`), or None if nothing extra was saved.
  """
  step, saved = _saved_tree(directory, step)
  saved_tables = set(saved.get("tables", {}))
  unknown = sorted(saved_tables - set(coll.tables))
  if unknown:
    raise CheckpointError(
        f"pallas_emb checkpoint {directory}/{step} holds tables {unknown} "
        f"that the collection does not have (it has {sorted(coll.tables)}); "
        "add their TableSpecs to restore it.")
  missing = sorted(set(coll.tables) - saved_tables)
  if missing and init_key is None:
    raise CheckpointError(
        f"pallas_emb checkpoint {directory}/{step} has no tables {missing}; "
        "pass init_key= to initialize them fresh.")
  targets = {name: _table_target(coll, name) for name in sorted(saved_tables)}
  tree = restore(directory, {
      "tables": {n: t for n, (t, _) in targets.items()},
      "opt_states": {n: o for n, (_, o) in targets.items()},
      "extra": {} if extra is None else extra}, step=step)
  tables, opt_states = dict(tree["tables"]), dict(tree["opt_states"])
  if missing:
    fresh = coll.init(init_key)
    fresh_tables = coll.table_arrays(fresh)
    fresh_opt = coll.optimizer_arrays(fresh)
    for name in missing:
      tables[name], opt_states[name] = fresh_tables[name], fresh_opt[name]
  return coll.state_from_arrays(tables, opt_states), tree["extra"]
