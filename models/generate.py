"""Sampling from a causal model (lm / image) with cached decoding, jitted once per shape.

`Decoder` wraps a model's `init_cache` / `prefill` / `decode` in `jax.jit` with the parameters as an argument
(split once with `nnx.split`), for callers that step themselves (benchmarks, tests). `generate` compiles the
whole loop: prefill a prompt, then sample one token per position with temperature, top-k and top-p (nucleus)
filtering from a fixed key, so a seed gives the same sequences on the same backend.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Array = Any


class Decoder:
  """Jitted cached decoding for `model` (its parameters at construction)."""

  def __init__(self, model: nnx.Module):
    self.graphdef, self.state = nnx.split(model)
    self._init = jax.jit(lambda state, batch, max_length: nnx.merge(self.graphdef, state).init_cache(
        batch, max_length), static_argnums=(1, 2))
    # The cache is donated: a step updates it in place instead of copying it (dense: O(L) per layer).
    self._decode = jax.jit(lambda state, cache, tokens, position: nnx.merge(self.graphdef, state).decode(
        cache, tokens, position), donate_argnums=(1,))
    self._prefill = jax.jit(lambda state, cache, prompt: nnx.merge(self.graphdef, state).prefill(cache,
                                                                                                  prompt))
    self._generate = jax.jit(functools.partial(_generate, self.graphdef),
                             static_argnames=("length", "max_length", "temperature", "top_k", "top_p"))

  def generate(self, key: Array, prompt: Array, **kwargs: Any) -> Array:
    """See `generate` (module level); compiled once per prompt shape and sampling setting."""
    return self._generate(self.state, key, prompt, **kwargs)

  def init_cache(self, batch: int, max_length: int) -> Any:
    return self._init(self.state, batch, max_length)

  def decode(self, cache: Any, tokens: Array, position: Any) -> tuple[Array, Any]:
    """tokens [batch] at position - 1 -> (logits [batch, vocab] for `position`, cache); consumes `cache`."""
    return self._decode(self.state, cache, tokens, jnp.asarray(position, jnp.int32))

  def prefill(self, cache: Any, prompt: Array) -> tuple[Array, Any]:
    """prompt [batch, P] -> (logits [batch, P + 1, vocab], cache through position P)."""
    return self._prefill(self.state, cache, prompt)


def filter_logits(logits: Array, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Array:
  """logits [batch, vocab] -> logits / temperature with the tokens outside top-k / top-p set to -inf.

  top_k = 0 and top_p = 1 keep everything; top-p keeps the smallest most-likely set whose probability reaches
  top_p (always at least the most likely token).
  """
  logits = logits.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, min(int(top_k), logits.shape[-1]))[0][:, -1:]  # [batch, 1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
    keep_sorted = before < top_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return logits


def sample_token(key: Array, logits: Array, *, temperature: float, top_k: int, top_p: float) -> Array:
  """One token per row of logits [batch, vocab]; temperature 0 is greedy."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
  return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


def _generate(graphdef: Any, state: Any, key: Array, prompt: Array, *, length: int, max_length: int,
              temperature: float, top_k: int, top_p: float) -> Array:
  model = nnx.merge(graphdef, state)
  batch, p = prompt.shape
  sample = functools.partial(sample_token, temperature=temperature, top_k=top_k, top_p=top_p)
  cache = model.init_cache(batch, max_length)
  logits, cache = model.prefill(cache, prompt)
  tokens = jnp.zeros((batch, length), jnp.int32).at[:, :p].set(prompt.astype(jnp.int32))
  tokens = tokens.at[:, p].set(sample(jax.random.fold_in(key, p), logits[:, -1]))

  def body(carry, t):
    tokens, cache = carry
    logits, cache = model.decode(cache, jax.lax.dynamic_index_in_dim(tokens, t - 1, 1, keepdims=False), t)
    token = sample(jax.random.fold_in(key, t), logits)
    return (jax.lax.dynamic_update_index_in_dim(tokens, token, t, 1), cache), None

  (tokens, _), _ = jax.lax.scan(body, (tokens, cache), jnp.arange(p + 1, length, dtype=jnp.int32))
  return tokens


def generate(model: nnx.Module | Decoder, key: Array, *, num_samples: int, length: int,
             prompt: Array | None = None, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             max_length: int | None = None) -> Array:
  """Samples [num_samples, length] tokens; the first P are `prompt` [num_samples, P] (P < length) when given.

  max_length (default `length`) is the length "auto" plan parameters are chosen for: the model's training
  length reproduces its training-time attention plan.
  """
  if prompt is None:
    prompt = jnp.zeros((num_samples, 0), jnp.int32)
  prompt = jnp.asarray(prompt, jnp.int32)
  if prompt.shape[0] != num_samples or prompt.shape[1] >= length:
    raise ValueError(f"prompt must be [num_samples={num_samples}, P < length={length}], "
                     f"got {tuple(prompt.shape)}")
  if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
    raise ValueError(f"need temperature >= 0, 0 < top_p <= 1 and top_k >= 0; got temperature={temperature}, "
                     f"top_p={top_p}, top_k={top_k}")
  decoder = model if isinstance(model, Decoder) else Decoder(model)
  return decoder.generate(key, prompt, length=length, max_length=max_length or length,
                          temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
