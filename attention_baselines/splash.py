"""Splash attention (JAX's block-sparse flash kernel for TPU) under the op contract, for static patterns.

`dense`, `local` and `longformer` run it on TPU: their patterns (causal, blocks, a sliding window with global
tokens) are known at trace time, so Splash skips every key tile the pattern leaves empty and computes the
pattern inside the tiles it visits (`Pattern.allows`, its in-kernel mask function). The key mask [batch, L]
rides as Splash's segment ids (every query in segment 1, real keys 1, masked keys 0), and lengths are padded
to whole tiles with masked keys.

The contract's guarantees are kept around the kernel, which multiplies zero weights with values: masked and
non-finite keys and values are selected to zero before it, and every query that sees a non-finite key or
value (over the pattern and the key mask) is set to NaN after it, as in the XLA paths; queries that see no
real key return zeros. Both reaches are interval sums over the pattern (`Pattern.key_ranges`), O(L) per row.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from attention_core import contract

Array = Any

DTYPES = ("bfloat16", "float32")  # Mosaic rejects float16 loads; float64 has no TPU kernel
TILE = 128  # Splash's smallest sequence tile: lengths are padded to a multiple (masked keys)
MAX_TILE = 512
MAX_GLOBALS = 8  # global positions are compared one by one inside the kernel


@dataclasses.dataclass(frozen=True)
class Pattern:
  """A static attention pattern: which key j query i may see, before the key mask.

  causal: j <= i. block > 0: only i's own block of `block` positions (local attention). window > 0: only
  |i - j| <= window, except for `global_positions`, which see every key and are seen by every query (the
  causal cut still applies). block and window 0: every key (dense)."""

  causal: bool
  block: int = 0
  window: int = 0
  global_positions: tuple[int, ...] = ()

  def allows(self, q_ids: Any, kv_ids: Any) -> Any:
    """Bool mask for broadcastable int arrays of query and key positions (numpy, or jnp in the kernel)."""
    seen = q_ids >= kv_ids if self.causal else None
    local = None
    if self.block:
      local = _quotient(q_ids, self.block) == _quotient(kv_ids, self.block)
    elif self.window:
      local = (kv_ids >= q_ids - self.window) & (kv_ids <= q_ids + self.window)
      for g in self.global_positions:
        local = local | (kv_ids == g) | (q_ids == g)
    if local is None:
      return seen if seen is not None else (q_ids >= 0) | (kv_ids >= 0)  # every pair
    return local if seen is None else seen & local

  def key_ranges(self, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) [length] int: the contiguous keys lo <= j < hi that query i may see besides the global keys
    (a global query's range is all of them)."""
    i = np.arange(length)
    lo, hi = np.zeros(length, np.int64), np.full(length, length, np.int64)
    if self.block:
      lo = i // self.block * self.block
      hi = np.minimum(lo + self.block, length)
    elif self.window:
      lo = np.maximum(i - self.window, 0)
      hi = np.minimum(i + self.window + 1, length)
      g = np.asarray(self.global_positions, np.int64)
      lo[g], hi[g] = 0, length
    if self.causal:
      hi = np.minimum(hi, i + 1)
    return lo, hi

  def reaches(self, flags: Array) -> Array:
    """flags [batch, length, heads] bool (per key) -> [batch, length, heads] bool: whether query i sees a
    flagged key under the pattern."""
    length = flags.shape[1]
    lo, hi = self.key_ranges(length)
    prefix = jnp.pad(jnp.cumsum(flags.astype(jnp.int32), axis=1), ((0, 0), (1, 0), (0, 0)))  # [b, L + 1, h]
    hit = (prefix[:, hi] - prefix[:, lo]) > 0  # [batch, length, heads]
    if self.window:
      for g in self.global_positions:
        visible = np.arange(length) >= g if self.causal else np.ones(length, bool)  # [length]
        hit = hit | (flags[:, g:g + 1] & visible[None, :, None])
    return hit


def _quotient(ids: Any, divisor: int) -> Any:
  """ids // divisor for non-negative ids: numpy's, or in the kernel a truncating division (Mosaic lowers
  jnp's floor division through a sign that needs the TPU's generation, unknown to an export)."""
  return ids // divisor if isinstance(ids, np.ndarray) else lax.div(ids, jnp.int32(divisor))


class _PatternMask(splash_mask._ComputableMask):  # noqa: SLF001  (Splash's own masks subclass it)
  """A `Pattern` over a padded length as a Splash mask computed in the kernel.

  Splash reads the mask tile by tile on the host to find the empty and the full tiles (a Python loop over
  every tile, three times: forward, dQ, dK/dV); a tile that the pattern's key ranges show to be empty or full
  is answered without evaluating it, which makes that loop several times faster at long lengths."""

  def __init__(self, pattern: Pattern, length: int):
    self.pattern = pattern
    self.lo, self.hi = pattern.key_ranges(length)  # [length] each
    super().__init__(shape=(length, length), mask_function=pattern.allows)

  def __getitem__(self, idx: Any) -> np.ndarray:
    rows, cols = idx
    if not (isinstance(rows, slice) and isinstance(cols, slice)):
      return super().__getitem__(idx)
    q0, q1, _ = rows.indices(self.shape[0])
    k0, k1, _ = cols.indices(self.shape[1])
    lo, hi = self.lo[q0:q1], self.hi[q0:q1]
    shape = (q1 - q0, k1 - k0)
    if np.all(lo <= k0) and np.all(hi >= k1):
      return _constant_tile(True, shape)
    globals_seen = [g for g in self.pattern.global_positions
                    if k0 <= g < k1 and (not self.pattern.causal or q1 - 1 >= g)]
    if not globals_seen and np.all((hi <= k0) | (lo >= k1)):
      return _constant_tile(False, shape)
    return super().__getitem__(idx)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _PatternMask) and (self.pattern, self.shape) == (other.pattern, other.shape)

  def __hash__(self) -> int:
    return hash((type(self), self.pattern, self.shape))


@functools.lru_cache(maxsize=16)
def _constant_tile(value: bool, shape: tuple[int, int]) -> np.ndarray:
  """A read-only contiguous tile of one value: numpy's any/all stop early on it (a broadcast view would be
  reduced element by element, ~100x slower)."""
  tile = np.full(shape, value)
  tile.flags.writeable = False
  return tile


def unsupported(q: Array, k: Array, v: Array, pattern: Pattern) -> str:
  """Why Splash cannot serve these inputs ("" when it can): q, k, v of one dtype in DTYPES, at most
  MAX_GLOBALS global positions."""
  names = {jnp.dtype(x.dtype).name for x in (q, k, v)}
  if len(names) != 1 or next(iter(names)) not in DTYPES:
    return f"Splash attention takes q, k, v all of one dtype in {DTYPES}, got {sorted(names)}"
  if len(pattern.global_positions) > MAX_GLOBALS:
    return (f"Splash attention here takes at most {MAX_GLOBALS} global positions, "
            f"got {len(pattern.global_positions)}")
  return ""


def tile(length: int, pattern: Pattern) -> int:
  """The sequence tile for a padded length: the largest power of two up to MAX_TILE dividing it, and no
  wider than the pattern's block or window (rounded up to TILE), whose wider tiles would be mostly empty."""
  cap = MAX_TILE
  reach = pattern.block or pattern.window
  if reach:
    cap = max(TILE, min(MAX_TILE, 1 << (reach - 1).bit_length()))
  size = TILE
  while size * 2 <= cap and length % (size * 2) == 0:
    size *= 2
  return size


def kernel(pattern: Pattern, length: int, heads: int, interpret: bool = False) -> Any:
  """The Splash kernel for a pattern over a padded length: [heads, length, d] q, k, v -> [heads, length, dv].
  Made per trace (it holds its tile lists as arrays); Splash caches the numpy mask preprocessing (which tiles
  to visit) per mask and tile."""
  size = tile(length, pattern)
  blocks = splash_kernel.BlockSizes(block_q=size, block_kv=size, block_kv_compute=size, block_q_dkv=size,
                                    block_kv_dkv=size, block_kv_dkv_compute=size, block_q_dq=size,
                                    block_kv_dq=size)
  if not (pattern.causal or pattern.block or pattern.window):
    head_mask = splash_mask.FullMask((length, length))
  else:
    head_mask = _PatternMask(pattern, length)
  return splash_kernel.make_splash_mha(splash_mask.MultiHeadMask([head_mask] * heads), block_sizes=blocks,
                                       head_shards=1, q_seq_shards=1, interpret=interpret)


def attention(q: Array, k: Array, v: Array, mask: Array | None, pattern: Pattern, *,
              interpret: bool = False) -> Array:
  """Softmax attention under `pattern` and the key mask through Splash (checked inputs, `unsupported` "").

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool or
  None (every key real). Returns [batch, length, heads, value_dim] in v's dtype."""
  batch, length, heads, head_dim = q.shape
  # Non-finite and masked keys and values are selected to zero (the kernel multiplies zero weights with
  # them); a real key with a non-finite entry is flagged, and the queries that see it return NaN below.
  finite = jnp.all(jnp.isfinite(k), axis=-1) & jnp.all(jnp.isfinite(v), axis=-1)  # [batch, length, heads]
  real = jnp.ones((batch, length, 1), bool) if mask is None else mask[:, :, None]  # [batch, length, 1]
  keep = (finite & real)[..., None]  # [batch, length, heads, 1]
  k, v = jnp.where(keep, k, 0), jnp.where(keep, v, 0)
  padded = -(-length // TILE) * TILE
  segments = None
  if mask is not None or padded != length:
    kv_ids = jnp.pad(real[..., 0], ((0, 0), (0, padded - length))).astype(jnp.int32)  # [batch, padded]
    segments = splash_kernel.SegmentIds(q=jnp.ones((batch, padded), jnp.int32), kv=kv_ids)
  scale = jnp.asarray(contract.logit_scale(head_dim), jnp.float32)
  q = (q.astype(jnp.float32) * scale).astype(q.dtype)  # Splash has no logit scale of its own
  pad = [(0, 0), (0, padded - length), (0, 0), (0, 0)]
  qh, kh, vh = (jnp.swapaxes(jnp.pad(t, pad), 1, 2) for t in (q, k, v))  # [batch, heads, padded, dim]
  run = kernel(pattern, padded, heads, interpret)
  rows = (qh, kh, vh) if segments is None else (qh, kh, vh, segments)

  def call(row: tuple[Array, ...]) -> Array:  # one batch row: [heads, padded, dim] each
    return run(*row[:3]) if segments is None else run(*row[:3], segment_ids=row[3])

  # One batched kernel on TPU; a program lowered for CPU (the TPU interpreter of `pallas.simulate`, which
  # does not run a batched Splash call) runs the rows one by one.
  out = lax.platform_dependent(rows, default=lambda rows: lax.map(call, rows),
                               tpu=lambda rows: jax.vmap(call)(rows))  # [batch, heads, padded, value_dim]
  out = jnp.swapaxes(out, 1, 2)[:, :length]  # [batch, length, heads, value_dim]
  sees_real = pattern.reaches(real)  # [batch, length, 1]: rows with no visible real key give zeros
  sees_bad = pattern.reaches(real & ~finite)  # [batch, length, heads]
  out = jnp.where(sees_real[..., None], out, 0)
  return jnp.where(sees_bad[..., None], jnp.nan, out).astype(v.dtype)


IMPLEMENTATIONS = ("auto", "xla", "splash")  # of the ops whose fused path is Splash alone (local, longformer)
IMPLEMENTATION_PLATFORMS = {"splash": ("tpu",)}  # where "splash" runs (registry.fused_path)


def choice(q: Array, k: Array, v: Array, *, implementation: Any = "auto", **_: Any) -> Any:
  """What such an op traces per platform (`contract.per_platform_op`'s key): for "auto" whether Splash
  serves its dtypes where it is traced; explicit choices (and bad arguments, which the op rejects) as
  given."""
  # Argument validation: malformed inputs take the one program where the op rejects them in its own words.
  if implementation != "auto" or not all(hasattr(x, "dtype") and len(getattr(x, "shape", ())) == 4
                                         for x in (q, k, v)):
    return implementation
  return contract.backend() == "tpu" and not unsupported(q, k, v, Pattern(causal=False))


def runs(q: Array, k: Array, v: Array, pattern: Pattern, implementation: str, *, op: str) -> bool:
  """Whether an op with IMPLEMENTATIONS runs Splash: "auto" on TPU where `unsupported` has no reason, "splash"
  there too (elsewhere a ValueError naming the reason), "xla" never."""
  contract.check_implementation(implementation, allowed=IMPLEMENTATIONS, op=op)
  if implementation == "xla":
    return False
  platform = contract.backend()
  reason = (unsupported(q, k, v, pattern) if platform == "tpu"
            else f"Splash attention runs on TPU, not {platform}")
  if reason and implementation == "splash":
    raise ValueError(f"{op}: argument 'implementation'='splash' does not apply here: {reason}; "
                     f"use 'auto' or 'xla'")
  return not reason
