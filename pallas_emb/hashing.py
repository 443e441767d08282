"""Hashing raw entity ids into small tables: a universal family mod 2^31 - 1.

A model that never looks raw ids up hashes each id x with `num_hashes`
functions of the Carter-Wegman family

    h_k(x) = ((a_k * x + b_k) mod p) mod (rows - 1) + 1,   p = 2^31 - 1,

into a table of `rows` rows, far fewer than the ids. Row 0 stays the padding
row: id 0 hashes to 0 under every h_k, and no other id does. The family
sees ids only mod p: raw ids that agree mod p (x and x + p) collide under
every h_k, so ids beyond 2^31 - 1 are best dense or mixed first.

Parameters: a_k in [1, p) and b_k in [0, p) are the (2k+1)-th and (2k+2)-th
outputs of splitmix64 seeded with `seed` (k = 0, 1, ...), reduced as
a_k = 1 + out mod (p - 1) and b_k = out mod p. splitmix64(seed) is the
sequence z_n = mix(seed + n * 0x9E3779B97F4A7C15 mod 2^64), n = 1, 2, ...,
with Steele, Lea and Flood's finaliser `mix`; its first output for seed 0 is
0xE220A8397B1DCDAF.

`hash_ids` dispatches on its input:

* numpy (or anything that is not a jax.Array): ids of any integer dtype,
  int64 / uint64 raw ids beyond 2^31 included, hashed on the host in uint64
  arithmetic (x is reduced mod p first, so a * (x mod p) + b < 2^63). A
  negative id raises `InputError`.
* jax (a jax.Array, traced or not): int32 ids (or narrower integer dtypes),
  hashed with 32-bit integer ops only, so jax_enable_x64 is not needed: the
  product a * x is split into 16-bit limbs and reduced mod the Mersenne prime
  with 2^31 = 1 (mod p). On every int32 id it is bit-identical to the numpy
  version. A concrete array is checked for negative ids (`InputError`); inside
  a trace nothing can be raised, so there a negative id hashes to 0, the
  padding row, documented rather than checked.

Both return int32 ids of shape `ids.shape + (num_hashes,)`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.errors import InputError

# The Mersenne prime of the family: 2^31 = 1 (mod P), so reducing a 32-bit
# value needs only a mask, a shift and one add.
P = (1 << 31) - 1
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
# Hashed ids are int32, so the last row, rows - 1, must fit in one.
_MAX_ROWS = 1 << 31


def _mix64(z: int) -> int:
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
  return z ^ (z >> 31)


def splitmix64(seed: int, n: int) -> int:
  """The n-th output (n >= 1) of splitmix64 seeded with `seed`."""
  return _mix64((seed + n * _GAMMA) & _MASK64)


def hash_params(num_hashes: int, seed: int = 0
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(a_0..a_{K-1}, b_0..b_{K-1}) of the K = `num_hashes` functions."""
  # Checked outside the cache, which would take True for 1.
  _check_int("num_hashes", num_hashes, 1, None)
  _check_int("seed", seed, 0, 1 << 64)
  return _params(int(num_hashes), int(seed))


@functools.lru_cache(maxsize=64)
def _params(num_hashes: int, seed: int
            ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  a = tuple(1 + splitmix64(seed, 2 * k + 1) % (P - 1)
            for k in range(num_hashes))
  b = tuple(splitmix64(seed, 2 * k + 2) % P for k in range(num_hashes))
  return a, b


def _check_int(name: str, value, low: int, high: int | None) -> None:
  ok = (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
        and value >= low and (high is None or value < high))
  if not ok:
    bound = f">= {low}" if high is None else f"in [{low}, {high})"
    raise InputError(f"pallas_emb hash_ids {name}={value!r}; expected an "
                     f"integer {bound}; pass one.")


def hash_ids(ids, *, num_hashes: int, rows: int, seed: int = 0):
  """Hashes ids into [1, rows) with `num_hashes` universal hash functions.

  Args:
    ids: integer ids, 0 = padding. A numpy array (or list / scalar) of any
      integer dtype is hashed on the host; a jax.Array (int32 or narrower)
      with 32-bit ops on the device. See the module docstring.
    num_hashes: functions per id, >= 1.
    rows: rows of the table the hashed ids index, 2 <= rows <= 2^31; row 0 is
      the padding row, so real ids land in [1, rows).
    seed: picks the functions (a_k, b_k); integer in [0, 2^64).

  Returns:
    int32 ids of shape `ids.shape + (num_hashes,)`; entry [..., k] is
    h_k(id), and 0 where id is 0. A numpy array for numpy input, a jax
    array for jax input.

  Raises:
    InputError: bad num_hashes, rows or seed, a non-integer dtype, negative
      concrete ids, or a jax dtype wider than 32 bits.
  """
  _check_int("rows", rows, 2, _MAX_ROWS + 1)
  a, b = hash_params(num_hashes, seed)
  if isinstance(ids, jax.Array):
    return _hash_jax(ids, a, b, rows)
  return _hash_numpy(ids, a, b, rows)


def _hash_numpy(ids, a, b, rows: int) -> np.ndarray:
  x = np.asarray(ids)
  if x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.integer):
    raise InputError(f"pallas_emb hash_ids got ids of dtype {x.dtype}; "
                     "expected integer ids; cast them (e.g. to int64).")
  if np.issubdtype(x.dtype, np.signedinteger) and x.size and x.min() < 0:
    raise InputError(f"pallas_emb hash_ids got a negative id {x.min()}; "
                     "expected ids >= 0 (0 is padding); map them to "
                     "non-negative raw ids first.")
  x = x.astype(np.uint64)[..., None]
  a = np.asarray(a, np.uint64)
  b = np.asarray(b, np.uint64)
  # x mod p < 2^31 and a < 2^31, so the product fits in 62 bits.
  h = (a * (x % np.uint64(P)) + b) % np.uint64(P)
  h = h % np.uint64(rows - 1) + np.uint64(1)
  return np.where(x == 0, np.uint64(0), h).astype(np.int32)


def _reduce(s):
  """s mod p for uint32 s (< 2^32): 2^31 = 1 (mod p)."""
  s = (s & P) + (s >> 31)  # <= p + 1
  return jnp.where(s >= P, s - P, s)


def _hash_jax(ids: jax.Array, a, b, rows: int) -> jax.Array:
  if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.dtype == jnp.bool_:
    raise InputError(f"pallas_emb hash_ids got jax ids of dtype {ids.dtype}; "
                     "expected int32 ids; cast them.")
  if jnp.dtype(ids.dtype).itemsize > 4 or ids.dtype == jnp.uint32:
    raise InputError(
        f"pallas_emb hash_ids got jax ids of dtype {ids.dtype}; expected "
        "int32 (or narrower) ids, which the 32-bit device hash covers; hash "
        "wider raw ids on the host with a numpy array.")
  if not isinstance(ids, jax.core.Tracer) and ids.size:
    low = int(jnp.min(ids))
    if low < 0:
      raise InputError(f"pallas_emb hash_ids got a negative id {low}; "
                       "expected ids >= 0 (0 is padding); map them to "
                       "non-negative raw ids first.")
  u32 = jnp.uint32
  x = ids.astype(jnp.int32)[..., None]
  valid = x > 0  # 0 is padding; traced negative ids also map to row 0
  x = _reduce(jnp.where(valid, x, 0).astype(u32))  # x = p -> 0
  a = jnp.asarray(np.asarray(a, np.uint32))
  b = jnp.asarray(np.asarray(b, np.uint32))
  # a * x with 16-bit limbs (a, x < 2^31, so the high limbs are < 2^15):
  # a*x = ah*xh*2^32 + (ah*xl + al*xh)*2^16 + al*xl, and 2^32 = 2 (mod p).
  ah, al = a >> 16, a & 0xFFFF
  xh, xl = x >> 16, x & 0xFFFF
  high = (ah * xh) << 1  # < 2^31
  mid = ah * xl + al * xh  # < 2^32
  # mid*2^16 = (mid >> 15)*2^31 + (mid & 0x7FFF)*2^16 = (mid >> 15) + ...
  mid = (mid >> 15) + ((mid & 0x7FFF) << 16)  # < 2^17 + 2^31
  low = _reduce(al * xl)
  h = _reduce(_reduce(high + low) + _reduce(mid))
  h = _reduce(h + b)
  h = h % u32(rows - 1) + u32(1)
  return jnp.where(valid, h, u32(0)).astype(jnp.int32)
