"""Pre-LayerNorm Transformer for every task of the project (Flax NNX).

- `lm` / `image`: decoder (causal attention) over the inputs right-shifted by a dedicated BOS id
  (id = vocab_size, an extra embedding row), predicting `inputs`; images are raster-order pixel/channel tokens
  (vocabulary 256) with factorised row/column/channel position embeddings.
- `mlm`: bidirectional encoder predicting `targets` from corrupted `inputs`.
- `classify`: bidirectional encoder + CLS (first position) or MEAN (padding-aware) pooling + MLP head.
- `retrieval`: the same encoder applied to both inputs (LRA dual encoder), head on [u, v, u*v, u-v].

The attention module is built from `config.attention` by `models.registry`; every parameter carries logical
axes.

Segment recurrence (Transformer-XL, Dai et al. 2019), `lm` only: with `model.mem_len` > 0 the LM call takes
the memory of the previous segments (`Transformer.init_memory`) and returns the updated one. Each block keeps
the last M of its own inputs (the residual stream entering it, no gradient) with their validity; its
attention module receives them, layer-normed like the segment, as `memory` / `memory_mask`. The memory also
carries the previous segment's last token, which the next segment reads at its first position instead of
BOS, so that two segments with memory read the same inputs as their concatenation. With
`model.compressed_mem_len` > 0 (Compressive Transformer, Rae et al. 2019) each block also keeps a compressed
memory: its module's `compress` maps the states the FIFO evicts to fewer ones, and the block reads
[compressed; memory] (models/compressive_attention.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from models import layers, registry, stacked
from runtime import cli

Array = Any
# The tasks the model has heads for (a dataset names one of them: `data.info.DatasetInfo.task`).
TASKS = ("lm", "mlm", "image", "classify", "retrieval")
CAUSAL_TASKS = ("lm", "image")
# model.remat: "full" recomputes each block in the backward, "minimal" only its attention core (matmuls
# without batch dimensions are kept). XLA:CPU schedules recomputation early, so there
# `model.attention.recompute` is the one that saves memory (models/recompute.py).
REMAT = ("none", "full", "minimal")


def dtype_of(name: str) -> Any:
  allowed = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}
  if name not in allowed:
    raise ValueError(f"model.dtype must be one of {sorted(allowed)}, got {name!r}")
  return allowed[name]


class Mlp(nnx.Module):
  def __init__(self, features: int, mlp_dim: int, *, dropout_rate: float, dtype: Any, rngs: nnx.Rngs):
    self.up = layers.DenseGeneral((features,), (mlp_dim,), in_axes=("embed",), out_axes=("mlp",), dtype=dtype,
                                  rngs=rngs)
    self.down = layers.DenseGeneral((mlp_dim,), (features,), in_axes=("mlp",), out_axes=("embed",),
                                    dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  def __call__(self, x: Array, *, deterministic: bool) -> Array:
    h = jax.nn.gelu(self.up(x))  # [batch, length, mlp]
    return self.down(self.dropout(h, deterministic=deterministic))  # [batch, length, features]


class Block(nnx.Module):
  """x + Attn(LN(x)); x + MLP(LN(x))."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, causal: bool, dtype: Any, rngs: nnx.Rngs,
               layer: int | None = None, seq_len: int | None = None):
    f = cfg.features
    mem_len = int(cfg.get("mem_len", 0) or 0)
    compressed_mem_len = int(cfg.get("compressed_mem_len", 0) or 0)
    self.norm1 = layers.LayerNorm(f, dtype=dtype, rngs=rngs)
    self.attention = registry.build(cfg.attention, features=f, num_heads=cfg.num_heads,
                                    head_dim=cfg.get("head_dim", None) or f // cfg.num_heads, causal=causal,
                                    dtype=dtype, rngs=rngs, layer=layer, num_layers=cfg.num_layers,
                                    seq_len=seq_len, mem_len=mem_len, compressed_mem_len=compressed_mem_len)
    if mem_len > 0 and not self.attention.takes_memory:
      raise cli.mark_usage(ValueError(
          f"config.model.mem_len={mem_len} needs an attention whose module takes a memory; attention "
          f"{cfg.attention.name!r} ({type(self.attention).__name__}) takes none"))
    if compressed_mem_len > 0 and not self.attention.COMPRESSES:
      raise cli.mark_usage(ValueError(
          f"config.model.compressed_mem_len={compressed_mem_len} needs an attention whose module compresses "
          f"memories; attention {cfg.attention.name!r} ({type(self.attention).__name__}) does not"))
    self.norm2 = layers.LayerNorm(f, dtype=dtype, rngs=rngs)
    self.mlp = Mlp(f, cfg.mlp_dim, dropout_rate=cfg.dropout_rate, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

  def __call__(self, x: Array, mask: Array | None, *, deterministic: bool, memory: Array | None = None,
               memory_mask: Array | None = None) -> Array:
    """memory: None, or this block's inputs of the previous segments [batch, M, features] with memory_mask
    [batch, M] (True = valid); normed here like x, so the module sees LN(concat(memory, x))."""
    if memory is None:
      h = self.attention(self.norm1(x), mask, deterministic=deterministic)
    else:
      h = self.attention(self.norm1(x), mask, deterministic=deterministic, memory=self.norm1(memory),
                         memory_mask=memory_mask)  # [batch, length, features]
    x = x + self.dropout(h, deterministic=deterministic)
    h = self.mlp(self.norm2(x), deterministic=deterministic)
    return x + self.dropout(h, deterministic=deterministic)  # [batch, length, features]

  def decode(self, x: Array, cache: Any, position: Array | None = None) -> tuple[Array, Any]:
    """One token x [batch, 1, features] at `position` (or, position=None, a prompt [batch, P, features] at
    positions [0, P)) through the block with the attention layer's cache; dropout off."""
    h, cache = self.attention.decode(x, cache, position, norm=self.norm1)
    x = x + h
    return x + self.mlp(self.norm2(x), deterministic=True), cache  # [batch, length, features]


class PositionEmbedding(nnx.Module):
  """Learned [max_len, features] table, or factorised over an image's (height, width, channels) grid:
  pos(i) = row[r] + col[c] + channel[ch] for raster order with channels innermost; "none" adds nothing (for
  attentions that carry positions themselves, e.g. relative ones)."""

  def __init__(self, cfg: ml_collections.ConfigDict, seq_len: int, *, dtype: Any, rngs: nnx.Rngs):
    self.kind = cfg.get("position_embedding", "learned")
    f = cfg.features
    init = nnx.initializers.normal(stddev=0.02)
    if self.kind == "learned":
      self.table = layers.param(rngs, init, (max(seq_len, cfg.get("max_len", 0) or 0), f), (None, "embed"))
    elif self.kind == "factorized":
      h, w, c = (int(s) for s in cfg.image_shape)
      if h * w * c != seq_len:
        raise ValueError(f"model.image_shape {tuple(cfg.image_shape)} has {h * w * c} positions, "
                         f"the data has seq_len={seq_len}")
      self.shape = (h, w, c)
      self.rows = layers.param(rngs, init, (h, f), (None, "embed"))
      self.cols = layers.param(rngs, init, (w, f), (None, "embed"))
      self.channels = layers.param(rngs, init, (c, f), (None, "embed"))
    elif self.kind != "none":
      raise ValueError(f"model.position_embedding must be one of ['learned', 'factorized', 'none'], "
                       f"got {self.kind!r}")
    self.dtype = dtype

  def __call__(self, length: int) -> Array:
    if self.kind == "learned":
      if length > self.table.shape[0]:
        raise ValueError(f"sequence length {length} exceeds the position table ({self.table.shape[0]})")
      return self.table[:length].astype(self.dtype)  # [length, features]
    h, w, c = self.shape
    pos = (self.rows[...][:, None, None] + self.cols[...][None, :, None] + self.channels[...][None, None, :])
    return pos.reshape(h * w * c, -1)[:length].astype(self.dtype)  # [length, features]

  def at(self, position: Array) -> Array:
    """The embedding of one (traced) position: [features]."""
    if self.kind == "learned":
      return jax.lax.dynamic_index_in_dim(self.table[...], position, keepdims=False).astype(self.dtype)
    _, w, c = self.shape
    row, col, channel = position // (w * c), (position // c) % w, position % c
    rows, cols, channels = (jax.lax.dynamic_index_in_dim(t[...], i, keepdims=False)
                            for t, i in ((self.rows, row), (self.cols, col), (self.channels, channel)))
    return (rows + cols + channels).astype(self.dtype)


class Encoder(nnx.Module):
  """Token + position embeddings, the blocks, and the final layer norm."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, vocab_size: int, seq_len: int, causal: bool,
               dtype: Any, rngs: nnx.Rngs):
    self.embed = layers.Embed(vocab_size, cfg.features, dtype=dtype, rngs=rngs)
    self.pos = PositionEmbedding(cfg, seq_len, dtype=dtype, rngs=rngs)
    self.positions = self.pos.kind != "none"
    self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
    blocks = [stacked.build(lambda rngs, i=i: Block(cfg, causal=causal, dtype=dtype, rngs=rngs, layer=i,
                                                    seq_len=seq_len), rngs) for i in range(cfg.num_layers)]
    self.num_layers = len(blocks)
    # model.scan_layers: the blocks as one module whose variables are stacked on a leading layer axis, run by
    # one lax.scan (models/stacked.py); a segment memory's layers are stacked for the scan and split after it.
    self.scanned = bool(cfg.get("scan_layers", False) and blocks)
    if self.scanned:
      _check_scannable(blocks, cfg.attention.name)
      self.blocks = stacked.stack(blocks)
    else:
      self.blocks = nnx.List(blocks)
    self.norm = layers.LayerNorm(cfg.features, dtype=dtype, rngs=rngs)
    # Graph attentions (BP-Transformer) carry node states beside the tokens through every block: their module
    # names the class that makes them (`GRAPH_NODES`: appends them, then `tokens` drops them).
    graph = type(blocks[0].attention).GRAPH_NODES if blocks else None
    self.graph_nodes = graph(cfg.features, seq_len, dtype=dtype, rngs=rngs) if graph is not None else None
    self.remat = cfg.get("remat", "none")
    if self.remat not in REMAT:
      raise ValueError(f"model.remat must be one of {list(REMAT)}, got {self.remat!r}")
    self.scan_unroll = int(cfg.get("scan_unroll", 1))  # at least 1 (configs/validation.py)

  def __call__(self, ids: Array, mask: Array | None, *, deterministic: bool,
               memory: list[dict[str, Array]] | None = None) -> Array | tuple[Array, list[dict[str, Array]]]:
    """memory: None, or per block {"hidden": [batch, M, features], "valid": [batch, M]}; then returns the
    normed features and the updated memory (the last M of concat(memory, the block's input), no gradient)."""
    x = self.embed(ids)  # [batch, length, features]
    if self.positions:
      x = x + self.pos(ids.shape[1])[None]
    x = self.dropout(x, deterministic=deterministic)
    if memory is not None:
      return self._with_memory(x, mask, memory, deterministic)
    if self.graph_nodes is not None:
      x, mask = self.graph_nodes(x, mask)  # [batch, length + extra nodes, features]
    if self.scanned:
      def layer(block, x, _):
        return block(x, mask, deterministic=deterministic), None  # [batch, length, features]

      x, _ = stacked.scan(self.blocks, layer, x, remat=self.remat != "none",
                          policy=_REMAT_POLICY.get(self.remat), unroll=self.scan_unroll)
    else:
      for block in self.blocks:
        if self.remat != "none":
          x = _REMATTED_BLOCK[self.remat](block, x, mask, deterministic)
        else:
          x = block(x, mask, deterministic=deterministic)
    if self.graph_nodes is not None:
      x = self.graph_nodes.tokens(x)  # [batch, length, features]
    return self.norm(x)  # [batch, length, features]

  def _with_memory(self, x: Array, mask: Array | None, memory: list[dict[str, Array]],
                   deterministic: bool) -> tuple[Array, list[dict[str, Array]]]:
    if len(memory) != self.num_layers:
      raise ValueError(f"memory has {len(memory)} layers, the model {self.num_layers}")
    if mask is None:
      mask = jnp.ones(x.shape[:2], bool)
    if self.scanned:  # each layer's memory arrays stacked [layers, ...], scanned with the blocks, then split
      def layer(block, x, mem):
        return _memory_layer(block, x, mask, mem, deterministic, "none")

      x, new = stacked.scan(self.blocks, layer, x, jax.tree.map(lambda *a: jnp.stack(a), *memory),
                            remat=self.remat != "none", policy=_REMAT_POLICY.get(self.remat),
                            unroll=self.scan_unroll)
      return self.norm(x), [jax.tree.map(lambda a, i=i: a[i], new) for i in range(self.num_layers)]
    new = []
    for block, mem in zip(self.blocks, memory, strict=True):
      x, layer_mem = _memory_layer(block, x, mask, mem, deterministic, self.remat)
      new.append(layer_mem)
    return self.norm(x), new  # [batch, length, features]

  def decode(self, ids: Array, caches: list[Any], position: Array | None = None) -> tuple[Array, list[Any]]:
    """ids [batch, 1] at `position` (or a prompt [batch, P] at [0, P) when position is None) -> normed
    features [batch, length, features] and the updated caches (`init_cache`)."""
    if self.graph_nodes is not None:
      return _decode_graph(self, ids, caches, position)
    x = self.embed(ids)  # [batch, P or 1, features]
    if self.positions and position is None:
      x = x + self.pos(ids.shape[1])[None]
    elif self.positions:
      x = x + self.pos.at(position)[None, None]
    x, new = self._decode_blocks(x, caches, position)
    return self.norm(x), new

  def init_cache(self, batch: int, max_length: int) -> list[Any]:
    """The blocks' decoding caches: one per block, or for stacked blocks one whose arrays have a leading layer
    axis; then, for graph attentions, the nodes' own."""
    if self.scanned:
      _, cache = stacked.scan(self.blocks, lambda block, _, __: (None, block.attention.init_cache(
          batch, max_length)), None, update=False)
      caches = [cache]
    else:
      caches = [block.attention.init_cache(batch, max_length) for block in self.blocks]
    if self.graph_nodes is not None:
      caches.append(self.graph_nodes.init_cache(batch, max_length))
    return caches

  def _decode_blocks(self, x: Array, caches: list[Any], position: Array | None) -> tuple[Array, list[Any]]:
    """x [batch, length, features] through the blocks' `decode` with their caches (`init_cache`'s, without
    the nodes' one) -> (x, the updated caches)."""
    if self.scanned:
      x, cache = stacked.scan(self.blocks, lambda block, x, cache: block.decode(x, cache, position), x,
                              caches[0], update=False)  # cache: the layers' caches stacked
      return x, [cache]
    new = []
    for block, cache in zip(self.blocks, caches, strict=True):
      x, cache = block.decode(x, cache, position)
      new.append(cache)
    return x, new


def _decode_graph(encoder: Encoder, ids: Array, caches: list[Any],
                  position: Array | None) -> tuple[Array, list[Any]]:
  """`Encoder.decode` of a graph attention: the token and the nodes its position completes
  (`GRAPH_NODES.step`) go through every block together; caches: the blocks', then the nodes' own. A prompt
  runs one step per token."""
  if position is None:
    def body(caches, inputs):
      out, caches = _decode_graph(encoder, inputs[0][:, None], caches, inputs[1])
      return caches, out[:, 0]

    caches, out = jax.lax.scan(body, caches, (ids.T, jnp.arange(ids.shape[1], dtype=jnp.int32)))
    return jnp.moveaxis(out, 0, 1), caches  # [batch, P, features]
  x = encoder.embed(ids)  # [batch, 1, features]
  if encoder.positions:
    x = x + encoder.pos.at(position)[None, None]
  nodes, node_cache = encoder.graph_nodes.step(x, caches[-1], position)
  x = jnp.concatenate([x, nodes], axis=1)  # [batch, 1 + nodes, features]
  x, new = encoder._decode_blocks(x, caches[:-1], position)
  return encoder.norm(x[:, :1]), new + [node_cache]


def _memory_layer(block: Block, x: Array, mask: Array, mem: dict[str, Array], deterministic: bool,
                  remat: str) -> tuple[Array, dict[str, Array]]:
  """One block over x [batch, length, features] reading its memory `mem` (hidden [batch, M, features], valid
  [batch, M]; with a compressed memory also compressed [batch, n_cm, features], compressed_valid) -> (x, the
  memory it leaves: the last M of [memory; x], no gradient, and the compressed FIFO updated)."""
  hidden, valid = mem["hidden"], mem["valid"]
  m = hidden.shape[1]
  both = jnp.concatenate([hidden, x.astype(hidden.dtype)], axis=1)  # [batch, M + length, features]
  both_valid = jnp.concatenate([valid, mask.astype(bool)], axis=1)  # [batch, M + length]
  keep = both.shape[1] - m  # the first position kept
  new = {"hidden": jax.lax.stop_gradient(both[:, keep:]), "valid": both_valid[:, keep:]}
  if "compressed" in mem:  # the block reads [compressed; memory] and compresses what the FIFO evicts
    new.update(_compress(block, mem, x, mask, both[:, :keep], both_valid[:, :keep], deterministic))
    hidden = jnp.concatenate([mem["compressed"], hidden], axis=1)  # [batch, n_cm + M, features]
    valid = jnp.concatenate([mem["compressed_valid"], valid], axis=1)
  if remat != "none":
    return _REMATTED_MEMORY_BLOCK[remat](block, x, mask, hidden, valid, deterministic), new
  return block(x, mask, deterministic=deterministic, memory=hidden, memory_mask=valid), new


def _compress(block: Block, mem: dict[str, Array], x: Array, mask: Array, evicted: Array,
              evicted_valid: Array, deterministic: bool) -> dict[str, Array]:
  """The compressed memory after a segment (Compressive Transformer): the module compresses the L evicted
  states [batch, L, features] (the oldest of [memory; x], no gradient) into [batch, L / c, features],
  appended to the compressed FIFO [batch, n_cm, features], its oldest dropped."""
  cm, cm_valid = mem["compressed"], mem["compressed_valid"]  # [batch, n_cm, features], [batch, n_cm]
  out, out_valid = block.attention.compress(
      jax.lax.stop_gradient(evicted), evicted_valid, x=x, mask=mask, memory=jnp.concatenate(
          [cm, mem["hidden"]], axis=1), memory_mask=jnp.concatenate([cm_valid, mem["valid"]], axis=1),
      evicted_at=cm.shape[1], norm=block.norm1, deterministic=deterministic)
  both = jnp.concatenate([cm, jax.lax.stop_gradient(out).astype(cm.dtype)], axis=1)
  both_valid = jnp.concatenate([cm_valid, out_valid], axis=1)
  n = cm.shape[1]
  return {"compressed": both[:, both.shape[1] - n:], "compressed_valid": both_valid[:, both.shape[1] - n:]}


def _check_scannable(blocks: list[Block], attention: str) -> None:
  """A one-line config error when the blocks differ in structure (an attention that varies by layer)."""
  first = nnx.graphdef(blocks[0])
  for i, block in enumerate(blocks[1:], 1):
    if nnx.graphdef(block) != first:
      raise cli.mark_usage(ValueError(
          f"config.model.scan_layers=True needs blocks of one structure; attention {attention!r} builds "
          f"block {i} differently from block 0 (a per-layer choice): set scan_layers=False"))


def _block_call(block: Block, x: Array, mask: Array | None, deterministic: bool) -> Array:
  return block(x, mask, deterministic=deterministic)  # [batch, length, features]


# Each trades about one extra forward pass of the recomputed part for a step memory of one block's
# intermediates.
_REMAT_POLICY = {"full": None, "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
_REMATTED_BLOCK = {name: nnx.remat(_block_call, static_argnums=(3,), policy=policy)
                   for name, policy in _REMAT_POLICY.items()}


def _memory_block_call(block: Block, x: Array, mask: Array | None, memory: Array, memory_mask: Array,
                       deterministic: bool) -> Array:
  return block(x, mask, deterministic=deterministic, memory=memory, memory_mask=memory_mask)


_REMATTED_MEMORY_BLOCK = {name: nnx.remat(_memory_block_call, static_argnums=(5,), policy=policy)
                          for name, policy in _REMAT_POLICY.items()}


class Transformer(nnx.Module):
  """The model for `task` (one of TASKS). `__call__(batch, *, deterministic)` returns float32 logits:
  [batch, length, vocab] for lm/image/mlm, [batch, num_classes] for classify/retrieval."""

  WARM_START = None  # a run starts from its own initial state (training/experiment.py `warm_start`)

  def __init__(self, cfg: ml_collections.ConfigDict, *, task: str, vocab_size: int, seq_len: int,
               num_classes: int | None = None, input_vocab_size: int | None = None, bos_id: int | None = None,
               rngs: nnx.Rngs):
    if task not in TASKS:
      raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    self.task, self.vocab_size, self.features = task, vocab_size, cfg.features
    dtype = dtype_of(cfg.get("dtype", "float32"))
    self.dtype = dtype
    causal = task in CAUSAL_TASKS
    # Decoders read a dedicated BOS id (default vocab_size, one extra embedding row), never a real token.
    self.bos_id = (vocab_size if bos_id is None else bos_id) if causal else None
    if input_vocab_size is None:
      input_vocab_size = vocab_size + 1
    if causal and self.bos_id >= input_vocab_size:
      raise ValueError(f"bos_id={self.bos_id} needs input_vocab_size > bos_id, got {input_vocab_size}")
    self.mem_len = int(cfg.get("mem_len", 0) or 0)
    self.compressed_mem_len = int(cfg.get("compressed_mem_len", 0) or 0)
    if self.mem_len > 0 and task != "lm":
      raise cli.mark_usage(ValueError(f"config.model.mem_len={self.mem_len}: segment recurrence is for task "
                                      f"'lm', not {task!r}"))
    self.encoder = Encoder(cfg, vocab_size=input_vocab_size, seq_len=seq_len, causal=causal, dtype=dtype,
                           rngs=rngs)
    f = cfg.features
    if task in ("lm", "image", "mlm"):
      self.head = layers.DenseGeneral((f,), (vocab_size,), in_axes=("embed",), out_axes=("vocab",),
                                      dtype=dtype, rngs=rngs)
    else:
      if not num_classes:
        raise ValueError(f"task {task!r} needs num_classes")
      self.pool = cfg.get("classifier_pool", "CLS")
      if self.pool not in ("CLS", "MEAN"):
        raise ValueError(f"model.classifier_pool must be one of ['CLS', 'MEAN'], got {self.pool!r}")
      in_f = 4 * f if task == "retrieval" else f
      self.hidden = layers.DenseGeneral((in_f,), (cfg.mlp_dim,), in_axes=("embed",), out_axes=("mlp",),
                                        dtype=dtype, rngs=rngs)
      self.head = layers.DenseGeneral((cfg.mlp_dim,), (num_classes,), in_axes=("mlp",), out_axes=(None,),
                                      dtype=dtype, rngs=rngs)

  def _pooled(self, ids: Array, mask: Array, *, deterministic: bool) -> Array:
    x = self.encoder(ids, mask, deterministic=deterministic)  # [batch, length, features]
    if self.pool == "CLS":  # the first position (LRA convention: its input token is the sequence's first)
      return x[:, 0]
    m = mask.astype(x.dtype)[..., None]  # [batch, length, 1]
    return (x * m).sum(1) / jnp.maximum(m.sum(1), 1.0)  # [batch, features]

  def __call__(self, batch: dict[str, Array], *, deterministic: bool,
               memory: dict[str, Any] | None = None) -> Array | tuple[Array, dict[str, Any]]:
    """memory (lm): None, or the previous segments' memory (`init_memory`); then returns (logits, the
    memory after this segment)."""
    if memory is not None:
      return self._lm_with_memory(batch, memory, deterministic)
    if self.task in CAUSAL_TASKS:
      ids, mask = batch["inputs"], batch.get("mask")
      if mask is None:
        mask = jnp.ones(ids.shape, bool)
      bos = jnp.full(ids[:, :1].shape, self.bos_id, ids.dtype)
      shifted = jnp.concatenate([bos, ids[:, :-1]], axis=1)  # [batch, length]
      shifted_mask = jnp.concatenate([jnp.ones_like(mask[:, :1]), mask[:, :-1]], axis=1)
      x = self.encoder(shifted, shifted_mask, deterministic=deterministic)
      return self.head(x).astype(jnp.float32)  # [batch, length, vocab]
    if self.task == "mlm":
      ids = batch["inputs"]
      mask = batch.get("mask")
      if mask is None:
        mask = jnp.ones(ids.shape, bool)
      x = self.encoder(ids, mask, deterministic=deterministic)
      return self.head(x).astype(jnp.float32)  # [batch, length, vocab]
    if self.task == "classify":
      pooled = self._pooled(batch["inputs"], batch["mask"], deterministic=deterministic)
    else:
      u = self._pooled(batch["inputs1"], batch["mask1"], deterministic=deterministic)
      v = self._pooled(batch["inputs2"], batch["mask2"], deterministic=deterministic)
      pooled = jnp.concatenate([u, v, u * v, u - v], axis=-1)  # [batch, 4 * features]
    return self.head(jax.nn.relu(self.hidden(pooled))).astype(jnp.float32)  # [batch, num_classes]

  # Segment recurrence (lm). The memory: {"layers": per block {"hidden": [batch, M, features] (its inputs),
  # "valid": [batch, M] bool, with compressed_mem_len > 0 also "compressed" [batch, n_cm, features] and
  # "compressed_valid" [batch, n_cm]}, "token": [batch] int32 (the previous segment's last input id),
  # "token_valid": [batch] bool}. M is the memory's own length: evaluation may pass a longer one.
  def init_memory(self, batch: int, mem_len: int, compressed_mem_len: int | None = None) -> dict[str, Any]:
    """An empty (all invalid) memory of `mem_len` positions for `batch` rows; with a compressed memory,
    `compressed_mem_len` compressed slots (None: the model's; 0: none, the FIFO alone, as Transformer-XL)."""
    if self.task != "lm":
      raise ValueError(f"segment recurrence is for task 'lm', not {self.task!r}")
    # The compressed memory (Compressive Transformer), when on; evaluation may pass another length.
    n_cm = self.compressed_mem_len if compressed_mem_len is None or not self.compressed_mem_len \
        else int(compressed_mem_len)

    def layer() -> dict[str, Array]:
      out = {"hidden": jnp.zeros((batch, mem_len, self.features), self.dtype),
             "valid": jnp.zeros((batch, mem_len), bool)}
      if n_cm:
        out.update(compressed=jnp.zeros((batch, n_cm, self.features), self.dtype),
                   compressed_valid=jnp.zeros((batch, n_cm), bool))
      return out

    return {"layers": [layer() for _ in range(self.encoder.num_layers)],
            "token": jnp.zeros((batch,), jnp.int32), "token_valid": jnp.zeros((batch,), bool)}

  def _lm_with_memory(self, batch: dict[str, Array], memory: dict[str, Any],
                      deterministic: bool) -> tuple[Array, dict[str, Any]]:
    if self.task != "lm":
      raise ValueError(f"segment recurrence is for task 'lm', not {self.task!r}")
    ids, mask = batch["inputs"], batch.get("mask")
    if mask is None:
      mask = jnp.ones(ids.shape, bool)
    # The first position reads the previous segment's last token (BOS after a reset or at the start).
    first = jnp.where(memory["token_valid"], memory["token"].astype(ids.dtype), self.bos_id)  # [batch]
    shifted = jnp.concatenate([first[:, None], ids[:, :-1]], axis=1)  # [batch, length]
    shifted_mask = jnp.concatenate([jnp.ones_like(mask[:, :1]), mask[:, :-1]], axis=1)
    x, layers_ = self.encoder(shifted, shifted_mask, deterministic=deterministic, memory=memory["layers"])
    new = {"layers": layers_, "token": ids[:, -1].astype(jnp.int32), "token_valid": mask[:, -1].astype(bool)}
    return self.head(x).astype(jnp.float32), new  # [batch, length, vocab]


  # Cached autoregressive decoding (lm / image). Position t reads the token at t - 1 (BOS at t = 0) and its
  # logits predict the token at t, exactly as row t of `__call__`'s logits; plan parameters set to "auto" are
  # chosen for `max_length`, so decoding equals the forward pass over `max_length` tokens. With a compressed
  # memory (Compressive Transformer) it equals instead the segment recurrence with segments of
  # compression_rate tokens (models/compressive_attention.py).
  def init_cache(self, batch: int, max_length: int) -> list[Any]:
    """Empty per-layer caches for `batch` sequences of up to `max_length` tokens."""
    if self.task not in CAUSAL_TASKS:
      raise ValueError(f"cached decoding needs a causal task {CAUSAL_TASKS}, got {self.task!r}")
    return self.encoder.init_cache(batch, max_length)

  def decode(self, cache: list[Any], tokens: Array, position: Array) -> tuple[Array, list[Any]]:
    """tokens [batch]: the tokens at position - 1 (ignored at position 0) -> float32 logits [batch, vocab] for
    the token at `position`, and the cache with `position` added."""
    position = jnp.asarray(position, jnp.int32)
    ids = jnp.where(position == 0, self.bos_id, tokens).astype(jnp.int32)[:, None]  # [batch, 1]
    x, cache = self.encoder.decode(ids, cache, position)
    return self.head(x[:, 0]).astype(jnp.float32), cache  # [batch, vocab]

  def prefill(self, cache: list[Any], prompt: Array) -> tuple[Array, list[Any]]:
    """prompt [batch, P] (P >= 0): the tokens at positions [0, P). Runs positions [0, P] (BOS, then the
    prompt) and returns their float32 logits [batch, P + 1, vocab] (the last one predicts the token at P) and
    the cache; continue with `decode(cache, next_token, P + 1)`."""
    bos = jnp.full((prompt.shape[0], 1), self.bos_id, jnp.int32)
    ids = jnp.concatenate([bos, prompt.astype(jnp.int32)], axis=1)  # [batch, P + 1]
    x, cache = self.encoder.decode(ids, cache)
    return self.head(x).astype(jnp.float32), cache


def reset_memory(memory: dict[str, Any], reset: Array) -> dict[str, Any]:
  """`memory` with the rows where reset [batch] is True emptied (a row that starts a new stream)."""
  keep = jnp.logical_not(reset.astype(bool))  # [batch]

  def clear(a: Array) -> Array:
    where = keep.reshape(keep.shape + (1,) * (a.ndim - 1))
    return jnp.where(where, a, jnp.zeros((), a.dtype))

  return jax.tree.map(clear, memory)


def build_model(cfg: ml_collections.ConfigDict, *, task: str, vocab_size: int, seq_len: int,
                num_classes: int | None = None, input_vocab_size: int | None = None,
                bos_id: int | None = None, seed: int = 0) -> Transformer:
  """The model with fresh parameters and the rng streams of the registry contract
  (params/dropout/attention)."""
  rngs = nnx.Rngs(params=seed, dropout=seed + 1, attention=seed + 2)
  return Transformer(cfg, task=task, vocab_size=vocab_size, seq_len=seq_len, num_classes=num_classes,
                     input_vocab_size=input_vocab_size, bos_id=bos_id, rngs=rngs)


def from_info(cfg: ml_collections.ConfigDict, info: Any, *, seed: int = 0) -> Transformer:
  """The model for a `data.DatasetInfo` (task, vocabulary, special ids, length, classes)."""
  return build_model(cfg, task=info.task, vocab_size=info.vocab_size, seq_len=info.seq_len,
                     num_classes=info.num_classes, input_vocab_size=info.input_vocab_size, bos_id=info.bos_id,
                     seed=seed)
