"""The attention-op contract shared by every op in the repository (docs/design.md section 3).

Every op takes q, k: [batch, length, heads, head_dim], v: [batch, length, heads, value_dim] and an optional
key mask [batch, length] (True = real token), and returns [batch, length, heads, value_dim] in v's dtype. This
module holds the checks and dtype rules so that every op rejects bad input with the same words.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attention_core import partition

Array = Any  # jax.Array; kept loose so numpy inputs are accepted and converted.


def check_qkv(q: Array, k: Array, v: Array, mask: Array | None, *, op: str,
              keep_none: bool = False) -> tuple[Array, Array, Array, Array | None]:
  """Validates the op contract and returns (q, k, v, mask) as jax arrays; mask defaults to all-True, or
  stays None with `keep_none` (for ops that then skip their masking work: every key is real)."""
  arrays = {}
  for name, x in (("q", q), ("k", k), ("v", v)):
    # argument validation: any array-like (numpy, jax, tracers) passes
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{op}: argument {name!r} must be an array of shape [batch, length, heads, dim], "
                      f"got {type(x).__name__}")
    x = jnp.asarray(x)
    if x.ndim != 4:
      raise ValueError(f"{op}: argument {name!r} must have rank 4 [batch, length, heads, dim], "
                       f"got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{op}: argument {name!r} must be floating point, got dtype {x.dtype}")
    arrays[name] = x
  q, k, v = arrays["q"], arrays["k"], arrays["v"]
  if q.shape != k.shape:
    raise ValueError(f"{op}: arguments 'q' and 'k' must have the same shape "
                     f"[batch, length, heads, head_dim], got q {tuple(q.shape)} and k {tuple(k.shape)}")
  if v.shape[:3] != q.shape[:3]:
    raise ValueError(f"{op}: argument 'v' must share [batch, length, heads] with q, got v {tuple(v.shape)} "
                     f"and q {tuple(q.shape)}")
  if q.shape[1] < 1:
    raise ValueError(f"{op}: length must be >= 1, got {q.shape[1]}")
  batch, length = q.shape[:2]
  if mask is None:
    mask = None if keep_none else jnp.ones((batch, length), dtype=bool)
  else:
    if not hasattr(mask, "shape"):  # argument validation: any array-like passes
      raise TypeError(f"{op}: argument 'mask' must be None or a bool array [batch, length], "
                      f"got {type(mask).__name__}")
    mask = jnp.asarray(mask)
    if mask.shape != (batch, length):
      raise ValueError(f"{op}: argument 'mask' must have shape [batch, length] = {(batch, length)}, "
                       f"got {tuple(mask.shape)}")
    if not (mask.dtype == bool or jnp.issubdtype(mask.dtype, jnp.integer)):
      # A float mask is often additive (0 = keep, -inf = drop): cast to bool it would mean the opposite.
      raise TypeError(f"{op}: argument 'mask' must be a bool (or integer 0/1) array, True = real token, "
                      f"got dtype {mask.dtype}")
    mask = mask.astype(bool)
  return q, k, v, mask


def check_positive_int(value: Any, *, name: str, op: str) -> int:
  """Block and row sizes must be positive Python ints (they fix static shapes)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{op}: argument {name!r} must be a positive integer, got {value!r}")
  return int(value)


def check_choice(value: Any, *, name: str, allowed: Iterable[str], op: str) -> str:
  allowed = tuple(allowed)
  if value not in allowed:
    raise ValueError(f"{op}: argument {name!r} must be one of {allowed}, got {value!r}")
  return value


# The platforms ops choose by, each with the `lax.platform_dependent` names it lowers as.
PLATFORMS = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}
_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("platform", default=None)
_LOWERED_FOR: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("lowered_for", default=())


def backend() -> str:
  """The platform ops are traced for, "cpu", "gpu" or "tpu": what "auto" implementations choose by. Inside
  `traced_for(p)` (a branch of `per_platform`) that is p, elsewhere the default backend."""
  return _PLATFORM.get() or jax.default_backend()


def platform_of(device: Any) -> str:
  """The `PLATFORMS` name ("cpu", "gpu" or "tpu") of a device (a TPU topology's devices included)."""
  return next((p for p, names in PLATFORMS.items() if device.platform in names), device.platform)


def traced_platform() -> str | None:
  """The one platform the code being traced will be lowered for: that of the enclosing `traced_for` where it
  serves no other (a `per_platform` branch may serve several), else None."""
  lowered = _LOWERED_FOR.get()
  return lowered[0] if len(lowered) == 1 else None


@contextlib.contextmanager
def traced_for(platform: str, *, also: tuple[str, ...] = ()) -> Iterator[None]:
  """Ops traced under this context make every platform choice for `platform` ("cpu", "gpu" or "tpu"), and
  `per_platform` stages no branches: one program for that platform, whatever the host's backend. also: other
  platforms the program is lowered for (a `per_platform` branch that serves several)."""
  for p in (platform, *also):
    check_choice(p, name="platform", allowed=PLATFORMS, op="contract.traced_for")
  token, lowered = _PLATFORM.set(platform), _LOWERED_FOR.set((platform, *also))
  try:
    yield
  finally:
    _LOWERED_FOR.reset(lowered)
    _PLATFORM.reset(token)


def per_platform(fn: Callable[[], Any], *, key: Callable[[], Any] | None = None) -> Any:
  """fn() staged once per platform in `lax.platform_dependent`, each branch traced in `traced_for` its
  platform, so a program lowered for TPU (even from a CPU host) holds the TPU choices and only the lowered
  platform's branch reaches the compiler. key() (evaluated per platform, cheap) names what fn's trace depends
  on: platforms with equal keys share one branch, and when every key agrees fn() is traced once, with no
  branches at all. Inside a branch (or `traced_for`) fn() runs directly."""
  if _PLATFORM.get() is not None:
    return fn()
  groups: dict[Any, list[str]] = {}
  for platform in PLATFORMS:
    with traced_for(platform):
      groups.setdefault(platform if key is None else key(), []).append(platform)
  if len(groups) == 1:
    return fn()
  branches = {}
  for platforms in groups.values():
    branch = functools.partial(_traced_for_call, tuple(platforms), fn)
    branches.update({name: branch for p in platforms for name in PLATFORMS[p]})
  return lax.platform_dependent(**branches)


def _traced_for_call(platforms: tuple[str, ...], fn: Callable[[], Any]) -> Any:
  with traced_for(platforms[0], also=platforms[1:]):
    return fn()


def per_platform_op(key: Callable[..., Any], *, per_head: tuple[str, ...] = (),
                    check: Callable[..., None] | None = None
                    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorator of the ops with fused paths: every call op(*args, **kw) runs through `per_platform`, its
  branches keyed by key(*args, **kw) (which must not raise on bad arguments: the op rejects them in its own
  words), and the op partitions itself (`partition.partitioned`: under any jit, on any mesh, each device
  runs it on its batch rows and heads). per_head: the op's per-head weight arguments (leading heads axis).
  An eager call on one device runs as one compiled program; check(*args, **kw) checks the argument values
  the op checks when they are concrete (its trace there sees none)."""
  def wrap(op: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(op)
    def run(*args: Any, **kw: Any) -> Any:
      return per_platform(lambda: op(*args, **kw), key=lambda: key(*args, **kw))
    return partition.partitioned(run, per_head=per_head, trace_key=trace_context, check=check)
  return wrap


def partitioned_op(*, per_head: tuple[str, ...] = (), like_q: tuple[str, ...] = ()
                   ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorator of the ops without fused paths whose XLA form XLA's partitioner cannot split on Explicit axes
  (a reshape or an update of a sharded axis): the op partitions itself as the fused ones do
  (`per_platform_op`, with no per-platform choices). per_head: arguments with a leading heads axis;
  like_q: arguments [batch, any length, heads, ...], split like q."""
  def wrap(op: Callable[..., Any]) -> Callable[..., Any]:
    return partition.partitioned(op, per_head=per_head, like_q=like_q, trace_key=trace_context)
  return wrap


def trace_context() -> tuple[Any, ...] | None:
  """What an op's trace depends on beyond its arguments: the platform it is traced for (`traced_for`) and
  `backend()`. None where that platform is not the one the call runs on (the TPU interpreter on a CPU
  host): such a trace is not reused."""
  platform = _PLATFORM.get()
  if platform is not None and platform != platform_of(jax.devices()[0]):
    return None
  return platform, _LOWERED_FOR.get(), backend()


IMPLEMENTATIONS = ("auto", "xla", "pallas")
ACCELERATOR_BACKENDS = ("gpu", "cuda", "rocm", "tpu")


def check_implementation(value: Any, allowed: Iterable[str] = IMPLEMENTATIONS, *, op: str) -> str:
  """An op's `implementation` argument: one of `allowed`, where "auto" means "choose by `backend()`", per
  lowering platform where the op runs through `per_platform`
  (`resolve_implementation` does it for ops whose accelerated kernel runs on every accelerator)."""
  return check_choice(value, name="implementation", allowed=allowed, op=op)


def resolve_implementation(value: Any, allowed: Iterable[str] = IMPLEMENTATIONS, *, op: str,
                           accelerated: str = "pallas", default: str = "xla") -> str:
  """The implementation to run: `value` itself, or for "auto" `accelerated` when `backend()` is a GPU or TPU
  and `default` otherwise (on CPU fused kernels only run interpreted)."""
  value = check_implementation(value, allowed, op=op)
  if value != "auto":
    return value
  return accelerated if backend() in ACCELERATOR_BACKENDS else default


def check_bool(value: Any, *, name: str, op: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{op}: argument {name!r} must be a bool, got {value!r}")
  return bool(value)


def softmax_dtype(*dtypes: Any) -> jnp.dtype:
  """Softmax / log-sum-exp run in float32, or float64 when the inputs are float64."""
  return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


def logit_scale(head_dim: int) -> float:
  """1/sqrt(head_dim), applied once by every op (same convention as jax.nn.dot_product_attention)."""
  return 1.0 / float(np.sqrt(head_dim))
