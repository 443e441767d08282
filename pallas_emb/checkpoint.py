"""Checkpoints of embedding state, restorable onto a different mesh.

    save(directory, state, step=7)      # writes <directory>/7
    latest_step(directory)              # -> 7, or None
    restore(directory, target)          # latest complete step, onto target
    restore_serving(directory, coll, "int8")   # a saved coll.quantize(...)

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

Integrity: every saved array and scalar carries a 64-bit checksum (two
position-dependent sums of a bijective 32-bit mix of each element's bits,
see `checksums.py`), computed on device over the sharded global array and stored
in the same orbax commit. `restore` recomputes it over what it read, so a
changed byte, a truncated, missing or unreadable file, or damaged metadata
is a `CheckpointError` naming the step, the array (where orbax says which)
and what is wrong, never wrong values. The sums do not depend on the
sharding, so a step saved over 8 devices verifies when restored over 2. A
checkpoint written before checksums existed restores unverified, with a
logged warning. `save` deletes stale `*.orbax-checkpoint-tmp*` directories
in `directory` (left by a crash mid-save; never a complete step) before
writing, and refuses leaves a checkpoint cannot hold (strings, objects)
before writing anything. A `StackState`'s slot map (dedup="slot_map", all
sentinel between steps) is not saved; `restore` makes a fresh one wherever
the target has one. A state with host-tier tables holds only their device
caches: `save` and `restore` refuse it, `save_collection` saves their
logical tables from host memory (`restore_collection` reads them back into
host memory, or into a `host_dir` table's files; `orbax_io` makes no
second copy of them either way).

Multi-process (`jax.distributed`): every process must call `save` and
`restore` with the same arguments, on a directory all processes can see
(shared filesystem or object store); orbax coordinates the processes, each
writes and reads only its addressable shards, and process 0 commits.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import host_memory
from pallas_emb import orbax_io
from pallas_emb import quantize
from pallas_emb.dedup import empty_slot_map
from pallas_emb.checksums import bit_width
from pallas_emb.checksums import checksums
from pallas_emb.errors import CheckpointError
from pallas_emb.state import CollectionState
from pallas_emb.state import ServingState
from pallas_emb.state import StackState
from pallas_emb.state import serving_layouts

# Orbax's commit marker (written last in both of its atomicity modes).
_COMMIT_MARKER = "commit_success.txt"
# Orbax's temporary step directories: `<step>.orbax-checkpoint-tmp[-<n>]`.
_TMP_MARKER = ".orbax-checkpoint-tmp"
# The saved tree: the user's state beside a parallel tree of checksums, so
# orbax's single atomic commit covers both.
_STATE, _SUMS = "pallas_emb_state", "pallas_emb_checksums"


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
  """Highest complete step saved under `directory`, or None if there is none
  (a CheckpointError if `directory` is a file)."""
  root = _dir(directory)
  _not_a_file(root)
  steps = _complete_steps(root)
  return steps[-1] if steps else None


# --- save --------------------------------------------------------------------


def _savable(name: str, leaf):
  """`leaf` as orbax will store it; a CheckpointError if it cannot be."""
  if isinstance(leaf, (bool, float)) or (
      isinstance(leaf, int) and -2**63 <= leaf < 2**63):
    return leaf
  if isinstance(leaf, int):
    why = f"the int {leaf}, outside int64"
  elif isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
    dtype = leaf.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      why = "a PRNG key array (store jax.random.key_data(key) instead)"
    elif not (dtype == np.bool_ or jax.dtypes.issubdtype(dtype, np.number)):
      # jax's issubdtype knows bfloat16, float8_* and int4 (ml_dtypes),
      # whichever module their dtype classes live in.
      why = f"a numpy array of dtype {dtype}"
    elif bit_width(dtype) < 8:
      why = f"an array of {dtype}, narrower than a byte"
    else:
      # Orbax restores numpy scalars as arrays: store them as 0-d arrays.
      return np.asarray(leaf) if isinstance(leaf, np.generic) else leaf
  else:
    kind = type(leaf).__name__
    why = f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"
  raise CheckpointError(
      f"pallas_emb checkpoint leaf {name!r} is {why}, which a checkpoint "
      "cannot hold; save only jax/numpy arrays of numbers or bools and "
      "python ints/floats/bools there (encode anything else as such, or keep "
      "it outside the checkpoint).")


def _remove_stale_tmp(root) -> None:
  """Deletes orbax's temporary step directories left by a crash mid-save."""
  # Process 0 only, before its orbax save: orbax has process 0 create this
  # save's temporary directory (the others wait for it), so every one found
  # here is an earlier save's.
  if jax.process_index() != 0 or not root.is_dir():
    return
  for p in root.iterdir():
    if _TMP_MARKER in p.name:
      logging.warning("pallas_emb checkpoint: removing %s, left by an "
                      "interrupted save.", p)
      if p.is_dir():
        p.rmtree()
      else:
        p.unlink()


def _causes(e: BaseException) -> list[BaseException]:
  """`e` and the exceptions it was raised from, outermost first."""
  chain = []
  while e is not None and e not in chain:
    chain.append(e)
    e = e.__cause__ or e.__context__
  return chain


def _reason(e: BaseException) -> str:
  """The innermost orbax/tensorstore error (tensorstore's own status, e.g.
  "NOT_FOUND: ..."), without the spec dump orbax appends."""
  text = str(_causes(e)[-1])
  for cut in (" [tensorstore_spec=", " See full TensorStore details"):
    text = text.split(cut)[0]
  text = (text.strip().splitlines() or [type(e).__name__])[0]
  return text if len(text) <= 300 else text[:297] + "..."


def save(directory, state, *, step: int) -> None:
  """Saves pytree `state` as `<directory>/<step>`; returns once committed."""
  _orbax()  # a clear ImportError without orbax-checkpoint
  step = _check_step(step)
  root = _dir(directory)
  _not_a_file(root)
  path = root / str(step)
  # Checked before anything touches the directory.
  _no_host_tier(state, "save")
  flat, treedef = jax.tree_util.tree_flatten_with_path(_no_slot_maps(state))
  leaves = [_savable(_key(p), v) for p, v in flat]
  if path.exists():
    raise CheckpointError(
        f"pallas_emb checkpoint {path} already exists; save under a new step "
        "or delete that directory first.")
  sums = checksums(leaves)
  tree = {_STATE: jax.tree_util.tree_unflatten(treedef, leaves),
          _SUMS: jax.tree_util.tree_unflatten(treedef, sums)}
  _remove_stale_tmp(root)
  # Saved asynchronously; closing the checkpointer waits for the commit, so
  # a returned `save` is a finished checkpoint.
  try:
    with orbax_io.checkpointer() as ckptr:
      ckptr.save(path, args=orbax_io.save_args(tree))
      ckptr.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-exception-caught
    # Orbax and tensorstore raise plain Exceptions (disk full, permissions).
    raise CheckpointError(
        f"pallas_emb checkpoint {path} could not be written ({_reason(e)}); "
        "make sure the directory is writable and has room, then save "
        "again.") from e


def _no_host_tier(tree, what: str) -> None:
  """A CheckpointError if `tree` holds a state with host-tier tables."""
  is_state = lambda x: isinstance(x, CollectionState)
  for x in jax.tree.leaves(tree, is_leaf=is_state):
    if is_state(x) and x.host is not None:
      raise CheckpointError(
          f"pallas_emb checkpoint {what} got a CollectionState with host-"
          "tier tables, whose rows live in host memory, not in the state; "
          f"{what} it with checkpoint.{what}_collection(directory, coll, "
          "...), which stores logical tables.")


def _no_slot_maps(tree):
  """`tree` with every StackState's slot map dropped (it follows from the
  rows: all sentinel between steps)."""
  is_stack = lambda x: isinstance(x, StackState)
  return jax.tree.map(lambda x: x._replace(slot_map=None) if is_stack(x)
                      else x, tree, is_leaf=is_stack)


def _fresh_slot_maps(target, tree):
  """`tree` (restored onto `_no_slot_maps(target)`) with a fresh slot map
  wherever `target` has one, placed as the target's."""
  def one(want, got):
    if not isinstance(want, StackState) or want.slot_map is None:
      return got
    m = want.slot_map
    return got._replace(slot_map=jax.jit(
        empty_slot_map, static_argnums=0,
        out_shardings=getattr(m, "sharding", None))(m.shape[0]))
  return jax.tree.map(one, target, tree,
                      is_leaf=lambda x: isinstance(x, StackState))


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


def _not_a_file(root) -> None:
  """CheckpointError if the checkpoint directory `root` is a file."""
  if root.exists() and not root.is_dir():
    raise CheckpointError(
        f"pallas_emb checkpoint directory {root} is a file, not a directory; "
        "pass the directory given to save() (it holds one subdirectory per "
        "step), not a file in it.")


def _resolve_step(directory, step: int | None):
  """`(root, step)`: the checkpoint root and a complete step in it (`step`,
  or the latest one when None); a clear error otherwise."""
  root = _dir(directory)
  _not_a_file(root)
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


def _damaged(path, what: str) -> CheckpointError:
  """The error for a step whose files do not give back what was saved."""
  root, step = path.parent, int(path.name)
  others = [s for s in _complete_steps(root) if s != step]
  fix = (f"restore another complete step with step=... (there are {others})"
         if others else "save the state again (no other complete step is "
         "there)")
  return CheckpointError(
      f"pallas_emb checkpoint {path} is damaged: {what}; do not use it, "
      f"{fix}.")


def _metadata(ckptr, path):
  """The saved tree of orbax metadata at `path`; CheckpointError if missing
  or unreadable."""
  try:
    meta = ckptr.metadata(path)
  except Exception as e:  # pylint: disable=broad-exception-caught
    # Missing or corrupt _METADATA/manifest: orbax raises what it meets.
    raise _damaged(path, f"its metadata cannot be read ({_reason(e)})") from e
  # orbax 0.12 wraps the tree in StepMetadata.item_metadata.tree.
  meta = getattr(meta, "item_metadata", meta)
  meta = getattr(meta, "tree", meta)
  if not isinstance(meta, dict):
    # Orbax logs and returns nothing when _METADATA is missing or empty.
    raise _damaged(path, "its metadata cannot be read (orbax found no tree "
                   "of arrays: _METADATA or the array index is missing or "
                   "damaged)")
  return meta


def _checked(meta) -> bool:
  """Whether saved tree `meta` carries checksums (else: an older format)."""
  return set(meta) == {_STATE, _SUMS}


def _array_name(e: BaseException) -> str | None:
  """The tree path of the array an orbax restore error is about, if it says.

  Tensorstore names it by orbax's dotted param name, as the key it could not
  read ("pallas_emb_state.tables.items/0") or the path in its spec dump.
  """
  for err in _causes(e):
    found = re.search(_STATE + r"\.([^\"'\\/\s]+)/", str(err))
    if found:
      return found.group(1).replace(".", "/")
  return None


def _verify(path, restored, sums, saved) -> None:
  """CheckpointError unless every restored leaf has its saved checksum."""
  got, want = _flat(restored), _flat(sums)
  names = sorted(got)
  # Host values are compared as the dtype they were saved as (orbax gives a
  # python scalar back for a saved python int, float or bool).
  values = [v if isinstance(v, jax.Array) else np.asarray(
      v, saved[n].dtype) for n, v in zip(names, (got[n] for n in names))]
  bad = [n for n, c in zip(names, checksums(values))
         if not np.array_equal(c, np.asarray(want[n]))]
  if bad:
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise _damaged(path, f"array {bad[0]!r}{more} does not match the "
                   "checksum saved with it, so its files changed after the "
                   "save")


def restore(directory, target, *, step: int | None = None):
  """Restores step `step` (default: the latest complete one) onto `target`.

  Returns a pytree shaped like `target` whose arrays carry the target
  shardings. Shapes, dtypes and tree structure are checked against the saved
  metadata before any array is read, and every value read against the
  checksum saved with it.
  """
  _orbax()  # a clear ImportError without orbax-checkpoint
  root, step = _resolve_step(directory, step)
  path = root / str(step)
  _no_host_tier(target, "restore")
  full_target, target = target, _no_slot_maps(target)

  with orbax_io.checkpointer() as ckptr:
    meta = _metadata(ckptr, path)
    checked = _checked(meta)
    saved = _flat(meta[_STATE] if checked else meta)
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
    if not checked:
      logging.warning(
          "pallas_emb checkpoint %s predates checksums: its values are "
          "restored unverified.", path)
    item = ({_STATE: abstract, _SUMS: jax.tree.map(
        lambda _: np.zeros(2, np.uint32), abstract)} if checked else abstract)
    try:
      tree = ckptr.restore(path, args=orbax_io.restore_args(item))
    except Exception as e:  # pylint: disable=broad-exception-caught
      # Tensorstore raises plain Exceptions/ValueErrors for truncated,
      # missing or undecodable chunks.
      name = _array_name(e)
      what = f"array {name!r}" if name else "an array"
      raise _damaged(path, f"{what} cannot be read ({_reason(e)})") from e
  if not checked:
    return _fresh_slot_maps(full_target, tree)
  _verify(path, tree[_STATE], tree[_SUMS], saved)
  return _fresh_slot_maps(full_target, tree[_STATE])


# --- collections: logical tables --------------------------------------------


def _saved_tree(directory, step: int | None):
  """`(step, saved metadata tree)` of a complete step (default: latest)."""
  _orbax()  # a clear ImportError without orbax-checkpoint
  root, step = _resolve_step(directory, step)
  with orbax_io.checkpointer() as ckptr:
    meta = _metadata(ckptr, root / str(step))
  return step, meta[_STATE] if _checked(meta) else meta


_TRAINING_KEYS = {"tables", "opt_states"}


def _serving_dtype(saved) -> str | None:
  """The dtype of a saved serving state ("int8", "bfloat16", "float16");
  None for any other tree."""
  if not saved or not set(saved) <= {"stacks", "layouts"}:
    return None
  stacks = {n: v for n, v in _flat(saved).items() if n.startswith("stacks/")}
  if not stacks or any(n.endswith("/table") for n in stacks):
    return None
  if any(n.endswith("/codes") for n in stacks):
    return quantize.INT8
  return np.dtype(next(iter(stacks.values())).dtype).name


def _a(word: str) -> str:
  return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def _holds(saved) -> str:
  """What a saved tree is, in words (for the errors of the restores that
  expect another kind)."""
  keys = sorted(saved)
  if _TRAINING_KEYS <= set(keys):
    return ("a training checkpoint (save_collection: logical tables "
            f"{sorted(saved['tables'])} and their optimizer states)")
  dtype = _serving_dtype(saved)
  if dtype:
    return (f"{_a(dtype)} serving state (save() of coll.quantize(state, "
            f"{dtype!r}))")
  if keys and set(keys) <= {"stacks", "layouts"}:
    return ("a collection state saved whole with save() (its stack tables "
            "and optimizer states)")
  return (f"a tree of {len(_flat(saved))} arrays that no pallas_emb "
          f"collection function wrote (top-level keys {keys[:8]}"
          f"{' ...' if len(keys) > 8 else ''})")


def save_collection(directory, coll, state, *, step: int, extra=None) -> None:
  """Saves a collection's state as logical tables (and `extra`, any pytree).

  Stored per table (`coll.table_arrays` / `coll.optimizer_arrays`), so the
  checkpoint restores under another stacking, rank count or mesh, and a
  host-tier table (saved from host memory) as a device table and back.
  """
  save(directory, {"tables": coll.table_arrays(state),
                   "opt_states": coll.optimizer_arrays(state),
                   "extra": extra if extra is not None else {}}, step=step)


def _table_target(coll, name: str):
  """The restore target of one logical table and its optimizer state: column
  tables column-sharded, the others (whose logical shape need not split over
  the ranks) replicated; `state_from_arrays` then places them. A host-tier
  table's arrays are read into host memory (numpy targets: untouched
  pages, no memory until read) or, with a `host_dir`, into its files
  (`orbax_io`: a chunk at a time), its step counter onto the devices."""
  spec = coll.tables[name]
  partition = (jax.sharding.PartitionSpec(None, coll.table_axis)
               if spec.placement == "column" else jax.sharding.PartitionSpec())
  sharding = jax.sharding.NamedSharding(coll.mesh, partition)
  table = jax.ShapeDtypeStruct((spec.vocab_rows, spec.emb_width), spec.dtype,
                               sharding=sharding)
  opt = spec.optimizer
  replicated = jax.sharding.NamedSharding(coll.mesh,
                                          jax.sharding.PartitionSpec())
  shapes = jax.eval_shape(lambda: opt.init_state(
      spec.vocab_rows, replicated, sharding, emb_width=spec.emb_width))
  opt_state = jax.tree.map(
      lambda s, p: jax.ShapeDtypeStruct(
          s.shape, s.dtype, sharding=jax.sharding.NamedSharding(coll.mesh, p)),
      shapes, opt.state_specs(partition))
  if spec.host:
    table = host_memory.host_array(spec, "rows", table.shape, table.dtype)
    if opt is not None:
      opt_state = opt_state._replace(**{
          s.name: host_memory.host_array(spec, s.name, x.shape, x.dtype)
          for s in opt.slots() for x in [getattr(opt_state, s.name)]})
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
  if not _TRAINING_KEYS <= set(saved):
    dtype = _serving_dtype(saved)
    fix = (f"restore it with restore_serving(directory, coll, {dtype!r})"
           if dtype else "restore it with restore(directory, target)")
    raise CheckpointError(
        f"pallas_emb restore_collection: checkpoint {directory}/{step} "
        f"holds {_holds(saved)}, not the logical tables that "
        f"save_collection writes; {fix}, or pass a save_collection "
        "checkpoint.")
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
  # Room for the host-tier tables, checked before any is read.
  host_memory.check_host_memory(coll, "restore_collection")
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
  # The restored host arrays become the host-tier tables' host memory.
  return coll.state_from_arrays(tables, opt_states, copy=False), tree["extra"]


# --- serving states ---------------------------------------------------------


def serving_target(coll, dtype: str) -> ServingState:
  """The `restore` target of a saved `coll.quantize(state, dtype)`: every
  stack's serving arrays as ShapeDtypeStructs placed where `coll.lookup`
  reads them (codes / cast tables as the stack's table, scale and bias with
  its rows: `quantize.serving_spec`)."""
  dtype = quantize.check_serving_dtype(dtype)
  stacks = {}
  for stack in coll.serving_plan.stacks:
    shape = (stack.total_rows, stack.emb_width)
    spec = quantize.serving_spec(coll.stack_sharding(stack).spec, dtype)
    place = lambda p, shape, dt: jax.ShapeDtypeStruct(
        shape, dt, sharding=jax.sharding.NamedSharding(coll.mesh, p))
    if dtype == quantize.INT8:
      stacks[stack.name] = quantize.QuantizedRows(
          place(spec.codes, shape, jnp.uint8),
          place(spec.scale, shape[:1], jnp.float32),
          place(spec.bias, shape[:1], jnp.float32))
    else:
      stacks[stack.name] = place(spec, shape, jnp.dtype(dtype))
  return ServingState(stacks, dtype, coll.serving_plan.fingerprint,
                      serving_layouts(coll.serving_plan))


def restore_serving(directory, coll, dtype: str, *,
                    step: int | None = None) -> ServingState:
  """A `ServingState` saved with `save(directory, coll.quantize(state,
  dtype), step=...)`, restored onto `coll` (any mesh with the same table
  axis size or another: the arrays are global).

  The serving arrays are stored per stack, so `coll` must stack its tables
  as the quantizing collection did (same TableSpecs in the same order); a
  checkpoint of another stacking does not match the target and is a
  CheckpointError, as is one of another dtype or kind (a training
  checkpoint: the error says which restore reads it). Row and table stacks place their rows by the rank
  count, so theirs restore over the same number of ranks only (else a
  CheckpointError). To serve under another stacking or rank count,
  quantize the state restored by `restore_collection` instead.
  """
  dtype = quantize.check_serving_dtype(dtype)
  target = serving_target(coll, dtype)
  step, saved = _saved_tree(directory, step)
  held = _serving_dtype(saved)
  if held != dtype:
    if held:
      fix = f"restore it with dtype={held!r}"
    elif _TRAINING_KEYS <= set(saved):
      fix = ("restore it with restore_collection(directory, coll), then "
             f"serve coll.quantize(state, {dtype!r})")
    else:
      fix = "restore it with restore(directory, target)"
    raise CheckpointError(
        f"pallas_emb restore_serving: checkpoint {directory}/{step} holds "
        f"{_holds(saved)}, not {_a(dtype)} serving state; {fix}.")
  saved_layouts = sorted(_flat(saved.get("layouts", {})))
  if saved_layouts != sorted(target.layouts):
    raise CheckpointError(
        f"pallas_emb restore_serving {directory} step {step}: its row and "
        f"table stacks were laid out as {saved_layouts} (stack_ranks<W>); "
        f"this collection lays them out as {sorted(target.layouts)}, with "
        "their rows elsewhere. Restore onto as many ranks, or quantize the "
        "state restore_collection restores.")
  return restore(directory, target, step=step)
