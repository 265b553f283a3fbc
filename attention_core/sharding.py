"""The models' placement of attention ops: the batch over the context mesh's data axes, heads over "model".

Every op with a fused path partitions itself (`attention_core.partition`): under any jit it runs under
`jax.shard_map`, each device on its batch rows and heads, on the placement q's type gives (Explicit axes) or
one it picks (Auto axes). The models say their placement instead: `attend` runs any op (fused or not) on
the context mesh (`jax.sharding.get_abstract_mesh()`, set by train.py around the step's tracing:
`traced_in`) with the batch over the mesh axes BATCH_AXES that divide it and the heads over HEADS_AXIS when
it divides them, as MaxText's AttentionOp does; an axis that does not divide stays unsplit (its devices hold
every row or head). Every other mesh axis (e.g. "seq") is replicated inside the map: the op sees whole
sequences. With no mesh, or one device, the op is called as it is.

Keyword arguments of the op are split by kind (`kinds`: QKV, HEADS, SHARED, RNG; `attention_core.partition`
says what each means and what is inferred when none is given). An op that partitions itself and is given a
key (YOSO's hash functions, Reformer's rotations) is called as it is with this placement given to it
(`partition.given`): it draws for every head before it splits them, so a heads shard hashes as one device
does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from attention_core import contract, partition
from attention_core.partition import HEADS, KINDS, QKV, RNG, SHARED  # noqa: F401  (the kinds of `attend`)

Array = Any

BATCH_AXES = ("data", "fsdp")
HEADS_AXIS = "model"


def context_mesh() -> Any:
  """The abstract mesh in JAX's context when it has more than one device and a non-manual axis, else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or not mesh.axis_names or mesh.size <= 1 or not partition.free_axes(mesh):
    return None
  return mesh


def split_axes(mesh: Any, batch: int, heads: int) -> tuple[tuple[str, ...], str | None]:
  """(mesh axes splitting the batch, mesh axis splitting the heads or None) for these sizes."""
  free, sizes = partition.free_axes(mesh), dict(mesh.shape)
  batch_axes = partition.dividing([a for a in BATCH_AXES if a in free], sizes, batch)
  heads_axes = partition.dividing([HEADS_AXIS] if HEADS_AXIS in free else [], sizes, heads)
  return batch_axes, (heads_axes[0] if heads_axes else None)


def attend(fn: Callable[..., Array], q: Array, k: Array, v: Array, *, mask: Array | None = None,
           kinds: dict[str, str] | None = None, **kwargs: Any) -> Array:
  """fn(q, k, v, mask=mask, **kwargs) -> [batch, length, heads, value_dim], each device running it on its
  batch rows and heads of the context mesh (module docstring); the direct call when no mesh splits
  anything."""
  mesh = context_mesh()
  if mesh is None:
    return fn(q, k, v, mask=mask, **kwargs)
  batch_axes, heads_axis = split_axes(mesh, q.shape[0], q.shape[2])
  if not batch_axes and heads_axis is None:
    return fn(q, k, v, mask=mask, **kwargs)
  placement = partition.Placement(batch_axes, (heads_axis,) if heads_axis else ())
  if _draws_for_every_head(fn, kwargs):
    with partition.given(placement, mesh):
      return fn(q, k, v, mask=mask, **kwargs)
  return partition.call(fn, q, k, v, {"mask": mask, **kwargs}, kinds=kinds, placement=placement, mesh=mesh)


def _draws_for_every_head(fn: Callable[..., Array], kwargs: dict[str, Any]) -> bool:
  """Whether fn partitions itself (`partition.partitioned`, or an op marked so that draws first) and is
  given a key: it then makes every head's draws before it splits the heads."""
  return getattr(partition.unwrapped(fn), "partitions_itself", False) and any(
      partition.is_key(x) for x in kwargs.values())


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
  """PartitionSpecs of [batch, length, heads, dim] arrays and of the [batch, length] mask: the batch and the
  heads as the partitioned op calling the form placed them (`partition.placed`), else as `attend` does."""
  place = partition.placed()
  if place is not None:
    b, h = partition.Placement.entry(place.batch), partition.Placement.entry(place.heads)
    return P(b, axis, h, None), P(b, axis)

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
