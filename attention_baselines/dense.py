"""Exact softmax attention under the op contract: the baseline every table row is compared against.

On GPU and TPU `dense` runs a fused flash kernel (cuDNN, or Splash attention on TPU) that never writes the
[L, L] logits; on CPU, and wherever the fused kernels do not apply, the XLA einsum path.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attention_baselines import splash
from attention_core import contract
from attention_core.combine import attend

Array = Any


IMPLEMENTATIONS = ("auto", "xla", "flash")
IMPLEMENTATION_PLATFORMS = {"flash": ("gpu", "tpu")}  # where "flash" runs (registry.fused_path)
FUSED_DTYPES = {"gpu": ("bfloat16", "float16"), "tpu": splash.DTYPES}
TPU_BLOCK = 128  # JAX's legacy TPU flash kernel (the benchmark's TPU baseline): its smallest tile
TPU_MAX_BLOCK = 512
_MASK_COORDS = 8  # cuDNN head dims come in multiples of 8: the key-mask coordinate is padded to 8


def _gpu_max_head_dim() -> int:
  """cuDNN's flash attention takes head dims up to 256 on Hopper and later, 128 before."""
  try:
    major = int(str(jax.devices()[0].compute_capability).split(".")[0])
  except (AttributeError, ValueError, IndexError):
    return 128
  return 256 if major >= 9 else 128


def fused_kernel(platform: str, dtypes: tuple[Any, ...], head_dim: int, value_dim: int, *, masked: bool,
                 max_head_dim: int = 128) -> tuple[str | None, str]:
  """(kernel, reason): which fused kernel serves these inputs on `platform` ("cudnn", "splash" or None)
  and, when none does, why. dtypes: those of q, k, v; masked: whether a key mask is given (cuDNN carries it
  as one more head coordinate, so it needs head_dim + 8 <= max_head_dim)."""
  names = {jnp.dtype(d).name for d in dtypes}
  if platform not in FUSED_DTYPES:
    return None, f"no fused attention kernel on {platform}"
  if len(names) != 1 or next(iter(names)) not in FUSED_DTYPES[platform]:
    return None, (f"the {platform} kernel takes q, k, v all of one dtype in {FUSED_DTYPES[platform]}, "
                  f"got {sorted(names)}")
  if platform == "tpu":
    return "splash", ""
  if value_dim != head_dim:
    return None, f"cuDNN needs value_dim == head_dim, got {value_dim} and {head_dim}"
  need = head_dim + (_MASK_COORDS if masked else 0)
  if head_dim % 8 or need > max_head_dim:
    extra = " + 8 (key mask)" if masked else ""
    return None, (f"cuDNN needs head_dim a multiple of 8 and head_dim{extra} <= {max_head_dim}, "
                  f"got head_dim={head_dim}")
  return "cudnn", ""


def _cudnn_available() -> bool:
  """Whether this host can trace cuDNN attention: JAX reads cuDNN's version while tracing it, so a host
  without CUDA traces the GPU program's XLA path instead."""
  try:
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version  # private, may be absent

    check_cudnn_version()
  except (ImportError, RuntimeError):
    return False
  return True


def _kernel(q: Array, k: Array, v: Array, masked: bool) -> tuple[str | None, str]:
  """`fused_kernel` for the platform being traced for (`contract.backend`)."""
  platform = contract.backend()
  if platform == "gpu" and not _cudnn_available():
    return None, "cuDNN, which JAX needs to trace its attention, is not installed on this host"
  max_head_dim = _gpu_max_head_dim() if platform == "gpu" else 128
  return fused_kernel(platform, (q.dtype, k.dtype, v.dtype), q.shape[-1], v.shape[-1], masked=masked,
                      max_head_dim=max_head_dim)


def _choice(q: Array, k: Array, v: Array, *, mask: Array | None = None, implementation: Any = "auto",
            **_: Any) -> Any:
  """What `dense` traces per platform: for "auto" the fused kernel that applies there (None: XLA)."""
  arrays = (q, k, v)
  # Argument validation: malformed inputs take the one program where `dense` rejects them in its own words.
  if implementation != "auto" or not all(hasattr(x, "dtype") and len(getattr(x, "shape", ())) == 4
                                         for x in arrays):
    return implementation  # explicit ones (and bad arguments, which `dense` rejects) are one program
  return _kernel(q, k, v, mask is not None)[0]


@contract.per_platform_op(_choice)
def dense(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
          implementation: str = "auto") -> Array:
  """softmax(q k^T / sqrt(d)) v with an optional causal mask and key mask.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  Returns [batch, length, heads, value_dim] in v's dtype; rows with no visible key are zeros.
  implementation: "xla" writes the [L, L] float32 logits (O(L^2) memory; the CPU path); "flash" runs the
  backend's fused kernel, which never writes them: cuDNN flash attention on GPU (bfloat16/float16 inputs; the
  softmax statistics stay float32 inside the kernel) or Splash attention on TPU (`attention_baselines.splash`:
  bfloat16 or float32 inputs, float32 statistics, causal tiles above the diagonal skipped); it raises
  ValueError where no fused kernel applies (CPU, float64, on GPU value_dim != head_dim and head dims cuDNN
  does not take; see `fused_kernel`). "auto" is "flash" where it
  applies and "xla" elsewhere, chosen per lowering platform (`contract.per_platform`), so models pick up the
  fused kernel with no configuration, also in a program compiled for TPU from a CPU host.
  """
  op = "dense"
  masked = mask is not None
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  contract.check_implementation(implementation, allowed=IMPLEMENTATIONS, op=op)
  kernel = None
  if implementation != "xla":
    kernel, reason = _kernel(q, k, v, masked)
    if kernel is None and implementation == "flash":
      raise ValueError(f"{op}: argument 'implementation'='flash' does not apply here: {reason}; "
                       f"use 'auto' or 'xla'")
  if kernel == "cudnn":
    out = _cudnn(q, k, v, mask if masked else None, causal)
  elif kernel == "splash":
    return _splash(q, k, v, mask if masked else None, causal)
  else:
    return _xla(q, k, v, mask, causal).astype(v.dtype)
  return jnp.where(_any_visible(mask, causal)[:, :, None, None], out, 0).astype(v.dtype)


def _any_visible(mask: Array, causal: bool) -> Array:
  """[batch, length] bool: whether query i sees any key (the fused kernels' other rows are zeroed)."""
  if causal:
    return jnp.cumsum(mask.astype(jnp.int32), axis=1) > 0
  return jnp.broadcast_to(jnp.any(mask, axis=1, keepdims=True), mask.shape)


def _xla(q: Array, k: Array, v: Array, mask: Array, causal: bool) -> Array:
  """The XLA path: [batch, heads, L, L] logits in float32 (or wider) and the shared masked softmax."""
  length = q.shape[1]
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  # Head-major, so batch and heads lead both batched matmuls: on CPU faster than the XLA path of
  # jax.nn.dot_product_attention and than the [b, q, h, k] layout
  # (docs/benchmarks_design.md, "Design measurements").
  v = jnp.where(mask[:, :, None, None], v, 0)  # a masked key's weight is 0, and 0 * NaN would still be NaN
  qh, kh, vh = (jnp.swapaxes(t.astype(ct), 1, 2) for t in (q, k, v))  # [batch, heads, length, dim]
  logits = jnp.einsum("bhqd,bhkd->bhqk", qh, kh) * contract.logit_scale(q.shape[-1])  # [b, heads, L_q, L_k]
  valid = mask[:, None, None, :]  # [batch, 1, 1, length_k]
  if causal:
    valid = valid & jnp.tril(jnp.ones((length, length), dtype=bool))
  out = attend(logits, valid, vh, "bhqk,bhkd->bhqd")  # [batch, heads, length, value_dim]
  return jnp.swapaxes(out, 1, 2)  # [batch, length, heads, value_dim]


def _mask_offset(dtype: Any) -> float:
  """The extra logit of a masked key in the cuDNN path: far below any real logit, finite in `dtype`."""
  return -(2.0**15) if jnp.dtype(dtype) == jnp.float16 else -(2.0**64)


def _cudnn(q: Array, k: Array, v: Array, mask: Array | None, causal: bool) -> Array:
  """cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`), [b, L, h, d] in and out.

  cuDNN takes only prefix (sequence-length) padding masks, so an arbitrary key mask rides as one more head
  coordinate: q gets 1 and k gets 0 (real key) or a large negative offset (masked key), which adds exactly 0
  to every real logit and sends masked ones to a softmax weight of exactly 0; the coordinate is padded to 8
  (cuDNN's head-dim granularity) with zeros, v likewise, and the output sliced back. Masked keys' k and v are
  zeroed first (a select), so NaN or Inf there cannot reach any output.
  """
  head_dim = q.shape[-1]
  scale = contract.logit_scale(head_dim)
  if mask is not None:
    keep = mask[:, :, None, None]  # [batch, length, 1, 1]
    k, v = jnp.where(keep, k, 0), jnp.where(keep, v, 0)
    pad = [(0, 0)] * 3 + [(0, _MASK_COORDS)]
    q = jnp.pad(q, pad).at[..., head_dim].set(1)  # [batch, length, heads, head_dim + 8]
    offset = jnp.where(keep[..., 0], 0, _mask_offset(k.dtype)).astype(k.dtype)  # [batch, length, 1]
    k = jnp.pad(k, pad).at[..., head_dim].set(offset)
    v = jnp.pad(v, pad)
  out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")
  return out[..., :head_dim]  # [batch, length, heads, head_dim]


def tpu_block_sizes(length: int) -> Any:
  """The tiles of JAX's legacy Pallas TPU flash kernel (`jax.experimental.pallas.ops.tpu.flash_attention`,
  the benchmark's TPU flash baseline) for a length that is a multiple of TPU_BLOCK: the largest power of two
  up to TPU_MAX_BLOCK that divides it, forward and backward."""
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash  # on use: only TPU runs need it

  block = TPU_BLOCK
  while block * 2 <= TPU_MAX_BLOCK and length % (block * 2) == 0:
    block *= 2
  return tpu_flash.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1,
                              block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block,
                              block_q_dkv=block, block_k_major_dq=block, block_k_dq=block, block_q_dq=block)


def _splash(q: Array, k: Array, v: Array, mask: Array | None, causal: bool) -> Array:
  """Splash attention on TPU (`attention_baselines.splash`), [b, L, h, d] in and out: the causal pattern (its
  tiles above the diagonal skipped) or every key, the key mask as segment ids; masked and non-finite keys
  are selected away, rows with no visible key are zeros, as on the XLA path."""
  return splash.attention(q, k, v, mask, splash.Pattern(causal=causal))


def dense_xla(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None) -> Array:
  """`jax.nn.dot_product_attention` (XLA path) under the op contract: the stock dense baseline, to compare.

  Inputs are cast to float32 (or wider) so its softmax meets the contract. jax's op takes one dim for q, k
  and v, so where value_dim != head_dim the narrower side is zero-padded (the logits and the weighted sum are
  unchanged; the scale stays 1/sqrt(head_dim)).
  """
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op="dense_xla")
  causal = contract.check_bool(causal, name="causal", op="dense_xla")
  head_dim, value_dim = q.shape[-1], v.shape[-1]
  width = max(head_dim, value_dim)

  def padded(x: Array) -> Array:  # [..., dim] -> [..., width], zeros after
    return jnp.pad(x, ((0, 0),) * 3 + ((0, width - x.shape[-1]),))

  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  length = q.shape[1]
  keep = mask[:, None, None, :]  # [batch, 1, 1, length_k]
  if causal:
    keep = keep & jnp.tril(jnp.ones((length, length), dtype=bool))
  # XLA contracts zero weights with every value, so masked and non-finite values are selected to 0 first;
  # a query that sees a non-finite value (a visible key before it, any when bidirectional) returns NaN.
  real = mask[:, :, None, None]  # [batch, length, 1, 1]
  finite = jnp.isfinite(v)
  k = jnp.where(real, k, 0)
  v_safe = jnp.where(real & finite, v, 0)
  bad = (~jnp.all(finite, axis=-1) & mask[:, :, None]).astype(jnp.int32)  # [batch, length, heads]
  seen_bad = (jnp.cumsum(bad, axis=1) if causal else jnp.sum(bad, axis=1, keepdims=True)) > 0
  out = jax.nn.dot_product_attention(padded(q.astype(ct)), padded(k.astype(ct)), padded(v_safe.astype(ct)),
                                     mask=keep, scale=head_dim ** -0.5, implementation="xla")[..., :value_dim]
  any_key = jnp.any(keep, axis=-1)[:, 0, :, None, None]  # rows with no visible key give zeros, as in `dense`
  return jnp.where(seen_bad[..., None], jnp.nan, jnp.where(any_key, out, 0.0)).astype(v.dtype)
