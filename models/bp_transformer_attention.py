"""BP-Transformer attention module: projections + `attention_baselines.bp_transformer` over the tokens and
the span nodes of the binary partition, with the paper's relative position vectors.

Name `bp_transformer`, causal and bidirectional. The paper's graph updates every node at every layer, so the
model carries the n - 1 span-node states through all blocks beside the tokens: the module declares
`GRAPH_NODES = SpanNodes`, and `models.transformer.Encoder` then appends the span nodes' initial states to the
token states before the first block (`SpanNodes`) and drops them after the last; the blocks' layer norms,
residuals and MLPs apply to them as to the tokens, and this module projects queries, keys and values of every
node with the same weights and calls the op with `graph=True`.

Span node initial state (a choice; the paper does not pin it down): the mean of its real tokens' embedded
inputs (token + position embeddings) plus a learned vector per level.

The module owns per layer the relative vectors added to the keys (zeros at first):
  rel_self              [heads, head_dim]          a token reading itself;
  rel_left, rel_right   [heads, T, k, head_dim]    the m-th nearest context node of level l on each side
                                                   (rel_right in bidirectional models only);
  rel_anc               [heads, T, head_dim]       a span node of level l reading its tokens (row l - 1);
T = log2 n at the model's sequence length (`seq_len`); longer sequences share the last row. `context` (k,
plan parameter) is fixed at construction. Config fields besides `name`, `params`, `dropout_rate`:
`recompute`, `seq_len`. No cached decoder: a decoding step would have to carry the span nodes that complete
at each position through every block (docs/design.md).
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import ml_collections
from flax import nnx

from attention_baselines.bp_transformer import span_offset, tokens_in_graph, tree_size
from attention_core import registry as ops_registry
from attention_core import sharding
from models import attention, layers, recompute

Array = Any


def num_levels(seq_len: int) -> int:
  """T: the tree's span levels at `seq_len` tokens (at least 1)."""
  return max(1, tree_size(seq_len).bit_length() - 1)


class SpanNodes(nnx.Module):
  """The span nodes' initial states: x [batch, L, features] (embedded tokens), mask [batch, L] or None ->
  [tokens; span nodes] [batch, L + n - 1, features] and its mask [batch, L + n - 1] (a span node is real when
  it covers a real token)."""

  def __init__(self, features: int, seq_len: int, *, dtype: Any, rngs: nnx.Rngs):
    self.dtype = dtype
    self.level = layers.param(rngs, nnx.initializers.normal(0.02), (num_levels(seq_len), features),
                              (None, "embed"))

  def __call__(self, x: Array, mask: Array | None) -> tuple[Array, Array]:
    batch, length, features = x.shape
    n = tree_size(length)
    real = jnp.ones((batch, length), bool) if mask is None else mask.astype(bool)
    real_n = jnp.pad(real, [(0, 0), (0, n - length)])  # [batch, n]
    xs = jnp.pad(x, [(0, 0), (0, n - length), (0, 0)])
    xs = jnp.where(real_n[..., None], xs, 0)  # [batch, n, features]; padding inert
    table = self.level[...]
    nodes, node_real = [x], [real]
    for lvl in range(1, n.bit_length()):
      size = 1 << lvl
      count = real_n.reshape(batch, n // size, size).sum(-1)  # [batch, n / size]
      total = xs.reshape(batch, n // size, size, features).sum(2)  # [batch, n / size, features]
      mean = total / jnp.maximum(count, 1)[..., None].astype(x.dtype)
      nodes.append((mean + table[min(lvl, table.shape[0]) - 1]).astype(x.dtype))
      node_real.append(count > 0)
    return jnp.concatenate(nodes, axis=1), jnp.concatenate(node_real, axis=1)  # [batch, L + n - 1, ...]

  @staticmethod
  def tokens(x: Array) -> Array:
    """[tokens; span nodes] [batch, L + n - 1, features] -> the tokens [batch, L, features]."""
    return x[:, :tokens_in_graph(x.shape[1])]

  @staticmethod
  def span_index(length: int, level: int, j: int) -> int:
    """Where span node (level, j) of L = `length` tokens sits in the [tokens; span nodes] sequence."""
    return length + span_offset(tree_size(length), level) + j


class BPTransformerAttention(attention.OpAttention):
  """Projections + BP-Transformer graph attention over [tokens; span nodes], learned relative vectors."""

  FIELDS = {"recompute": attention.RECOMPUTE, "seq_len": attention.SEQ_LEN}
  GRAPH_NODES = SpanNodes

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    plan = attention.resolve_plan_params(ops_registry.get(self.op_name), self.plan_params, 1)
    context = plan["context"]
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
      raise ValueError(f"attention 'bp_transformer': params.context must be a positive int, got {context!r}")
    self.plan_params["context"] = context
    t = num_levels(self.seq_len(config, "size the relative position tables"))
    zeros = nnx.initializers.zeros
    self.rel_self = layers.param(rngs, zeros, (num_heads, head_dim), ("heads", "kv"))
    self.rel_left = layers.param(rngs, zeros, (num_heads, t, context, head_dim), ("heads", None, None, "kv"))
    self.rel_right = None if causal else layers.param(rngs, zeros, (num_heads, t, context, head_dim),
                                                      ("heads", None, None, "kv"))
    self.rel_anc = layers.param(rngs, zeros, (num_heads, t, head_dim), ("heads", None, "kv"))

  def op_kinds(self) -> dict[str, str]:
    return {n: sharding.HEADS for n in ("rel_self", "rel_left", "rel_right", "rel_anc")}

  def __call__(self, x: Array, mask: Array | None, *, deterministic: bool) -> Array:
    """x: [batch, L + n - 1, features], the tokens then the span nodes (`SpanNodes`); mask over the same."""
    q, k, v = self.project(x)  # [batch, nodes, heads, head_dim]
    params = dict(self.plan_params, graph=True)
    extra = {"rel_self": self.rel_self[...], "rel_left": self.rel_left[...], "rel_anc": self.rel_anc[...]}
    if self.rel_right is not None:
      extra["rel_right"] = self.rel_right[...]
    call = functools.partial(self.call_op, ops_registry.get(self.op_name).fn)
    if self.recompute:
      names = list(extra)

      def op(q, k, v, mask, *rest):
        return call(q, k, v, mask, **params, **dict(zip(names, rest, strict=True)))

      o = recompute.recompute_in_backward(op, q, k, v, mask, *extra.values())
    else:
      o = call(q, k, v, mask, **params, **extra)
    return self.output(o, deterministic=deterministic)  # [batch, nodes, features]
