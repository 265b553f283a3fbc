"""YOSO attention (Zeng et al., 2021): self-attention as LSH Bernoulli sampling, with its own backward.

With l2-normalised queries and keys, `B_ij = 1[f(q_i) = f(k_j)]` for a random `tau`-bit hyperplane hash `f` is
a Bernoulli variable with mean `p_ij = (1 - arccos(q_i . k_j)/pi)^tau` (`yoso.collision`). YOSO-m averages
`B V` over `m` hashes; YOSO-E is its expectation `P V`; YOSO-C adds a depthwise convolution of V
(`yoso.conv`). N-YOSO l2-normalises the output (the paper's default), which also makes the missing row
normalisation of `P` irrelevant.

Forward (paper section 3.2): for each hash, a table of `2^tau` buckets holds the sum of the values of the keys
hashed there, and each query reads its bucket (`yoso.tables`). Groups (batch * heads) run one at a time
with a `lax.scan` over hashes inside, so one table is alive at a time: memory is O(2^tau*d) for tables
plus O(L*m) int32 codes and O(L*d) accumulators; time is O(L*m*d). Masked keys go to an extra bucket that
no query ever reads. The backward is a `jax.custom_vjp` that re-uses the forward's codes (`yoso.backward`).

Causal form (`causal=True`, for decoders; the paper defines only the bidirectional op): the same estimator
restricted to keys j <= i, out_i = 1/m sum_t sum_{j <= i} B^t_ij v_j. A table cannot hold a prefix, so per
hash the keys are sorted by (bucket, position) and a running sum restarting at every bucket is read at each
query's place: O(L log L) per hash for the sort, O(L*m*d) for the sums, O(L*d) memory per live hash. The
backward is the same sampled gradient with its sums restricted the same way (dQ over the keys j <= i, dK and
dV over the queries i >= j). YOSO-E takes the causal mask on its dense P; YOSO-C stays bidirectional (its
"same" convolution reads future values).

This module holds the public ops: their argument checks, the hashing and the custom_vjp wiring.
The 1/sqrt(head_dim) logit scale of the op contract is a no-op here: YOSO only sees directions of q and k.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attention_core import contract
from attention_core.combine import weighted_sum
from yoso import hashing, tables
from yoso.backward import BACKWARDS, cotangents, directions, sketch_basis, visible
from yoso.collision import expected_collision
from yoso.conv import depthwise_conv

Array = Any

HASHES = ("gaussian", "fast")
MAX_TAU = 24  # 2^tau buckets per table; beyond this the tables dwarf the sequence
_NORM_EPS = 1e-6


def l2_normalize(x: Array) -> Array:
  """x / max(|x|, eps) along the last axis: zero vectors stay zero with finite gradients."""
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), _NORM_EPS**2))


def _make_cumulation(tau: int, backward: str, formulation: str = "sorted", causal: bool = False,
                     operands: str = "float32"):
  """The custom_vjp core on groups g = batch * heads: (qn, kn [g, L, d], v [g, L, e], codes [g, L, m], kvalid
  [g, L], directions) -> the mean over hashes of B V [g, L, e] (over keys j <= i when causal), not
  normalised. formulation "sorted" (segment sums and bucket-sorted tables, for CPUs), "onehot" (one-hot
  matmuls) or "pallas" (one-hot matmuls in fused kernels, for GPUs and TPUs, with matmul operands
  `operands`): the same sums; the causal sums are sorted running sums whatever the formulation.
  The backward (`yoso.backward.cotangents`) re-uses the codes and directions saved here."""
  num_buckets = 1 << tau
  positions = "prefix" if causal else "all"

  def forward(v, qcodes, kcodes, kvalid):
    out = tables.cumulate(qcodes, kcodes, kvalid, v, num_buckets, formulation, positions, operands)
    return out / qcodes.shape[-1]

  @jax.custom_vjp
  def cumulation(qn, kn, v, qcodes, kcodes, kvalid, directions):
    return forward(v, qcodes, kcodes, kvalid)

  def fwd(qn, kn, v, qcodes, kcodes, kvalid, directions):
    return forward(v, qcodes, kcodes, kvalid), (qn, kn, v, qcodes, kcodes, kvalid, directions)

  def bwd(res, dy):
    dq, dk, dv = cotangents(backward, tau, formulation, causal, *res, dy, operands=operands)
    return dq, dk, dv, None, None, None, None

  cumulation.defvjp(fwd, bwd)
  return cumulation


def _check_tau(tau: Any, op: str) -> int:
  tau = contract.check_positive_int(tau, name="tau", op=op)
  if tau > MAX_TAU:
    raise ValueError(f"{op}: argument 'tau' must be an integer in [1, {MAX_TAU}], got {tau}")
  return tau


def _check_bidirectional(causal: Any, op: str) -> None:
  if contract.check_bool(causal, name="causal", op=op):
    raise ValueError(f"{op}: argument 'causal' must be False: YOSO-C's depthwise convolution ('same' "
                     f"padding) reads future values; use yoso or yoso_e for causal attention")


def _check_rng(rng: Any, op: str) -> Array:
  if rng is None or not hasattr(rng, "dtype"):  # argument validation: a key array or a tracer of one
    raise TypeError(f"{op}: argument 'rng' must be a JAX PRNG key (jax.random.key(seed)), got {rng!r}")
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.dtype != jnp.uint32 or rng.shape[-1:] != (2,):
      raise TypeError(f"{op}: argument 'rng' must be a JAX PRNG key, got dtype {rng.dtype} shape {rng.shape}")
    rng = jax.random.wrap_key_data(rng)
  if rng.shape != ():
    raise ValueError(f"{op}: argument 'rng' must be a single key, got shape {rng.shape}")
  return rng


def _formulation_choice(*_: Any, formulation: Any = "auto", **__: Any) -> Any:
  """What `yoso` traces per platform (`contract.per_platform_op`): the formulation "auto" resolves to."""
  if formulation not in tables.FORMULATIONS:
    return formulation  # the op rejects it
  return tables.resolve_formulation(formulation, contract.backend())


def yoso(q: Array, k: Array, v: Array, *, rng: Array, num_hashes: int, tau: int, causal: bool = False,
         mask: Array | None = None, normalize_output: bool = True, hash: str = "gaussian",
         backward: str = "sampled", backward_features: int | None = None, formulation: str = "auto") -> Array:
  """YOSO-m attention: the mean over `num_hashes` LSH samples of B V, l2-normalised per row when asked.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool
  (True = real key; masked keys are never inserted in a table). rng: a PRNG key; the same key gives the same
  hash functions (and backward sketch), so pass a fresh key per training step and a fixed one in evaluation.
  hash: "gaussian" (exact hyperplanes) or "fast" (Hadamard rotations, power-of-two head_dim).
  causal: keys j <= i only (the same estimator restricted to the prefix; sorted running sums per hash,
  O(L log L * m) for the sorts on top of the bidirectional cost, one formulation on every backend).
  backward: "sampled" (linear cost, re-uses the forward's codes) or "dense" (exact O(L^2) surrogate gradient).
  backward_features: None (default) computes the sampled dQ/dK with every value feature, exactly the paper's
  estimator, O(L*m*d*value_dim) (up to L = 2048 through dense collision counts, O(L^2*(m + d)), faster
  there); an int s sketches the value space with s random directions per hash, O(L*m*s*d), unbiased but with
  about value_dim/s times the gradient variance (s <= 2: two forward-like passes, much faster than the
  exact form; the "yoso_sketch" registry op uses s=1). Causal, the exact form stays on the quadratic counts
  up to 8192 tokens and runs running sums of value_dim*head_dim-wide rows beyond (linear in L but slow): long
  causal sequences should take a sketch.
  formulation: how the bucket tables are built and read, the same estimator and sums either way: "sorted"
  (segment sums and bucket-sorted chunked matmuls, serial-scatter friendly: CPUs), "onehot" (one-hot matmuls,
  2^tau times the multiply-adds but all on tensor cores / the MXU), "pallas" (the one-hot matmuls in fused
  kernels that make the one-hot factors on chip: GPUs and TPUs; bfloat16 matmul operands for bfloat16
  inputs, split float32 ones otherwise), "auto" (by backend, per lowering platform). The exact backward's
  per-feature tables (backward_features None, beyond the counts) are one-hot matmuls under "pallas".
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  op = "yoso"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  rng = _check_rng(rng, op)
  num_hashes = contract.check_positive_int(num_hashes, name="num_hashes", op=op)
  tau = _check_tau(tau, op)
  normalize_output = contract.check_bool(normalize_output, name="normalize_output", op=op)
  contract.check_choice(hash, name="hash", allowed=HASHES, op=op)
  contract.check_choice(backward, name="backward", allowed=BACKWARDS, op=op)
  contract.check_choice(formulation, name="formulation", allowed=tables.FORMULATIONS, op=op)
  if backward_features is not None:
    backward_features = contract.check_positive_int(backward_features, name="backward_features", op=op)
  heads, head_dim = q.shape[2:]
  if hash == "fast" and not hashing.is_power_of_two(head_dim):
    raise ValueError(f"{op}: argument 'hash'='fast' needs a power-of-two head_dim, got head_dim={head_dim}; "
                     f"use hash='gaussian'")
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  hash_rng, sketch_rng = jax.random.split(rng)
  # Drawn for every head before the op partitions itself, so a heads shard hashes as a one-device call does.
  functions = hashing.hash_functions(hash_rng, heads=heads, dim=head_dim, num_hashes=num_hashes, tau=tau,
                                     method=hash, dtype=ct)  # [heads, ...]
  basis = sketch_basis(sketch_rng, heads, num_hashes, v.shape[-1], backward_features, ct)  # [heads, m, e, s]
  return _yoso_drawn(q, k, v, functions=functions, basis=basis, num_hashes=num_hashes, tau=tau, causal=causal,
                     mask=mask, normalize_output=normalize_output, hash=hash, backward=backward,
                     formulation=formulation)


@contract.per_platform_op(_formulation_choice, per_head=("functions", "basis"))
def _yoso_drawn(q: Array, k: Array, v: Array, *, functions: Array, basis: Array | None, num_hashes: int,
                tau: int, causal: bool, mask: Array, normalize_output: bool, hash: str, backward: str,
                formulation: str) -> Array:
  """`yoso` with its arguments checked and its hash functions [heads, ...] (`hashing.hash_functions`) and
  backward sketch basis [heads, m, e, s] or None (`backward.sketch_basis`) drawn."""
  formulation = tables.resolve_formulation(formulation, contract.backend())  # "auto": per lowering platform
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  batch, length, heads = q.shape[:3]
  # Heads-major inside: XLA's CPU dots and gathers are several times faster with (batch, heads) leading.
  qn = l2_normalize(jnp.swapaxes(q, 1, 2).astype(ct))  # [batch, heads, length, head_dim]
  kn = l2_normalize(jnp.swapaxes(k, 1, 2).astype(ct))
  vh = jnp.swapaxes(v, 1, 2).astype(ct)  # [batch, heads, length, value_dim]
  # Codes are integers: no gradient flows through hashing; the custom backward supplies dQ and dK.
  lsh = dict(num_hashes=num_hashes, tau=tau, method=hash)
  functions = jax.lax.stop_gradient(functions)
  qcodes = hashing.codes(jax.lax.stop_gradient(qn), functions, **lsh)  # [batch, heads, length, m]
  kcodes = hashing.codes(jax.lax.stop_gradient(kn), functions, **lsh)
  sketch = directions(None if basis is None else jax.lax.stop_gradient(basis), batch)
  groups = batch * heads

  def flat(x):  # [batch, heads, length, ...] -> [batch * heads, length, ...]
    return x.reshape(groups, length, *x.shape[3:])

  kvalid = jnp.broadcast_to(mask[:, None, :], (batch, heads, length))
  operands = "bfloat16" if all(x.dtype == jnp.bfloat16 for x in (q, k, v)) else "float32"
  out = _make_cumulation(tau, backward, formulation, causal, operands)(
      flat(qn), flat(kn), flat(vh), flat(qcodes), flat(kcodes), flat(kvalid),
      sketch)  # [batch * heads, length, value_dim]
  if normalize_output:
    out = l2_normalize(out)
  out = out.reshape(batch, heads, length, -1)
  return jnp.swapaxes(out, 1, 2).astype(v.dtype)  # [batch, length, heads, value_dim]


yoso.partitions_itself = True  # through `_yoso_drawn` (attention_core.partition)


def yoso_e(q: Array, k: Array, v: Array, *, tau: int, causal: bool = False, mask: Array | None = None,
           normalize_output: bool = True) -> Array:
  """YOSO-E: the expectation P V with P_ij = (1 - arccos(q_i . k_j)/pi)^tau on l2-normalised q, k; O(L^2).

  Shapes as in `yoso`; causal: P_ij = 0 for j > i (the expectation of causal `yoso`). Gradients are the exact
  derivatives of the expectation (a custom_jvp that re-uses the forward's `base^(tau-1)`; below float64 the
  arccos is the A&S 4.4.46 polynomial, `arccos_poly`).
  """
  op = "yoso_e"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  tau = _check_tau(tau, op)
  normalize_output = contract.check_bool(normalize_output, name="normalize_output", op=op)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  qn = l2_normalize(jnp.swapaxes(q, 1, 2).astype(ct))  # [batch, heads, length, head_dim]
  # Masked keys are zeroed (by a select) in the normalised keys and in V rather than in P: one [L, L]
  # elementwise pass less, their P column receives an exactly zero cotangent (no gradient), and a NaN or Inf
  # behind the mask reaches neither P nor the product.
  kn = jnp.where(mask[:, None, :, None], l2_normalize(jnp.swapaxes(k, 1, 2).astype(ct)), 0.0)
  vh = jnp.where(mask[:, None, :, None], jnp.swapaxes(v, 1, 2).astype(ct), 0.0)  # [batch, heads, length, e]
  cos = jnp.einsum("bhqd,bhkd->bhqk", qn, kn)  # [batch, heads, length_q, length_k]
  p = expected_collision(cos, tau)  # [batch, heads, length_q, length_k]
  if causal:
    # Future keys: P selected to 0, and future values that are not finite selected out (weighted_sum).
    p = jnp.where(visible(mask[:, None, :], causal=True), p, 0.0)
    out = weighted_sum("bhqk,bhke->bhqe", p, vh)  # [batch, heads, length, e]
  else:
    out = jnp.einsum("bhqk,bhke->bhqe", p, vh)  # [batch, heads, length, e]
  if normalize_output:
    out = l2_normalize(out)
  return jnp.swapaxes(out, 1, 2).astype(v.dtype)  # [batch, length, heads, value_dim]



def yoso_c(q: Array, k: Array, v: Array, *, rng: Array, num_hashes: int, tau: int, conv_kernel: Array,
           causal: bool = False, mask: Array | None = None, normalize_output: bool = True,
           hash: str = "gaussian", backward: str = "sampled", backward_features: int | None = None,
           formulation: str = "auto") -> Array:
  """YOSO-C (paper section 4.2): `yoso(...)` plus a per-head depthwise convolution of V (`depthwise_conv`).

  conv_kernel: [heads, size] or [size], size odd, an explicit input like YOSO's rng (the model owns it as a
  parameter). Other arguments as in `yoso`, but bidirectional only (the convolution reads future values).
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  _check_bidirectional(causal, "yoso_c")
  out = yoso(q, k, v, rng=rng, num_hashes=num_hashes, tau=tau, causal=causal, mask=mask,
             normalize_output=normalize_output, hash=hash, backward=backward,
             backward_features=backward_features, formulation=formulation)
  shape = jnp.shape(conv_kernel)
  if len(shape) not in (1, 2) or shape[-1] % 2 == 0 or (len(shape) == 2 and shape[0] != q.shape[2]):
    raise ValueError(f"yoso_c: argument 'conv_kernel' must be [heads={q.shape[2]}, size] or [size] with an "
                     f"odd size, got shape {shape}")
  kernel = jnp.broadcast_to(conv_kernel, (q.shape[2], shape[-1]))  # [heads, size]
  conv = convolution(q, k, v, conv_kernel=kernel, mask=None if mask is None else jnp.asarray(mask, bool))
  return (out + conv).astype(v.dtype)  # [batch, length, heads, value_dim]


yoso_c.partitions_itself = True  # through `_yoso_drawn` and `convolution` (attention_core.partition)


@contract.partitioned_op(per_head=("conv_kernel",))
def convolution(q: Array, k: Array, v: Array, *, conv_kernel: Array, mask: Array | None) -> Array:
  """YOSO-C's depthwise convolution of v [batch, length, heads, value_dim] by conv_kernel [heads, size]
  (q, k: the op contract's, unread)."""
  del q, k
  return depthwise_conv(v, conv_kernel, mask)
