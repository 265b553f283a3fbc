"""NSA decoded from the whole key/value cache: each token recomputes the compressed blocks that are complete,
scores and chooses its selection blocks, and reads its window, all by `attention_baselines.nsa.attend_rows`
for one query, so a step equals row `position` of the forward pass over the cache's length. The compression
is recomputed per token (O(L/s * l * d * hidden) for the MLP, O(L * d) for the scores), not grown by one
block per stride. Step arguments besides the plan: `gates` [batch, heads, 3] for the token, and the
compression MLPs (`cmp_key_*`, `cmp_value_*`) as for the op."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_baselines.nsa import BRANCHES, MLP_PARTS, attend_rows, check_mlp, check_num_selected
from attention_core import contract
from attention_core.blocks import num_blocks
from attention_core.decode import Cache, Decoder, finish, token, write, zeros

Array = Any
OP = "nsa"


def init_cache(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
               select_block: Any = 64, **unused: Any) -> Cache:
  """Keys and values for whole selection blocks of the max_length tokens (the forward pass's padding)."""
  del unused
  sel = contract.check_positive_int(select_block, name="select_block", op=OP)
  slots = num_blocks(max_length, sel) * sel
  return {"k": zeros(batch, heads, slots, head_dim, dtype), "v": zeros(batch, heads, slots, value_dim, dtype)}


def step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, pool_q: Array | None = None,
         pool_k: Array | None = None, compress_block: Any = 32, compress_stride: Any = 16,
         select_block: Any = 64, num_selected: Any = 16, window: Any = 512, query_chunks: Any = None,
         gates: Array | None = None, **mlps: Array) -> tuple[Array, Cache]:
  """Writes the token's key and value at its position and attends as the forward pass's row `position`."""
  del pool_q, pool_k, query_chunks
  x = token(q, k, v, position, None, None, op=OP)
  cache = {"k": write(cache["k"], x.k, x.position), "v": write(cache["v"], x.v, x.position)}
  batch, heads, slots, head_dim = cache["k"].shape
  value_dim = cache["v"].shape[-1]
  size = contract.check_positive_int(compress_block, name="compress_block", op=OP)
  key_mlp = check_mlp(OP, "cmp_key", tuple(mlps.get(f"cmp_key_{p}") for p in MLP_PARTS), heads, size,
                      head_dim)
  value_mlp = check_mlp(OP, "cmp_value", tuple(mlps.get(f"cmp_value_{p}") for p in MLP_PARTS), heads, size,
                        value_dim)
  rows = batch * heads
  g = (jnp.full((rows, 1, BRANCHES), 1.0 / BRANCHES, cache["k"].dtype) if gates is None
       else jnp.asarray(gates, cache["k"].dtype).reshape(rows, 1, BRANCHES))
  plan = {name: contract.check_positive_int(value, name=name, op=OP) for name, value in (
      ("compress_stride", compress_stride), ("select_block", select_block), ("window", window))}
  plan["num_selected"] = check_num_selected(num_selected, op=OP)
  out = attend_rows((x.q * x.scale).reshape(rows, 1, head_dim), x.position[None], g,
                    cache["k"].reshape(rows, slots, head_dim), cache["v"].reshape(rows, slots, value_dim),
                    jnp.ones((rows, slots), bool), batch=batch, compress_block=size, **plan, key_mlp=key_mlp,
                    value_mlp=value_mlp, query_chunks=1)
  return finish(out.reshape(batch, heads, value_dim), x), cache


def prefill(cache: Cache, q: Array, k: Array, v: Array, **unused: Any) -> Cache:
  """Writes the prompt's keys and values (k [batch, prompt_length, heads, head_dim]) at [0, prompt_length)."""
  del q, unused
  return {name: cache[name].at[:, :, :x.shape[1]].set(jnp.swapaxes(x, 1, 2).astype(cache[name].dtype))
          for name, x in (("k", k), ("v", v))}


NSA = Decoder(init_cache, step, prefill)
