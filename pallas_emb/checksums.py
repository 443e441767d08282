"""64-bit checksums of arrays, equal on host and device and under any sharding.

Two independent position-dependent sums of a bijective 32-bit mix of each
element's bits (`_sums`). A sharded jax array is summed where it lives; a
numpy array (64-bit dtypes included) on the host; both give the same
checksum for the same values. `checkpoint.py` stores one per saved array
and recomputes it on restore.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Two independent 32-bit sums make a 64-bit checksum.
_SEEDS = (0x243F6A88, 0x85A308D3)


def _fmix32(h):
  # murmur3's finalizer: a bijection of uint32, so changing one element's
  # bits always changes its term, and with it the sum.
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _sums(xp, words, index):
  """`uint32[2]`: sum_i fmix32(words_i ^ key(index_i) ^ seed) mod 2^32 per
  seed. Sums commute, so the result does not depend on how the array is
  sharded; the position key catches elements that moved."""
  key = _fmix32(index * np.uint32(0x9E3779B9) + np.uint32(1))
  return xp.stack([xp.sum(_fmix32(words ^ key ^ np.uint32(s)),
                          dtype=xp.uint32) for s in _SEEDS])


def bit_width(dtype) -> int:
  return int(jax.dtypes.itemsize_bits(dtype))


# A host array is summed this many elements at a time, so that a table of
# tens of GB (a host-tier table's) needs no temporaries of its size.
_HOST_CHUNK = 1 << 24


def _host_checksum(x: np.ndarray) -> np.ndarray:
  """`_sums` of a host array (any numpy dtype, 64-bit ones included)."""
  x = np.ascontiguousarray(x)
  if x.dtype.kind == "c":
    x = np.stack([x.real, x.imag], -1)
  flat = x.reshape(-1)
  total = np.zeros(len(_SEEDS), np.uint32)
  for start in range(0, max(flat.size, 1), _HOST_CHUNK):
    part = flat[start:start + _HOST_CHUNK]
    if x.dtype == np.bool_:
      words = part.astype(np.uint32)
    else:
      # Little-endian words: an 8-byte element is (low word, high word).
      words = part.view({1: np.uint8, 2: np.uint16, 4: np.uint32,
                         8: np.uint32}[x.dtype.itemsize]).astype(np.uint32)
    first = start * (2 if x.dtype.itemsize == 8 else 1)
    index = (np.arange(words.size, dtype=np.uint64) + first).astype(
        np.uint32)
    with np.errstate(over="ignore"):
      total += _sums(np, words, index)
  return total


def _device_checksum(x: jax.Array) -> jax.Array:
  """`_sums` of a (sharded) jax array, computed where it lives."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag], -1)
  size = np.dtype(x.dtype).itemsize
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  elif size == 8:  # Only under jax_enable_x64; same word order as the host.
    u = jax.lax.bitcast_convert_type(x, jnp.uint64)
    words = jnp.stack([(u & 0xFFFFFFFF).astype(jnp.uint32),
                       (u >> 32).astype(jnp.uint32)], -1)
  else:
    words = jax.lax.bitcast_convert_type(
        x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]).astype(
            jnp.uint32)
  # Row-major word index mod 2^32 from per-axis iotas: no int64 and no
  # flattening (which would move data between shards).
  index = jnp.zeros(words.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(words.ndim)):
    index = index + jax.lax.broadcasted_iota(
        jnp.uint32, words.shape, axis) * np.uint32(stride % 2**32)
    stride *= words.shape[axis]
  return _sums(jnp, words, index)


# One program per device set sums every array of a save or restore: one
# compilation instead of one per leaf shape.
_device_checksums = jax.jit(lambda xs: [_device_checksum(x) for x in xs])


def _finish_checksum(c) -> np.ndarray:
  if isinstance(c, jax.Array) and not c.is_fully_addressable:
    # Multi-process: a full reduction is replicated, so any local copy is it.
    c = c.addressable_data(0)
  return np.asarray(c, np.uint32)


def checksums(leaves) -> list[np.ndarray]:
  """Checksums of `leaves`: jax arrays on their devices (one program per set
  of devices, all started before any result is awaited), the rest on the
  host."""
  out = [None] * len(leaves)
  groups = {}
  for i, x in enumerate(leaves):
    if isinstance(x, jax.Array):
      devices = tuple(sorted(d.id for d in x.sharding.device_set))
      groups.setdefault(devices, []).append(i)
    else:
      out[i] = _host_checksum(np.asarray(x))
  started = [(idx, _device_checksums([leaves[i] for i in idx]))
             for idx in groups.values()]
  for idx, sums in started:
    for i, c in zip(idx, sums):
      out[i] = _finish_checksum(c)
  return out
