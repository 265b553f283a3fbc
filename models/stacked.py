"""Layers of one structure held as one module whose variables carry a leading layer axis (Flax NNX).

`stack(modules)` turns L modules of one structure (the same `nnx.graphdef`) into one module of that structure
whose every variable is theirs stacked on a new leading axis of size L; variables that declare logical axes
(`out_sharding`, models/layers.py) get the logical axis `LAYERS` in front, which the sharding rules map to a
mesh axis or to none (configs/base.py: replicated). `scan` runs a function over the layers by one
`jax.lax.scan`, so the compiler sees one layer whatever the depth, and the train step's per-parameter work
(gradient norm, clipping, the optimizer's update) runs once over each stacked array instead of once per layer.

The values are the unstacked modules' own: `stack` of modules built one after another holds the parameters
and random streams they were built with, and `reseed` gives a stacked module's random streams the keys
`nnx.reseed` gives the unstacked layers' streams, layer after layer. So a stacked model computes what its
layers computed one by one, and a checkpoint converts between the two layouts by stacking or unstacking
(training/layouts.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

LAYERS = "layers"  # the logical name of the leading axis of stacked variables


def build(make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
  """make(rngs), traced on its own (`nnx.jit`) when the model is built inside a trace (jit, eval_shape).

  There each random draw of a constructor costs time in proportion to the trace it is drawn in (flax compares
  the new stream count's sharding, and JAX describes a tracer's origin by walking the whole trace), so L
  layers built in one trace cost O(L^2) and in one trace each O(L). Eagerly (no trace) it is make(rngs)."""
  if any(isinstance(stream.count[...], jax.core.Tracer) for _, stream in rngs.items()):
    return nnx.jit(make)(rngs)
  return make(rngs)


def _with_layer_axis(v: nnx.Variable) -> nnx.Variable:
  axes = v.get_metadata("out_sharding", None)
  return v if axes is None else v.copy(out_sharding=(LAYERS, *axes))


def stack(modules: Sequence[nnx.Module]) -> nnx.Module:
  """One module of the modules' structure, each variable theirs stacked on a new leading axis (layer i at
  index i). The modules must share one graphdef (the caller says which config field to change if not)."""
  graphdef = nnx.graphdef(modules[0])
  states = [nnx.state(m) for m in modules]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *states)  # each leaf [layers, ...]
  stacked = jax.tree.map(_with_layer_axis, stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, stacked)


def is_stacked(v: nnx.Variable) -> bool:
  """Whether a variable declares the leading layer axis (a stacked parameter or module state)."""
  axes = v.get_metadata("out_sharding", None) if isinstance(v, nnx.Variable) else None
  return bool(axes) and axes[0] == LAYERS


def depths(node: Any) -> set[int]:
  """The layer counts of the stacked modules in `node` (their variables' leading layer axis); {} for none."""
  leaves = jax.tree.leaves(nnx.state(node), is_leaf=lambda x: isinstance(x, nnx.Variable))
  return {int(v.shape[0]) for v in leaves if is_stacked(v)}


def scan(module: nnx.Module, fn: Callable[[nnx.Module, Any, Any], tuple[Any, Any]], carry: Any,
         xs: Any = None, *, remat: bool = False, policy: Any = None, update: bool = True,
         unroll: int = 1) -> tuple[Any, Any]:
  """carry, ys = for each layer i of the stacked `module`: carry, y_i = fn(layer_i, carry, xs_i), by
  `jax.lax.scan`; ys stacked on a leading layer axis. With `update`, the state the layers leave (random
  streams advanced, routing centroids updated, values sown) is written back into `module`, stacked; without,
  it is dropped (decoding, which changes no state, may then run inside another transform). remat:
  `jax.checkpoint` the layer with `policy` (each layer recomputed in the backward pass from its input).
  unroll: layers per iteration of the loop (`jax.lax.scan`'s; the same results)."""
  graphdef, params, other = nnx.split(module, nnx.Param, ...)

  def body(carry, inputs):
    layer_params, layer_other, x = inputs
    block = nnx.merge(graphdef, layer_params, layer_other)
    carry, y = fn(block, carry, x)
    return carry, (y, nnx.state(block, nnx.Not(nnx.Param)))

  if remat:
    body = jax.checkpoint(body, policy=policy)
  carry, (ys, after) = jax.lax.scan(body, carry, (params, other, xs), unroll=unroll)
  if update:
    nnx.update(module, after)
  return carry, ys


def _key_of(stream: nnx.RngStream) -> Any:
  return stream.key[...]


def reseed(node: Any, **stream_keys: Any) -> None:
  """`nnx.reseed(node, **stream_keys)`, where a stacked module's streams (keys with a leading layer axis)
  get the keys its unstacked layers' streams would get: layer 0's streams in graph order, then layer 1's.
  Those are computed for all layers at once (`fold_in` of the stream's counts, vectorized), so the program
  does not grow with the depth."""
  rngs = nnx.Rngs(**stream_keys)
  streams = [s for _, s in nnx.iter_graph(node)
             if isinstance(s, nnx.RngStream) and s.key.tag in stream_keys]
  i = 0
  while i < len(streams):
    if _key_of(streams[i]).ndim == 0:
      streams[i].key.set_value(rngs[streams[i].key.tag]())
      streams[i].count.set_value(jnp.zeros((), jnp.uint32))
      i += 1
      continue
    # A stacked module's streams follow one another in graph order.
    n = _key_of(streams[i]).shape[0]
    j = i
    while j < len(streams) and _key_of(streams[j]).shape == (n,):
      j += 1
    _reseed_stacked(rngs, streams[i:j], n)
    i = j


def _reseed_stacked(rngs: nnx.Rngs, run: list[nnx.RngStream], n: int) -> None:
  """Unstacked, layer l's k-th stream of a tag would take that tag's (c0 + l * S + k)-th key, where S is the
  number of the tag's streams in a layer and c0 the tag's count before them."""
  for tag in dict.fromkeys(s.key.tag for s in run):
    members = [s for s in run if s.key.tag == tag]
    source = rngs[tag]
    base, c0 = source.key[...], source.count[...]
    layer_ = jnp.arange(n, dtype=jnp.uint32)
    for k, s in enumerate(members):
      counts = c0 + layer_ * len(members) + k  # [layers]
      s.key.set_value(jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base, counts))
      s.count.set_value(jnp.zeros((n,), jnp.uint32))
    source.count.set_value(c0 + n * len(members))


# -----------------------------------------------------------------------------------------------------------
# One layout to the other: per-layer entries `.../<i>/...` <-> stacked entries `...` (checkpoints, tests)


def convert(tree: Any, like: Any) -> Any:
  """`tree` (a model state, or anything holding one: optimizer moments, a checkpoint's state) in the layer
  layout of `like` (the same model in the other layout, abstract or not): the per-layer entries
  `<prefix>/<i>/<rest>` (i = 0..L-1) of a module that `like` holds stacked become one entry `<prefix>/<rest>`
  stacked on a leading axis, and the other way round. The values are the same bits; KeyError names an entry
  of `like` that `tree` has in neither layout."""
  source = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
  wanted, treedef = jax.tree_util.tree_flatten_with_path(like)
  return jax.tree_util.tree_unflatten(treedef, [_entry(source, path, want) for path, want in wanted])


def _entry(source: dict[tuple, Any], path: tuple, want: Any) -> Any:
  if path in source:
    return source[path]
  index = jax.tree_util.DictKey
  for k in range(1, len(path)):  # a stacked entry: the layers' entries stacked
    if path[:k] + (index(0),) + path[k:] in source:
      return jnp.stack([source[path[:k] + (index(i),) + path[k:]] for i in range(want.shape[0])])
  for k, part in enumerate(path):  # one layer's entry: its slice of the stacked one
    if isinstance(part, index) and isinstance(part.key, int) and path[:k] + path[k + 1:] in source:
      return source[path[:k] + path[k + 1:]][part.key]
  raise KeyError(f"{jax.tree_util.keystr(path)} is in neither layout")
