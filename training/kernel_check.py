"""The model's fused attention kernel checked on the device before the first training step.

On a GPU or TPU `implementation="auto"` runs fused kernels (Pallas: Triton on GPU, Mosaic on TPU): the
Combiner plans' kernels (combiner/kernel_plans.py), dense's cuDNN / Splash kernel (on TPU local's
and Longformer's too) and YOSO's bucket-table kernels (yoso/kernels.py, chosen by `params.formulation`). A
kernel that does not compile there would kill every worker at the first jit. `checked_config` runs before the
experiment is built (training/loop.py):

1. it compiles the model's attention layer (projections and op, forward and backward) with the kernel, at
   the shapes each device runs it at (batch rows over the data axes, heads over "model"; `sharding.attend`)
   and in the model's dtype;
2. it runs a small case (one row, at most 256 tokens, two heads) with the kernel and with the XLA path, same
   parameters and inputs, and compares the output and the gradients (inputs and parameters) by relative L2
   error against the tolerance of scripts/check_kernels.py (1e-2 float32, 5e-2 bfloat16).

On a failure the decision depends on what was asked: under "auto" one WARNING line gives the reason, the run
trains on the XLA path (the returned config has `implementation="xla"`, or `params.formulation="sorted"` for
YOSO, a copy: config.json keeps the config as given, so a resume checks and falls back the same way), and
`<workdir>/status/kernel_check.json` records it; a kernel named explicitly ("pallas", "flash") raises
KernelCheckFailed (train.py: one ERROR line, exit 1). Every process makes the same decision (a failure on one
host is a failure on all). Where "auto" means XLA (a CPU), or the op has no kernel choice, nothing runs.

Test hook: the environment variable KERNEL_CHECK_INJECT=<message> makes the kernel's compile raise
<message>, as a Mosaic or Triton error would, and makes the check run also where "auto" means XLA.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attention_core import contract, sharding
from attention_core import registry as ops_registry

INJECT_ENV = "KERNEL_CHECK_INJECT"
RECORD = "kernel_check"  # <workdir>/status/kernel_check.json (training/status.py)
TOLERANCE = {"float32": 1e-2, "bfloat16": 5e-2, "float64": 1e-6}
ACCELERATORS = ("gpu", "tpu")
SMALL_LENGTH, SMALL_HEADS = 256, 2


class KernelCheckFailed(RuntimeError):
  """A kernel named explicitly in the config failed its check: training does not start."""


class InjectedKernelFailure(RuntimeError):
  """The failure KERNEL_CHECK_INJECT stands for (a Mosaic / Triton compile error)."""


@dataclasses.dataclass(frozen=True)
class Choice:
  """Where the config chooses the op's kernel: `field` of config.model.attention holds `requested`; `xla`
  is the value of the XLA path."""

  op: str
  field: str  # "implementation" or "params.formulation"
  requested: str  # "auto", or a kernel named explicitly ("pallas", "flash")
  xla: str  # "xla" or "sorted"

  @property
  def explicit(self) -> bool:
    return self.requested != "auto"


def kernel_choice(config: ml_collections.ConfigDict) -> Choice | None:
  """The model attention's kernel choice, None when its op has none or the config asks for the XLA path."""

  att = config.model.attention
  name = str(att.get("op", None) or att.name)
  if name not in ops_registry.names():
    return None  # a model-only module (tests)
  path = ops_registry.fused_path(ops_registry.get(name))
  if path is None:
    return None
  if path.argument == "implementation":
    choice = Choice(name, "implementation", str(att.get("implementation", None) or "auto"), path.reference)
  else:  # an op parameter: formulation
    params = att.get("params", None) or {}
    value = params.get(path.argument, None)
    choice = Choice(name, f"params.{path.argument}", str(value if value not in (None, "auto") else "auto"),
                    path.reference)
  return None if choice.requested == choice.xla else choice


def with_choice(config: ml_collections.ConfigDict, field: str, value: str) -> ml_collections.ConfigDict:
  """A copy of `config` with config.model.attention.<field> = value."""
  out = copy.deepcopy(config)
  with out.unlocked():
    node = out.model.attention
    *parents, leaf = field.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return out


def _one_line(exc: BaseException, limit: int = 300) -> str:
  """The exception's type and first non-empty message line (a Mosaic error runs to pages)."""
  lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
  text = type(exc).__name__ + (f": {lines[0]}" if lines else "")
  return text if len(text) <= limit else text[:limit - 3] + "..."


def relative_error(got: Any, want: Any, rows: Any = None) -> float:
  """||got - want|| / ||want||, inf where got is not finite; `rows` (broadcasting to got, bool) limits the
  comparison to those entries (padded query rows are don't-care under the op contract: finite, not
  compared)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return float("inf")
  if rows is not None:
    got, want = np.where(rows, got, 0.0), np.where(rows, want, 0.0)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# -----------------------------------------------------------------------------------------------------------
# The attention layer as a function of (params, x)


@dataclasses.dataclass
class Layer:
  """One attention layer of the model, built from `config` with `heads` heads (the per-device count)."""

  config: ml_collections.ConfigDict
  heads: int
  length: int
  causal: bool

  def build(self) -> tuple[Any, Any, Any]:
    """(graphdef, params, rest): the layer split into its parameters and everything else (rng streams)."""
    from flax import nnx

    from models import registry, transformer

    cfg = self.config.model
    head_dim = cfg.get("head_dim", None) or cfg.features // cfg.num_heads
    module = registry.build(cfg.attention, features=cfg.features, num_heads=self.heads, head_dim=head_dim,
                            causal=self.causal, dtype=transformer.dtype_of(cfg.get("dtype", "float32")),
                            rngs=nnx.Rngs(params=0, dropout=1, attention=2), layer=0,
                            num_layers=cfg.num_layers, seq_len=self.length)
    return nnx.split(module, nnx.Param, ...)

  def forward_backward(self, platform: str) -> Any:
    """f(params, rest, x, mask, cot) -> (out, d params, d x) of sum(out * cot), traced for `platform`."""
    from flax import nnx


    graphdef = self.build()[0]

    def f(params, rest, x, mask, cot):
      with contract.traced_for(platform):
        def apply(params, x):
          return nnx.merge(graphdef, params, rest, copy=True)(x, mask, deterministic=True)

        out, vjp = jax.vjp(apply, params, x)
        return (out, *vjp(cot.astype(out.dtype)))

    return f


def _dtype(config: ml_collections.ConfigDict) -> Any:
  from models import transformer

  return transformer.dtype_of(config.model.get("dtype", "float32"))


def _inputs(config: ml_collections.ConfigDict, batch: int, length: int, seed: int = 0) -> tuple[Any, ...]:
  """x and the cotangent [batch, length, features] in the model dtype; a key mask with its first key real."""
  kx, kc, km = jax.random.split(jax.random.key(seed), 3)
  shape = (batch, length, int(config.model.features))
  x = jax.random.normal(kx, shape, _dtype(config))
  cot = jax.random.normal(kc, shape, _dtype(config))
  mask = jax.random.bernoulli(km, 0.9, (batch, length)).at[:, 0].set(True)
  return x, mask, cot


def per_device(config: ml_collections.ConfigDict, devices: list | None) -> tuple[int, int, bool]:
  """(batch rows, heads) the op runs on per device, and whether the sequence-parallel form runs instead."""
  from training.mesh import make_mesh

  mesh = make_mesh(config, devices)
  batch, heads = int(config.train.batch_size), int(config.model.num_heads)
  att = config.model.attention
  spec = ops_registry.get(str(att.get("op", None) or att.name))
  seq_parallel = spec.seq_parallel is not None and dict(mesh.shape).get(sharding.SEQ_AXIS, 1) > 1
  batch_axes, heads_axis = sharding.split_axes(mesh, batch, heads)
  for axis in batch_axes:
    batch //= mesh.shape[axis]
  if heads_axis is not None:
    heads //= mesh.shape[heads_axis]
  return batch, heads, seq_parallel


def compare(config: ml_collections.ConfigDict, choice: Choice, platform: str, *, causal: bool, length: int,
            heads: int) -> dict[str, float]:
  """Relative errors of the kernel against the XLA path on a small case (output, d x, d params)."""
  small = Layer(config, min(heads, SMALL_HEADS), min(length, SMALL_LENGTH), causal)
  xla = Layer(with_choice(config, choice.field, choice.xla), small.heads, small.length, causal)
  _, params, rest = small.build()
  x, mask, cot = _inputs(config, 1, small.length, seed=1)
  real = np.asarray(mask)[:, :, None]  # padded query rows are don't-care: finite, not compared, no cotangent
  cot = jnp.where(real, cot, 0).astype(cot.dtype)
  got = jax.jit(small.forward_backward(platform))(params, rest, x, mask, cot)
  want = jax.jit(xla.forward_backward(platform))(params, rest, x, mask, cot)
  errors = {"out": relative_error(got[0], want[0], real), "d_x": relative_error(got[2], want[2])}
  # All parameter gradients as one vector: a bias the softmax ignores (the key's) has a gradient near zero.
  flat = [np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(g)] or [np.zeros(0)])
          for g in (got[1], want[1])]
  errors["d_params"] = relative_error(*flat)
  return errors


# -----------------------------------------------------------------------------------------------------------
# The check and the decision


def check(config: ml_collections.ConfigDict, choice: Choice, platform: str, *, devices: list | None = None
          ) -> dict[str, Any]:
  """Compiles the kernel at the real per-device shapes and compares a small case with the XLA path; a dict
  with `ok`, `reason` (when not ok), the shapes, dtype and errors. Never raises for a kernel failure."""
  from models import transformer
  from training.experiment import dataset_info

  info = dataset_info(config)
  causal = info.task in transformer.CAUSAL_TASKS
  batch, heads, seq_parallel = per_device(config, devices)
  length = int(info.seq_len)
  dtype = jnp.dtype(_dtype(config)).name
  head_dim = config.model.get("head_dim", None) or config.model.features // config.model.num_heads
  report: dict[str, Any] = {"shape": [batch, length, heads, int(head_dim)], "dtype": dtype, "causal": causal}
  if seq_parallel:
    return {**report, "ok": True, "skipped": "skipped: the sequence-parallel form runs, without the kernel"}
  start = time.perf_counter()
  try:
    injected = os.environ.get(INJECT_ENV)
    if injected:
      raise InjectedKernelFailure(injected)
    layer = Layer(config, heads, length, causal)
    _, params, rest = layer.build()
    abstract = [jax.ShapeDtypeStruct((batch, length, int(config.model.features)), _dtype(config)),
                jax.ShapeDtypeStruct((batch, length), jnp.bool_)]
    jax.jit(layer.forward_backward(platform)).lower(params, rest, abstract[0], abstract[1],
                                                     abstract[0]).compile()
    errors = compare(config, choice, platform, causal=causal, length=length, heads=heads)
  except Exception as e:  # a lowering or compile error of the kernel, or its run: the reason, in one line
    return {**report, "ok": False, "reason": _one_line(e), "seconds": time.perf_counter() - start}
  report.update(errors=errors, seconds=time.perf_counter() - start)
  tolerance = TOLERANCE.get(dtype, 1e-2)
  worst = max(errors, key=errors.get)
  if not errors[worst] <= tolerance:
    reason = f"differs from the XLA path: {worst} relative error {errors[worst]:.2e} > {tolerance:.0e}"
    return {**report, "ok": False, "reason": reason}
  return {**report, "ok": True}


def _agree(ok: bool) -> bool:
  """Whether every process's check passed (one host's failure is every host's: one program for all)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils

  flags = multihost_utils.process_allgather(np.asarray([0 if ok else 1], np.int32))
  return not bool(np.any(flags))


def _abstract_inputs(config: ml_collections.ConfigDict, length: int) -> tuple[Any, Any]:
  """x [1, length, features] in the model dtype and its mask [1, length], as shapes."""
  return (jax.ShapeDtypeStruct((1, length, int(config.model.features)), _dtype(config)),
          jax.ShapeDtypeStruct((1, length), jnp.bool_))


def check_arguments(config: ml_collections.ConfigDict) -> None:
  """Traces the model's attention layer (nothing compiled or run: shapes only) at the model's length with
  every head and one row. What the op itself refuses of the config's choices (a pooling it does not know, a
  block size the length does not allow) or a module that does not run in the model's direction raises here,
  as a UsageError naming config.model.attention, before the experiment is built or the workdir written;
  otherwise it would surface as a traceback when the first step is traced."""
  from flax import nnx

  from models import registry as model_registry
  from models import transformer
  from runtime import cli
  from training.experiment import dataset_info

  att = config.model.attention
  name = str(att.get("op", None) or att.name)
  if name not in ops_registry.names():
    return  # a model-only module (tests)
  info = dataset_info(config)
  features, length = int(config.model.features), int(info.seq_len)
  try:
    graph = model_registry.get_module(str(att.name)).GRAPH_NODES
    if graph is not None:  # it attends over the tokens and the graph's nodes (models.transformer.Encoder)
      nodes = graph(features, length, dtype=_dtype(config), rngs=nnx.Rngs(0))
      length = jax.eval_shape(lambda x, m: nodes(x, m)[0], *_abstract_inputs(config, length)).shape[1]
    layer = Layer(config, int(config.model.num_heads), length, info.task in transformer.CAUSAL_TASKS)
    graphdef, params, rest = layer.build()
    jax.eval_shape(lambda p, r, x, m: nnx.merge(graphdef, p, r, copy=True)(x, m, deterministic=True),
                   params, rest, *_abstract_inputs(config, length))
  except (ValueError, TypeError) as e:
    message = cli.user_error(e) or str(e)
    if message.startswith("config."):
      raise cli.UsageError(message) from e
    raise cli.UsageError(f"config.model.attention ({att.name!r} at length {length}): "
                         f"{cli.one_line(message)}") from e


def checked_config(config: ml_collections.ConfigDict, workdir: str, *, devices: list | None = None,
                   record: bool = True) -> ml_collections.ConfigDict:
  """The config to build the model from (its attention's arguments first traced, `check_arguments`):
  `config` itself when its fused kernel passes (or none runs), a copy on the XLA path when the kernel failed
  under "auto"; raises KernelCheckFailed when a kernel named explicitly failed. Process 0 prints the outcome.
  record: write `<workdir>/status/kernel_check.json` (train.py's process 0; eval.py and sample.py check
  again and record nothing)."""
  from training import config_io, status

  check_arguments(config)
  choice = kernel_choice(config)
  if choice is None:
    return config
  platform = contract.platform_of((devices or jax.devices())[0])
  if not (choice.explicit or platform in ACCELERATORS or os.environ.get(INJECT_ENV)):
    return config  # "auto" is the XLA path here: nothing to check
  result = check(config, choice, platform, devices=devices)
  ok = _agree(result["ok"])
  if result["ok"] and not ok:
    result.update(ok=False, reason="the kernel check failed on another process")
  what = f"{choice.op} {choice.field}={choice.requested} on {platform}"
  where = f"{result['shape']} {result['dtype']}"
  used = choice.requested if ok else (None if choice.explicit else choice.xla)
  path = status.record_path(workdir, RECORD)
  if record:
    config_io.write_json(path, {"time": time.time(), "op": choice.op, "field": choice.field,
                                "requested": choice.requested, "used": used, "platform": platform,
                                "device_kind": (devices or jax.devices())[0].device_kind, **result})
  say = jax.process_index() == 0
  if ok:
    if say:
      done = result.get("skipped") or (f"compiled at {where} and matches the XLA path "
                                       f"({result.get('seconds', 0):.0f} s)")
      print(f"kernel check: {what} {done}", flush=True)
    return config
  field = f"model.attention.{choice.field}"
  if choice.explicit:
    raise KernelCheckFailed(f"kernel check: {what} failed at {where}: {result['reason']}; not started "
                            f"(--config.{field}=auto falls back to the XLA path on failure)")
  if say:
    recorded = f", recorded in {path}" if record else ""
    print(f"WARNING: kernel check: {what} failed at {where}: {result['reason']}; the model runs on the XLA "
          f"path ({field}={choice.xla}){recorded}", file=sys.stderr, flush=True)
  return with_choice(config, choice.field, choice.xla)
