"""Registers the baselines' pure ops."""

from baselines.bigbird import bigbird
from baselines.dense import dense, dense_xla
from baselines.dense_decode import DENSE
from baselines.linear import linear
from baselines.local import local
from baselines.longformer import longformer
from baselines.none import none
from baselines.performer import performer
from core.registry import OpSpec, register, sqrt_pow2

register(OpSpec("dense", dense, description="exact softmax attention, O(L^2)",
                decode=DENSE))
register(OpSpec("dense_xla", dense_xla, description="jax.nn.dot_product_attention (XLA), O(L^2), for comparison"))


def _performer_params(length):
  """m = 256 features (the paper's setting) drawn from a fixed key; models own and redraw their features."""
  import jax

  return {"rng": jax.random.key(0), "num_features": 256, "chunk_size": 64}


register(OpSpec("performer", performer, params=_performer_params,
                description="Performer FAVOR+, 256 positive orthogonal random features, O(L*m*d)"))
register(OpSpec("linear", linear, params=lambda length: {"chunk_size": 64},
                description="linear transformer, elu+1 features, O(L*d^2)"))
register(OpSpec("local", local, params=lambda length: {"block_size": sqrt_pow2(length)},
                description="block-local attention (own block), O(L*b*d)"))
register(OpSpec("longformer", longformer,
                params=lambda length: {"window": sqrt_pow2(length), "global_positions": (0,)},
                description="Longformer sliding window (w each side) + global tokens, O(L*w*d)"))
register(OpSpec("bigbird", bigbird,
                params=lambda length: {"block_size": min(64, sqrt_pow2(length)), "global_blocks": (0, -1),
                                       "num_random_blocks": 3},
                description="BigBird ITC: 3 window + 2 global + 3 random blocks, O(L*8b*d)"))
register(OpSpec("none", none, description="no attention (zeros): the feed-forward-only reference"))
