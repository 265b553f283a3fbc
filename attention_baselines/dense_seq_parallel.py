"""Dense softmax attention with the sequence split over a mesh axis ("seq"): the context-parallel baseline.

Each device keeps its run of queries and all-gathers K, V and the mask (the collective the sequence-parallel
Combiner ops avoid, combiner/seq_parallel.py). The form `attention_baselines.registry` names for "dense".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attention_core import blocks, contract, sharding
from attention_core.combine import attend

Array = Any


def dense(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, mesh: Any = None,
          axis: str = sharding.SEQ_AXIS) -> Array:
  """Dense softmax attention, context-parallel: queries stay split along `axis`, K, V and the mask are
  all-gathered. The baseline whose communication the Combiner ops are compared with; equals
  `attention_baselines.dense`.
  """
  op = "attention_baselines.dense_seq_parallel.dense"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  contract.check_bool(causal, name="causal", op=op)
  mesh = sharding.resolve_mesh(mesh, axis, op)
  parts = int(mesh.shape[axis])
  batch, length, heads, _ = q.shape
  sharding.check_seq_length(length, parts, 1, op, "1")
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  scale = contract.logit_scale(q.shape[-1])

  def local(q, k, v, m):
    k_all, v_all = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))  # [b, L, h, d]
    m_all = jax.lax.all_gather(m, axis, axis=1, tiled=True)  # [batch, length]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(ct), k_all.astype(ct)) * scale  # [b, h, local, L]
    valid = m_all[:, None, None, :]
    if causal:
      q_pos = jax.lax.axis_index(axis) * q.shape[1] + jnp.arange(q.shape[1])
      valid = valid & (jnp.arange(k_all.shape[1])[None, :] <= q_pos[:, None])
    out = attend(logits, valid, v_all.astype(ct), "bhqk,bkhd->bhqd")  # [batch, heads, local, value_dim]
    return blocks.head_major(out).astype(v.dtype)

  spec, mspec = sharding.seq_specs(mesh, axis, batch, heads)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (mspec,), out_specs=spec)(q, k, v, mask)

