"""Registers the baselines' pure ops."""

from baselines.dense import dense, dense_xla
from baselines.dense_decode import DENSE
from core.registry import OpSpec, register

register(OpSpec("dense", dense, description="exact softmax attention, O(L^2)",
                decode=DENSE))
register(OpSpec("dense_xla", dense_xla, description="jax.nn.dot_product_attention (XLA), O(L^2), for comparison"))
