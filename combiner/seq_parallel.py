"""Sequence parallelism: one sequence split over the devices of a mesh axis ("seq") under `shard_map`.

Each device holds a contiguous run of L / P positions, a whole number of blocks. For Combiner-Fixed a query
needs its own block (local) and, from every other block, only that block's span summary: the pooled key
k̄_r and the in-span value ṽ_r, both computed where the block lives. So the one collective of the forward
pass is an all-gather of L / block_size summary rows per head (its transpose, a reduce-scatter of their
gradients, is the one of the backward pass); keys and values never cross devices. `dense` is the usual
context-parallel baseline to compare against (attention_baselines/dense_seq_parallel.py): it all-gathers K
and V. `sparse_fixed` is the same program with each block's summary position (its last key and value) for its
summary. The other plans' forms: combiner/seq_parallel_logsparse.py and combiner/seq_parallel_axial.py.

Batch is split over the "data" and "fsdp" axes and heads over "model" when the mesh has them (and they divide
evenly); the mesh axes are `Auto` ones, as training/mesh.py makes them.
`chunk_blocks` processes the local blocks a few at a time in a loop, forward and backward (an explicit
`custom_vjp` that recomputes each chunk and writes its gradients in place), so the live logits are
chunk x block x (block + L / block) per head instead of the whole local run's: what makes very long sequences
fit in memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attention_core import blocks, contract, sharding
from attention_core.combine import Piece, joint_softmax
from combiner.common import span_summaries
from combiner.fixed import block_direct_piece
from combiner.pooling import POOLINGS

Array = Any
def _slice(x: Array, start: Any, size: int) -> Array:
  """x[:, start:start + size] of a [batch, length, ...] array."""
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _put(x: Array, update: Array, start: Any, axis: int = 1) -> Array:
  """x with `update` written at `start` along `axis` (in place inside a loop)."""
  return jax.lax.dynamic_update_slice_in_dim(x, update.astype(x.dtype), start, axis=axis)


def _loop(body: Callable, length: int, chunk: int, init: Any, inputs: tuple[Array, ...]) -> Any:
  """carry = body(start, carry, *inputs) for start = 0, chunk, 2 chunk, ... < length (one call if no loop).

  The body slices its chunk out of `inputs`. They ride along as loop carries behind an optimization barrier:
  as loop invariants, XLA:CPU would hoist the float32 casts it gives bfloat16 slices out of the loop, i.e.
  keep whole-run float32 copies. The initial carry is marked as varying over the mesh axes the inputs vary
  over (shard_map's type of per-device values), as the carries the body returns are.
  """
  if chunk >= length:
    return body(0, init, *inputs)
  axes = set().union(*(_varying_axes(x) for x in inputs))

  def varying(x):
    missing = tuple(sorted(axes - _varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  def step(i, state):
    carry, xs = state
    xs = jax.lax.optimization_barrier(xs)
    return body(i * chunk, carry, *xs), xs

  return jax.lax.fori_loop(0, length // chunk, step, (jax.tree.map(varying, init), tuple(inputs)))[0]


def _varying_axes(x: Array) -> set[str]:
  """The manual mesh axes along which a value inside `shard_map` differs between devices."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return set(mat.varying if mat is not None else getattr(aval, "vma", ()))


class _Plan(NamedTuple):
  """The static parameters of one device's part of `fixed`."""

  size: int  # block size
  causal: bool
  pooling: str | None  # None: sparse Fixed (each block's last position stands for it)
  axis: str  # the sequence mesh axis
  chunk: int  # positions per loop step (a whole number of blocks)
  scale: float
  dtype: Any  # softmax dtype
  pools: tuple[str, ...]  # which of "pool_q", "pool_k" are given as extra inputs


def _blocks(plan: _Plan, x: Array) -> Array:
  """[batch, n * size, heads, dim] -> [batch, heads, n, size, dim] in the softmax dtype."""
  return blocks.to_grid(blocks.head_major(x.astype(plan.dtype)), x.shape[1] // plan.size, plan.size, 2)


def _summaries(plan: _Plan, q: Array, k: Array, v: Array, m: Array, *pooled: Array) -> tuple[Array, ...]:
  """Span summaries of a run of whole blocks: k_bar [b, h, n, d], v_tilde [b, h, n, dv], nonempty [b, 1, n].
  """
  given = dict(zip(plan.pools, pooled, strict=True))
  kb = _blocks(plan, k)
  if plan.pooling is None:  # sparse: each block's summary position, its last (masked keys zeroed)
    last = blocks.to_grid(m, m.shape[1] // plan.size, plan.size, 1)[:, None, :, -1]  # [batch, 1, n]
    k_sum, v_sum = (jnp.where(last[..., None], t[:, :, :, -1], 0) for t in (kb, _blocks(plan, v)))
    return k_sum, v_sum, last  # [batch, heads, n, dim], [batch, heads, n, value_dim], [batch, 1, n]
  pkb = _blocks(plan, given["pool_k"]) if "pool_k" in given else kb
  mb = blocks.to_grid(m, m.shape[1] // plan.size, plan.size, 1)[:, None]  # [batch, 1, n, size]
  return span_summaries(_blocks(plan, given.get("pool_q", q)), pkb, kb, _blocks(plan, v), mb, plan.scale,
                        plan.pooling)


def _attend(plan: _Plan, q: Array, k: Array, v: Array, m: Array, k_all: Array, v_all: Array, ne_all: Array,
            first_block: Any) -> Array:
  """Output [batch, n * size, heads, value_dim] (softmax dtype) of a run of whole query blocks whose first
  block has global index `first_block`: own block directly, every other block through the gathered summaries.
  """
  qb, kb, vb = _blocks(plan, q), _blocks(plan, k), _blocks(plan, v)
  n = qb.shape[2]
  mb = blocks.to_grid(m, n, plan.size, 1)[:, None]  # [batch, 1, n, size]
  direct = block_direct_piece(qb, kb, vb, mb, plan.scale, plan.causal)
  blk = first_block + jnp.arange(n)  # global index of each query block
  spans_r = jnp.arange(k_all.shape[2])
  other = (spans_r[None, :] < blk[:, None]) if plan.causal else (spans_r[None, :] != blk[:, None])
  logits = jnp.einsum("bhnqd,bhrd->bhnqr", qb, k_all) * plan.scale  # [batch, heads, n, size, blocks]
  valid = other[:, None, :] & ne_all[:, :, None, None, :]
  spans = Piece(logits, valid, lambda w: jnp.einsum("bhnqr,bhrd->bhnqd", w, v_all))
  out = joint_softmax([direct, spans])  # [batch, heads, n, size, value_dim]
  return blocks.head_major(blocks.from_grid(out, n * plan.size, 2))


def _forward(plan: _Plan, q: Array, k: Array, v: Array, m: Array, *pooled: Array) -> tuple[Array, tuple]:
  """One device's run [batch, local_length, heads, dim] -> its output, and the gathered summaries."""
  batch, length, heads, _ = q.shape
  n_blocks = length // plan.size
  init = (jnp.zeros((batch, heads, n_blocks, k.shape[-1]), plan.dtype),
          jnp.zeros((batch, heads, n_blocks, v.shape[-1]), plan.dtype), jnp.zeros((batch, 1, n_blocks), bool))

  def summarize(start, acc, *xs):
    new = _summaries(plan, *(_slice(x, start, plan.chunk) for x in xs))
    return tuple(_put(a, y, start // plan.size, axis=2) for a, y in zip(acc, new, strict=True))

  k_bar, v_tilde, nonempty = _loop(summarize, length, plan.chunk, init, (q, k, v, m, *pooled))
  # The only communication: every block's summary, L / block_size rows per head.
  k_all, ne_all, v_all = (jax.lax.all_gather(y, plan.axis, axis=2, tiled=True)
                          for y in (k_bar, nonempty, v_tilde))
  first = jax.lax.axis_index(plan.axis) * n_blocks  # global index of this device's first block

  def attend_chunk(start, out, *xs):
    chunk_in = (_slice(x, start, plan.chunk) for x in xs)
    o = _attend(plan, *chunk_in, k_all, v_all, ne_all, first + start // plan.size)
    return _put(out, o, start)

  out = _loop(attend_chunk, length, plan.chunk, jnp.zeros((*q.shape[:3], v.shape[-1]), v.dtype), (q, k, v, m))
  return out, (k_all, v_all, ne_all)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _local(plan: _Plan, q: Array, k: Array, v: Array, m: Array, *pooled: Array) -> Array:
  return _forward(plan, q, k, v, m, *pooled)[0]


def _local_fwd(plan: _Plan, q: Array, k: Array, v: Array, m: Array, *pooled: Array) -> tuple[Array, tuple]:
  out, gathered = _forward(plan, q, k, v, m, *pooled)
  return out, (q, k, v, m, pooled, gathered)


def _local_bwd(plan: _Plan, res: tuple, g: Array) -> tuple:
  """Backward pass chunk by chunk: recompute each chunk's attention and take its vjp (direct gradients, and
  the summaries' gradients summed over chunks), reduce-scatter the summaries' gradients to the devices that
  own the blocks, then add each chunk's summary vjp in place. Only one chunk's intermediates are ever alive.
  """
  q, k, v, m, pooled, (k_all, v_all, ne_all) = res
  length, size, chunk = q.shape[1], plan.size, plan.chunk
  first = jax.lax.axis_index(plan.axis) * (length // size)

  def attend_grads(start, carry, q, k, v, m, g):
    dq, dk, dv, dk_all, dv_all = carry
    m_c, g_c = _slice(m, start, chunk), _slice(g, start, chunk).astype(plan.dtype)

    def f(q_c, k_c, v_c, ka, va):
      return _attend(plan, q_c, k_c, v_c, m_c, ka, va, ne_all, first + start // size)

    _, vjp = jax.vjp(f, *(_slice(x, start, chunk) for x in (q, k, v)), k_all, v_all)
    gq, gk, gv, gka, gva = vjp(g_c)
    return _put(dq, gq, start), _put(dk, gk, start), _put(dv, gv, start), dk_all + gka, dv_all + gva

  init = tuple(jnp.zeros_like(x) for x in (q, k, v, k_all, v_all))
  dq, dk, dv, dk_all, dv_all = _loop(attend_grads, length, chunk, init, (q, k, v, m, g))
  # Transpose of the all-gather: every device's contributions to a block's summary, summed where it lives.
  dk_bar, dv_tilde = (jax.lax.psum_scatter(y, plan.axis, scatter_dimension=2, tiled=True)
                      for y in (dk_all, dv_all))

  def summary_grads(start, grads, m, *xs):
    m_c = _slice(m, start, chunk)

    def f(*xs):
      k_bar, v_tilde, _ = _summaries(plan, *xs[:3], m_c, *xs[3:])
      return k_bar, v_tilde

    _, vjp = jax.vjp(f, *(_slice(x, start, chunk) for x in xs))
    cot = tuple(jax.lax.dynamic_slice_in_dim(y, start // size, chunk // size, axis=2)
                for y in (dk_bar, dv_tilde))
    return tuple(_put(d, _slice(d, start, chunk).astype(plan.dtype) + gd, start)
                 for d, gd in zip(grads, vjp(cot), strict=True))

  grads = _loop(summary_grads, length, chunk, (dq, dk, dv, *(jnp.zeros_like(x) for x in pooled)),
                (m, q, k, v, *pooled))
  return (*grads[:3], None, *grads[3:])


_local.defvjp(_local_fwd, _local_bwd)


def fixed(q: Array, k: Array, v: Array, *, block_size: int, causal: bool, mask: Array | None = None,
          pooling: str = "max", pool_q: Array | None = None, pool_k: Array | None = None, select: int = 0,
          query_chunks: int | None = None, mesh: Any = None, axis: str = sharding.SEQ_AXIS,
          chunk_blocks: int | None = None) -> Array:
  """Combiner-Fixed with the sequence split over mesh axis `axis`; equals `combiner.fixed` (same arguments).

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; length must be a multiple of
  (devices along `axis`) x block_size. chunk_blocks: blocks per step of the local computation (None = all);
  query_chunks (the one-device XLA path's query chunking) is taken and has nothing to chunk here. Selected
  spans (select > 0) have no sequence-parallel form.
  """
  op = "combiner.seq_parallel.fixed"
  contract.check_choice(pooling, name="pooling", allowed=POOLINGS, op=op)
  if select != 0:
    raise ValueError(f"{op}: select must be 0 (selected spans have no sequence-parallel form), "
                     f"got {select!r}")
  return _run(op, q, k, v, block_size=block_size, causal=causal, mask=mask, pooling=pooling, pool_q=pool_q,
              pool_k=pool_k, mesh=mesh, axis=axis, chunk_blocks=chunk_blocks)


def sparse_fixed(q: Array, k: Array, v: Array, *, block_size: int, causal: bool, mask: Array | None = None,
                 mesh: Any = None, axis: str = sharding.SEQ_AXIS, chunk_blocks: int | None = None) -> Array:
  """Sparse Transformer "fixed" with the sequence split over mesh axis `axis`; equals `combiner.sparse.fixed`.

  The same program as `fixed` with each block's summary position (its last key and value) in place of the
  pooled summary: the one collective is the all-gather of those L / block_size rows.
  """
  return _run("combiner.seq_parallel.sparse_fixed", q, k, v, block_size=block_size, causal=causal, mask=mask,
              pooling=None, pool_q=None, pool_k=None, mesh=mesh, axis=axis, chunk_blocks=chunk_blocks)


def _run(op: str, q: Array, k: Array, v: Array, *, block_size: int, causal: bool, mask: Array | None,
         pooling: str | None, pool_q: Array | None, pool_k: Array | None, mesh: Any, axis: str,
         chunk_blocks: int | None) -> Array:
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  contract.check_bool(causal, name="causal", op=op)
  size = contract.check_positive_int(block_size, name="block_size", op=op)
  if chunk_blocks is not None:
    chunk_blocks = contract.check_positive_int(chunk_blocks, name="chunk_blocks", op=op)
  mesh = sharding.resolve_mesh(mesh, axis, op)
  parts = int(mesh.shape[axis])
  batch, length, heads, _ = q.shape
  sharding.check_seq_length(length, parts, size, op, f"block_size {size}")
  local_blocks = length // (parts * size)
  if chunk_blocks is not None and local_blocks % chunk_blocks:
    raise ValueError(f"{op}: argument 'chunk_blocks' ({chunk_blocks}) must divide the {local_blocks} blocks "
                     "each device holds")
  # Pooled inputs other than q, k travel as extra arguments only when given (each one costs its own gradient).
  pools = {name: x for name, x in (("pool_q", pool_q), ("pool_k", pool_k)) if x is not None}
  for name, x in pools.items():
    if not hasattr(x, "shape") or tuple(x.shape) != tuple(q.shape):
      raise ValueError(f"{op}: argument {name!r} must be None or an array shaped like q {tuple(q.shape)}, "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
  chunk = size * (local_blocks if chunk_blocks is None else chunk_blocks)
  plan = _Plan(size, bool(causal), pooling, axis, chunk, contract.logit_scale(q.shape[-1]),
               contract.softmax_dtype(q.dtype, k.dtype, v.dtype), tuple(pools))
  spec, mspec = sharding.seq_specs(mesh, axis, batch, heads)
  in_specs = (spec,) * 3 + (mspec,) + (spec,) * len(pools)
  return jax.shard_map(functools.partial(_local, plan), mesh=mesh, in_specs=in_specs, out_specs=spec)(
      q, k, v, mask, *pools.values())

