"""Attention modules: multi-head projections around a pure op registered in `attention_core.registry`
   (docs/design.md
section 3).

`AttentionBase` owns what every attention module shares (q/k/v/output projections with logical axis names,
heads, compute dtype, output dropout, the plan parameters from the config); `OpAttention` wraps any registered
pure op by name, so a new op needs no module of its own; `CombinerAttention` adds the model-level Combiner
options of the paper (Table 3 DeepSets pooling, the row-major learned span key of the released code).
The constructor signature and call convention are documented in `models/registry.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
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

Array = Any
AUTO = "auto"

# Fields of `config.model.attention` every module understands; plan parameters live in `params`.
COMMON_FIELDS = ("name", "params", "dropout_rate", "implementation")


@dataclasses.dataclass(frozen=True)
class Field:
  """A `config.model.attention` field a module reads, declared in the module's `FIELDS` {name: Field}.

  A config holds only the fields it sets; absent or None means the module's default. The entry points check
  a set value against `kind` (int is accepted for float, a list for tuple) and `minimum` before building
  (models.registry.check_fields), so a bad value is a one-line error naming the field."""
  kind: type  # bool | int | float | str | tuple
  help: str
  minimum: float | None = None


# Fields several modules read.
RECOMPUTE = Field(bool, "recompute the op in the backward pass instead of keeping its intermediates "
                  "(models.recompute): same gradients, one extra op forward")
SEQ_LEN = Field(int, "the model's sequence length; filled in by models.registry.build when unset "
                "(state shaped at construction)", minimum=1)


# Keyword-only op arguments that are not plan parameters (the contract's own and the model's inputs).
NON_PLAN_KEYWORDS = ("causal", "mask", "pool_q", "pool_k", "span_key_fn", "implementation")


def is_auto(value: Any) -> bool:
  return isinstance(value, str) and value == AUTO


def plan_value(value: Any) -> Any:
  """A plan parameter as configs hold it: "16" from a command-line override of "auto" becomes 16."""
  if isinstance(value, str) and value.lstrip("-").isdigit():
    return int(value)
  return value


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


def op_parameters(spec: ops_registry.OpSpec) -> list[str] | None:
  """The plan parameters an op takes (keyword-only, minus the contract's own); None if it takes **kwargs."""
  sig = inspect.signature(spec.fn)
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
    return None
  return [n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
          and n not in NON_PLAN_KEYWORDS]


def check_op_kwargs(spec: ops_registry.OpSpec, names: list[str]) -> None:
  """Plan parameters the op's signature does not accept are config errors, reported with the accepted ones."""
  accepted = op_parameters(spec)
  if accepted is None:
    return
  for name in names:
    if name not in accepted:
      raise ValueError(f"attention op {spec.name!r} does not take parameter {name!r}; "
                       f"its parameters: {accepted}")


def op_function(spec: ops_registry.OpSpec) -> Any:
  """The op itself, or its sequence-parallel form (the registration's `seq_parallel`) when the current mesh
  (JAX's context mesh, which train steps trace in: `attention_core.sharding.traced_in`, or `jax.set_mesh`)
  splits the sequence over its "seq" axis. Ops without one run as they are, the partitioner gathering the
  sequence."""
  if spec.seq_parallel is not None and sharding.seq_size() > 1:
    return spec.seq_parallel
  return spec.fn


@flax.struct.dataclass
class LayerCache:
  """One attention layer's decoding cache: the op's arrays and the length its plan was chosen for."""

  state: Any  # the op decoder's cache (a dict of arrays)
  max_length: int = flax.struct.field(pytree_node=False)


def check_decodable(spec: ops_registry.OpSpec) -> Any:
  """The op's decoder, or a ValueError naming the op (and the ops that have one)."""
  if spec.decode is None:
    have = [n for n in ops_registry.names() if ops_registry.get(n).decode is not None]
    raise ValueError(f"attention op {spec.name!r} has no cached decoding step; ops with one: {have}")
  return spec.decode


class AttentionBase(nnx.Module):
  """Multi-head projections shared by all attention modules.

  x: [batch, length, features] -> q, k, v: [batch, length, heads, head_dim] in `dtype`;
  the output projection maps [batch, length, heads, head_dim] back to [batch, length, features].
  """

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

  def project(self, x: Array) -> tuple[Array, Array, Array]:
    return self.query(x), self.key(x), self.value(x)  # each [batch, length, heads, head_dim]

  def output(self, o: Array, *, deterministic: bool) -> Array:
    o = self.dropout(o, deterministic=deterministic)  # [batch, length, heads, head_dim]
    return self.out(o)  # [batch, length, features]

  # Cached decoding (see `models.transformer.Transformer.init_cache`); modules that support it override these.
  def init_cache(self, batch: int, max_length: int) -> LayerCache:
    raise ValueError(f"attention {self.name!r} has no cached decoding step")

  def decode_step(self, x: Array, cache: LayerCache, position: Array) -> tuple[Array, LayerCache]:
    raise ValueError(f"attention {self.name!r} has no cached decoding step")

  def prefill(self, x: Array, cache: LayerCache) -> tuple[Array, LayerCache]:
    raise ValueError(f"attention {self.name!r} has no cached decoding step")


class OpAttention(AttentionBase):
  """Any registered pure op, chosen by `config.name`, with plan parameters `config.params`."""

  FIELDS: dict[str, Field] = {"recompute": RECOMPUTE}  # config fields beyond COMMON_FIELDS

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    self.op_name = str(config.get("op", None) or config.name)
    spec = ops_registry.get(self.op_name)
    if causal and not spec.causal:
      raise ValueError(f"attention {self.op_name!r} does not support causal=True "
                       "(decoder LM / image models); choose a causal op")
    if not causal and not spec.bidirectional:
      raise ValueError(f"attention {self.op_name!r} does not support causal=False (encoders); "
                       "choose a bidirectional op")
    params = config.get("params", None)
    params = dict(params.to_dict() if isinstance(params, ml_collections.ConfigDict) else (params or {}))
    # "auto" entries the op does not take are dropped: configs pre-fill "auto" for their default attention so
    # that `--config.model.attention.params.block_size=64` works, and a later switch of op must not trip on
    # it.
    accepted = op_parameters(spec)
    self.plan_params = {k: v for k, v in params.items() if not (v == AUTO and accepted is not None
                                                               and k not in accepted)}
    check_op_kwargs(spec, list(self.plan_params))
    # Kernel choice, passed to ops that take it; naming one for an op without the choice is an error.
    implementation = str(config.get("implementation", None) or AUTO)
    self.implementation = implementation if ops_registry.takes_implementation(spec) else None
    if self.implementation is None and implementation != AUTO:
      raise ValueError(f"attention op {self.op_name!r} does not take 'implementation' "
                       f"(got {implementation!r}); leave it 'auto'")
    # Recompute the op in the backward pass instead of keeping its intermediates (models.recompute).
    self.recompute = bool(config.get("recompute", None) or False)

  def seq_len(self, config: ml_collections.ConfigDict, need: str = "shape its parameters") -> int:
    """The model's sequence length (`config.seq_len`, filled in by models.registry.build), for modules whose
    parameters or plan depend on it; a clear error naming what it is `need`ed for when it is missing."""
    seq_len = config.get("seq_len", None)
    if not seq_len:
      raise ValueError(f"attention {self.op_name!r}: 'seq_len' (the model's sequence length) is needed to "
                       f"{need}; build the module through models.registry.build(..., seq_len=L)")
    return int(seq_len)

  def op_kwargs(self, q: Array, k: Array) -> dict[str, Any]:
    """Extra keyword arguments for the op (subclasses add model-level options)."""
    return {}

  def op_kinds(self) -> dict[str, str]:
    """How `attention_core.sharding.attend` splits op arguments it cannot infer (per-head weights: HEADS)."""
    return {}

  def call_op(self, fn: Any, q: Array, k: Array, v: Array, mask: Array | None, **kwargs: Any) -> Array:
    """fn(q, k, v, causal, mask, **kwargs) on each device's batch rows and heads of the context mesh
    (`attention_core.sharding`): fused kernels cannot be partitioned."""
    return sharding.attend(fn, q, k, v, mask=mask, kinds=self.op_kinds(), causal=self.causal, **kwargs)

  def step_kwargs(self, q: Array, k: Array) -> dict[str, Any]:
    """`op_kwargs` for one decoding step (q, k: [batch, 1, heads, head_dim]): per-token arrays at that token,
    functions as they are; subclasses whose arrays are not per token (Performer's features) pass them
    whole."""
    return {n: (a if callable(a) else a[:, 0]) for n, a in self.op_kwargs(q, k).items()}

  def __call__(self, x: Array, mask: Array | None, *, deterministic: bool) -> Array:
    q, k, v = self.project(x)  # [batch, length, heads, head_dim]
    spec = ops_registry.get(self.op_name)
    fn = op_function(spec)
    params = resolve_plan_params(spec, self.plan_params, x.shape[1])
    if self.implementation is not None and fn is spec.fn:  # sequence-parallel counterparts have no choice
      params["implementation"] = self.implementation
    extra = self.op_kwargs(q, k)
    # Sequence-parallel counterparts map over the mesh themselves (batch, heads and sequence).
    call = functools.partial(self.call_op, fn) if fn is spec.fn else (
        lambda q, k, v, mask, **kw: fn(q, k, v, causal=self.causal, mask=mask, **kw))
    o = self.attend(call, q, k, v, mask, params, extra)
    return self.output(o, deterministic=deterministic)  # [batch, length, features]

  def attend(self, call: Any, q: Array, k: Array, v: Array, mask: Array | None, params: dict[str, Any],
             extra: dict[str, Any]) -> Array:
    """call(q, k, v, mask, **params, **extra), or with `recompute` the same recomputed in the backward pass
    (the arrays of `extra` pass through as arguments, so their gradients flow)."""
    if not self.recompute:
      return call(q, k, v, mask, **params, **extra)
    arrays = {name: a for name, a in extra.items() if not callable(a)}
    if len(arrays) != len(extra):
      raise ValueError(f"attention {self.op_name!r}: 'recompute' needs array-only op arguments; "
                       f"{sorted(set(extra) - set(arrays))} is a learned function (learned_span_key)")
    names = list(arrays)

    def op(q, k, v, mask, *rest):
      return call(q, k, v, mask, **params, **dict(zip(names, rest, strict=True)))

    return recompute.recompute_in_backward(op, q, k, v, mask, *arrays.values())

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
                               **{k: v for k, v in params.items() if k != "span_key_fn"})
    return LayerCache(state, max_length)

  def decode_step(self, x: Array, cache: LayerCache, position: Array) -> tuple[Array, LayerCache]:
    """x: [batch, 1, features], the token at `position` -> ([batch, 1, features], cache); equals row
    `position` of the causal forward pass over `cache.max_length` tokens."""
    decoder, params = self._decoding(cache.max_length)
    q, k, v = self.project(x)  # [batch, 1, heads, head_dim]
    o, state = decoder.step(cache.state, q[:, 0], k[:, 0], v[:, 0], position, **params,
                            **self.step_kwargs(q, k))
    return self.out(o[:, None]), LayerCache(state, cache.max_length)  # [batch, 1, features]

  def prefill(self, x: Array, cache: LayerCache) -> tuple[Array, LayerCache]:
    """x: [batch, prompt_length, features] at positions [0, prompt_length): the forward pass's output and the
    cache filled with those positions."""
    decoder, params = self._decoding(cache.max_length)
    q, k, v = self.project(x)  # [batch, prompt_length, heads, head_dim]
    extra = self.op_kwargs(q, k)
    chosen = {} if self.implementation is None else {"implementation": self.implementation}
    fn = ops_registry.get(self.op_name).fn
    kinds = self.op_kinds()
    if decoder.pad_prompt:  # the plan of max_length tokens; the padding is after every prompt row
      pad = [(0, 0), (0, cache.max_length - x.shape[1]), (0, 0), (0, 0)]
      o = sharding.attend(fn, *(jnp.pad(a, pad) for a in (q, k, v)), kinds=kinds, causal=True, **params,
                          **chosen, **extra)[:, :x.shape[1]]
    else:
      o = sharding.attend(fn, q, k, v, kinds=kinds, causal=True, **params, **chosen, **extra)
    state = decoder.prefill(cache.state, q, k, v, **params, **extra)
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
    sig = inspect.signature(ops_registry.get(self.op_name).fn).parameters
    self.use_deepsets = bool(config.get("deepsets", False))
    self.use_span_key = bool(config.get("learned_span_key", False))
    if self.use_deepsets and "pool_q" not in sig:
      raise ValueError(f"attention {self.op_name!r}: 'deepsets' needs an op with pool_q/pool_k arguments")
    if self.use_span_key and "span_key_fn" not in sig:
      raise ValueError(f"attention {self.op_name!r}: 'learned_span_key' is only for combiner_axial_rowmajor "
                       "(an op with a span_key_fn argument)")
    self.pool_q = DeepSetsPool(num_heads, head_dim, dtype=dtype, rngs=rngs) if self.use_deepsets else None
    self.pool_k = DeepSetsPool(num_heads, head_dim, dtype=dtype, rngs=rngs) if self.use_deepsets else None
    self.span_key = SpanKey(num_heads, head_dim, dtype=dtype, rngs=rngs) if self.use_span_key else None

  def op_kinds(self) -> dict[str, str]:
    return {"span_key_fn": sharding.HEADS}  # SpanKey's parameters are per head

  def op_kwargs(self, q: Array, k: Array) -> dict[str, Any]:
    kwargs = {}
    if self.pool_q is not None:
      kwargs.update(pool_q=self.pool_q(q), pool_k=self.pool_k(k))
    if self.span_key is not None:
      kwargs["span_key_fn"] = self.span_key
    return kwargs
