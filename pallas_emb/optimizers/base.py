"""What every fused sparse optimizer shares.

An optimizer is a frozen, hashable dataclass of hyper-parameters that
subclasses `SparseOptimizer` and says three things:

* its state: a NamedTuple type (`state_type`) whose fields are its slots
  and a trailing `step`, and `slots()`, one `Slot` per array: `ROW` (f32 or
  int32 `[V]`, replicated) or `ELEMENT` (f32 `[V, D]`, column-sharded like
  the table, `[V, S]` per rank). A field that `slots()` leaves out (e.g. a
  mode's optional array) is None in the state;
* `scalars(step)`: the traced f32 values of one step (the learning rate of
  a schedule, bias corrections), computed once per step, not per row;
* the per-row math, `row_update` and `column_update`, pure jnp functions
  that the Pallas kernel and its jnp twin both call (the contract is in
  `kernels.sparse_update.UpdateRule`).

Everything else -- init, sharding specs, the per-rank update through the
backend switch, the step counter and the no-op when the update is not
applied, slicing and stacking the state of tables in a stack, the state
checks of `apply_gradients` -- is here, once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, ClassVar, NamedTuple, Union

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from pallas_emb import exchange
from pallas_emb import kernels
from pallas_emb import validation
from pallas_emb.kernels import common
from pallas_emb.errors import HyperParameterError
from pallas_emb.errors import InputError
from pallas_emb.validation import EmbeddingContext

Schedule = Callable[[jax.Array], jax.Array]
LearningRate = Union[float, Schedule]

ROW = "row"
ELEMENT = "element"

# The arithmetic helpers an optimizer's math uses (see their docstrings):
# `round_to(x, dtype)` rounds f32 values to the table dtype and back;
# `unfused_product(x, y)` is `x * y`, never contracted into an FMA, so the
# kernel and the twin round every product alike.
round_to = common.round_to
unfused_product = common.unfused_product


def add_rounded(values: jax.Array, delta: jax.Array, dtype) -> jax.Array:
  """`values + R(delta)` (f32; the kernel rounds the sum to `dtype`).

  The rounding points of an additive update on a bf16 table, as row-wise
  Adagrad's: the update is rounded to the table dtype before
  it is added, the sum once more; identities for an f32 table.
  """
  return values + round_to(delta, dtype)


@dataclasses.dataclass(frozen=True)
class Slot:
  """One state array: `ROW` `[V]` (replicated) or `ELEMENT` `[V, D]`."""
  name: str
  kind: str
  init: float = 0.0
  dtype: Any = jnp.float32


def snake_case(name: str) -> str:
  """'PartialRowwiseAdam' -> 'partial_rowwise_adam'."""
  return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def is_finite_number(x) -> bool:
  """A real number (not a bool) that stays finite in float32, the dtype the
  update computes in (1e39 is a finite float but an f32 inf)."""
  if not isinstance(x, (int, float)) or isinstance(x, bool):
    return False
  return math.isfinite(x) and abs(x) <= float(np.finfo(np.float32).max)


def check(ok: bool, owner, message: str) -> None:
  """Raises HyperParameterError('pallas_emb <Class> <message>') unless ok."""
  if not ok:
    raise HyperParameterError(f"pallas_emb {type(owner).__name__} {message}")


def check_learning_rate(owner) -> None:
  """Every optimizer's rule for a float learning rate: finite and > 0 in
  float32 (0 would train nothing, a negative one ascend the loss). A
  schedule's values are checked per step (`scalars_are_valid`)."""
  lr = owner.learning_rate
  if callable(lr):
    return
  check(is_finite_number(lr) and np.float32(lr) > 0, owner,
        f"learning_rate={lr!r} must be a finite number > 0 (in float32) or "
        "a schedule step -> learning rate.")


def check_at_least(owner, name: str, low: float, strict: bool = False,
                   high: float | None = None) -> None:
  """`getattr(owner, name)` is finite and >= low (> low if strict), < high.

  Compared as the float32 the math uses: an eps of 1e-50 is 0 there, a b1
  of 1 - 1e-9 is 1.
  """
  value = getattr(owner, name)
  ok = is_finite_number(value)
  if ok:
    value32 = np.float32(value)
    ok = value32 > low if strict else value32 >= low
    ok = ok and (high is None or value32 < high)
  bounds = f"{'>' if strict else '>='} {low}" + (
      "" if high is None else f" and < {high}")
  check(ok, owner, f"{name}={value!r} must be finite and {bounds} in "
        "float32.")


@dataclasses.dataclass(frozen=True)
class SparseOptimizer:
  """Base of the fused sparse optimizers; see the module docstring.

  Subclasses are frozen dataclasses with a `learning_rate` field (a float
  > 0, or a schedule `step -> lr`, e.g. an optax one, evaluated at the
  stack's step counter: updates applied so far; a step where it is not
  finite is skipped, see `scalars_are_valid`).
  """
  state_type: ClassVar[type]
  # A row in the batch whose gradient is all zero (row_sq == 0: the padding
  # id's slot) is left as it is: lazy sparse semantics update the rows that
  # got a gradient. RowwiseAdagrad keeps §4's decay of such rows.
  updates_zero_rows: ClassVar[bool] = False

  # --- what a subclass defines -------------------------------------------------

  def slots(self) -> tuple[Slot, ...]:
    return ()

  def scalars(self, step: jax.Array) -> tuple[jax.Array, ...]:
    """Per-step f32 values for the math; by default the learning rate."""
    return (self.learning_rate_at(step),)

  def scalars_are_valid(self, step: jax.Array) -> jax.Array:
    """bool scalar: whether the update at `step` may be applied as far as
    its per-step values go.

    A schedule (of the learning rate or of any hyper-parameter) or a bias
    correction that is not finite would write NaN into every touched row,
    so such a step is skipped like one with a non-finite gradient norm.
    Subclasses whose math needs more (Ftrl: a learning rate > 0) extend it.
    """
    ok = jnp.bool_(True)
    for value in self.scalars(step):
      ok &= jnp.all(jnp.isfinite(value))
    return ok

  def row_update(self, row, row_sq, step, scalars, emb_width):
    """`({slot: new [R] value}, per-row coefficients)`; default: none."""
    del row, row_sq, step, scalars, emb_width
    return {}, ()

  def column_update(self, coeffs, values, grad, element, scalars, dtype):
    raise NotImplementedError(f"{type(self).__name__}.column_update")

  # --- the update rule the kernels see ----------------------------------------

  @property
  def kernel_name(self) -> str:
    return "pallas_emb_" + snake_case(type(self).__name__)

  @property
  def row_slots(self) -> tuple[str, ...]:
    return tuple(s.name for s in self.slots() if s.kind == ROW)

  @property
  def element_slots(self) -> tuple[str, ...]:
    return tuple(s.name for s in self.slots() if s.kind == ELEMENT)

  def learning_rate_at(self, step: jax.Array) -> jax.Array:
    lr = self.learning_rate
    return jnp.asarray(lr(step) if callable(lr) else lr, jnp.float32)

  # --- state ------------------------------------------------------------------

  def _state(self, arrays: dict[str, Any], step) -> NamedTuple:
    fields = {name: arrays.get(name) for name in self.state_type._fields}
    fields["step"] = step
    return self.state_type(**fields)

  def init(self, ctx: EmbeddingContext, table: jax.Array):
    """The state of a `[vocab_rows, emb_width]` table laid out by `ctx`."""
    validation.check_table(ctx, table)
    return self.init_state(table.shape[0], exchange.replicated_sharding(ctx),
                           exchange.table_sharding(ctx),
                           emb_width=table.shape[1])

  def init_state(self, vocab_rows: int, replicated, table_sharding=None, *,
                 emb_width: int | None = None):
    """The state of `vocab_rows` rows: row-wise arrays on `replicated`,
    element-wise ones `[vocab_rows, emb_width]` on `table_sharding`."""
    arrays = {}
    for slot in self.slots():
      if slot.kind == ROW:
        arrays[slot.name] = exchange.place(
            jnp.full((vocab_rows,), slot.init, slot.dtype, device=replicated),
            replicated)
        continue
      if emb_width is None or table_sharding is None:
        raise InputError(
            f"pallas_emb {type(self).__name__}.init_state needs emb_width= "
            f"and table_sharding= for its element-wise state "
            f"{slot.name!r} ([vocab_rows, emb_width], sharded like the "
            "table).")
      # `place`: under a user's jit (`jax.jit(coll.init)`), `device=` alone
      # left the state replicated on every rank.
      arrays[slot.name] = exchange.place(
          jnp.full((vocab_rows, emb_width), slot.init, slot.dtype,
                   device=table_sharding), table_sharding)
    return self._state(arrays, jnp.zeros((), jnp.int32, device=replicated))

  def state_specs(self, table_spec: P):
    """The PartitionSpec of each state leaf (element-wise: the table's)."""
    return self._state({s.name: table_spec if s.kind == ELEMENT else P()
                        for s in self.slots()}, P())

  def slice_rows(self, opt_state, start: int, stop: int):
    """The state of rows `[start, stop)` (one table of a stack)."""
    return self._state({s.name: getattr(opt_state, s.name)[start:stop]
                        for s in self.slots()}, opt_state.step)

  def concat_rows(self, states):
    """The state of tables stacked in order (inverse of `slice_rows`).

    Element-wise arrays keep the first table's sharding (the table's).
    """
    states = list(states)
    arrays = {}
    for slot in self.slots():
      parts = [getattr(s, slot.name) for s in states]
      if slot.kind == ELEMENT and len(parts) > 1:
        arrays[slot.name] = jax.jit(
            lambda *a: jnp.concatenate(a),
            out_shardings=getattr(parts[0], "sharding", None))(*parts)
      else:
        arrays[slot.name] = (parts[0] if len(parts) == 1
                             else jnp.concatenate(parts))
    step = jnp.max(jnp.stack([jnp.asarray(s.step) for s in states]))
    return self._state(arrays, step)

  def check_state(self, opt_state, table_shape) -> None:
    """Raises InputError unless `opt_state` is this optimizer's state of a
    `table_shape` table (global shapes)."""
    vocab_rows, emb_width = table_shape
    name = type(self).__name__
    if not isinstance(opt_state, self.state_type):
      raise InputError(
          f"pallas_emb opt_state is a {type(opt_state).__name__}; expected "
          f"the {self.state_type.__name__} that {name}.init(ctx, table) "
          "returns.")
    slots = {s.name: s for s in self.slots()}
    for field in self.state_type._fields[:-1]:
      array = getattr(opt_state, field)
      if (array is None) != (field not in slots):
        raise InputError(
            f"pallas_emb {name} state field {field!r} is "
            f"{'missing' if array is None else 'unexpected'} (the state of "
            f"another configuration?); re-create it with opt.init(ctx, "
            "table).")
      if array is None:
        continue
      want = ((vocab_rows,) if slots[field].kind == ROW
              else (vocab_rows, emb_width))
      if tuple(array.shape) != want:
        raise InputError(
            f"pallas_emb opt_state.{field} has shape {tuple(array.shape)}; "
            f"expected {want}, its {slots[field].kind}-wise state of a "
            f"[{vocab_rows}, {emb_width}] table. Re-create it with "
            "opt.init(ctx, table).")

  # --- the update -------------------------------------------------------------

  def update_rows(self, table, opt_state, unique_tokens, grad_accum, row_sq,
                  apply, *, emb_width: int, backend: str, config=None,
                  sorted_tokens: bool = False):
    """The fused update of the rows of `unique_tokens` (per rank).

    `grad_accum` f32 `[U, S]` holds this rank's columns of each unique
    row's summed gradient, `row_sq` f32 `[U]` the full-width squared norms;
    nothing changes, not even the step, where `apply` is false or this
    step's scalars are not valid (`scalars_are_valid`). `sorted_tokens`:
    `unique_tokens` ascend (`kernels.sparse_update_rows`).
    """
    step = opt_state.step
    apply = jnp.asarray(apply, jnp.bool_) & self.scalars_are_valid(step)
    table, rows, elements = kernels.sparse_update_rows(
        self, table, [getattr(opt_state, n) for n in self.row_slots],
        [getattr(opt_state, n) for n in self.element_slots], unique_tokens,
        grad_accum, row_sq, apply, step, self.scalars(step),
        emb_width=emb_width, backend=backend, config=config,
        sorted_tokens=sorted_tokens)
    arrays = dict(zip(self.row_slots, rows))
    arrays.update(zip(self.element_slots, elements))
    return table, self._state(arrays, step + apply.astype(jnp.int32))
