"""Shared by the model tests of attention that takes a memory (config.model.mem_len): the LM run one segment
at a time with its memory, and the checks such attention must pass (segments over a memory that covers the
past equal one pass over the whole sequence; the memory a segment returns gets no gradient; the module's
`recompute` changes no loss or gradient)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def by_segment(model, tokens, length, mem_len):
  """The LM over tokens [batch, n * length] one segment of `length` at a time (one compiled step), each
  segment reading the memory the one before returned, the first model.init_memory(batch, mem_len): per
  segment (logits, memory)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, memory, segment):
    return nnx.merge(graphdef, state)({"inputs": segment}, deterministic=True, memory=memory)

  memory, out = model.init_memory(tokens.shape[0], mem_len), []
  for s in range(tokens.shape[1] // length):
    logits, memory = step(state, memory, tokens[:, s * length:(s + 1) * length])
    out.append((logits, memory))
  return out


def run_segments(model, tokens, length, mem_len):
  """by_segment's logits concatenated [batch, n * length, vocab], and the final memory."""
  out = by_segment(model, tokens, length, mem_len)
  return jnp.concatenate([logits for logits, _ in out], axis=1), out[-1][1]


def assert_segments_equal_whole(model, tokens, length, mem_len, rtol=1e-4, atol=1e-5):
  """The segments of `length` (mem_len must cover every earlier position) give the logits of one pass over
  all of tokens without a memory."""
  segments, _ = run_segments(model, tokens, length, mem_len)
  graphdef, state = nnx.split(model)
  whole = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)({"inputs": tokens}, deterministic=True))(
      state, tokens)
  np.testing.assert_allclose(segments, whole, rtol=rtol, atol=atol)


def assert_memory_gets_no_gradient(model, tokens, weights, mem_len, rtol, atol):
  """tokens [batch, 2 * length] as two segments: the memory segment 1 returns is a constant to the parameters
  (a loss on its hidden states, weighted by `weights` [batch, mem_len, features], has zero gradient), so
  segment 2's gradient through it is the one with that memory held fixed; and segment 2 does read the
  memory (its loss has a gradient with respect to the first layer's hidden states)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  length = tokens.shape[1] // 2
  seg1, seg2 = {"inputs": tokens[:, :length]}, {"inputs": tokens[:, length:]}

  def segment_memory(params):
    m = nnx.merge(graphdef, params, rest, copy=True)
    return m(seg1, deterministic=True, memory=m.init_memory(tokens.shape[0], mem_len))[1]

  def loss(params, memory):
    m = nnx.merge(graphdef, params, rest, copy=True)
    return jnp.sum(m(seg2, deterministic=True, memory=memory)[0] ** 2)

  @jax.jit
  def grads(params):
    of_memory = jax.grad(lambda p: sum(jnp.sum(layer["hidden"] * weights)
                                       for layer in segment_memory(p)["layers"]))(params)
    through = jax.grad(lambda p: loss(p, segment_memory(p)))(params)
    memory = segment_memory(params)

    def with_hidden(hidden):  # the first layer's memory replaced
      layers = memory["layers"]
      return loss(params, {**memory, "layers": [{**layers[0], "hidden": hidden}, *layers[1:]]})

    return of_memory, through, jax.grad(loss)(params, memory), jax.grad(with_hidden)(
        memory["layers"][0]["hidden"])

  of_memory, through, fixed, of_hidden = grads(params)
  assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(of_memory))
  for a, b in zip(jax.tree.leaves(through), jax.tree.leaves(fixed), strict=True):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
  assert float(jnp.abs(of_hidden).max()) > 0  # ... while segment 2 does read the memory


def assert_recompute_changes_nothing(make_module, features):
  """make_module(**fields) built as it is and with recompute=True, called on x [2, 5, features] (the last
  position of row 1 padded) with a memory [2, 3, features]: the same loss and gradients. Returns the
  gradients (without recompute), for the caller to check where they reach."""
  g = np.random.default_rng(3)
  x = jnp.asarray(g.normal(size=(2, 5, features)), jnp.float32)
  memory = jnp.asarray(g.normal(size=(2, 3, features)), jnp.float32)
  mask = jnp.asarray([[True] * 5, [True] * 4 + [False]])
  results = []
  for fields in ({}, {"recompute": True}):
    graphdef, params, rest = nnx.split(make_module(**fields), nnx.Param, ...)

    def loss(params, graphdef=graphdef, rest=rest):
      m = nnx.merge(graphdef, params, rest)
      return jnp.sum(m(x, mask, deterministic=True, memory=memory) ** 2)

    results.append(jax.jit(jax.value_and_grad(loss))(params))
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  return results[0][1]
