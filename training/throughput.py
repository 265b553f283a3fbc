"""What a training step costs and how fast it runs: model FLOPs, MFU, device memory, a profiler window.

Model FLOPs per step (`model_flops`), forward + backward, estimated from the config without running anything:

- Non-attention: `6 * N * tokens`, N the parameters of the matrices every token goes through (projections,
  MLP, the LM head; ndim >= 2 without biases; the token and position embedding tables excluded: they are
  looked up, not multiplied);
  2 FLOPs per multiply-add in the forward pass and twice that in the backward (input and weight gradients).
  Per-example matrices (a classifier's pooled head) count once per example; a retrieval model runs its encoder
  on both inputs. Layer norms, biases and activations are left out (a few FLOPs per activation).
- Attention: the registered op's forward FLOPs from XLA's cost analysis of
  `jax.jit(op).lower(ShapeDtypeStructs at the model's shape)` on the XLA path, times 3 for forward + backward,
  times the layers. Nothing is tabulated per op: a new registration is covered as it is. XLA counts the body
  of a loop once, so every `scan` in the op's jaxpr adds (length - 1) times its body's cost (nested scans
  too).
  Recomputation (`remat`, `recompute`) is not counted: these are model FLOPs, the MFU convention.

MFU = model FLOPs per second / (the devices' peak FLOP/s), with the peak per chip by device kind and compute
dtype: a TPU's from runtime/tpu_generations.py (its dense bf16 figure, also for float32, which its default
matmul precision runs in bf16 passes), a GPU's from `GPU_PEAK_FLOPS` (float32 at TF32). Unknown devices (the
CPU) have no peak: MFU is not reported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from attention_core import registry as op_registry
from models import attention as model_attention
from models import stacked, transformer
from runtime import tpu_generations
from training import recurrence

# Peak dense FLOP/s per GPU by the start of `device_kind` (lowercase), first match wins: {dtype: FLOP/s}.
# NVIDIA H100/H200 datasheets (SXM; PCIe separately), without sparsity.
GPU_PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("nvidia h100 pcie", {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12}),
    ("nvidia h100", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12}),
    ("nvidia h200", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12}),
)
TPU_DTYPES = ("bfloat16", "float16", "float32")  # what a TPU's bf16 peak applies to


def peak_flops(device_kind: str, dtype: str) -> float | None:
  """Peak FLOP/s of one device of `device_kind` computing in `dtype` (a config's model.dtype), or None when
  there is no figure (the CPU, float64, an unlisted accelerator)."""
  tpu = tpu_generations.of_device(device_kind)
  if tpu is not None:
    return tpu.peak_flops if str(dtype) in TPU_DTYPES else None
  kind = device_kind.strip().lower()
  for prefix, by_dtype in GPU_PEAK_FLOPS:
    if kind.startswith(prefix):
      return by_dtype.get(str(dtype))
  return None


def mfu(flops_per_step: float | None, steps_per_s: float, peak_per_device: float | None,
        num_devices: int) -> float | None:
  """Model FLOPs utilization in [0, 1] (None when either figure is unknown)."""
  if not flops_per_step or not peak_per_device:
    return None
  return flops_per_step * steps_per_s / (peak_per_device * num_devices)


def memory(devices: list[Any]) -> dict[str, float]:
  """Device memory in use and its peak (GB, the largest over `devices`) where `memory_stats()` has them
  (GPUs, TPUs; the CPU has none: empty)."""
  used, peak = [], []
  for d in devices:
    try:
      stats = d.memory_stats() or {}
    except Exception:  # a backend without the call
      stats = {}
    if "bytes_in_use" in stats:
      used.append(stats["bytes_in_use"])
    if "peak_bytes_in_use" in stats:
      peak.append(stats["peak_bytes_in_use"])
  out = {}
  if used:
    out["mem_gb"] = max(used) / 1e9
  if peak:
    out["peak_mem_gb"] = max(peak) / 1e9
  return out


# -----------------------------------------------------------------------------------------------------------
# FLOPs


def _sub_jaxprs(eqn: Any) -> list[jex.ClosedJaxpr]:
  found = []
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, jex.ClosedJaxpr):
        found.append(v)
      elif isinstance(v, jex.Jaxpr):
        found.append(jex.ClosedJaxpr(v, []))
  return found


def _first(cost: Any) -> dict[str, float]:
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0] if cost else {}
  return cost or {}


def _xla_flops(closed: jex.ClosedJaxpr) -> float:
  args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
  lowered = jax.jit(jex.jaxpr_as_fun(closed)).lower(*args)
  try:
    cost = _first(lowered.cost_analysis())
  except NotImplementedError:  # PJRT plugins (GPU) have no cost analysis before compilation
    cost = {}
  if "flops" not in cost:  # read from the compiled program instead (the GPU plugin answers there)
    cost = _first(lowered.compile().cost_analysis())
  return float(cost.get("flops", 0.0))


def _loop_extra(closed: jex.ClosedJaxpr) -> float:
  """FLOPs XLA's cost analysis leaves out of `closed`: (length - 1) bodies of every scan, at any depth."""
  extra = 0.0
  for eqn in closed.jaxpr.eqns:
    if eqn.primitive.name == "scan":
      # XLA counted the body once (its inner loops once too): the scan is `length` whole bodies.
      body, length = eqn.params["jaxpr"], int(eqn.params["length"])
      extra += (length - 1) * _xla_flops(body) + length * _loop_extra(body)
    else:
      for sub in _sub_jaxprs(eqn):
        extra += _loop_extra(sub)
  return extra


def function_flops(fn: Callable[..., Any], *args: Any) -> float:
  """Forward FLOPs of `fn(*args)` (args: arrays or ShapeDtypeStructs, any pytree) by XLA's cost analysis of
  its lowering, with every scan counted `length` times (XLA counts a loop body once)."""
  closed = jax.make_jaxpr(fn)(*args)
  return _xla_flops(closed) + _loop_extra(closed)


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


def attention_op_flops(name: str, params: dict[str, Any], *, batch: int, length: int, heads: int,
                       head_dim: int, dtype: Any, causal: bool, memory: int = 0) -> float:
  """Forward FLOPs of one call of the registered op `name` on [batch, length, heads, head_dim] queries and
  [batch, memory + length, heads, head_dim] keys and values (with a [batch, memory + length] key mask, as the
  models pass one; `memory` > 0: segment recurrence), its config plan parameters resolved as the model
  resolves them ("auto" = the registration's `params(L)`), model-owned arguments from its `bench_inputs`.
  Remembered per process (runs of the same shapes, as tests and resumed runs make, lower the op once)."""
  key = (name, tuple(sorted(params.items())), batch, length, heads, head_dim, jnp.dtype(dtype).name, causal,
         memory)
  try:
    return _op_flops_cached(*key)
  except TypeError:  # an unhashable plan parameter: not remembered
    return _op_flops(name, params, batch, length, heads, head_dim, dtype, causal, memory)


@functools.lru_cache(maxsize=64)
def _op_flops_cached(name: str, params: tuple, batch: int, length: int, heads: int, head_dim: int, dtype: str,
                     causal: bool, memory: int) -> float:
  return _op_flops(name, dict(params), batch, length, heads, head_dim, jnp.dtype(dtype), causal, memory)


def _op_flops(name: str, params: dict[str, Any], batch: int, length: int, heads: int, head_dim: int,
              dtype: Any, causal: bool, memory: int) -> float:
  spec = op_registry.get(name)
  plan = {k: v for k, v in params.items() if not (model_attention.is_auto(v) and k not in spec.plan)}
  plan = model_attention.resolve_plan_params(spec, plan, length)
  keys = memory + length  # the model-owned inputs (relative embeddings) cover every distance a key is read at
  inputs = op_registry.bench_params(spec, keys, batch=batch, heads=heads, head_dim=head_dim, dtype=dtype)
  static = {**{k: v for k, v in inputs.items() if not isinstance(v, jax.Array)}, **plan}
  arrays = {k: v for k, v in inputs.items() if isinstance(v, jax.Array) and k not in plan}
  if op_registry.takes_implementation(spec):
    static["implementation"] = "xla"
  q = jax.ShapeDtypeStruct((batch, length, heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, keys, heads, head_dim), dtype)
  mask = jax.ShapeDtypeStruct((batch, keys), jnp.bool_)

  def op(q, k, v, mask, arrays):
    return spec.fn(q, k, v, causal=causal, mask=mask, **static, **arrays)

  return function_flops(op, q, kv, kv, mask, _abstract(arrays))


def _not_a_matmul(path: str) -> bool:
  """Embedding and position tables (looked up), biases and norm scales (added, multiplied elementwise)."""
  return any(name in path for name in ("['embedding']", "['pos']", "['bias']", "['scale']"))


def matmul_params(abstract_params: Any) -> tuple[int, int]:
  """(per-token, per-example) parameter counts of the model's matrices: ndim >= 2, without the embedding and
  position tables and without biases (per-head biases are 2-d); per-example = those outside the encoder (the
  caller adds an LM head to the per-token ones; a classifier's pooled MLP stays per example). Stacked blocks'
  layer axis (models/stacked.py) is not a matrix dimension."""
  per_token = per_example = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params,
                                                        is_leaf=lambda x: isinstance(x, nnx.Variable)):
    key = jax.tree_util.keystr(path)
    shape = np.shape(leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf)
    if len(shape) - stacked.is_stacked(leaf) < 2 or _not_a_matmul(key):
      continue
    size = int(np.prod(shape))
    if key.startswith("['encoder']"):
      per_token += size
    else:
      per_example += size
  return per_token, per_example


def model_flops(model_cfg: ml_collections.ConfigDict, *, task: str, abstract_params: Any, batch: int,
                seq_len: int) -> dict[str, Any]:
  """Model FLOPs of one training step (forward + backward) of `batch` examples of `seq_len` tokens: a dict
  with `total`, `non_attention`, `attention` (None with a `note` when the op cannot be costed) and
  `tokens`. With segment recurrence the attention reads the memory's keys too (and the Compressive
  Transformer's compressed memory)."""
  encodes = 2 if task == "retrieval" else 1
  tokens = batch * seq_len * encodes
  per_token, per_example = matmul_params(abstract_params)
  if task in ("lm", "image", "mlm"):  # the LM head is applied at every position
    per_token, per_example = per_token + per_example, 0
  non_attention = 6.0 * (per_token * tokens + per_example * batch)
  att = model_cfg.attention
  name = str(att.get("op", None) or att.name)
  heads = int(model_cfg.num_heads)
  head_dim = int(model_cfg.get("head_dim", None) or model_cfg.features // heads)
  dtype = transformer.dtype_of(str(model_cfg.get("dtype", "float32")))
  params = att.params.to_dict() if isinstance(att.params, ml_collections.ConfigDict) else dict(att.params)
  out: dict[str, Any] = {"tokens": tokens, "non_attention": non_attention, "attention": None, "total": None}
  if name not in op_registry.names():
    out["note"] = f"attention {name!r} is a module without a registered op"
    return out
  try:
    fwd = attention_op_flops(name, params, batch=batch, length=seq_len, heads=heads, head_dim=head_dim,
                             dtype=dtype, causal=task in transformer.CAUSAL_TASKS,
                             memory=memory_keys(model_cfg))
  except Exception as e:  # an estimate never stops a run
    first = (str(e).splitlines() or [""])[0][:120]
    out["note"] = f"attention {name!r} could not be costed: {type(e).__name__}: {first}"
    return out
  out["attention"] = 3.0 * fwd * int(model_cfg.num_layers) * encodes
  out["total"] = non_attention + out["attention"]
  return out


def memory_keys(model_cfg: ml_collections.ConfigDict) -> int:
  """Keys each layer's attention reads before its segment's: the memory and, beside it, the compressed memory
  (0 without segment recurrence)."""
  mem_len, _ = recurrence.lengths(model_cfg)
  return mem_len + int(model_cfg.get("compressed_mem_len", 0) or 0) if mem_len else 0


def describe(flops: dict[str, Any]) -> str:
  """One line for the log: the step's model FLOPs and their parts."""
  if flops["total"] is None:
    return (f"model FLOPs per step: unknown ({flops.get('note', '')}); non-attention "
            f"{flops['non_attention']:.3g}; MFU not reported")
  return (f"model FLOPs per step: {flops['total']:.3g} (6*N*tokens {flops['non_attention']:.3g} + attention "
          f"{flops['attention']:.3g}, fwd+bwd) for {flops['tokens']:,} tokens")


# -----------------------------------------------------------------------------------------------------------
# Profiler window


class ProfileWindow:
  """A `jax.profiler` trace of the steps that take the state from step `start` to step `stop`
  (`config.train.profile_steps`), written to `logdir`; a run resumed inside the window traces from its first
  step. `before_step(step)` before a step runs, `ends_at(step)` and `close()` once the state is at `step`."""

  def __init__(self, steps: Any, logdir: str, *, enabled: bool = True):
    self.start, self.stop = (int(steps[0]), int(steps[1])) if steps is not None and enabled else (None, None)
    self.logdir = logdir
    self.active = False
    self.written = False

  def before_step(self, step: int) -> None:
    if self.start is not None and not self.active and not self.written and self.start <= step < self.stop:
      jax.profiler.start_trace(self.logdir)
      self.active = True

  def ends_at(self, step: int) -> bool:
    """Whether the trace ends now that the state is at `step` (the caller waits for the step, then
    `close`)."""
    return self.active and step >= self.stop

  def close(self) -> None:
    if self.active:
      self.active = False
      self.written = True
      jax.profiler.stop_trace()
