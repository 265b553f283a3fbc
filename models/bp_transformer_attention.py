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
  rel_left, rel_right   [heads, T, k, head_dim]    slot m of a token's contextual nodes of level l on each
                                                   side (the op's partition of the context; rel_right in
                                                   bidirectional models only);
  rel_anc               [heads, T, head_dim]       a span node of level l reading its tokens (row l - 1);
T = log2 n at the model's sequence length (`seq_len`); longer sequences share the last row. `context` (k,
plan parameter) is fixed at construction. Config fields besides `name`, `params`, `dropout_rate`:
`recompute`, `seq_len`. Cached decoding (`decode_step`) carries, with each token, the span nodes that its
position completes through every block.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from attention_baselines.bp_transformer import (
  anc_label,
  label_of,
  relative_table,
  span_offset,
  token_neighbours,
  tokens_in_graph,
  tree_size,
)
from attention_core import contract, sharding
from attention_core import registry as ops_registry
from attention_core.combine import attend_zeros_hidden
from models import attention, layers

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

  def init_cache(self, batch: int, max_length: int) -> dict[str, Array]:
    """Cached decoding: the embedded token inputs so far [batch, n, features] (span nodes' initial states)."""
    return {"inputs": jnp.zeros((batch, tree_size(max_length), self.level.shape[1]), self.dtype)}

  def step(self, x: Array, cache: dict[str, Array], position: Array) -> tuple[Array, dict[str, Array]]:
    """x [batch, 1, features], the embedded token at `position` -> the initial states of the span nodes
    (l, position >> l), one per level l = 1..log2 n [batch, log2 n, features] (used where `position` completes
    the span: every token of it is then real), and the cache with x added."""
    inputs = cache["inputs"]
    inputs = jax.lax.dynamic_update_slice_in_dim(inputs, x.astype(inputs.dtype), position, 1)
    n, table, rows = inputs.shape[1], self.level[...], []
    for lvl in range(1, n.bit_length()):
      size = 1 << lvl
      span = jax.lax.dynamic_slice_in_dim(inputs, (position >> lvl) * size, size, axis=1)  # [b, size, f]
      rows.append(span.mean(1) + table[min(lvl, table.shape[0]) - 1])
    out = jnp.stack(rows, 1) if rows else inputs[:, :0]
    return out.astype(x.dtype), {"inputs": inputs}  # [batch, log2 n, features]

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

  def op_inputs(self, q: Array, k: Array, *, x: Array, mask: Array | None,
                params: dict[str, Any]) -> dict[str, Any]:
    """x: [batch, L + n - 1, features], the tokens then the span nodes (`SpanNodes`); mask over the same."""
    inputs = {"graph": True, "rel_self": self.rel_self[...], "rel_left": self.rel_left[...],
              "rel_anc": self.rel_anc[...]}
    if self.rel_right is not None:
      inputs["rel_right"] = self.rel_right[...]
    return inputs

  # Cached decoding. Each step takes the token at `position` and, after it, one row per level l = 1..log2 n:
  # the span node (l, position >> l), which is complete (and then stored) where position + 1 is a multiple of
  # 2^l; `models.transformer.Encoder` supplies their initial states (`SpanNodes.step`).
  def init_cache(self, batch: int, max_length: int) -> attention.LayerCache:
    """Every token's key and value [batch, n, heads, head_dim] and every span node's [batch, n - 1, ...], n =
    tree_size(max_length): the graph of the forward pass over `max_length` tokens."""
    if not self.causal:
      raise ValueError("attention 'bp_transformer': cached decoding needs a causal model")
    n = tree_size(max_length)
    z = lambda m: jnp.zeros((batch, m, self.num_heads, self.head_dim), self.dtype)  # noqa: E731
    return attention.LayerCache({"k": z(n), "v": z(n), "span_k": z(n - 1), "span_v": z(n - 1)}, max_length)

  def decode_step(self, x: Array, cache: attention.LayerCache,
                  position: Array) -> tuple[Array, attention.LayerCache]:
    """x: [batch, 1 + log2 n, features], the token at `position` then its span nodes (above) ->
    ([batch, 1 + log2 n, features], cache); the token row equals row `position` of the causal forward pass
    over `cache.max_length` tokens, a completed span node's row its span-node row there."""
    st = cache.state
    n = st["k"].shape[1]
    context = int(self.plan_params["context"])
    q, k, v = self.project(x)  # [batch, 1 + log2 n, heads, head_dim]
    ct = contract.softmax_dtype(q.dtype)
    scale = contract.logit_scale(self.head_dim)
    table, rows = relative_table(self.num_heads, self.head_dim, context, self.rel_self[...],
                                 self.rel_left[...], None, self.rel_anc[...], ct)  # [h, labels, d]
    put = lambda buf, row, at: jax.lax.dynamic_update_slice_in_dim(buf, row.astype(buf.dtype), at, 1)  # noqa: E731
    tk, tv = put(st["k"], k[:, :1], position), put(st["v"], v[:, :1], position)
    sk, sv, outs = st["span_k"], st["span_v"], []
    for lvl in range(1, n.bit_length()):  # span nodes: their 2^l tokens, all in the cache once complete
      size = 1 << lvl
      start = (position >> lvl) * size
      keys = jax.lax.dynamic_slice_in_dim(tk, start, size, axis=1).astype(ct)  # [b, size, h, d]
      vals = jax.lax.dynamic_slice_in_dim(tv, start, size, axis=1)
      vals = jnp.moveaxis(vals, 1, 2).astype(ct)  # [b, h, size, d]
      ql = q[:, lvl].astype(ct)  # [b, h, d]
      s = jnp.einsum("bhd,bthd->bht", ql, keys + table[:, anc_label(lvl, rows, context)])
      done = (position + 1) % size == 0
      outs.append(attend_zeros_hidden(s * scale, jnp.ones((1, 1, size), bool), vals, "bht,bhtd->bhd"))
      at = span_offset(n, lvl) + (position >> lvl)
      sk = jnp.where(done, put(sk, k[:, lvl:lvl + 1], at), sk)
      sv = jnp.where(done, put(sv, v[:, lvl:lvl + 1], at), sv)
    index, valid, kind, level, rank = token_neighbours(n, context, True)
    labels = label_of(kind, level, rank, rows, context)  # [n, S]
    idx, ok, lab = (jnp.asarray(a)[position] for a in (index, valid, labels))  # [S]
    node_k = jnp.concatenate([tk, sk, jnp.zeros_like(tk[:, :1])], axis=1)[:, idx].astype(ct)  # [b, S, h, d]
    node_v = jnp.concatenate([tv, sv, jnp.zeros_like(tv[:, :1])], axis=1)[:, idx].astype(ct)
    q0 = q[:, 0].astype(ct)  # [b, h, d]
    s = jnp.einsum("bhd,bshd->bhs", q0, node_k) + jnp.einsum("bhd,hld->bhl", q0, table)[:, :, lab]
    token = attend_zeros_hidden(s * scale, ok[None, None], jnp.moveaxis(node_v, 1, 2), "bhs,bhsd->bhd")
    o = jnp.stack([token] + outs, axis=1).astype(v.dtype)  # [b, 1 + log2 n, h, d]
    state = {"k": tk, "v": tv, "span_k": sk, "span_v": sv}
    return self.out(o), attention.LayerCache(state, cache.max_length)  # [b, 1 + log2 n, features]

  def prefill(self, x: Array, cache: attention.LayerCache) -> tuple[Array, attention.LayerCache]:
    raise ValueError("attention 'bp_transformer': the Encoder prefills a prompt one decoding step per token")
