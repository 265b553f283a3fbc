"""Compressive Transformer attention (Rae et al., 2019, arXiv 1911.05507): Transformer-XL attention over
[compressed memory; memory; segment] plus the compression of the memories that leave the FIFO.

Name `compressive` (decoders only; the op is `attention_baselines.transformer_xl`). With
`config.model.compressed_mem_len` = n_cm > 0, each layer's memory (models/transformer.py) holds a FIFO of
n_m = `mem_len` hidden states and a compressed FIFO of n_cm. When a segment of L enters, the L oldest of
[memory; segment] leave the FIFO (the evicted memories, [batch, L, features], stop-gradient); the encoder
asks this module for `compress(evicted)`, L / c states appended to the compressed FIFO (its oldest dropped).
The attention itself is `TransformerXLAttention` with the memory [compressed; memory]: relative distances
count the compressed slots as single positions, as the paper's concatenation does.

Compression functions f_c (field `compression`), over groups of c = `compression_rate` consecutive evicted
states (L must be a multiple of c); an invalid evicted state (a memory slot never filled since a reset)
counts nowhere, and a compressed slot is valid when one of its inputs is:
  max_pool / mean_pool  the max / mean of the group's valid states;
  conv                  a 1D convolution with kernel = stride = c, W [c, features, features] and a bias, the
                        invalid inputs read as zeros;
  dilated_conv          two residual dilated convolutions over the evicted block (kernel 2, dilations 1 and 2,
                        ReLU, zeros before the block and at invalid positions), then `conv`;
  most_used             the L / c valid evicted states that received the most attention, in their order. Usage
                        of evicted state j = sum over the segment's valid queries i of this layer's attention
                        probability p_ij (Transformer-XL logits, softmax over every key of [compressed;
                        memory; segment]), averaged over heads. The segment counted is the one that evicts
                        them; with mem_len = L (the paper's settings) it is the only one that read them.

The attention-reconstruction loss (learned compressions only): for the segment's queries h (the layer's
normed input, stop-gradient) and content attention attn(h, m) = softmax((h W_q)(m W_k)^T / sqrt(d)) (m W_v)
per head over the valid rows of m (normed like the keys), with W_q, W_k, W_v and the layer norm held fixed
(stop-gradient), the loss is
  weight * mean ||attn(h, evicted) - attn(h, f_c(evicted))||^2
(the mean over valid queries of rows with a valid evicted state, heads and head_dim), so its gradient reaches
only the compression parameters; the task loss never reaches them (the compressed memory is read with no
gradient in later segments). It is sown as a `loss_term` (docs/design.md section 5) in training calls.

Cached decoding (the paper's sampling; `decode_compressive`, called by the block with its raw input and
norm when the compressed memory is on): per layer a window of n_m + c block inputs with their keys, values,
validity and usage, and n_cm compressed slots (keys, values, validity). Each token attends over [compressed;
window] at the forward pass's relative distances; after every c tokens the c oldest window states are
compressed into one slot. Decoding therefore equals the model's segment recurrence with segments of c tokens
(memories of n_m and n_cm, empty at the start, position_embedding 'none') position by position. most_used is
exact too: a window state's usage is the attention mass it received from the queries of the group that evicts
it (accumulated while decoding that group, averaged over heads), the forward pass's usage with L = c. Without
a compressed memory decoding is Transformer-XL's (from position 0, no memory).

Config fields besides `name`, `params`, `dropout_rate`: `compression`, `compression_rate`,
`reconstruction_loss`, `recompute`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from attention_baselines.transformer_xl import clamped, rel_shift
from attention_core import contract
from attention_core import registry as ops_registry
from models import attention, layers
from models.transformer_xl_attention import TransformerXLAttention

Array = Any
COMPRESSIONS = ("max_pool", "mean_pool", "conv", "dilated_conv", "most_used")
LEARNED = ("conv", "dilated_conv")
RATE = 3  # the paper's enwik8 compression rate
DILATIONS = (1, 2)
NEG = -1e30  # a masked logit (finite: rows with no valid key stay NaN-free)


def frozen(module: nnx.Module) -> nnx.Module:
  """A copy of `module` whose parameters are stop-gradient (same values)."""
  graphdef, state = nnx.split(module)
  return nnx.merge(graphdef, jax.tree.map(jax.lax.stop_gradient, state))


def masked_softmax(logits: Array, valid: Array) -> Array:
  """softmax over the last axis restricted to `valid`; a row with no valid entry is zeros."""
  s = jnp.where(valid, logits, NEG)
  e = jnp.where(valid, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0)
  return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), jnp.finfo(e.dtype).tiny)


class CompressiveAttention(TransformerXLAttention):
  """Transformer-XL attention whose module also compresses evicted memories (`compress`)."""

  FIELDS = {
    "compression": attention.Field(str, f"the compression function, one of {list(COMPRESSIONS)} (None = "
                                   "conv)"),
    "compression_rate": attention.Field(int, f"c: evicted memories per compressed one (None = {RATE}); the "
                                        "segment length must be a multiple", minimum=1),
    "reconstruction_loss": attention.Field(float, "weight of the attention-reconstruction loss of learned "
                                           "compressions (None = 1)", minimum=0),
    "recompute": attention.RECOMPUTE,
  }
  CONTEXT = ("mem_len", "compressed_mem_len")
  COMPRESSES = True

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs, mem_len: int = 0, compressed_mem_len: int = 0):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    self.compression = str(config.get("compression", None) or "conv")
    if self.compression not in COMPRESSIONS:
      raise ValueError(f"config.model.attention.compression must be one of {list(COMPRESSIONS)}, got "
                       f"{self.compression!r}")
    rate = config.get("compression_rate", None)
    self.rate = RATE if rate is None else int(rate)
    weight = config.get("reconstruction_loss", None)
    self.loss_weight = 1.0 if weight is None else float(weight)
    conv = dict(in_axes=(None, "embed"), out_axes=(None,), dtype=dtype, rngs=rngs)
    if self.compression in LEARNED:
      self.conv = layers.DenseGeneral((self.rate, features), (features,), **conv)
    if self.compression == "dilated_conv":
      self.dilated = nnx.List([layers.DenseGeneral((2, features), (features,), **conv) for _ in DILATIONS])
    # The model's memories, which cached decoding keeps when the compressed memory is on; None: decoding is
    # Transformer-XL's, from position 0 without memory.
    self.decoding_memory = (int(mem_len), int(compressed_mem_len)) if compressed_mem_len else None

  def compress(self, evicted: Array, evicted_valid: Array, *, x: Array, mask: Array, memory: Array,
               memory_mask: Array, evicted_at: int, norm: Any, deterministic: bool) -> tuple[Array, Array]:
    """evicted [batch, L, features] (stop-gradient block inputs) with evicted_valid [batch, L] -> the
    compressed states [batch, L / c, features] and their validity [batch, L / c].

    x [batch, L, features] / mask [batch, L]: the segment's block input; memory [batch, K, features] /
    memory_mask [batch, K]: what the layer's attention read before x ([compressed; memory], unnormed), the
    evicted states being keys evicted_at .. evicted_at + L - 1 of [memory; x]; norm: the block's layer norm
    applied before the attention."""
    usage = None
    if self.compression == "most_used":
      length = evicted.shape[1]
      usage = self.usage(x, mask, memory, memory_mask, norm)[:, evicted_at:evicted_at + length]  # [batch, L]
    out, out_valid = self.compressed(evicted, evicted_valid, usage)
    if self.compression in LEARNED and not deterministic and self.loss_weight > 0:
      self.sow(nnx.Intermediate, "loss_term", self.loss_weight * self.reconstruction(
          x, mask, evicted, evicted_valid.astype(bool), out, out_valid, norm))
    out = jnp.where(out_valid[..., None], out, 0)
    return out.astype(evicted.dtype), out_valid

  def compressed(self, evicted: Array, evicted_valid: Array, usage: Array | None) -> tuple[Array, Array]:
    """f_c itself: evicted [batch, L, features] with evicted_valid [batch, L] (and, for most_used, their
    usage [batch, L]) -> [batch, L / c, features] (invalid slots not yet zeroed) and the validity."""
    batch, length, features = evicted.shape
    if length % self.rate:
      raise ValueError(f"attention 'compressive': the segment length {length} must be a multiple of "
                       f"compression_rate={self.rate}")
    groups = length // self.rate
    valid = evicted_valid.astype(bool)
    zeroed = jnp.where(valid[..., None], evicted, 0)  # [batch, L, features]
    grouped_valid = valid.reshape(batch, groups, self.rate)  # [batch, L / c, c]
    out_valid = grouped_valid.any(-1)  # [batch, L / c]
    if self.compression == "most_used":
      _, top = jax.lax.top_k(jnp.where(valid, usage, -jnp.inf), groups)  # [batch, L / c]
      top = jnp.sort(top, axis=-1)  # in their order
      out = jnp.take_along_axis(zeroed, top[..., None], axis=1)  # [batch, L / c, features]
      return out, jnp.take_along_axis(valid, top, axis=1)
    if self.compression == "max_pool":
      out = jnp.where(grouped_valid[..., None], evicted.reshape(batch, groups, self.rate, features),
                      -jnp.inf).max(2)  # [batch, L / c, features]
    elif self.compression == "mean_pool":
      count = jnp.maximum(grouped_valid.sum(-1), 1)[..., None]  # [batch, L / c, 1]
      out = zeroed.reshape(batch, groups, self.rate, features).sum(2) / count.astype(zeroed.dtype)
    else:
      h = zeroed
      if self.compression == "dilated_conv":
        for dilation, layer in zip(DILATIONS, self.dilated, strict=True):
          before = jnp.pad(h, ((0, 0), (dilation, 0), (0, 0)))[:, :length]  # [batch, L, features]: h[t - d]
          h = h + jax.nn.relu(layer(jnp.stack([before, h], axis=2)))  # [batch, L, features]
          h = jnp.where(valid[..., None], h, 0)
      out = self.conv(h.reshape(batch, groups, self.rate, features))  # [batch, L / c, features]
    return out, out_valid

  def usage(self, x: Array, mask: Array, memory: Array, memory_mask: Array, norm: Any) -> Array:
    """The attention each key of [memory; x] receives from the segment x: [batch, K + L], summed over the
    valid queries and averaged over heads (the layer's Transformer-XL probabilities, no gradient)."""
    x, memory = jax.lax.stop_gradient(x), jax.lax.stop_gradient(memory)
    length = x.shape[1]
    context, keys = attention.with_memory(x, mask, memory, memory_mask)  # [batch, K + L, .], [batch, K + L]
    total = context.shape[1]
    q = self.query(norm(x))  # [batch, L, heads, head_dim]
    k = self.key(norm(context))  # [batch, K + L, heads, head_dim]
    params = attention.resolve_plan_params(ops_registry.get(self.op_name), self.plan_params, length)
    ct = contract.softmax_dtype(q.dtype)
    r = clamped(self.relative(total), total, int(params.get("clamp_len", -1))).astype(ct)  # [K + L, heads, d]
    qh, kh = (jnp.swapaxes(a.astype(ct), 1, 2) for a in (q, k))  # [batch, heads, ., head_dim]
    u, v_bias = (b[...].astype(ct)[:, None] for b in (self.u, self.v_bias))  # [heads, 1, head_dim]
    content = jnp.einsum("bhid,bhjd->bhij", qh + u, kh)  # [batch, heads, L, K + L]
    by_distance = jnp.einsum("bhid,nhd->bhin", qh + v_bias, r[::-1])  # [batch, heads, L, K + L]
    logits = (content + rel_shift(by_distance)) * contract.logit_scale(self.head_dim)
    visible = np.arange(total)[None, :] <= total - length + np.arange(length)[:, None]  # [L, K + L]
    p = masked_softmax(logits, keys[:, None, None, :] & visible)  # [batch, heads, L, K + L]
    p = jnp.where(mask[:, None, :, None], p, 0)
    return jax.lax.stop_gradient(p.sum(2).mean(1))  # [batch, K + L]

  def reconstruction(self, x: Array, mask: Array, evicted: Array, valid: Array, compressed: Array,
                     compressed_valid: Array, norm: Any) -> Array:
    """mean ||attn(h, evicted) - attn(h, compressed)||^2 (see the module docstring): a scalar whose gradient
    reaches `compressed` only."""
    fixed_norm, wq, wk, wv = (frozen(m) for m in (norm, self.query, self.key, self.value))
    q = wq(fixed_norm(jax.lax.stop_gradient(x)))  # [batch, L, heads, head_dim]
    ct = contract.softmax_dtype(q.dtype)

    def attend(m: Array, m_valid: Array) -> Array:
      normed = fixed_norm(m)  # [batch, n, features]
      k, v = wk(normed).astype(ct), wv(normed).astype(ct)  # [batch, n, heads, head_dim]
      s = jnp.einsum("bihd,bjhd->bhij", q.astype(ct), k) * contract.logit_scale(self.head_dim)
      p = masked_softmax(s, m_valid[:, None, None, :])  # [batch, heads, L, n]
      return jnp.einsum("bhij,bjhd->bihd", p, v)  # [batch, L, heads, head_dim]

    diff = attend(evicted, valid) - attend(compressed, compressed_valid)  # [batch, L, heads, head_dim]
    queries = mask.astype(bool) & valid.any(-1)[:, None]  # [batch, L]
    total = jnp.sum(jnp.where(queries[..., None, None], diff * diff, 0))
    count = jnp.maximum(jnp.sum(queries), 1) * self.num_heads * self.head_dim
    return total / count

  # Cached decoding with the memories (see the module docstring): the block passes its raw input and norm.
  def decode(self, x: Array, cache: attention.LayerCache, position: Array | None, *, norm: Any
             ) -> tuple[Array, attention.LayerCache]:
    if self.decoding_memory:  # compresses the raw inputs that leave its window
      return self.decode_compressive(x, cache, position, norm=norm)
    return super().decode(x, cache, position, norm=norm)

  def init_cache(self, batch: int, max_length: int) -> attention.LayerCache:
    """Without `decoding_memory`, Transformer-XL's cache; with it, a window of mem_len + c block inputs (their
    keys, values, validity and usage) and n_cm compressed slots (keys, values, validity), all empty. Its size
    does not depend on max_length: decoding may run past it."""
    if not self.decoding_memory:
      return super().init_cache(batch, max_length)
    mem_len, n_cm = self.decoding_memory
    window, heads = mem_len + self.rate, (self.num_heads, self.head_dim)
    ct = contract.softmax_dtype(self.dtype)
    state = {"hidden": jnp.zeros((batch, window, self.features), self.dtype),
             "k": jnp.zeros((batch, window, *heads), self.dtype),
             "v": jnp.zeros((batch, window, *heads), self.dtype),
             "valid": jnp.zeros((batch, window), bool), "usage": jnp.zeros((batch, window), ct),
             "compressed_k": jnp.zeros((batch, n_cm, *heads), self.dtype),
             "compressed_v": jnp.zeros((batch, n_cm, *heads), self.dtype),
             "compressed_valid": jnp.zeros((batch, n_cm), bool)}
    return attention.LayerCache(state, max_length)

  def decode_compressive(self, x: Array, cache: attention.LayerCache, position: Array | None, *, norm: Any
                         ) -> tuple[Array, attention.LayerCache]:
    """x: the block's raw input, [batch, 1, features] at `position`, or (position None) a prompt [batch, P,
    features] at [0, P) from an empty cache, run one step per token; norm: the block's layer norm.

    Step t (offset i = t mod c in its group) writes its state to window slot mem_len + i and attends over
    [compressed (n_cm); window slots 0 .. mem_len + i] with the relative distances of the segment forward
    pass; after the group's last step the c oldest window states are compressed into one slot (appended to
    the compressed FIFO, its oldest dropped) and the window moves on by c. This is exactly the model's
    segment recurrence with segments of c tokens (`__call__` with a memory of mem_len and n_cm), so decoding
    equals it position by position (with position_embedding 'none', as relative attention has: the
    recurrence adds a learned table per segment). most_used: usage is the attention mass each window state
    received from the queries of the current group, summed over them and averaged over heads, the forward
    pass's usage of the segment that evicts it."""
    if position is not None:
      out, state = self._decode_one(x, cache.state, jnp.asarray(position, jnp.int32), norm)
      return out, attention.LayerCache(state, cache.max_length)

    def body(state, inputs):
      out, state = self._decode_one(inputs[0][:, None], state, inputs[1], norm)
      return state, out[:, 0]

    state, out = jax.lax.scan(body, cache.state,
                              (jnp.swapaxes(x, 0, 1), jnp.arange(x.shape[1], dtype=jnp.int32)))
    return jnp.swapaxes(out, 0, 1), attention.LayerCache(state, cache.max_length)  # [batch, P, features]

  def _decode_one(self, x: Array, state: dict[str, Array], position: Array, norm: Any
                  ) -> tuple[Array, dict[str, Array]]:
    """One step of `decode_compressive`: x [batch, 1, features] -> ([batch, 1, features], state)."""
    mem_len, n_cm = self.decoding_memory
    rate = self.rate
    window = mem_len + rate
    total = n_cm + window
    slot = mem_len + position % rate  # the query's window slot
    q, k, v = self.project(norm(x))  # [batch, 1, heads, head_dim]

    def put(a: Array, value: Array) -> Array:
      return jax.lax.dynamic_update_slice_in_dim(a, value.astype(a.dtype), slot, axis=1)

    hidden = put(state["hidden"], x)  # [batch, window, features]
    keys, values = put(state["k"], k), put(state["v"], v)  # [batch, window, heads, head_dim]
    valid = put(state["valid"], jnp.ones((x.shape[0], 1), bool))  # [batch, window]
    ck = jnp.concatenate([state["compressed_k"], keys], axis=1)  # [batch, total, heads, head_dim]
    cv = jnp.concatenate([state["compressed_v"], values], axis=1)
    c_valid = jnp.concatenate([state["compressed_valid"], valid], axis=1)  # [batch, total]
    params = attention.resolve_plan_params(ops_registry.get(self.op_name), self.plan_params, rate)
    ct = contract.softmax_dtype(q.dtype)
    r = clamped(self.relative(total), total, int(params.get("clamp_len", -1))).astype(ct)  # [total, heads, d]
    distance = n_cm + slot - jnp.arange(total)  # [total]: the query sits at n_cm + slot
    r = jnp.take(r, jnp.clip(distance, 0, total - 1), axis=0)  # [total, heads, head_dim]
    qh = q[:, 0].astype(ct)  # [batch, heads, head_dim]
    u, v_bias = self.u[...].astype(ct), self.v_bias[...].astype(ct)  # [heads, head_dim]
    logits = (jnp.einsum("bhd,bjhd->bhj", qh + u, ck.astype(ct))
              + jnp.einsum("bhd,jhd->bhj", qh + v_bias, r)) * contract.logit_scale(self.head_dim)
    p = masked_softmax(logits, c_valid[:, None, :] & (distance >= 0)[None, None, :])  # [batch, heads, total]
    o = jnp.einsum("bhj,bjhd->bhd", p, cv.astype(ct)).astype(v.dtype)  # [batch, heads, head_dim]
    usage = state["usage"] + p[:, :, n_cm:].mean(1)  # [batch, window]
    new = {"hidden": hidden, "k": keys, "v": values, "valid": valid, "usage": usage,
           "compressed_k": state["compressed_k"], "compressed_v": state["compressed_v"],
           "compressed_valid": state["compressed_valid"]}
    new = jax.lax.cond(position % rate == rate - 1, lambda st: self._evict(st, norm), lambda st: st, new)
    return self.out(o[:, None]), new  # [batch, 1, features]

  def _evict(self, state: dict[str, Array], norm: Any) -> dict[str, Array]:
    """After a group's last step: its c oldest window states leave, compressed into one slot appended to the
    compressed FIFO (its oldest dropped); the window moves on by c and the usage restarts."""
    rate = self.rate
    hidden, valid = state["hidden"], state["valid"]  # [batch, window, features], [batch, window]
    out, out_valid = self.compressed(hidden[:, :rate], valid[:, :rate], state["usage"][:, :rate])
    out = jnp.where(out_valid[..., None], out, 0).astype(hidden.dtype)  # [batch, 1, features]
    entering = {"compressed_k": self.key(norm(out)), "compressed_v": self.value(norm(out)),
                "compressed_valid": out_valid}  # [batch, 1, heads, head_dim], [batch, 1]

    def fifo(a: Array, added: Array) -> Array:
      return jnp.concatenate([a, added.astype(a.dtype)], axis=1)[:, added.shape[1]:]

    moved = {name: fifo(state[name], jnp.zeros_like(state[name][:, :rate]))
             for name in ("hidden", "k", "v", "valid")}
    return {**moved, "usage": jnp.zeros_like(state["usage"]),
            **{name: fifo(state[name], a) for name, a in entering.items()}}
