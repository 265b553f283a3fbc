"""Per-array checksums of a checkpointed state, written with each checkpoint and verified on restore.

A checkpoint whose bytes were damaged after the write (a flipped bit on disk or in transit) can restore as
finite but wrong values, which the finite-value check cannot see. So each save records, per array of the
state, a 64-bit checksum computed on the devices from the arrays' bits, and a restore recomputes it from what
it read: any difference makes the step unrestorable (set aside, and the previous step is used, as for missing
files).

The checksum of an array is two position-weighted sums of its bits as uint32 words, modulo 2^32, with odd
weights: flipping any single bit changes each sum (the change is +-2^b times an odd weight, never 0 mod 2^32),
and other damage goes unnoticed with probability about 2^-64. It runs under jit on sharded arrays, so no array
leaves its devices; only the two words per array do.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_MULTIPLIERS = (2654435761, 2246822519)  # odd: Knuth's and xxHash's 32-bit primes


def _words(x: jax.Array) -> jax.Array:
  """The array's bits as a flat uint32 vector."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  size = x.dtype.itemsize
  if size == 4:
    w = jax.lax.bitcast_convert_type(x, jnp.uint32)
  elif size == 8:
    w = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
  elif size == 2:
    w = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  elif size == 1:
    w = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
  else:
    raise TypeError(f"no checksum for dtype {x.dtype}")
  return w.reshape(-1)


def _checksum(x: jax.Array) -> jax.Array:
  """[2] uint32: sum_i w_i * (i * m | 1) mod 2^32 for each multiplier m."""
  w = _words(x)
  i = jnp.arange(w.shape[0], dtype=jnp.uint32)
  return jnp.stack([jnp.sum(w * ((i * jnp.uint32(m)) | jnp.uint32(1)), dtype=jnp.uint32)
                    for m in _MULTIPLIERS])


@jax.jit
def _checksums(leaves: list[jax.Array]) -> list[jax.Array]:
  return [_checksum(x) for x in leaves]


def checksums(tree: Any) -> dict[str, str]:
  """{tree path: 16 hex digits} for every array of `tree` (sharded or not); the same on every process."""
  paths_leaves = jax.tree_util.tree_leaves_with_path(tree)
  sums = jax.device_get(_checksums([leaf for _, leaf in paths_leaves]))
  return {jax.tree_util.keystr(p): "".join(f"{int(v):08x}" for v in np.asarray(s))
          for (p, _), s in zip(paths_leaves, sums, strict=True)}


def verify(tree: Any, expected: dict[str, str] | None) -> None:
  """Raises ValueError naming the first array whose checksum differs from the one saved with it (a missing
  record, from a checkpoint written before checksums existed, is not checked)."""
  if not expected:
    return
  got = checksums(tree)
  for path, value in got.items():
    if path in expected and expected[path] != value:
      raise ValueError(f"checksum mismatch in {path}: the checkpoint's bytes changed after it was written")
  missing = sorted(set(expected) - set(got))
  if missing:
    raise ValueError(f"arrays missing from the restored state: {', '.join(missing[:3])}")
