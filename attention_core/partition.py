"""Ops that partition themselves: an attention op called inside any `jax.jit`, with q, k, v sharded over the
batch and/or the heads on a mesh with any axis names, runs on each device's batch rows and heads.

Fused kernels (Pallas/Mosaic on TPU, Triton on GPU) have no partitioning rule ("Mosaic kernels cannot be
automatically partitioned"), and TPU compilers take no partitioning callback (`custom_partitioning` does not
reach libtpu). But every (batch row, head) of the op contract is independent, so an op is exact on any block
of rows and heads: `partitioned` (every op with a fused path has it, through `contract.per_platform_op`)
runs the op under `jax.shard_map`, each device on its block, with no collective inside. The block is chosen
when the op is traced:

  * Explicit mesh axes (sharding in types; `jax.make_mesh`'s default): q's type names the axes that split
    the batch and the heads, and the op follows them. k, v, the mask and per-head weights typed otherwise are
    resharded to match q.
  * Auto mesh axes (the types name a mesh but the partitioner places arrays after tracing): the op picks the
    split from the mesh (`auto_placement`: the last of several axes splits the heads, the others the batch,
    each where its size divides them; one axis splits the batch, else the heads). Inputs placed otherwise
    are moved there by the partitioner. Use Explicit axes to have the op follow your placement.
  * Inside `jax.shard_map` (every mesh axis manual), on one device, with no mesh in the types or in JAX's
    context (`jax.set_mesh`), or inside another partitioned op: the op is called as it is.
  * A caller that knows its placement passes it (`call(..., placement=, mesh=)`), or gives it to the ops
    called inside (`given`); the models do (`attention_core.sharding.attend`: the batch over
    "data"/"fsdp", the heads over "model").
A placement that splits nothing still runs under shard_map, every device running the whole op (a fused
kernel runs only on device-local arrays). One that leaves a mesh axis unused (the batch over one axis of
two) has its own VJP (`_stacked_vjp`), so that no gradient crosses devices either.

The sequence: q typed as sharded along its length over an Explicit axis runs the op's sequence-parallel form
(its registration's `seq_parallel`, over that axis) where it has one; otherwise the sequence is gathered
(each device sees whole sequences of its rows and heads), as are axes splitting head_dim or value_dim. Under
Auto axes the op never splits the sequence.

Keyword arguments of the op that are arrays are split by kind (`kinds`, else inferred):
  QKV     [batch, length, heads, ...] like q (inferred from the leading three dims; an op declares those of
          another length: `like_q`): split like q (along the sequence only where the length is q's)
  HEADS   a leading heads axis (per-head weights; an op declares them: `per_head`): split like q's heads; a
          leading axis of 1 (shared by the heads) is replicated
  SHARED  the same on every device (inferred for other arrays): replicated (gradients summed over devices)
  RNG     a PRNG key (inferred from its dtype): replicated over batch shards (ops draw their randomness per
          head and share it over the batch, so every batch shard draws the same functions as one device);
          with heads split, the heads shard's index is folded into it, so that the shards' heads draw
          independent functions (different draws from a one-device run of the same key, same distribution).
          The registered ops that take a key draw for every head before they split them: one device's draws
An argument that is an `nnx.Module` travels as its state, each array of which has the argument's kind
(default HEADS). Other callables are closed over, and then the heads are not split (their weights are whole).
Everything else is passed as it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

Array = Any
QKV, HEADS, SHARED, RNG = "qkv", "heads", "shared", "rng"
KINDS = (QKV, HEADS, SHARED, RNG)
_MASK = "mask"

_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("partition_inside", default=False)
_PLACED: contextvars.ContextVar[Placement | None] = contextvars.ContextVar("partition_placed", default=None)
_GIVEN: contextvars.ContextVar[tuple[Placement, Any] | None] = contextvars.ContextVar("partition_given",
                                                                                      default=None)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Mesh axes splitting the batch, the heads and the sequence (each a tuple, major first; empty = whole)."""

  batch: tuple[str, ...] = ()
  heads: tuple[str, ...] = ()
  seq: tuple[str, ...] = ()

  @staticmethod
  def entry(axes: tuple[str, ...]) -> Any:
    """The PartitionSpec entry of `axes`."""
    return None if not axes else axes[0] if len(axes) == 1 else axes

  @property
  def qkv(self) -> P:
    """The PartitionSpec of [batch, length, heads, dim] arrays."""
    return P(self.entry(self.batch), self.entry(self.seq), self.entry(self.heads), None)


def placed() -> Placement | None:
  """The placement of the partitioned op being traced, for its sequence-parallel form
  (`attention_core.sharding.seq_specs`); None outside one."""
  return _PLACED.get()


def free_axes(mesh: Any) -> tuple[str, ...]:
  """Mesh axes not already manual (outside any enclosing shard_map)."""
  manual = jax.sharding.AxisType.Manual
  return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != manual)


def dividing(axes: Sequence[str], sizes: dict[str, int], n: int) -> tuple[str, ...]:
  """The axes of `axes` that split n: in order, each one of size > 1 whose size times the product of those
  kept so far divides n."""
  kept, parts = [], 1
  for a in axes:
    if sizes[a] > 1 and n % (parts * sizes[a]) == 0:
      kept.append(a)
      parts *= sizes[a]
  return tuple(kept)


def auto_placement(mesh: Any, batch: int, heads: int) -> Placement:
  """The split an op picks on Auto mesh axes: with several free axes of size > 1, the heads over the last
  (when its size divides them) and the batch over the others (each while it divides the batch), as in the
  usual data x model layout; with one, the batch over it, else the heads."""
  sizes = dict(mesh.shape)
  axes = [a for a in free_axes(mesh) if sizes[a] > 1]
  if len(axes) == 1:
    return Placement(batch=dividing(axes, sizes, batch)) if dividing(axes, sizes, batch) else \
        Placement(heads=dividing(axes, sizes, heads))
  head_axes = dividing(axes[-1:], sizes, heads)
  return Placement(dividing([a for a in axes if a not in head_axes], sizes, batch), head_axes)


# ------------------------------------------------------------------------------------------------------------
# One call: its arrays with kinds, and the op on one device's block of them


def is_key(x: Any) -> bool:  # an argument's value sorted by kind (module docstring), not a capability probe
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_array(x: Any) -> bool:  # the same: arrays and tracers are split, other values passed as they are
  return hasattr(x, "shape") and hasattr(x, "dtype") and not callable(x)


class _Call:
  """fn(q, k, v, **kwargs) as flat arrays with kinds (`arrays`, `kinds`) and the rest, static."""

  def __init__(self, fn: Callable[..., Array], q: Array, k: Array, v: Array, kwargs: dict[str, Any],
               kinds: dict[str, str], op: str):
    self.fn, self.op, self.kwargs = fn, op, kwargs
    self.arrays, self.kinds, self.names = [q, k, v], [QKV, QKV, QKV], ["q", "k", "v"]
    self.static, self.modules, self.closures = {}, {}, []
    self.batch, self.length, self.heads = q.shape[:3]
    for name, x in kwargs.items():
      if isinstance(x, nnx.Module):
        graphdef, state = nnx.split(x)
        leaves, tree = jax.tree.flatten(state)
        self.modules[name] = (graphdef, tree, len(self.arrays), len(leaves))
        self._add(leaves, kinds.get(name, HEADS), [f"{name}/{i}" for i in range(len(leaves))])
      elif _is_array(x):
        self._add([x], _MASK if name == "mask" else self._kind(name, x, kinds), [name])
      else:
        self.static[name] = x
        if callable(x) and not isinstance(x, type):
          self.closures.append(name)

  def _kind(self, name: str, x: Any, kinds: dict[str, str]) -> str:
    kind = kinds.get(name)
    if kind is None:
      kind = RNG if is_key(x) else QKV if x.ndim >= 3 and tuple(x.shape[:3]) == (
          self.batch, self.length, self.heads) else SHARED
    if kind not in KINDS:
      raise ValueError(f"{self.op}: argument {name!r} has kind {kind!r}; kinds: {KINDS}")
    return kind

  def _add(self, xs: list[Array], kind: str, names: list[str]) -> None:
    self.arrays += xs
    self.kinds += [kind] * len(xs)
    self.names += names

  def spec(self, i: int, place: Placement) -> P:
    """The PartitionSpec of flat array i under `place`."""
    kind, shape = self.kinds[i], self.arrays[i].shape
    b, h = place.entry(place.batch), place.entry(place.heads)
    s = place.entry(place.seq) if len(shape) > 1 and shape[1] == self.length else None
    rest = [None] * (len(shape) - 1)
    if kind == QKV:
      return P(b, s, h, *rest[2:])
    if kind == _MASK:
      return P(b, s, *rest[1:])
    if kind == HEADS and len(shape) and shape[0] == self.heads:
      return P(h, *rest)
    return P(*([None] * len(shape)))

  def local(self, arrays: Sequence[Array], place: Placement) -> Array:
    """The op on one device's block `arrays` of `self.arrays` (split by `place`)."""
    kwargs = dict(self.static)
    leaves = set()
    for name, (graphdef, tree, start, count) in self.modules.items():
      kwargs[name] = nnx.merge(graphdef, jax.tree.unflatten(tree, arrays[start:start + count]))
      leaves.update(range(start, start + count))
    for i in range(3, len(arrays)):
      if i not in leaves:
        x = arrays[i]
        if self.kinds[i] == RNG and place.heads:
          x = jax.random.fold_in(x, jax.lax.axis_index(place.heads))
        kwargs[self.names[i]] = x
    with _inside():
      return self.fn(*arrays[:3], **kwargs)

  def run(self, mesh: Any, place: Placement, *, own_vjp: bool = True) -> Array:
    """The op under jax.shard_map over `mesh`, each device running it on its block of `place` (the heads
    whole when a closure is passed; every device runs the whole op when nothing is split: a fused kernel
    runs only on device-local arrays). own_vjp: differentiate through `_stacked_vjp` when the placement
    leaves a mesh axis unused, else (and always when False) through shard_map's own rule."""
    if self.closures:
      place = dataclasses.replace(place, heads=())
    specs = tuple(self.spec(i, place) for i in range(len(self.arrays)))
    sizes, used = dict(mesh.shape), set(place.batch + place.heads + place.seq)
    if own_vjp and any(sizes[a] > 1 and a not in used for a in free_axes(mesh)):
      return _stacked_vjp(self, mesh, place, specs)
    return _shard_map(functools.partial(_local, self, place), mesh, specs, place.qkv)(*self.arrays)

  @property
  def diff(self) -> list[int]:
    """The arrays that get gradients (floating point)."""
    return [i for i, x in enumerate(self.arrays) if jnp.issubdtype(x.dtype, jnp.floating)]


def _shard_map(fn: Callable[..., Any], mesh: Any, in_specs: Any, out_specs: Any) -> Callable[..., Any]:
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       axis_names=set(free_axes(mesh)), check_vma=False)


def _local(call: _Call, place: Placement, *arrays: Array) -> Array:
  return call.local(arrays, place)


def _stacked_vjp(call: _Call, mesh: Any, place: Placement, specs: tuple[P, ...]) -> Array:
  """The op under shard_map with its own VJP, for placements that leave a mesh axis unused. (shard_map's
  rule would sum the gradients of inputs replicated along that axis over it, as if each device held a
  part; here every device along it computes the same gradients, which stay where they are.) The forward
  hands each device's residuals to its backward stacked along a new leading axis split over every mesh
  axis; gradients of weights are summed over the devices that split the batch (and the heads, for weights
  shared by the heads)."""
  n, diff, stacked = len(call.arrays), call.diff, P(free_axes(mesh))
  found: dict[str, Any] = {}

  def forward_body(*xs):
    out, vjp = jax.vjp(lambda *d: call.local(_with(xs, diff, d), place), *(xs[i] for i in diff))
    leaves, found["tree"] = jax.tree.flatten(vjp)
    found["leaves"] = [_leaf_kind(leaf, xs) for leaf in leaves]
    return out, [leaf[None] for leaf, (kind, _) in zip(leaves, found["leaves"], strict=True) if kind == "res"]

  def backward_body(xs, residuals, ct):
    residuals, leaves = iter(residuals), []
    for kind, value in found["leaves"]:
      leaves.append(xs[value] if kind == "arg" else next(residuals)[0] if kind == "res" else value)
    grads = list(jax.tree.unflatten(found["tree"], leaves)(ct))
    for m, i in enumerate(diff):
      kind, shape = call.kinds[i], call.arrays[i].shape
      axes = () if kind in (QKV, _MASK) else place.batch if kind == HEADS and shape[:1] == (call.heads,) \
          else place.batch + place.heads
      if axes:
        grads[m] = jax.lax.psum(grads[m], axes)
    return tuple(grads)

  def primal(*xs):
    return _shard_map(functools.partial(_local, call, place), mesh, specs, place.qkv)(*xs)

  def forward(*xs):
    out, residuals = _shard_map(forward_body, mesh, specs, (place.qkv, stacked))(*xs)
    return out, (xs, residuals)

  def backward(saved, ct):
    xs, residuals = saved
    grads = _shard_map(backward_body, mesh, (specs, stacked, place.qkv), tuple(specs[i] for i in diff))(
        xs, residuals, ct)
    by_index = dict(zip(diff, grads, strict=True))
    return tuple(by_index.get(i) for i in range(n))

  op = jax.custom_vjp(primal)
  op.defvjp(forward, backward)
  return op(*call.arrays)


def _leaf_kind(leaf: Any, xs: Sequence[Array]) -> tuple[str, Any]:
  """A VJP leaf: ("arg", i) the op's argument i, ("res", None) a residual array, ("static", leaf) else."""
  for i, x in enumerate(xs):
    if x is leaf:
      return "arg", i
  return ("res", None) if isinstance(leaf, (jax.Array, jax.core.Tracer)) else ("static", leaf)


def _with(xs: Sequence[Array], indices: Sequence[int], values: Sequence[Array]) -> list[Array]:
  """xs with xs[indices[j]] replaced by values[j]."""
  out = list(xs)
  for i, x in zip(indices, values, strict=True):
    out[i] = x
  return out


@contextlib.contextmanager
def given(placement: Placement, mesh: Any) -> Iterator[None]:
  """Ops that partition themselves, called inside, take `placement` on `mesh` (each for its own batch and
  heads: the axes of it that divide them) instead of the one the types give: a caller that knows its
  placement and calls an op that draws for every head before it splits them (`attention_core.sharding`)."""
  token = _GIVEN.set((placement, mesh))
  try:
    yield
  finally:
    _GIVEN.reset(token)


@contextlib.contextmanager
def _inside() -> Iterator[None]:
  token = _INSIDE.set(True)
  try:
    yield
  finally:
    _INSIDE.reset(token)


# ------------------------------------------------------------------------------------------------------------
# Explicit axes: the placement of q's type


def _typed_spec(x: Array) -> tuple[Any, ...]:
  spec = tuple(jax.typeof(x).sharding.spec)
  return spec + (None,) * (jnp.ndim(x) - len(spec))


def _axes(entry: Any) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _seq_form(op: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[Callable[..., Any], dict] | None:
  """(the sequence-parallel form registered for op called with kwargs, its keyword arguments), or None
  when it has none or the form does not take every argument given (the fused-path choice aside)."""
  # Read by name, as the registry reads the op packages: it imports contract, which imports this module.
  registry = importlib.import_module("attention_core.registry")

  missing = object()
  for name in registry.names():
    spec = registry.get(name)
    fn, bound = (spec.fn.func, spec.fn.keywords) if isinstance(spec.fn, functools.partial) else (spec.fn, {})
    # A registration that binds arguments is this call only where the call passes the same values.
    differs = any(kwargs.get(k, missing) != x for k, x in bound.items())
    if spec.seq_parallel is None or fn is not op or differs:
      continue
    # The form takes what the registration declares (its plan, the model's inputs; tests/attention_core/
    # test_registry.py holds them against each other), not the op's kernel choice.
    path = registry.fused_path(spec)
    rest = {k: x for k, x in kwargs.items() if path is None or k != path.argument}
    takes = {"causal", "mask", *spec.plan, *spec.inputs}
    return (spec.seq_parallel, rest) if set(rest) - set(bound) <= takes else None
  return None


def _reshard(call: _Call, mesh: Any, place: Placement) -> None:
  """On Explicit axes: each array of `call` typed other than `place` splits it (k, v, the mask, per-head
  weights made as constants) resharded to match, as shard_map's in_specs require."""
  for i, x in enumerate(call.arrays):
    want = call.spec(i, place)
    if _typed_spec(x) != tuple(want) + (None,) * (jnp.ndim(x) - len(want)):
      call.arrays[i] = jax.sharding.reshard(x, NamedSharding(mesh, want))


def _explicit(op: Callable[..., Any], call: _Call, mesh: Any, kwargs: dict[str, Any]) -> Array:
  """Explicit axes: the op on q's typed placement (its sequence-parallel form for a split sequence), the
  other arrays resharded to match."""
  spec, sizes = _typed_spec(call.arrays[0]), dict(mesh.shape)
  heads = () if call.closures else _axes(spec[2])
  place = Placement(dividing(_axes(spec[0]), sizes, call.batch), dividing(heads, sizes, call.heads))
  seq = _axes(spec[1])
  form = _seq_form(op, kwargs) if len(seq) == 1 and not call.modules and not call.closures else None
  if form is not None:
    place = dataclasses.replace(place, seq=seq)
  _reshard(call, mesh, place)
  if form is None:
    return call.run(mesh, place)
  fn, rest = form
  arrays = dict(zip(call.names, call.arrays, strict=True))
  rest.update({n: arrays[n] for n in rest if n in arrays})
  if rest.get("mask") is None:  # every key real, as the form's own default, but placed like q
    mask = jnp.ones((call.batch, call.length), bool)
    rest["mask"] = jax.sharding.reshard(mask, NamedSharding(mesh, P(*place.qkv[:2])))
  token = _PLACED.set(place)
  try:
    return fn(*call.arrays[:3], **rest, mesh=mesh, axis=seq[0])
  finally:
    _PLACED.reset(token)


# ------------------------------------------------------------------------------------------------------------
# The entry points


def _contract_shaped(q: Any, k: Any, v: Any, mask: Any) -> bool:
  """Whether q, k, v (and the mask) have the op contract's shapes: otherwise the op rejects them itself."""
  if not all(_is_array(x) and jnp.ndim(x) == 4 for x in (q, k, v)):
    return False
  if (k.shape[0], k.shape[2]) != (q.shape[0], q.shape[2]) or v.shape[:3] != k.shape[:3]:
    return False
  return mask is None or (_is_array(mask) and tuple(mask.shape) == tuple(k.shape[:2]))


def unwrapped(op: Callable[..., Any]) -> Callable[..., Any]:
  """The function under any functools.partial (the models bind plan parameters so)."""
  while isinstance(op, functools.partial):
    op = op.func
  return op


def _name(op: Callable[..., Any]) -> str:
  """module.name of an op, through functools.partial."""
  op = unwrapped(op)
  return f"{getattr(op, '__module__', None)}.{getattr(op, '__qualname__', type(op).__name__)}"


def call(fn: Callable[..., Array], q: Array, k: Array, v: Array, kwargs: dict[str, Any], *,
         kinds: dict[str, str] | None = None, placement: Placement | None = None, mesh: Any = None,
         op: Callable[..., Any] | None = None) -> Array:
  """fn(q, k, v, **kwargs) -> [batch, length, heads, value_dim], each device running it on its batch rows
  and heads (module docstring). placement, mesh: the caller's own placement on `mesh` instead of the one
  the types give. op: the registered op (whose sequence-parallel form to look up), default fn."""
  op = fn if op is None else op
  kinds = dict(kinds or {})
  name = _name(op)

  def direct() -> Array:
    return fn(q, k, v, **kwargs)

  if _INSIDE.get() or not _contract_shaped(q, k, v, kwargs.get("mask")):
    return direct()
  if placement is None and _GIVEN.get() is not None:
    outer, mesh = _GIVEN.get()
    sizes = dict(mesh.shape)
    placement = Placement(dividing(outer.batch, sizes, q.shape[0]), dividing(outer.heads, sizes, q.shape[2]))
  if placement is not None:
    c = _Call(fn, q, k, v, kwargs, kinds, name)
    if jax.sharding.AxisType.Explicit in mesh.axis_types:
      _reshard(c, mesh, dataclasses.replace(placement, heads=() if c.closures else placement.heads))
    return c.run(mesh, placement, own_vjp=False)
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and not free_axes(context):
    return direct()  # inside shard_map: q, k, v are this device's already
  arrays = [q, k, v, *(x for x in kwargs.values() if _is_array(x))]
  if not any(isinstance(x, jax.core.Tracer) for x in arrays):
    return _eager(fn, q, k, v, kwargs, kinds, op, arrays)
  typed = jax.typeof(q).sharding.mesh
  mesh = typed if not typed.empty else context
  if mesh.empty or mesh.size == 1 or not free_axes(mesh):
    return direct()
  c = _Call(fn, q, k, v, kwargs, kinds, name)
  if jax.sharding.AxisType.Explicit in mesh.axis_types:
    return _explicit(op, c, mesh, kwargs)
  return c.run(mesh, auto_placement(mesh, c.batch, c.heads))


def _eager(fn: Callable[..., Array], q: Array, k: Array, v: Array, kwargs: dict[str, Any],
           kinds: dict[str, str], op: Callable[..., Any], arrays: list[Array]) -> Array:
  """A call on concrete arrays: on one device compiled whole (`_whole`), else jitted on q's placement."""
  devices = set().union(*(x.sharding.device_set for x in arrays if isinstance(x, jax.Array)))
  sharding = getattr(q, "sharding", None)
  if len(devices) <= 1 or not isinstance(sharding, NamedSharding):
    return _whole(fn, q, k, v, kwargs, op)
  spec, sizes = tuple(sharding.spec) + (None,) * 4, dict(sharding.mesh.shape)
  place = Placement(dividing(_axes(spec[0]), sizes, q.shape[0]), dividing(_axes(spec[2]), sizes, q.shape[2]))
  names = [n for n, x in kwargs.items() if _is_array(x)]
  rest = {n: x for n, x in kwargs.items() if n not in names}

  def run(q, k, v, xs):
    return call(fn, q, k, v, {**rest, **dict(zip(names, xs, strict=True))}, kinds=kinds, op=op,
                placement=place, mesh=sharding.mesh)

  return jax.jit(run)(q, k, v, [kwargs[n] for n in names])


def _plain(x: Any) -> bool:
  """A value that can key a compiled program: None, a bool, number or string, or a tuple of them."""
  return x is None or isinstance(x, (bool, int, float, str)) or (
      isinstance(x, tuple) and all(_plain(i) for i in x))


def _typed(x: Any) -> Any:
  """x's types, into tuples: a cache key part, since (0,), (0.0,) and (False,) are equal but an op may take
  only one of them."""
  return tuple(_typed(i) for i in x) if isinstance(x, tuple) else type(x)


def _whole(fn: Callable[..., Array], q: Array, k: Array, v: Array, kwargs: dict[str, Any],
           op: Callable[..., Any]) -> Array:
  """fn(q, k, v, **kwargs) on concrete arrays on one device, compiled as one program (cached by shapes,
  the other arguments and the op's trace context, `partitioned`'s trace_key) rather than run primitive by
  primitive, which compiles each of a plan's hundreds of operations on its own. Arguments that are not
  plain values (callables, modules) or a trace context of None run it as it is. The op's `check` reads
  the concrete values its trace cannot."""
  trace_key = getattr(op, "trace_key", None)
  context = trace_key() if trace_key is not None else None
  names = tuple(n for n, x in kwargs.items() if isinstance(x, (jax.Array, np.ndarray)))  # not numpy scalars
  static = tuple((n, _typed(x), x) for n, x in kwargs.items() if n not in names)
  scalars = any(jnp.ndim(kwargs[n]) == 0 for n in names)  # a size given as an array: the op names it as given
  if context is None or scalars or not all(_plain(x) for _, _, x in static):
    return fn(q, k, v, **kwargs)
  if getattr(op, "check", None) is not None:
    op.check(q, k, v, **kwargs)
  return _compiled(fn, names, static, context, q, k, v, tuple(kwargs[n] for n in names))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _compiled(fn: Callable[..., Array], names: tuple[str, ...], static: tuple, context: Any,
              q: Array, k: Array, v: Array, xs: tuple[Array, ...]) -> Array:
  del context  # a key of the cache only: the trace depends on it
  return fn(q, k, v, **{n: x for n, _, x in static}, **dict(zip(names, xs, strict=True)))


def clear_compiled() -> None:
  """Forgets the programs of eager calls (`_whole`), for code that changes what an op traces to."""
  _compiled.clear_cache()


def partitioned(op: Callable[..., Array], *, per_head: Sequence[str] = (), like_q: Sequence[str] = (),
                trace_key: Callable[[], Any] | None = None,
                check: Callable[..., None] | None = None) -> Callable[..., Array]:
  """op(q, k, v, *, causal, mask=None, **params), partitioning itself (module docstring): under any jit, on
  any mesh, each device runs it on its batch rows and heads. per_head: its per-head weight arguments (a
  leading heads axis); like_q: its arguments [batch, any length, heads, ...] (kind QKV). trace_key() -> what
  else op's trace depends on (hashable; None: it cannot be cached), so that an eager call on one device runs
  as one compiled program (`_whole`); check(q, k, v, **kwargs): what op checks of its arguments' values when
  they are concrete, run before that program."""
  kinds = {**{n: HEADS for n in per_head}, **{n: QKV for n in like_q}}

  @functools.wraps(op)
  def run(*args: Any, **kwargs: Any) -> Array:
    args = list(args) + [kwargs.pop(p) for p in ("q", "k", "v")[len(args):] if p in kwargs]  # contract names
    if len(args) != 3:
      return op(*args, **kwargs)
    return call(op, *args, kwargs, kinds=kinds, op=run)

  run.partitions_itself = True
  run.trace_key, run.check = trace_key, check
  return run
