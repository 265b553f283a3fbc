"""YOSO attention modules: the sampled op with a fresh hash rng per call, YOSO-E, and YOSO-C.

Names (`config.model.attention.name`):
  yoso         YOSO-m, `yoso.attention.yoso`; the hash functions come from the "attention" rng stream, which
               the train step reseeds from the step key (fresh hashes every step) and evaluation reseeds with
               a fixed seed (deterministic evaluation).
  yoso_sketch  YOSO-m with the linear-in-d backward (`backward_features=1`): faster, noisier dQ/dK.
  yoso_e       YOSO-E, the dense expectation (no randomness).
  yoso_c       YOSO-C (paper section 4.2), `yoso.attention.yoso_c`: YOSO-m plus a per-head depthwise
               convolution of V along the sequence, added to the attention output; the kernel [heads, size] is
               a parameter here. `conv_kernel_size` also adds the convolution to yoso / yoso_e (a YOSO-E-C
               ablation).
  yoso_sketch_c  YOSO-C with yoso_sketch's backward (the paper's starred *YOSO-C rows).

Config fields besides `name`, `params`, `dropout_rate`:
  params.num_hashes, params.tau, params.hash, params.backward, params.backward_features,
  params.normalize_output
                     the op's arguments ("auto" = the registry's m = 32, tau = 8); `params.rng` and
                     `params.conv_kernel` are ignored (the module supplies the key and its kernel parameter)
  conv_kernel_size   odd int; None = no convolution for yoso / yoso_e, 33 for yoso_c / yoso_sketch_c (the
                     convolution size the paper uses for Nystromformer, section 4.2); bidirectional only
yoso, yoso_sketch and yoso_e also run causally (decoder LMs: keys j <= i, `yoso.attention`); the YOSO-C ops
and any `conv_kernel_size` are bidirectional only (the "same" convolution reads future values), so decoder
models refuse them.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
from flax import nnx

from attention_core import registry as ops_registry
from attention_core import sharding
from models import attention, layers
from yoso.attention import convolution

Array = Any
DEFAULT_CONV_KERNEL = 33


def with_conv(fn: Any) -> Any:
  """`fn` plus a per-head depthwise convolution of V (YOSO-C as an ablation of yoso / yoso_e), the kernel
  passed as `conv` [heads, size]. It partitions itself where fn does (the convolution always does)."""
  def op(q: Array, k: Array, v: Array, *, conv: Array, mask: Array | None = None, **kwargs: Any) -> Array:
    o = fn(q, k, v, mask=mask, **kwargs)  # [batch, length, heads, head_dim]
    return o + convolution(q, k, v, conv_kernel=conv, mask=mask).astype(o.dtype)
  op.partitions_itself = getattr(fn, "partitions_itself", False)
  return op


class YosoAttention(attention.OpAttention):
  """Projections + a YOSO op (+ the YOSO-C convolution of V). Its registration's `inputs` say what the
  module supplies: a hash key (`rng`: sampled ops) and the YOSO-C kernel (`conv_kernel`)."""

  FIELDS = {"conv_kernel_size": attention.Field(
    int, "YOSO-C: the odd kernel size of the depthwise convolution over V (None = 33)", minimum=1)}

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    inputs = ops_registry.get(self.op_name).inputs
    self.sampled = "rng" in inputs
    self.takes_conv = "conv_kernel" in inputs
    self.rng = rngs.attention.fork() if self.sampled else None
    size = config.get("conv_kernel_size", None)
    if size is None and self.takes_conv:
      size = DEFAULT_CONV_KERNEL
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size % 2 == 0
                             or size < 1):
      raise ValueError(f"attention {self.name!r}: conv_kernel_size must be a positive odd int or None, "
                       f"got {size!r}")
    if size is not None and causal:
      raise ValueError(f"attention {self.name!r}: conv_kernel_size must be None with causal=True (decoder "
                       f"models): the depthwise convolution of V ('same' padding) reads future values")
    bound = 1.0 / float(size or 1) ** 0.5

    def init(key, shape, dt):
      # Uniform(+-1/sqrt(fan_in)), fan_in = size: PyTorch's conv default, as in the Nystromformer/YOSO code.
      return jax.random.uniform(key, shape, dt, -bound, bound)

    # [heads, size]
    self.conv = layers.param(rngs, init, (num_heads, size), ("heads", None)) if size else None

  def op_kinds(self) -> dict[str, str]:
    # How the ops that do not partition themselves split these (yoso_e with a convolution); the sampled
    # ops draw every head's hashes before they split the heads, as one device does (attention_core.sharding).
    return {"rng": sharding.RNG, "conv_kernel": sharding.HEADS, "conv": sharding.HEADS}

  def op_fn(self) -> Any:
    fn = ops_registry.get(self.op_name).fn
    return with_conv(fn) if self.conv is not None and not self.takes_conv else fn

  def op_inputs(self, q: Array, k: Array, *, x: Array, mask: Array | None,
                params: dict[str, Any]) -> dict[str, Any]:
    inputs = {"rng": self.rng()} if self.sampled else {}
    if self.conv is not None:
      inputs["conv_kernel" if self.takes_conv else "conv"] = self.conv[...]  # [heads, size]
    return inputs
