"""Attention modules: multi-head projections around a pure op registered in `attention_core.registry`
(docs/design.md section 3).

`AttentionBase` owns what every attention module shares (q/k/v/output projections with logical axis names,
heads, compute dtype, output dropout) and the declarations every module makes (`FIELDS`, `CONTEXT`, `PLAN`,
`COMPRESSES`, `GRAPH_NODES`: docs/design.md section 5). `OpAttention` wraps any registered pure op by name,
so a new op needs no module of its own, and is the one attention path of the models: memory context, key
masks, the op's model inputs and recompute (`attend`); modules with weights of their own supply them through
`op_inputs`. `CombinerAttention` adds the model-level Combiner options of the paper (Table 3 DeepSets pooling,
the row-major learned span key of the released code). The constructor signature and call convention are
docs/design.md section 5's module contract.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from attention_core import registry as ops_registry
from attention_core import sharding
from attention_core.norm import layer_norm
from models import layers, recompute
from runtime import cli

Array = Any
AUTO = "auto"

# Fields of `config.model.attention` every module understands; plan parameters live in `params`.
COMMON_FIELDS = ("name", "params", "dropout_rate", "implementation")


@dataclasses.dataclass(frozen=True)
class Field:
  """A `config.model.attention` field a module reads, declared in the module's `FIELDS` {name: Field}.

  A config holds only the fields it sets; absent or None means the module's default. A set value is checked
  against `kind` (int is accepted for float, a list for tuple) and the bounds before the module is built
  (models.registry.check_fields), so a bad value is a one-line error naming the field."""
  kind: type  # bool | int | float | str | tuple
  help: str
  minimum: float | None = None
  maximum: float | None = None

  def check(self, name: str, value: Any) -> None:
    ops_registry.check_kind(value, self.kind, name=f"config.model.attention.{name}", minimum=self.minimum,
                            maximum=self.maximum, optional=True, note=self.help)

  def read(self, config: ml_collections.ConfigDict, name: str, default: Any) -> Any:
    """The config's value of this field (`default` when absent or None), checked."""
    value = config.get(name, None)
    if value is None:
      return default
    self.check(name, value)
    return value


# Fields several modules read.
RECOMPUTE = Field(bool, "recompute the op in the backward pass instead of keeping its intermediates "
                  "(models.recompute): same gradients, one extra op forward")
SEQ_LEN = Field(int, "the model's sequence length; filled in by models.registry.build when unset "
                "(state shaped at construction)", minimum=1)


def is_auto(value: Any) -> bool:
  return isinstance(value, str) and value == AUTO


def plan_value(value: Any) -> Any:
  """A plan parameter as configs hold it: "16" from a command-line override of "auto" becomes 16."""
  if isinstance(value, str) and value.lstrip("-").isdigit():
    return int(value)
  return value


def plan_params(config: ml_collections.ConfigDict, plan: Mapping[str, ops_registry.Param], name: str,
                model_inputs: tuple[str, ...] = ()) -> dict[str, Any]:
  """The config's plan parameters for an attention declaring `plan`, checked against it. "auto" entries it
  does not take are dropped: configs pre-fill "auto" for their default attention so that
  `--config.model.attention.params.block_size=64` works, and a later switch of op must not trip on them."""
  params = config.get("params", None)
  raw = dict(params.to_dict() if isinstance(params, ml_collections.ConfigDict) else (params or {}))
  out = {}
  for key, value in raw.items():
    value = plan_value(value)
    if key not in plan:
      if is_auto(value):
        continue
      if key in model_inputs:
        raise ValueError(f"attention {name!r}: params {[key]} are not plan parameters (the model supplies "
                         f"{list(model_inputs)}); its plan parameters: {list(plan)}")
      raise ValueError(f"attention op {name!r} does not take parameter {key!r}; its parameters: {list(plan)}")
    if not is_auto(value):
      plan[key].check(value, name=f"config.model.attention.params.{key}")
    out[key] = value
  return out


def resolve_plan_params(spec: ops_registry.OpSpec, params: dict[str, Any], length: int) -> dict[str, Any]:
  """Config plan parameters with "auto" replaced by the op's own choice for this length (spec.params(L))."""
  auto = spec.params(length)
  out = {}
  for key, value in params.items():
    value = plan_value(value)
    if is_auto(value):
      if key not in auto:
        raise ValueError(f"attention op {spec.name!r}: parameter {key!r}='auto' has no automatic value; "
                         f"automatic parameters: {sorted(auto)}")
      value = auto[key]
    out[key] = value
  for key, value in auto.items():  # parameters the config leaves out take the op's automatic value
    out.setdefault(key, value)
  return out


def with_memory(x: Array, mask: Array | None, memory: Array | None, memory_mask: Array | None
                ) -> tuple[Array, Array | None]:
  """(keys' inputs [batch, M + L, features] = concat([memory, x]), their mask [batch, M + L] or None when
  every key is real); x and mask themselves without a memory. The caller stops the memory's gradient."""
  if memory is None:
    return x, mask
  batch, length = x.shape[:2]
  context = jnp.concatenate([jnp.asarray(memory).astype(x.dtype), x], axis=1)
  if mask is None and memory_mask is None:
    return context, None
  mem = jnp.ones((batch, memory.shape[1]), bool) if memory_mask is None else jnp.asarray(memory_mask, bool)
  parts = (mem, jnp.ones((batch, length), bool) if mask is None else jnp.asarray(mask, bool))
  return context, jnp.concatenate(parts, axis=1)


@flax.struct.dataclass
class LayerCache:
  """One attention layer's decoding cache: the op's arrays and the length its plan was chosen for."""

  state: Any  # the op decoder's cache (a dict of arrays)
  max_length: int = flax.struct.field(pytree_node=False)


def check_decodable(spec: ops_registry.OpSpec) -> Any:
  """The op's decoder, or a ValueError naming the op (and the ops that have one): the user's to fix (one
  line from sample.py), since the config chose the op."""
  if spec.decode is None:
    have = [n for n in ops_registry.names() if ops_registry.get(n).decode is not None]
    raise cli.mark_usage(ValueError(f"attention op {spec.name!r} has no cached decoding step; ops with "
                                    f"one: {have}"))
  return spec.decode


class AttentionBase(nnx.Module):
  """Multi-head projections shared by all attention modules.

  x: [batch, length, features] -> q, k, v: [batch, length, heads, head_dim] in `dtype`;
  the output projection maps [batch, length, heads, head_dim] back to [batch, length, features].
  """

  # What a module declares (docs/design.md section 5); the model reads these, never the module's code.
  FIELDS: dict[str, Field] = {}  # the config fields it reads beyond COMMON_FIELDS
  CONTEXT: tuple[str, ...] = ()  # model facts its constructor takes: layer, num_layers, mem_len,
                                 # compressed_mem_len
  PLAN: Mapping[str, ops_registry.Param] | None = None  # its plan parameters (None: its op's)
  MEMORY = False  # `__call__` takes memory / memory_mask (an op's module: its registration's `memory`)
  COMPRESSES = False  # compresses the memories the FIFO evicts (`compress`: Compressive Transformer)
  GRAPH_NODES: type | None = None  # the module that adds node states beside the tokens (BP-Transformer)

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    self.name = str(config.name)
    self.features, self.num_heads, self.head_dim = features, num_heads, head_dim
    self.causal, self.dtype = causal, dtype
    proj = dict(in_axes=("embed",), out_axes=("heads", "kv"), dtype=dtype, rngs=rngs)
    self.query = layers.DenseGeneral((features,), (num_heads, head_dim), **proj)
    self.key = layers.DenseGeneral((features,), (num_heads, head_dim), **proj)
    self.value = layers.DenseGeneral((features,), (num_heads, head_dim), **proj)
    self.out = layers.DenseGeneral((num_heads, head_dim), (features,), in_axes=("heads", "kv"),
                                   out_axes=("embed",), dtype=dtype, rngs=rngs)
    # The ops are fused (no attention matrix ever exists), so "attention dropout" drops the per-head op output
    # before the output projection; with the softmax weights out of reach this is the closest equivalent.
    self.dropout = nnx.Dropout(float(config.get("dropout_rate", None) or 0.0), broadcast_dims=(), rngs=rngs)

  @property
  def takes_memory(self) -> bool:
    """Whether `__call__` takes `memory` / `memory_mask` (segment recurrence)."""
    return self.MEMORY

  def project(self, x: Array) -> tuple[Array, Array, Array]:
    return self.query(x), self.key(x), self.value(x)  # each [batch, length, heads, head_dim]

  def output(self, o: Array, *, deterministic: bool) -> Array:
    o = self.dropout(o, deterministic=deterministic)  # [batch, length, heads, head_dim]
    return self.out(o)  # [batch, length, features]

  # Cached decoding (see `models.transformer.Transformer.init_cache`); modules that support it override these.
  def init_cache(self, batch: int, max_length: int) -> LayerCache:
    raise cli.mark_usage(ValueError(f"attention {self.name!r} has no cached decoding step"))

  def decode_step(self, x: Array, cache: LayerCache, position: Array) -> tuple[Array, LayerCache]:
    raise cli.mark_usage(ValueError(f"attention {self.name!r} has no cached decoding step"))

  def prefill(self, x: Array, cache: LayerCache) -> tuple[Array, LayerCache]:
    raise cli.mark_usage(ValueError(f"attention {self.name!r} has no cached decoding step"))

  def decode(self, x: Array, cache: LayerCache, position: Array | None, *, norm: Any) -> tuple[Array, Any]:
    """The block's decoding of x, its raw input: one token at `position`, or a prompt (position None);
    `norm` is the block's layer norm before the attention."""
    if position is None:
      return self.prefill(norm(x), cache)
    return self.decode_step(norm(x), cache, position)


def implementation_of(config: ml_collections.ConfigDict, spec: ops_registry.OpSpec, name: str) -> str | None:
  """The kernel choice `config.implementation` for an op that takes one (its registration's `fused` path),
  None for an op without the choice; naming a choice for such an op is an error."""
  implementation = str(config.get("implementation", None) or AUTO)
  if ops_registry.takes_implementation(spec):
    return implementation
  if implementation != AUTO:
    raise ValueError(f"attention op {name!r} does not take 'implementation' (got {implementation!r}); "
                     "leave it 'auto'")
  return None


class OpAttention(AttentionBase):
  """Any registered pure op, chosen by `config.name`, with plan parameters `config.params`."""

  FIELDS: dict[str, Field] = {"recompute": RECOMPUTE}

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    self.op_name = str(config.get("op", None) or config.name)
    spec = ops_registry.get(self.op_name)
    if causal and not spec.causal:  # the config's choice: one line from the entry points
      raise cli.mark_usage(ValueError(
          f"config.model.attention.name: attention {self.op_name!r} does not support causal=True (decoder "
          f"LM / image models); choose a causal one (train.py --list)"))
    if not causal and not spec.bidirectional:
      raise cli.mark_usage(ValueError(
          f"config.model.attention.name: attention {self.op_name!r} does not support causal=False "
          f"(encoders); choose a bidirectional one (train.py --list)"))
    self.plan_params = plan_params(config, spec.plan, self.op_name, spec.inputs)
    self.implementation = implementation_of(config, spec, self.op_name)
    self.recompute = bool(config.get("recompute", None) or False)

  @property
  def takes_memory(self) -> bool:
    return ops_registry.get(self.op_name).memory

  def seq_len(self, config: ml_collections.ConfigDict, need: str = "shape its parameters") -> int:
    """The model's sequence length (`config.seq_len`, filled in by models.registry.build), for modules whose
    parameters or plan depend on it; a clear error naming what it is `need`ed for when it is missing."""
    seq_len = config.get("seq_len", None)
    if not seq_len:
      raise ValueError(f"attention {self.op_name!r}: 'seq_len' (the model's sequence length) is needed to "
                       f"{need}; build the module through models.registry.build(..., seq_len=L)")
    return int(seq_len)

  # -- what modules with weights of their own override ------------------------------------------------------

  def op_fn(self) -> Callable[..., Array]:
    """The function `attend` calls (the registered op; a module may wrap it, e.g. for its argument layout)."""
    return ops_registry.get(self.op_name).fn

  def op_inputs(self, q: Array, k: Array, *, x: Array, mask: Array | None,
                params: dict[str, Any]) -> dict[str, Any]:
    """The op arguments the model supplies (its registration's `inputs`: weights, keys, pools), for queries
    from x [batch, L, features] (mask: x's) and the resolved plan parameters."""
    return {}

  def op_kinds(self) -> dict[str, str]:
    """How `attention_core.sharding.attend` splits op arguments it cannot infer (per-head weights: HEADS)."""
    return {}

  def step_kwargs(self, q: Array, k: Array, x: Array, params: dict[str, Any]) -> dict[str, Any]:
    """`op_inputs` for one decoding step (q, k: [batch, 1, heads, head_dim]): per-token arrays at that token,
    functions as they are; modules whose arrays are not per token (weights, features) pass them whole."""
    inputs = self.op_inputs(q, k, x=x, mask=None, params=params)
    return {n: (a if callable(a) else a[:, 0]) for n, a in inputs.items()}

  # -- the attention path ---------------------------------------------------------------------------------

  def call_op(self, fn: Any, q: Array, k: Array, v: Array, mask: Array | None, **kwargs: Any) -> Array:
    """fn(q, k, v, causal, mask, **kwargs) on each device's batch rows and heads of the context mesh
    (`attention_core.sharding`): fused kernels cannot be partitioned."""
    return sharding.attend(fn, q, k, v, mask=mask, kinds=self.op_kinds(), causal=self.causal, **kwargs)

  def __call__(self, x: Array, mask: Array | None, *, deterministic: bool, memory: Array | None = None,
               memory_mask: Array | None = None) -> Array:
    """x: [batch, L, features]; mask: None or [batch, L]; memory (ops declared with one): None or [batch, M,
    features] earlier segments' states, taken as given, with memory_mask [batch, M] (True = valid)."""
    o = self.attend(x, mask, memory, memory_mask)  # [batch, L, heads, head_dim]
    return self.output(o, deterministic=deterministic)  # [batch, L, features]

  def attend(self, x: Array, mask: Array | None, memory: Array | None = None,
             memory_mask: Array | None = None) -> Array:
    """The one attention path: queries from x, keys and values from [memory; x] under their key mask, the op
    (its sequence-parallel form where the mesh splits the sequence) with the plan parameters for x's length
    and the model's inputs, recomputed in the backward pass with `recompute`. -> [batch, L, heads, d]."""
    spec = ops_registry.get(self.op_name)
    if memory is not None and not spec.memory:
      raise ValueError(f"attention {self.op_name!r} takes no memory")
    context, keys = with_memory(x, mask, memory, memory_mask)
    q, k, v = self.query(x), self.key(context), self.value(context)  # [batch, L or M + L, heads, head_dim]
    params = resolve_plan_params(spec, self.plan_params, x.shape[1])
    inputs = self.op_inputs(q, k, x=x, mask=mask, params=params)
    if spec.seq_parallel is not None and sharding.seq_size() > 1:  # maps over the mesh itself
      call = functools.partial(spec.seq_parallel, causal=self.causal)
      run = lambda q, k, v, keys, **kw: call(q, k, v, mask=keys, **kw)  # noqa: E731
    else:
      if self.implementation is not None:
        params["implementation"] = self.implementation
      run = functools.partial(self.call_op, self.op_fn())
    if not self.recompute:
      return run(q, k, v, keys, **params, **inputs)
    # Recomputed: the arrays among the inputs pass as arguments, so that their gradients flow.
    arrays = {n: a for n, a in inputs.items() if isinstance(a, jax.Array)}
    static = {n: a for n, a in inputs.items() if n not in arrays}
    if any(callable(a) for a in static.values()):
      raise ValueError(f"attention {self.op_name!r}: 'recompute' needs array-only op arguments; "
                       f"{sorted(n for n, a in static.items() if callable(a))} is a learned function "
                       "(learned_span_key)")
    names = list(arrays)

    def op(q, k, v, keys, *values):
      return run(q, k, v, keys, **params, **static, **dict(zip(names, values, strict=True)))

    return recompute.recompute_in_backward(op, q, k, v, keys, *arrays.values())

  # -- cached decoding ------------------------------------------------------------------------------------

  def _decoding(self, max_length: int) -> tuple[Any, dict[str, Any]]:
    spec = ops_registry.get(self.op_name)
    decoder = check_decodable(spec)
    if not self.causal:
      raise ValueError(f"attention {self.op_name!r}: cached decoding needs a causal model")
    return decoder, resolve_plan_params(spec, self.plan_params, max_length)

  def init_cache(self, batch: int, max_length: int) -> LayerCache:
    """An empty cache for up to `max_length` tokens ("auto" plan parameters are chosen for that length)."""
    decoder, params = self._decoding(max_length)
    state = decoder.init_cache(batch, self.num_heads, max_length, self.head_dim, self.head_dim, self.dtype,
                               **params)
    return LayerCache(state, max_length)

  def decode_step(self, x: Array, cache: LayerCache, position: Array) -> tuple[Array, LayerCache]:
    """x: [batch, 1, features], the token at `position` -> ([batch, 1, features], cache); equals row
    `position` of the causal forward pass over `cache.max_length` tokens."""
    decoder, params = self._decoding(cache.max_length)
    q, k, v = self.project(x)  # [batch, 1, heads, head_dim]
    o, state = decoder.step(cache.state, q[:, 0], k[:, 0], v[:, 0], position, **params,
                            **self.step_kwargs(q, k, x, params))
    return self.out(o[:, None]), LayerCache(state, cache.max_length)  # [batch, 1, features]

  def prefill_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
    """Which of the prompt's `op_inputs` the decoder's prefill takes (all: a decoder that takes pools)."""
    return inputs

  def prefill(self, x: Array, cache: LayerCache) -> tuple[Array, LayerCache]:
    """x: [batch, prompt_length, features] at positions [0, prompt_length): the forward pass's output and the
    cache filled with those positions."""
    decoder, params = self._decoding(cache.max_length)
    q, k, v = self.project(x)  # [batch, prompt_length, heads, head_dim]
    inputs = self.op_inputs(q, k, x=x, mask=None, params=params)
    chosen = {} if self.implementation is None else {"implementation": self.implementation}
    attend = functools.partial(sharding.attend, self.op_fn(), kinds=self.op_kinds(), causal=True, **params,
                               **chosen, **inputs)
    if decoder.pad_prompt:  # the plan of max_length tokens; the padding is after every prompt row
      pad = [(0, 0), (0, cache.max_length - x.shape[1]), (0, 0), (0, 0)]
      o = attend(*(jnp.pad(a, pad) for a in (q, k, v)))[:, :x.shape[1]]
    else:
      o = attend(q, k, v)
    state = decoder.prefill(cache.state, q, k, v, **params, **self.prefill_inputs(inputs))
    return self.out(o), LayerCache(state, cache.max_length)  # [batch, prompt_length, features]


def per_head_init(key: Array, shape: tuple[int, ...], dtype: Any) -> Array:
  """lecun-normal init of one [in, out] matrix per head: shape [heads, in, out]."""
  return jax.vmap(lambda kk: layers.default_kernel_init(kk, shape[1:], dtype))(
      jax.random.split(key, shape[0]))


class DeepSetsPool(nnx.Module):
  """relu(Dense(x)) per head (paper Table 3): the vectors the op pools into span abstractions."""

  def __init__(self, num_heads: int, head_dim: int, *, dtype: Any, rngs: nnx.Rngs):
    # One kernel per head: [heads, head_dim, head_dim].
    self.kernel = layers.param(rngs, per_head_init, (num_heads, head_dim, head_dim), ("heads", "kv", None))
    self.bias = layers.param(rngs, layers.zeros_init, (num_heads, head_dim), ("heads", None))

  def __call__(self, x: Array) -> Array:  # x: [batch, length, heads, head_dim]
    y = jnp.einsum("blhd,hde->blhe", x, self.kernel[...].astype(x.dtype)) + self.bias[...].astype(x.dtype)
    return jax.nn.relu(y)  # [batch, length, heads, head_dim]


class SpanKey(nnx.Module):
  """A learned row-summary key for axial rowmajor: pooled key -> dense, residual, layer norm, key projection,
  per head. An approximation of the released code's summary key, which is per column, computed from the
  row-attention output and mixes heads (docs/design.md section 4). Maps [batch, rows, heads, head_dim] to the
  same shape."""

  def __init__(self, num_heads: int, head_dim: int, *, dtype: Any, rngs: nnx.Rngs):
    self.dense = layers.param(rngs, per_head_init, (num_heads, head_dim, head_dim), ("heads", "kv", None))
    self.dense_bias = layers.param(rngs, layers.zeros_init, (num_heads, head_dim), ("heads", None))
    self.norm_scale = layers.param(rngs, layers.ones_init, (num_heads, head_dim), ("heads", None))
    self.norm_bias = layers.param(rngs, layers.zeros_init, (num_heads, head_dim), ("heads", None))
    self.proj = layers.param(rngs, per_head_init, (num_heads, head_dim, head_dim), ("heads", "kv", None))

  def __call__(self, s: Array) -> Array:  # s: [batch, rows, heads, head_dim]
    dt = s.dtype
    h = s + jnp.einsum("brhd,hde->brhe", s, self.dense[...].astype(dt)) + self.dense_bias[...].astype(dt)
    h = (layer_norm(h) * self.norm_scale[...] + self.norm_bias[...]).astype(dt)
    return jnp.einsum("brhd,hde->brhe", h, self.proj[...].astype(dt))  # [batch, rows, heads, head_dim]


class CombinerAttention(OpAttention):
  """A Combiner op plus the model-level options.

  config.deepsets: pool relu(Dense_q(q)) / relu(Dense_k(k)) (separate parameters) instead of q / k for the
    span abstractions; the pooling kind (max | mean) stays the op's `params.pooling`.
  config.learned_span_key: axial rowmajor only; span keys pass through `SpanKey`.
  """

  FIELDS = {
    "deepsets": Field(bool, "pool relu(Dense(q)) / relu(Dense(k)) into the span abstractions (Table 3)"),
    "recompute": RECOMPUTE,
    "learned_span_key": Field(bool, "axial rowmajor: a learned row-summary span key per head, from the "
                              "pooled key (an approximation of the released code's per-column key)"),
  }

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    inputs = ops_registry.get(self.op_name).inputs
    self.use_deepsets = bool(config.get("deepsets", False))
    self.use_span_key = bool(config.get("learned_span_key", False))
    if self.use_deepsets and "pool_q" not in inputs:
      raise ValueError(f"attention {self.op_name!r}: 'deepsets' needs an op with pool_q/pool_k arguments")
    if self.use_span_key and "span_key_fn" not in inputs:
      raise ValueError(f"attention {self.op_name!r}: 'learned_span_key' is only for combiner_axial_rowmajor "
                       "(an op with a span_key_fn argument)")
    self.pool_q = DeepSetsPool(num_heads, head_dim, dtype=dtype, rngs=rngs) if self.use_deepsets else None
    self.pool_k = DeepSetsPool(num_heads, head_dim, dtype=dtype, rngs=rngs) if self.use_deepsets else None
    self.span_key = SpanKey(num_heads, head_dim, dtype=dtype, rngs=rngs) if self.use_span_key else None

  def op_kinds(self) -> dict[str, str]:
    return {"span_key_fn": sharding.HEADS}  # SpanKey's parameters are per head

  def op_inputs(self, q: Array, k: Array, *, x: Array, mask: Array | None,
                params: dict[str, Any]) -> dict[str, Any]:
    inputs = {}
    if self.pool_q is not None:
      inputs.update(pool_q=self.pool_q(q), pool_k=self.pool_k(k))
    if self.span_key is not None:
      inputs["span_key_fn"] = self.span_key
    return inputs
