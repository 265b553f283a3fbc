"""The device mesh (data, fsdp, seq, model) and the shardings of parameters by logical-axis rules.

Data parallelism runs over two axes: the batch is split over ("data", "fsdp") together; parameters and
optimizer state are split over "fsdp" and "seq" along their "embed" dimension (`configs/base.py:
SHARDING_RULES`, the MaxText rule) and XLA's SPMD partitioner gathers each layer's weights where they are used
and reduce-scatters their gradients (fully sharded data parallelism; the devices that split a sequence hold
the same weights, so they share them out too). On "data" devices hold whole copies. By default every
data-parallel device is an fsdp one; `config.mesh.fsdp=1` gives plain data parallelism.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import ml_collections
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention_core.sharding import BATCH_AXES  # the batch is split over (data, fsdp)
from runtime.cli import UsageError

AXES = ("data", "fsdp", "seq", "model")
# Which axis set to -1 takes the devices the others leave, first to last; any later -1 gets one device.
AUTO_ORDER = ("seq", "model", "fsdp", "data")


def make_mesh(config: ml_collections.ConfigDict, devices: list | None = None) -> jax.sharding.Mesh:
  """Mesh (data, fsdp, seq, model) from `config.mesh` (sizes as `mesh_sizes` resolves them)."""
  devices = list(devices if devices is not None else jax.devices())
  auto = (jax.sharding.AxisType.Auto,) * len(AXES)
  sizes = mesh_sizes(config, len(devices))
  try:
    return jax.make_mesh(sizes, AXES, axis_types=auto, devices=devices)
  except NotImplementedError:  # a logical axis no product of the torus' axes gives (2 of a 4x4x4 v5p slice)
    grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
    return jax.sharding.Mesh(grid, AXES, axis_types=auto)


def mesh_sizes(config: ml_collections.ConfigDict, n: int) -> tuple[int, ...]:
  """The (data, fsdp, seq, model) sizes `config.mesh` gives on n devices; ValueError when it does not fit.

  -1 means the devices the other axes leave. When several axes are -1 the first of seq/model, then fsdp, then
  data takes them and the others get one device: data = fsdp = -1 (the defaults) puts every data-parallel
  device on fsdp, fsdp = 1 on data. A config without an fsdp field (written before the axis existed) has
  fsdp = 1, its old mesh.
  """
  given = {name: config.mesh.get(name, 1) for name in AXES}
  sizes = {name: int(value) for name, value in given.items()}
  if sizes["seq"] == -1 and sizes["model"] == -1:
    raise UsageError("config.mesh: at most one of seq/model may be -1")
  auto = [name for name in AUTO_ORDER if sizes[name] == -1]
  for name in auto[1:]:
    sizes[name] = 1
  if auto:
    sizes[auto[0]] = n // max(1, -math.prod(sizes.values()))
  if min(sizes.values()) < 1 or math.prod(sizes.values()) != n:
    raise UsageError(f"config.mesh {given} does not fit the {n} devices (their product, with -1 the "
                     f"devices the other axes leave, must be {n})")
  return tuple(sizes[name] for name in AXES)


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
  """Devices the batch is split over (data x fsdp)."""
  return math.prod(int(dict(mesh.shape).get(name, 1)) for name in BATCH_AXES)


def logical_to_mesh(spec: Any, shape: tuple[int, ...], rules: dict[str, Any], mesh: jax.sharding.Mesh) -> P:
  """Maps logical axis names to mesh axes. A rule names one mesh axis or a tuple of them, the dimension then
  split over their product ("embed" over ("fsdp", "seq"), as MaxText splits it over its fsdp and sequence
  axes). Axes with a single device, not in the mesh, or taken by an earlier dimension are left out, and the
  last ones are dropped until the rest divide the dimension; none left is replicated (so a one-device mesh
  gives replicated specs throughout)."""
  names = tuple(spec) if spec is not None else ()
  sizes = dict(mesh.shape)
  out = []
  used = set()
  for dim, name in zip(shape, names + (None,) * (len(shape) - len(names)), strict=True):
    rule = rules.get(name) if name is not None else None
    rule = (rule,) if isinstance(rule, str) else tuple(rule or ())
    axes = [axis for axis in rule if axis not in used and sizes.get(axis, 1) > 1]
    while axes and dim % math.prod(sizes[axis] for axis in axes):
      axes.pop()
    used.update(axes)
    out.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
  return P(*out)


def state_shardings(abstract_state: Any, rules: dict[str, Any], mesh: jax.sharding.Mesh) -> Any:
  """NamedShardings for an nnx.State from each variable's `out_sharding` logical axes (default replicated)."""

  def one(x):
    axes = x.get_metadata().get("out_sharding") if isinstance(x, nnx.Variable) else None
    value = x.get_value() if isinstance(x, nnx.Variable) else x
    sharding = NamedSharding(mesh, logical_to_mesh(axes, tuple(value.shape), rules, mesh))
    return x.replace(sharding) if isinstance(x, nnx.Variable) else sharding

  return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def per_device_bytes(tree: Any) -> int:
  """Bytes the fullest device holds of a tree of arrays or ShapeDtypeStructs with shardings (nothing is
  allocated: read from the shardings)."""
  totals: dict[Any, int] = {}
  for leaf in jax.tree.leaves(tree):
    sharding = leaf.sharding
    shard = sharding.shard_shape(tuple(leaf.shape))
    nbytes = math.prod(shard) * leaf.dtype.itemsize
    for device in sharding.device_set:
      totals[device] = totals.get(device, 0) + nbytes
  return max(totals.values(), default=0)
