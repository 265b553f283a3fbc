"""Splash attention under the op contract (attention_baselines/splash.py): `dense`, `local` and `longformer`
on TPU.

On CPU the TPU branch runs in JAX's TPU interpreter (`attention_core.pallas.simulate("tpu")`, the "auto" ops
making their TPU choices) and must equal the XLA path: outputs and gradients, key masks, ragged lengths,
queries with no visible key, NaN and Inf at masked and future keys. The TPU program itself is compiled ahead
of time by libtpu for a v5e chip and exported for TPU from this host, where "auto" must pick the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines import dense as dense_module
from attention_baselines import local as local_module
from attention_baselines import longformer as longformer_module
from attention_baselines import splash
from attention_core import contract, pallas, sharding

FAST_COMPILE = {"xla_backend_optimization_level": 0}  # interpreted programs compile slowly
OPS = {
    "dense": dense_module.dense,
    "local": functools.partial(local_module.local, block_size=48),
    "longformer": functools.partial(longformer_module.longformer, window=20, global_positions=(0, 77)),
}


def _inputs(length: int, *, batch: int = 2, heads: int = 2, head_dim: int = 16, value_dim: int = 8, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k = (jax.random.normal(kk, (batch, length, heads, head_dim)) for kk in keys[:2])
  v = jax.random.normal(keys[2], (batch, length, heads, value_dim))
  cotangent = jax.random.normal(keys[3], v.shape)
  mask = np.ones((batch, length), bool)
  mask[0, :3] = False  # queries 0-2 of row 0 see no real key when causal
  mask[-1, length // 3:length // 2] = False  # a run of masked keys inside the sequence
  return q, k, v, jnp.asarray(mask), cotangent


def _value_and_grads(fn, q, k, v, cotangent):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(cotangent))


def _pattern_softmax(pattern: splash.Pattern):
  """Softmax attention over `pattern.allows` and the key mask in plain jnp: the reference for local and
  longformer, whose patterns test_pattern_is_the_xla_ops_attention_pattern ties to their XLA paths (those
  take ~30 s each to compile with gradients here)."""
  def op(q, k, v, *, causal, mask):
    ids = np.arange(q.shape[1])
    allowed = pattern.allows(ids[:, None], ids[None, :])[None, None] & mask[:, None, None, :]  # [b, 1, L, L]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])  # [batch, heads, L, L]
    weights = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
    weights = jnp.where(jnp.any(allowed, axis=-1, keepdims=True), weights, 0)  # no visible key: zeros
    return jnp.einsum("bhqk,bkhd->bqhd", weights, jnp.where(mask[:, :, None, None], v, 0))
  return op


def _compare(name: str, length: int, causal: bool, poisons=(jnp.nan, jnp.inf), **kw):
  """The op's TPU branch (Splash, interpreted) against its XLA path (dense) or the softmax over its pattern:
  output and gradients, with a key mask; then NaN and Inf at masked keys (and, causal, at future keys) leave
  the visible outputs as they were."""
  op = OPS[name]
  q, k, v, mask, cotangent = _inputs(length, **kw)
  with pallas.simulate("tpu"):
    fn = jax.jit(lambda q, k, v, m: _value_and_grads(lambda *a: op(*a, causal=causal, mask=m), q, k, v,
                                                     cotangent), compiler_options=FAST_COMPILE)
    got = fn(q, k, v, mask)
    poison = ~mask
    if causal:
      poison = poison.at[:, length - 5:].set(True)  # future keys of every query before them
    visible = np.asarray(mask.at[:, length - 5:].set(False) if causal else mask)
    for bad in poisons:
      k2, v2 = (jnp.where(poison[:, :, None, None], bad, t) for t in (k, v))
      out = np.asarray(fn(q, k2, v2, mask)[0])
      np.testing.assert_allclose(out[visible], np.asarray(got[0])[visible], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{bad} behind the masks")
  if name == "dense":
    xla = functools.partial(op, causal=causal, mask=mask, implementation="xla")
  else:
    kwargs = op.keywords
    pattern = splash.Pattern(causal=causal, block=kwargs.get("block_size", 0), window=kwargs.get("window", 0),
                             global_positions=kwargs.get("global_positions", ()))
    xla = functools.partial(_pattern_softmax(pattern), causal=causal, mask=mask)
  want = jax.jit(lambda q, k, v: _value_and_grads(xla, q, k, v, cotangent))(q, k, v)
  for what, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5, err_msg=what)
  if causal and name == "dense":
    assert float(jnp.max(jnp.abs(got[0][0, :3]))) == 0.0  # no visible key: zeros, as the XLA path


def test_dense_causal_with_key_mask_equals_xla():
  _compare("dense", 96, True, batch=1, heads=1)


@pytest.mark.slow  # each ~5-15 s interpreted; the fast run keeps dense causal
@pytest.mark.parametrize("name,length,causal", [
    ("dense", 200, False),  # ragged: two tiles, padded keys masked
    ("dense", 200, True),
    ("local", 200, True),  # blocks of 48: ragged last block, blocks across tile edges
    ("local", 200, False),
    ("longformer", 200, True),  # window 20, globals 0 and 77
    ("longformer", 200, False),
])
def test_splash_equals_the_reference(name, length, causal):
  _compare(name, length, causal, poisons=(jnp.nan,), batch=1, heads=1, value_dim=16)


@pytest.mark.slow  # ~5 s interpreted; the fast run checks masked and future NaN in the dense case
def test_visible_non_finite_key_shows_as_on_the_xla_path():
  # A real key holding NaN: every query that sees it is NaN (and only those), as `dense`'s XLA path gives.
  q, k, v, mask, _ = _inputs(40, heads=1)
  k = k.at[1, 30, 0, 2].set(jnp.nan)
  with pallas.simulate("tpu"):
    out = jax.jit(lambda *a: dense_module.dense(*a, causal=True, mask=mask),
                  compiler_options=FAST_COMPILE)(q, k, v)
  ref = dense_module.dense(q, k, v, causal=True, mask=mask, implementation="xla")
  assert np.array_equal(np.isnan(np.asarray(out)).any(-1), np.isnan(np.asarray(ref)).any(-1))
  assert bool(jnp.all(jnp.isnan(out[1, 30:]))) and bool(jnp.all(jnp.isfinite(out[1, :30])))


_BIDIRECTIONAL = pytest.mark.slow  # ~1-3 s each; the fast run checks the causal form of each pattern
PATTERNS = [splash.Pattern(causal=True), pytest.param(splash.Pattern(causal=False), marks=_BIDIRECTIONAL),
            splash.Pattern(causal=True, block=5),
            pytest.param(splash.Pattern(causal=False, block=5), marks=_BIDIRECTIONAL),
            splash.Pattern(causal=True, window=3, global_positions=(0, 11)),
            pytest.param(splash.Pattern(causal=False, window=3, global_positions=(4,)), marks=_BIDIRECTIONAL)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_is_the_xla_ops_attention_pattern(pattern):
  # The support of each XLA op's attention rows (v = one-hot keys, every key real) is Pattern.allows, and
  # `reaches` (the NaN flags and the rows with a real key) reads the same pattern.
  length = 17
  q, k, _, _, _ = _inputs(length, batch=1, heads=1)
  v = jnp.eye(length)[None, :, None, :]  # [1, length, 1, length]: value j is the one-hot of key j
  if pattern.block:
    op = functools.partial(local_module.local, block_size=pattern.block)
  elif pattern.window:
    op = functools.partial(longformer_module.longformer, window=pattern.window,
                           global_positions=pattern.global_positions)
  else:
    op = dense_module.dense
  rows = jax.jit(lambda q, k, v: op(q, k, v, causal=pattern.causal, implementation="xla"))(q, k, v)
  ids = np.arange(length)
  allowed = pattern.allows(ids[:, None], ids[None, :])  # [query, key]
  np.testing.assert_array_equal(np.asarray(rows)[0, :, 0] > 0, allowed)
  flags = jnp.eye(length, dtype=bool)[:, :, None]  # batch row j flags key j alone: [length, length, 1]
  np.testing.assert_array_equal(np.asarray(pattern.reaches(flags))[:, :, 0].T, allowed)


def test_splash_reads_each_tile_of_the_pattern_exactly():
  # The mask Splash preprocesses on the host (which tiles to skip, which to compute), answered from the key
  # ranges for empty and full tiles, equals the pattern evaluated everywhere, tile by tile.
  length, size = 512, 128
  ids = np.arange(length)
  for pattern in (splash.Pattern(causal=True), splash.Pattern(causal=True, block=96),
                  splash.Pattern(causal=False, block=256), splash.Pattern(causal=True, window=100),
                  splash.Pattern(causal=False, window=40, global_positions=(3, 300)),
                  splash.Pattern(causal=True, window=40, global_positions=(0, 200))):
    mask = splash._PatternMask(pattern, length)  # noqa: SLF001
    full = pattern.allows(ids[:, None], ids[None, :])
    for q0 in range(0, length, size):
      for k0 in range(0, length, size):
        tile = mask[q0:q0 + size, k0:k0 + size]
        np.testing.assert_array_equal(tile, full[q0:q0 + size, k0:k0 + size], err_msg=f"{pattern} {q0} {k0}")


def test_what_splash_serves_and_the_reason_otherwise(monkeypatch):
  x = {dtype: jnp.ones((1, 16, 1, 8), dtype) for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)}
  causal = splash.Pattern(causal=True)
  assert splash.unsupported(x[jnp.float32], x[jnp.float32], x[jnp.float32], causal) == ""
  assert splash.unsupported(x[jnp.bfloat16], x[jnp.bfloat16], x[jnp.bfloat16], causal) == ""
  assert "dtype" in splash.unsupported(x[jnp.float16], x[jnp.float16], x[jnp.float16], causal)
  assert "dtype" in splash.unsupported(x[jnp.bfloat16], x[jnp.bfloat16], x[jnp.float32], causal)
  many = splash.Pattern(causal=False, window=2, global_positions=tuple(range(splash.MAX_GLOBALS + 1)))
  assert "global positions" in splash.unsupported(x[jnp.float32], x[jnp.float32], x[jnp.float32], many)
  q = x[jnp.float32]
  with pytest.raises(ValueError, match="'implementation'='splash' does not apply here: .* on TPU, not cpu"):
    local_module.local(q, q, q, causal=True, block_size=4, implementation="splash")
  with pytest.raises(ValueError, match="'implementation'"):
    local_module.local(q, q, q, causal=True, block_size=4, implementation="pallas")
  monkeypatch.setattr(contract, "backend", lambda: "tpu")
  with pytest.raises(ValueError, match="at most 8 global positions"):
    longformer_module.longformer(q, q, q, causal=False, window=2, global_positions=tuple(range(9)),
                                 implementation="splash")
  assert dense_module.fused_kernel("tpu", (jnp.bfloat16,) * 3, 64, 32, masked=True) == ("splash", "")


def test_tiles_follow_the_length_and_the_pattern():
  assert splash.tile(16384, splash.Pattern(causal=True)) == 512
  assert splash.tile(384, splash.Pattern(causal=True)) == 128
  assert splash.tile(16384, splash.Pattern(causal=True, block=128)) == 128
  assert splash.tile(16384, splash.Pattern(causal=False, window=200)) == 256


# The TPU program: "auto" picks Splash when lowered for TPU from this CPU host, and libtpu compiles it.


def _abstract(length, head_dim, dtype=jnp.bfloat16, sharding_=None):
  qkv = jax.ShapeDtypeStruct((2, length, 2, head_dim), dtype, sharding=sharding_)
  mask = jax.ShapeDtypeStruct((2, length), jnp.bool_, sharding=sharding_)
  return qkv, mask


def _grad(op, causal, **kw):
  def fwd_bwd(q, k, v, m):
    return jax.grad(lambda *a: jnp.sum(op(*a, causal=causal, mask=m, **kw).astype(jnp.float32)),
                    argnums=(0, 1, 2))(q, k, v)
  return fwd_bwd


@pytest.mark.all_platforms
@pytest.mark.parametrize("name", ["dense", "local", "longformer"])
def test_auto_exports_splash_for_tpu(name):
  # Traced on this CPU host for every platform (`lax.platform_dependent`): the TPU program holds the kernel,
  # forward and backward; the CPU program does not.
  qkv, mask = _abstract(1000, 64)
  fn = jax.jit(_grad(OPS[name], True))
  tpu = jax.export.export(fn, platforms=["tpu"])(qkv, qkv, qkv, mask).mlir_module()
  assert "tpu_custom_call" in tpu and "splash" in tpu
  cpu = jax.export.export(fn, platforms=["cpu"])(qkv, qkv, qkv, mask).mlir_module()
  assert "tpu_custom_call" not in cpu


def _compile_for_v5e(name, causal, length, head_dim, dtype=jnp.bfloat16):
  from scripts import compile_tpu  # libtpu for this process (scripts/compile_tpu.py)

  pytest.importorskip("libtpu")

  devices = compile_tpu.devices(compile_tpu.Slice(compile_tpu.GENERATIONS["v5e"], 1))
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("data",))
  placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  qkv, mask = _abstract(length, head_dim, dtype, placed)
  lowered = jax.jit(sharding.traced_in(mesh, _grad(OPS[name], causal))).lower(qkv, qkv, qkv, mask)
  assert "tpu_custom_call" in lowered.as_text()
  lowered.compile()


@pytest.mark.slow  # 5-10 s each; the fast run exports the TPU programs (and the fused-kernel compile grid of
# tests/attention_core/test_tpu_kernels_compile.py compiles dense, local and longformer at one shape)
@pytest.mark.parametrize("name,causal,length,head_dim,dtype", [
    ("dense", True, 1000, 64, jnp.bfloat16),
    ("dense", False, 1024, 128, jnp.bfloat16),
    ("dense", True, 640, 80, jnp.float32),  # a head dim that is no multiple of 128 lanes
    ("local", True, 2048, 64, jnp.bfloat16),
    ("longformer", True, 2048, 64, jnp.bfloat16),
    ("longformer", False, 1000, 128, jnp.float32),
])
def test_ops_compile_for_tpu(name, causal, length, head_dim, dtype):
  _compile_for_v5e(name, causal, length, head_dim, dtype)
