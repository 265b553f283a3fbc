"""The device mesh (data, seq, model) and the shardings of parameters by logical-axis rules."""

from __future__ import annotations

import math
from typing import Any

import jax
import ml_collections
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "seq", "model")


def make_mesh(config: ml_collections.ConfigDict, devices: list | None = None) -> jax.sharding.Mesh:
  """Mesh (data, seq, model) from `config.mesh`; at most one size may be -1 (the devices the others leave)."""
  devices = list(devices if devices is not None else jax.devices())
  auto = (jax.sharding.AxisType.Auto,) * 3
  return jax.make_mesh(mesh_sizes(config, len(devices)), AXES, axis_types=auto, devices=devices)


def mesh_sizes(config: ml_collections.ConfigDict, n: int) -> tuple[int, ...]:
  """The (data, seq, model) sizes `config.mesh` gives on n devices; ValueError when it does not fit them."""
  sizes = [int(config.mesh.get(name, 1)) for name in AXES]
  if sizes.count(-1) > 1:
    raise ValueError("config.mesh: at most one of data/seq/model may be -1")
  if -1 in sizes:
    sizes[sizes.index(-1)] = n // max(1, -math.prod(sizes))
  if min(sizes) < 1 or math.prod(sizes) != n:
    given = {name: config.mesh.get(name, 1) for name in AXES}
    raise ValueError(f"config.mesh {given} does not fit the {n} devices")
  return tuple(sizes)


def logical_to_mesh(spec: Any, shape: tuple[int, ...], rules: dict[str, Any], mesh: jax.sharding.Mesh) -> P:
  """Maps logical axis names to mesh axes; a dimension the mesh axis does not divide stays replicated."""
  names = tuple(spec) if spec is not None else ()
  out = []
  used = set()
  for dim, name in zip(shape, names + (None,) * (len(shape) - len(names)), strict=True):
    axis = rules.get(name) if name is not None else None
    if axis is not None and (axis in used or dim % mesh.shape[axis] != 0):
      axis = None
    if axis is not None:
      used.add(axis)
    out.append(axis)
  return P(*out)


def state_shardings(abstract_state: Any, rules: dict[str, Any], mesh: jax.sharding.Mesh) -> Any:
  """NamedShardings for an nnx.State from each variable's `out_sharding` logical axes (default replicated)."""

  def one(x):
    axes = x.get_metadata().get("out_sharding") if isinstance(x, nnx.Variable) else None
    value = x.get_value() if isinstance(x, nnx.Variable) else x
    sharding = NamedSharding(mesh, logical_to_mesh(axes, tuple(value.shape), rules, mesh))
    return x.replace(sharding) if isinstance(x, nnx.Variable) else sharding

  return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
