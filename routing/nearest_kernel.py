"""Combiner-routed's routing decision on one Pallas kernel: each token's nearest centroid to its layer-normed
query and key together (`routing.attention.nearest_assignments`' ids), without the [batch, heads, clusters, L]
float32 scores or the layer-normed copies of q and k in HBM.

One program per (batch row, block of heads, tile of positions) reads its tiles of q and k in the op
contract's layout (on TPU [tile, 8 heads, head_dim] blocks, each head's rows loaded strided from VMEM in
steps of 128 positions; on GPUs one head per program, [tile, head_dim] read strided from HBM), layer-norms
them in float32, takes the scores of every centroid against both ([clusters, tile], float32-accumulating
dots, clusters on sublanes) and writes their sum's argmax (the first maximum, as `jnp.argmax`): lane-dense
int32 rows. With `sides` it also writes each score's own argmax, the query-only and key-only assignments a
model's k-means update uses (`models.routing_attention`), from the same scores. The same kernel runs on TPU
(Mosaic), GPU (Triton: clusters padded to a power of two of at least 16 rows, the padding scored -inf) and
CPU (interpret mode). The dots run at each compiler's precision, so a token whose two best centroids score
within rounding of each other may go either way, on the kernel as between XLA programs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from attention_core import contract, pallas
from attention_core.norm import layer_norm

Array = Any
TILE = 1024  # positions per program at most: its [clusters, TILE] float32 scores take 1 MiB at 256 clusters
VMEM_BUDGET = 6 << 20  # TPU: bytes of q and k blocks per program, double-buffered (sublanes padded)
HEAD_BLOCK = 8  # TPU: heads per program (all of them when 8 does not divide the heads)
STEP = 128  # TPU: positions per loop step inside a program (a long straight-line body compiles slowly)
GPU_TILE = 128  # positions per Triton program: [clusters, 128] float32 scores in registers
GPU_MIN_ROWS = 16  # Triton's smallest dot dimension


def supported(q: Array, platform: str) -> bool:
  """Whether the kernel serves q [batch, length, heads, head_dim] on `platform` (Triton needs a
  power-of-two head_dim of at least 16)."""
  d = int(q.shape[-1])
  return platform != "gpu" or (d >= GPU_MIN_ROWS and d & (d - 1) == 0)


def _tile(length: int, per_head: bool, block_bytes: int) -> int:
  """Positions per program: a power of two on GPUs (Triton's blocks); on TPU a whole row or a multiple of
  128 lanes, its q and k blocks (double-buffered) within VMEM_BUDGET."""
  if per_head:
    return min(GPU_TILE, max(GPU_MIN_ROWS, 1 << (length - 1).bit_length()))
  tile = TILE
  while tile > 128 and 4 * tile * block_bytes > VMEM_BUDGET:
    tile //= 2
  return length if length <= tile else tile


def _first_max(s: Array, clusters: int) -> Array:
  """s: [rows >= clusters, tile] scores -> [1, tile] int32: the first row of the maximum among the first
  `clusters` (a NaN column: its first NaN row, clamped into range)."""
  row = lax.broadcasted_iota(jnp.int32, s.shape, 0)
  s = jnp.where(row < clusters, s, -jnp.inf)
  best = jnp.max(s, axis=0, keepdims=True)  # [1, tile]
  first = jnp.min(jnp.where((s == best) | (s != s), row, clusters), axis=0, keepdims=True)  # NaN: its own
  return jnp.minimum(first, clusters - 1)


def _nearest(q: Array, k: Array, c: Array, clusters: int, sides: bool) -> list[Array]:
  """q, k: [tile, d]; c: [rows >= clusters, d] -> [1, tile] int32 nearest centroids: to the query and key
  together, and with `sides` also to the query alone and the key alone."""
  qn = layer_norm(q)  # [tile, d] float32 (float64 inputs stay float64)
  kn = layer_norm(k)
  c = c.astype(qn.dtype)
  sq, sk = pallas.dot(c, qn, trans_b=True), pallas.dot(c, kn, trans_b=True)  # [rows, tile]
  both = _first_max(sq + sk, clusters)
  return [both, _first_max(sq, clusters), _first_max(sk, clusters)] if sides else [both]


def _kernel(q_ref, k_ref, c_ref, *o_refs, clusters: int, heads: int | None) -> None:
  """One head (GPU: q_ref, k_ref [tile, d], c_ref [rows, d], each o_ref [tile]) or a block of `heads` (TPU:
  [tile, heads, d], [heads, rows, d], [heads, tile]; each head's strided rows loaded from VMEM). o_refs: the
  joint ids, then (when given) the query-only and key-only ones."""
  sides = len(o_refs) > 1
  if heads is None:
    for o_ref, ids in zip(o_refs, _nearest(q_ref[...], k_ref[...], c_ref[...], clusters, sides), strict=True):
      o_ref[...] = ids[0]
    return
  tile = q_ref.shape[0]
  steps, rest = divmod(tile, STEP)

  def part(start: Any, size: int) -> None:  # positions start..start+size of every head in the block
    rows = pl.ds(start, size)
    for h in range(heads):
      ids = _nearest(q_ref[rows, h, :], k_ref[rows, h, :], c_ref[h], clusters, sides)
      for o_ref, x in zip(o_refs, ids, strict=True):
        o_ref[pl.ds(h, 1), rows] = x

  def step(i: Array, carry: Any) -> Any:
    part(pl.multiple_of(i * STEP, STEP), STEP)
    return carry

  if steps:
    lax.fori_loop(0, steps, step, 0)
  if rest:
    part(steps * STEP, rest)


def nearest(q: Array, k: Array, centroids: Array, *, platform: str | None = None,
            per_head: bool | None = None, sides: bool = False) -> Any:
  """ids [batch, length, heads] int32: argmax_c LN(q)·centroids[h, c] + LN(k)·centroids[h, c].

  q, k: [batch, length, heads, head_dim]; centroids: [heads, clusters, head_dim] (no gradient flows).
  platform: the one the call is lowered for (default: the traced platform, `contract.backend()`).
  per_head: the GPU layout, one head per program (default: on GPUs only; the tests run it interpreted).
  sides: also the query's and the key's own nearest centroids, as the k-means updates use them: returns
  (ids, q_ids [batch, heads, length], k_ids [batch, heads, length]) from the same scores."""
  platform = platform or contract.backend()
  per_head = platform == "gpu" if per_head is None else per_head
  batch, length, heads, d = q.shape
  clusters = int(centroids.shape[1])
  q, k = lax.stop_gradient(q), lax.stop_gradient(k)
  c = lax.stop_gradient(centroids).astype(jnp.float32 if q.dtype != jnp.float64 else q.dtype)
  rows = clusters
  if per_head:  # one head per program: Triton reads its strided [tile, d] rows
    rows = max(GPU_MIN_ROWS, 1 << (clusters - 1).bit_length())
    c = jnp.pad(c, ((0, 0), (0, rows - clusters), (0, 0)))
    hb, tok_block, c_block, o_block = None, (None, None), (None, rows, d), (None, None)
  else:  # a block of heads per program: Mosaic's blocks keep [heads, d] whole in their last two dimensions
    hb = HEAD_BLOCK if heads % HEAD_BLOCK == 0 else heads
    tok_block, c_block, o_block = (None, hb), (hb, rows, d), (None, hb)
  sublanes = 32 // q.dtype.itemsize  # a TPU tile's rows of this dtype: a block of heads pads to them
  tile = _tile(length, per_head, -(-(hb or 1) // sublanes) * sublanes * d * q.dtype.itemsize)
  grid = (batch, heads // (hb or 1), pl.cdiv(length, tile))
  tok = pl.BlockSpec((tok_block[0], tile, tok_block[1], d), lambda b, h, i: (b, i, h, 0))
  outs = 3 if sides else 1
  ids = pallas.platform_call(
      lambda *refs: _kernel(*refs, clusters=clusters, heads=hb),
      gpu_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      tpu_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
      platform=platform, grid=grid,
      in_specs=[tok, tok, pl.BlockSpec(c_block, lambda b, h, i: (h, 0, 0))],
      out_specs=[pl.BlockSpec((*o_block, tile), lambda b, h, i: (b, h, i))] * outs,
      out_shape=[jax.ShapeDtypeStruct((batch, heads, length), jnp.int32)] * outs, name="routing_nearest",
  )(q, k, c)
  both = ids[0].transpose(0, 2, 1)  # [batch, length, heads]
  return (both, ids[1], ids[2]) if sides else both
