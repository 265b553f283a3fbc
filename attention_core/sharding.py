"""Attention ops under `jax.shard_map` over the context mesh's batch and heads axes.

Fused kernels (Pallas/Mosaic on TPU, Triton on GPU) have no partitioning rule: inside a jitted step whose
q, k, v are sharded over batch or heads, the partitioner cannot split them. `attend` runs the op per device
on its local batch rows and heads instead (as MaxText's AttentionOp does), which is exact for the op
contract (every (batch row, head) is independent). The mesh is the one in JAX's context
(`jax.sharding.get_abstract_mesh()`, set by train.py around the step's tracing); with none, or one device,
the op is called as it is.

Batch rows are split over the mesh axes BATCH_AXES that divide the batch, heads over HEADS_AXIS when it
divides the heads; an axis that does not divide stays unsplit (its devices hold every row or head). Every
other mesh axis (e.g. "seq") is replicated inside the map: the op sees whole sequences.

Keyword arguments of the op that are arrays are passed by kind (`kinds`, else inferred):
  QKV     shaped [batch, length, heads, ...] like q (inferred from the leading three dims): split like q
  HEADS   a leading heads axis (per-head weights): split over the heads axis
  SHARED  the same on every device (inferred for other arrays): replicated
  RNG     a PRNG key (inferred from its dtype): replicated over batch shards (ops draw their randomness per
          head and share it over the batch, so every batch shard draws the same functions as one device);
          with heads split, the heads shard's index is folded into it, so that the shards' heads draw
          independent functions (different draws from a one-device run of the same key, same distribution)
A callable argument that is an `nnx.Module` (e.g. a learned span key) travels as its state, each array of
which has the kind given for the argument (default HEADS); other callables are closed over, and then heads
are not split (their weights are unknown). Non-array arguments are passed as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from attention_core import contract

Array = Any

BATCH_AXES = ("data", "fsdp")
HEADS_AXIS = "model"
QKV, HEADS, SHARED, RNG = "qkv", "heads", "shared", "rng"
KINDS = (QKV, HEADS, SHARED, RNG)


def context_mesh() -> Any:
  """The abstract mesh in JAX's context when it has more than one device and a non-manual axis, else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or not mesh.axis_names or mesh.size <= 1 or not _free_axes(mesh):
    return None
  return mesh


def _free_axes(mesh: Any) -> tuple[str, ...]:
  """Mesh axes not already manual (outside any enclosing shard_map)."""
  manual = jax.sharding.AxisType.Manual
  return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != manual)


def split_axes(mesh: Any, batch: int, heads: int) -> tuple[tuple[str, ...], str | None]:
  """(mesh axes splitting the batch, mesh axis splitting the heads or None) for these sizes."""
  free, sizes = _free_axes(mesh), dict(mesh.shape)
  batch_axes, parts = [], 1
  for name in BATCH_AXES:
    n = sizes.get(name, 1)
    if name in free and n > 1 and batch % (parts * n) == 0:
      batch_axes.append(name)
      parts *= n
  n = sizes.get(HEADS_AXIS, 1)
  heads_axis = HEADS_AXIS if HEADS_AXIS in free and n > 1 and heads % n == 0 else None
  return tuple(batch_axes), heads_axis


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _kind(name: str, x: Any, q: Array, kinds: dict[str, str]) -> str:
  kind = kinds.get(name)
  if kind is None:
    if _is_key(x):
      kind = RNG
    elif x.ndim >= 3 and tuple(x.shape[:3]) == tuple(q.shape[:3]):
      kind = QKV
    else:
      kind = SHARED
  if kind not in KINDS:
    raise ValueError(f"sharding.attend: argument {name!r} has kind {kind!r}; kinds: {KINDS}")
  return kind


def _module_spec(spec: Callable[[str, int], P], kind: str, x: Array) -> P:
  return spec(kind, jnp.ndim(x))


def attend(fn: Callable[..., Array], q: Array, k: Array, v: Array, *, mask: Array | None = None,
           kinds: dict[str, str] | None = None, **kwargs: Any) -> Array:
  """fn(q, k, v, mask=mask, **kwargs) -> [batch, length, heads, value_dim], each device running it on its
  batch rows and heads of the context mesh (see the module docstring); the direct call when no mesh splits
  anything."""
  mesh = context_mesh()
  if mesh is None:
    return fn(q, k, v, mask=mask, **kwargs)
  kinds = dict(kinds or {})
  arrays, modules, static = {}, {}, {}
  for name, x in kwargs.items():
    if isinstance(x, nnx.Module):
      modules[name] = nnx.split(x)
    elif hasattr(x, "shape") and hasattr(x, "dtype") and not callable(x):
      arrays[name] = x
    else:
      static[name] = x
  batch_axes, heads_axis = split_axes(mesh, q.shape[0], q.shape[2])
  if any(callable(x) for x in static.values()):
    heads_axis = None  # a closure's weights are whole: its heads must be too
  if not batch_axes and heads_axis is None:
    return fn(q, k, v, mask=mask, **kwargs)
  b = batch_axes[0] if len(batch_axes) == 1 else (batch_axes or None)

  def spec(kind: str, ndim: int) -> P:
    if kind == QKV:
      return P(b, None, heads_axis, *([None] * (ndim - 3)))
    if kind == HEADS:
      return P(heads_axis)
    return P()

  array_kinds = {name: _kind(name, x, q, kinds) for name, x in arrays.items()}
  array_specs = {name: spec(array_kinds[name], jnp.ndim(x)) for name, x in arrays.items()}
  module_graphs = {name: g for name, (g, _) in modules.items()}
  module_states = {name: s for name, (_, s) in modules.items()}
  module_specs = {name: jax.tree.map(functools.partial(_module_spec, spec, kinds.get(name, HEADS)), s)
                  for name, s in module_states.items()}
  qkv = P(b, None, heads_axis, None)

  def local(q, k, v, mask, arrays, states):
    own = {}
    for name, x in arrays.items():
      if array_kinds[name] == RNG and heads_axis is not None:
        x = jax.random.fold_in(x, jax.lax.axis_index(heads_axis))
      own[name] = x
    own.update({name: nnx.merge(module_graphs[name], s) for name, s in states.items()})
    return fn(q, k, v, mask=mask, **static, **own)

  mask_spec = P() if mask is None else P(b, None)
  return jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, mask_spec, array_specs, module_specs),
                       out_specs=qkv, axis_names=set(_free_axes(mesh)), check_vma=False)(
                           q, k, v, mask, arrays, module_states)


def traced_in(mesh: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` with `mesh` as JAX's context mesh while it is traced (what `attend` reads): jit(traced_in(mesh, f))
  maps the attention ops of f over the mesh however f is called or lowered. The ops also make their
  platform choices for the mesh's devices (`contract.traced_for`), so f is traced once, for the platform
  it will run on (a TPU topology's mesh from a CPU host included), instead of once per platform."""
  platform = contract.platform_of(mesh.devices.flat[0])

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), contract.traced_for(platform):
      return fn(*args, **kwargs)

  return wrapped


# -----------------------------------------------------------------------------------------------------------
# Sequence parallelism: the "seq" mesh axis that the sequence-parallel forms of ops split the sequence over

SEQ_AXIS = "seq"


def current_mesh() -> Any:
  """JAX's context mesh (`jax.sharding.use_abstract_mesh`, set by `attention_core.sharding.traced_in` around
     a train
  step's tracing, or `jax.set_mesh`), else None. It is read when an op is traced: a jitted function traced
  before keeps the op it traced."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh if mesh is not None and mesh.axis_names else None


def resolve_mesh(mesh: Any, axis: str, op: str) -> Any:
  """The explicit `mesh`, else `current_mesh()`; it must have the sequence axis."""
  mesh = current_mesh() if mesh is None else mesh
  if mesh is None or axis not in tuple(mesh.axis_names):
    raise ValueError(f"{op}: needs a device mesh with a {axis!r} axis (argument 'mesh' or JAX's "
                     f"context mesh), got {None if mesh is None else dict(mesh.shape)}")
  return mesh


def seq_size(mesh: Any = None, axis: str = SEQ_AXIS) -> int:
  """Devices along the sequence axis of `mesh` (default `current_mesh()`); 1 when there is none."""
  mesh = current_mesh() if mesh is None else mesh
  if mesh is None or axis not in tuple(mesh.axis_names):
    return 1
  return int(mesh.shape[axis])


def seq_specs(mesh: Any, axis: str, batch: int, heads: int) -> tuple[P, P]:
  """PartitionSpecs of [batch, length, heads, dim] arrays and of the [batch, length] mask."""
  def split(name: str, size: int) -> str | None:
    n = dict(mesh.shape).get(name, 1)
    return name if name != axis and n > 1 and size % n == 0 else None

  batch_axes, parts = [], 1
  for name in BATCH_AXES:  # the batch over every data-parallel axis that divides it, as split_axes does
    n = dict(mesh.shape).get(name, 1)
    if name != axis and n > 1 and batch % (parts * n) == 0:
      batch_axes.append(name)
      parts *= n
  b = batch_axes[0] if len(batch_axes) == 1 else (tuple(batch_axes) or None)
  h = split("model", heads)
  return P(b, axis, h, None), P(b, axis)


def check_seq_length(length: int, parts: int, multiple: int, op: str, what: str) -> None:
  if length % (parts * multiple):
    raise ValueError(f"{op}: length {length} must be a multiple of {parts} devices along the sequence axis "
                     f"x {what} = {parts * multiple} (each device holds whole blocks); pad the sequence with "
                     "masked positions to such a length")
