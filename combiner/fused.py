"""The Combiner plans and their sparse counterparts on the Pallas kernel of `combiner.flash`.

Each plan becomes a few `flash.attend` calls on two layouts of the same tensors, merged by log-sum-exp:
  fixed:      groups = blocks; sources = own block (causal "le") + the pooled span summaries (shared, "lt"/"ne"
              by block index).
  axial:      row-major layout (groups = rows) and column-major layout (groups = columns, q transposed):
              own row ("le"), own column minus the query ("lt"/"ne" by row index), and the span family:
              rowmajor summaries are read column-major (its in-span value depends on the query's column),
              vertical ones row-major, horizontal ones column-major.
  mixture:    the axial pieces, merged once per plan ("mean") or all at once ("joint").
The span summaries' in-span expectations are themselves flash calls (a pooled query against its span's keys),
so no [L, sqrt(L)] logits exist; pooling (max/mean, prefix scans) stays in XLA at O(L·d).

Semantics are those of the XLA plans: the same pooling, masks, padding and empty-span rules; matmul inputs keep
the caller's 16-bit dtype (float32 otherwise), softmax statistics are float32.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from combiner import common, flash
from combiner import pooling as pool_ops
from combiner.combine import attend as xla_attend

Array = Any


def _kernel_dtype(*arrays: Array) -> Any:
  dt = jnp.result_type(*(a.dtype for a in arrays))
  return dt if jnp.dtype(dt).itemsize < 4 else jnp.float32


def _bh(x: Array) -> Array:
  """[batch, heads, groups, n, dim] -> [batch * heads, groups, n, dim]."""
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _unbh(x: Array, batch: int) -> Array:
  return x.reshape(batch, x.shape[0] // batch, *x.shape[1:])


def _direct_rule(causal: bool) -> str:
  return "le" if causal else "all"


def _other_rule(causal: bool) -> str:
  return "lt" if causal else "ne"


def fixed(x: common.Inputs, size: int, causal: bool, pooling: str | None, dtype: Any) -> Array:
  """Combiner-Fixed (pooling = "max"/"mean") or Sparse-Fixed (pooling None: each block's last position)."""
  batch, heads, length, _ = x.q.shape
  blocks = common.num_blocks(length, size)
  qb, kb, vb = (common.to_grid(t, blocks, size, 2) for t in (x.q, x.k, x.v))  # [b, heads, blocks, size, d]
  mb = common.to_grid(x.mask, blocks, size, 1)  # [batch, blocks, size]
  if pooling is None:
    k_sum, v_sum, ok_sum = kb[:, :, :, -1], vb[:, :, :, -1], mb[:, :, -1]
  else:
    pqb, pkb = (common.to_grid(t, blocks, size, 2) for t in (x.pool_q, x.pool_k))
    k_sum, ok_sum = pool_ops.pool(pkb, mb[:, None], axis=3, kind=pooling)  # [b, heads, blocks, d], [b, 1, blocks]
    q_bar, _ = pool_ops.pool(pqb, mb[:, None], axis=3, kind=pooling)
    span_logits = jnp.einsum("bhrd,bhrkd->bhrk", q_bar, kb) * x.scale  # [batch, heads, blocks, size]
    v_sum = xla_attend(span_logits, mb[:, None], vb, "bhrk,bhrkd->bhrd")  # [batch, heads, blocks, value_dim]
    ok_sum = ok_sum[:, 0]
  sources = [
      flash.Source(_bh(kb).astype(dtype), _bh(vb).astype(dtype), mb, _direct_rule(causal), "row"),
      flash.Source(_bh(k_sum[:, :, None]).astype(dtype), _bh(v_sum[:, :, None]).astype(dtype), ok_sum[:, None],
                   _other_rule(causal), "group"),
  ]
  out, _ = flash.attend(_bh(qb).astype(dtype), sources, heads=heads, scale=x.scale)  # [bh, blocks, size, dv]
  return common.finish(common.from_grid(_unbh(out, batch), length, 2), x)
