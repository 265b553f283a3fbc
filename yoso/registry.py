"""Registers the YOSO pure ops (the benchmark uses the paper's m = 32, tau = 8).

yoso, yoso_sketch and yoso_e have a causal form (keys j <= i, for decoders); the YOSO-C ops are bidirectional
only: their depthwise convolution ("same" padding) reads future values.
"""

import jax
import jax.numpy as jnp

from attention_core.registry import FLAG, POSITIVE, TEXT, FusedPath, OpSpec, Param, Shape, register
from yoso.attention import yoso, yoso_c, yoso_e
from yoso.tables import FORMULATIONS

TAU = 8
MODULE = "models.yoso_attention:YosoAttention"  # owns the hash key and the YOSO-C kernel
EXPECTED = {"tau": POSITIVE, "normalize_output": FLAG}
SAMPLED = {**EXPECTED, "num_hashes": POSITIVE, "hash": TEXT, "backward": TEXT,
           "backward_features": Param(int, 1, optional=True), "formulation": TEXT}
# The hash tables' formulation: "sorted" (XLA) is the reference, "onehot" another XLA form, "pallas"
# the kernel;
# causal YOSO runs sorted running sums on every backend, so the kernel is bidirectional only.
TABLES = FusedPath.declare(FORMULATIONS, argument="formulation", reference="sorted", xla=("onehot",),
                           causal=False)


def _sampled(**extra):
  """params(length) of a sampled op: the paper's m = 32, tau = 8, plus `extra`."""
  return lambda length: {"num_hashes": 32, "tau": TAU, **extra}


def _key(length: int, shape: Shape) -> dict:
  """A fixed key (the benchmark times one sample; models pass a fresh key per training step)."""
  return {"rng": jax.random.key(0)}


def _key_and_kernel(length: int, shape: Shape) -> dict:
  """The key, and a fixed averaging kernel of size 33 (the model learns one kernel per head; built per call,
  so importing the registry creates no array)."""
  return {**_key(length, shape), "conv_kernel": jnp.full((33,), 1 / 33, jnp.float32)}


register(OpSpec(
    "yoso", yoso, causal=True, bidirectional=True,
    params=_sampled(), bench_inputs=_key, module=MODULE, plan=SAMPLED, inputs=("rng",), fused=TABLES,
    description="YOSO-32: LSH Bernoulli sampling, tau=8, O(L*m*d) forward, the paper's per-feature sampled "
                "backward, O(L*m*d^2) (dense collision counts up to L=2048)"))
register(OpSpec(
    "yoso_sketch", yoso, causal=True, bidirectional=True,
    params=_sampled(backward_features=1), bench_inputs=_key, module=MODULE, plan=SAMPLED, inputs=("rng",),
    fused=TABLES,
    description="YOSO-32 with the linear-in-d backward: dY.v sketched by one random direction per hash "
                "(two forward-like passes; ~64x the dQ/dK variance of yoso's exact per-feature tables)"))
register(OpSpec(
    "yoso_e", yoso_e, causal=True, bidirectional=True,
    params=lambda length: {"tau": TAU}, module=MODULE, plan=EXPECTED,
    description="YOSO-E: expected collision probability attention, tau=8, O(L^2)"))
register(OpSpec(
    "yoso_c", yoso_c, causal=False, bidirectional=True,
    params=_sampled(), bench_inputs=_key_and_kernel, module=MODULE, plan=SAMPLED,
    inputs=("rng", "conv_kernel"), fused=TABLES,
    description="YOSO-C-32: YOSO-32 plus a per-head depthwise convolution of V (kernel 33)"))
register(OpSpec(
    "yoso_sketch_c", yoso_c, causal=False, bidirectional=True,
    params=_sampled(backward_features=1), bench_inputs=_key_and_kernel, module=MODULE, plan=SAMPLED,
    inputs=("rng", "conv_kernel"), fused=TABLES,
    description="YOSO-C-32 with yoso_sketch's linear-in-d backward (the paper's *YOSO-C rows)"))
