"""The Combiner plans' kernels (combiner/kernel_plans.py) equal their XLA plans and lower for TPU and CUDA.

On CPU the kernels run in interpret mode; forward outputs and the gradients of sum(out * cotangent) with
respect to q, k, v (and pool_q / pool_k) are compared with implementation="xla" in float32, with masks,
lengths that are not multiples of the block/row size, value_dim != head_dim, both directions and both
poolings. Interpret-mode programs compile slowly, so the fast tests take one configuration per plan family and
the slow sweep the rest. The GPU layout (heads packed, summaries' gradients as per-group partial sums) runs
here too, forced. The lowering tests export the bfloat16 forward and forward+backward programs for
platforms=["tpu"] (Mosaic) and ["cuda"] (Triton).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import combiner
from attention_core import contract
from attention_core import registry as ops_registry
from combiner import frames, kernel_plans, sparse

FAST_COMPILE = {"xla_backend_optimization_level": 0}
BATCH, HEADS, HEAD_DIM, VALUE_DIM = 2, 2, 8, 5


def op(plan: str, size: int):
  """op(q, k, v, *, causal, mask, pooling, pool_q, pool_k, implementation) for a plan at a block/row size."""
  combiner_plans = {
      "fixed": functools.partial(combiner.fixed, block_size=size),
      "axial_rowmajor": functools.partial(combiner.axial, row_length=size, direction="rowmajor"),
      "axial_vertical": functools.partial(combiner.axial, row_length=size, direction="vertical"),
      "axial_horizontal": functools.partial(combiner.axial, row_length=size, direction="horizontal"),
      "mixture_mean": functools.partial(combiner.mixture, row_length=size),
      "mixture_joint": functools.partial(combiner.mixture, row_length=size, normalize="joint"),
      "logsparse": combiner.logsparse,
      "fixed_select": functools.partial(combiner.fixed, block_size=size, select=2),
  }
  if plan in combiner_plans:
    return combiner_plans[plan]
  sparse_plans = {"sparse_fixed": functools.partial(sparse.fixed, block_size=size),
                  "sparse_axial": functools.partial(sparse.axial, row_length=size),
                  "sparse_logsparse": sparse.logsparse}
  fn = sparse_plans[plan]
  return lambda q, k, v, *, pooling=None, pool_q=None, pool_k=None, **kw: fn(q, k, v, **kw)


def inputs(length: int, seed: int, deepsets: bool, heads: int = HEADS, head_dim: int = HEAD_DIM,
           value_dim: int = VALUE_DIM):
  keys = jax.random.split(jax.random.PRNGKey(seed), 7)
  shape = (BATCH, length, heads, head_dim)
  q, k = (jax.random.normal(kk, shape) for kk in keys[:2])
  v = jax.random.normal(keys[2], (BATCH, length, heads, value_dim))
  mask = jax.random.bernoulli(keys[3], 0.75, (BATCH, length)).at[:, 0].set(True)
  cotangent = jax.random.normal(keys[4], v.shape)
  pools = [jax.random.normal(kk, shape) for kk in keys[5:]] if deepsets else [None, None]
  return q, k, v, mask, cotangent, pools


def compare(plan, length, size, causal, pooling, deepsets, seed=0, heads=HEADS, head_dim=HEAD_DIM,
            value_dim=VALUE_DIM):
  """Forward and gradients of the pallas implementation against the xla one."""
  q, k, v, mask, cotangent, (pool_q, pool_k) = inputs(length, seed, deepsets, heads, head_dim, value_dim)
  fn = op(plan, size)

  def run(implementation, q, k, v, pool_q, pool_k):
    def f(q, k, v, pool_q, pool_k):
      return fn(q, k, v, causal=causal, mask=mask, pooling=pooling, pool_q=pool_q, pool_k=pool_k,
                implementation=implementation)
    out, vjp = jax.vjp(f, q, k, v, pool_q, pool_k)
    return out, vjp(cotangent)

  args = (q, k, v, pool_q, pool_k)
  got = jax.jit(functools.partial(run, "pallas"), compiler_options=FAST_COMPILE)(*args)
  want = jax.jit(functools.partial(run, "xla"))(*args)
  names = ("out", "dq", "dk", "dv") + (("dpool_q", "dpool_k") if deepsets else ())
  for name, a, b in zip(names, jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5, err_msg=f"{plan}: {name}")


# (plan, length, size, causal, pooling, deepsets): each plan family once, odd lengths, both directions and
# poolings, DeepSets pools on some. The fast run keeps one case per kernel family, -m slow the rest.
CASES = (
    ("fixed", 13, 4, True, "max", False),
    ("fixed_select", 21, 4, True, "max", False),
    ("sparse_fixed", 13, 4, False, None, False),
    ("axial_vertical", 11, 4, True, "mean", True),
    ("mixture_joint", 14, 3, False, "max", False),
    ("logsparse", 13, None, False, "max", True),
)
SWEEP_CASES = (
    ("fixed", 21, 5, False, "mean", True),
    ("fixed_select", 21, 4, False, "mean", True),
    ("sparse_fixed", 21, 5, True, None, False),
    ("axial_rowmajor", 11, 4, True, "max", False),
    ("axial_rowmajor", 14, 4, False, "mean", True),
    ("axial_vertical", 14, 3, False, "max", False),
    ("axial_horizontal", 11, 4, True, "max", True),
    ("axial_horizontal", 14, 3, False, "mean", False),
    ("sparse_axial", 11, 4, True, None, False),
    ("sparse_axial", 14, 3, False, None, False),
    ("mixture_mean", 11, 3, False, "max", False),
    ("mixture_mean", 14, 4, True, "mean", True),
    ("mixture_joint", 11, 4, True, "max", False),
    ("logsparse", 21, None, True, "mean", False),
    ("logsparse", 40, None, True, "max", False),
    ("sparse_logsparse", 13, None, True, None, False),
    ("sparse_logsparse", 21, None, False, None, False),
)


@pytest.mark.parametrize("plan,length,size,causal,pooling,deepsets", CASES)
def test_pallas_equals_xla(plan, length, size, causal, pooling, deepsets):
  compare(plan, length, size, causal, pooling, deepsets)


@pytest.mark.slow
@pytest.mark.parametrize("plan,length,size,causal,pooling,deepsets", SWEEP_CASES)
def test_pallas_equals_xla_sweep(plan, length, size, causal, pooling, deepsets):
  compare(plan, length, size, causal, pooling, deepsets, seed=1)


@pytest.mark.parametrize("plan,length,size,causal,pooling,deepsets", [
    ("fixed", 13, 4, True, "max", False),
    pytest.param("fixed_select", 21, 4, True, "mean", False, marks=pytest.mark.slow),  # rows loaded from HBM
    pytest.param("axial_vertical", 11, 4, False, "max", True, marks=pytest.mark.slow),  # column passes
    pytest.param("logsparse", 13, None, False, "max", False, marks=pytest.mark.slow),  # reversed tiles
])
def test_heads_in_blocks_of_their_own_axis(plan, length, size, causal, pooling, deepsets):
  """12 heads run 6 to a program: a block of heads neither whole nor a multiple of 8 is read from the frame
  arrays viewed [.., 2, 6, dim] (all 12 in one block overflowed a v4 core's VMEM at d = 64 in float32)."""
  f = kernel_plans.make_frame(jnp.zeros((1, 16, 12, 8)), jnp.zeros((1, 16, 12, 8)), None, 4, 4, "tpu")
  assert (f.heads_per_block, f.layout(8)) == (6, "split")
  compare(plan, length, size, causal, pooling, deepsets, heads=12)


@pytest.mark.parametrize("plan,length,size,causal,pooling,deepsets,head_dim,value_dim,layouts", [
    ("fixed", 13, 4, True, "max", False, 64, 64, ("fold", "fold", "fold")),
    pytest.param("fixed_select", 21, 4, True, "mean", False, 64, 5, ("fold", "fold", "split"),
                 marks=pytest.mark.slow),  # rows loaded from HBM
    pytest.param("axial_vertical", 11, 4, False, "max", True, 64, 8, ("fold", "fold", "split"),
                 marks=pytest.mark.slow),  # column passes: [batch, rows, cols * heads * 64]
    pytest.param("logsparse", 13, None, True, "mean", False, 128, 64, ("split", "split", "fold"),
                 marks=pytest.mark.slow)])
def test_heads_folded_into_lanes(monkeypatch, plan, length, size, causal, pooling, deepsets, head_dim,
                                 value_dim, layouts):
  """Blocks of 2 of 4 heads (HEAD_BLOCK 2) in `Frame.layout`'s views: heads of 64 folded into 128-lane
  blocks, [.., heads * 64] (the second block at lane 128; a column pass's columns folded in too), beside heads
  of 5, 8 or 128 in blocks of their own axis."""
  monkeypatch.setattr(frames, "HEAD_BLOCK", 2)
  f = kernel_plans.make_frame(jnp.zeros((1, 16, 4, head_dim)), jnp.zeros((1, 16, 4, value_dim)), None, 4, 4,
                              "tpu")
  got = (f.layout(head_dim), f.layout(head_dim, columns=True), f.layout(value_dim))
  assert (f.heads_per_block, *got) == (2, *layouts)
  compare(plan, length, size, causal, pooling, deepsets, heads=4, head_dim=head_dim, value_dim=value_dim)


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_rowmajor_span_keys_equal_xla(causal):
  """Rowmajor with learned span keys (`span_key_fn`): the kernels take the mapped keys as given rows and
  return their gradient, which reaches k through the map."""
  q, k, v, mask, cotangent, _ = inputs(11, 5, False)

  def run(implementation, q, k, v):
    def f(q, k, v):
      return combiner.axial(q, k, v, row_length=4, direction="rowmajor", causal=causal, mask=mask,
                            span_key_fn=lambda kb: 1.5 * jnp.tanh(kb) + 0.3, implementation=implementation)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(cotangent)

  got = jax.jit(functools.partial(run, "pallas"), compiler_options=FAST_COMPILE)(q, k, v)
  want = jax.jit(functools.partial(run, "xla"))(q, k, v)
  for name, a, b in zip(("out", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.parametrize("plan,causal,pooling,deepsets", [
    ("fixed", True, "mean", True), ("sparse_fixed", False, None, False),
    pytest.param("axial_horizontal", False, "max", True, marks=pytest.mark.slow),
    pytest.param("axial_rowmajor", True, "mean", False, marks=pytest.mark.slow),
    pytest.param("logsparse", False, "max", True, marks=pytest.mark.slow)])
def test_gpu_layout_equals_xla(monkeypatch, plan, causal, pooling, deepsets):
  """The layout GPUs run, forced on CPU: heads-packed frames (a column pass reads strided tiles of the row
  order) and the gradients of shared summaries as per-group partial sums."""
  monkeypatch.setattr(kernel_plans, "packs_heads", lambda platform: True)
  monkeypatch.setattr(kernel_plans, "partial_banks", lambda platform: True)
  compare(plan, 13, 4, causal, pooling, deepsets, seed=4)


@pytest.mark.parametrize("length,causal,pooling,deepsets", [
    (45, True, "max", True), pytest.param(37, False, "mean", False, marks=pytest.mark.slow),
    pytest.param(70, False, None, False, marks=pytest.mark.slow),
    pytest.param(130, True, None, False, marks=pytest.mark.slow)])
def test_logsparse_high_levels_equal_xla(monkeypatch, length, causal, pooling, deepsets):
  """Logsparse with tiles of 16 positions: the levels above a tile become span rows built over several tiles,
  read by the tiles of their sibling span (and, bidirectionally, of the reversed sequence)."""
  monkeypatch.setattr(frames, "TILE", 16)
  compare("logsparse" if pooling else "sparse_logsparse", length, None, causal, pooling, deepsets, seed=5)


@pytest.mark.parametrize("length,pooling,deepsets", [
    (64, "max", True), pytest.param(32, "mean", False, marks=pytest.mark.slow),
    pytest.param(128, None, False, marks=pytest.mark.slow)])
def test_bidirectional_logsparse_reads_the_reversed_tiles(monkeypatch, length, pooling, deepsets):
  """Without padding (length a multiple of the tile) the reversed half of bidirectional logsparse reads q, k,
  v, do and o backwards in its kernels, rows flipped in VMEM, writes its output and adds its gradients in
  place, in the arrays' order: equal to the XLA plan, and the compiled program flips no [batch, L, heads,
  dim] array."""
  monkeypatch.setattr(frames, "TILE", 16)
  name = "logsparse" if pooling else "sparse_logsparse"
  compare(name, length, None, False, pooling, deepsets, seed=6)
  q, k, v, mask, cotangent, _ = inputs(length, 6, False)
  fn = op(name, None)
  grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, causal=False, mask=mask, implementation="pallas")
                                           * cotangent), argnums=(0, 1, 2))
  hlo = jax.jit(grads).lower(q, k, v).compile().as_text()
  flips = re.findall(rf"f32\[{BATCH},{length},{HEADS},\d+\]\S* reverse\(", hlo)
  assert not flips, flips


def test_fully_masked_rows_and_nan_keys_stay_finite():
  """A batch row with every key masked returns zeros, and masked keys holding NaN never reach an output."""
  q, k, v, mask, _, _ = inputs(9, 2, False)
  mask = mask.at[1].set(False).at[0, 3].set(False)
  k = k.at[0, 3].set(jnp.nan)
  fn = op("fixed", 4)
  run = jax.jit(lambda impl: fn(q, k, v, causal=True, mask=mask, implementation=impl), static_argnums=0,
                compiler_options=FAST_COMPILE)
  got, want = run("pallas"), run("xla")
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(got[1]), 0.0)


@pytest.mark.parametrize("plan,size,packed", [("fixed", 4, False), ("fixed", 4, True),
                                              ("logsparse", None, False), ("axial_vertical", 4, False)])
def test_future_nonfinite_values_reach_only_the_queries_that_see_them(monkeypatch, plan, size, packed):
  """A NaN value and an Inf key at a future position leave every earlier output as in the clean run, and the
  later outputs that see them are non-finite exactly where the XLA plan's are (the kernel never multiplies a
  zero weight with them)."""
  monkeypatch.setattr(kernel_plans, "packs_heads", lambda platform: packed)
  q, k, v, mask, _, _ = inputs(13, 3, False)
  mask = jnp.ones_like(mask)
  fn = op(plan, size)
  run = jax.jit(lambda impl, k, v: fn(q, k, v, causal=True, mask=mask, implementation=impl), static_argnums=0,
                compiler_options=FAST_COMPILE)
  clean = np.asarray(run("pallas", k, v))
  k, v = k.at[0, 6].set(jnp.inf), v.at[1, 6].set(jnp.nan)
  got, want = np.asarray(run("pallas", k, v)), np.asarray(run("xla", k, v))
  np.testing.assert_allclose(got[:, :6], clean[:, :6], atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
  assert (~np.isfinite(got[:, 6:])).any(axis=(1, 2, 3)).all()


def test_implementation_argument():
  q, k, v, _, _, _ = inputs(4, 0, False)
  with pytest.raises(ValueError, match="argument 'implementation' must be one of"):
    combiner.fixed(q, k, v, block_size=2, causal=True, implementation="cuda")
  assert contract.resolve_implementation("auto", op="t") == (
      "xla" if jax.default_backend() == "cpu" else "pallas")
  assert contract.resolve_implementation("pallas", op="t") == "pallas"
  with pytest.raises(ValueError, match="'implementation'"):
    contract.check_implementation("pallas", ("auto", "xla", "flash"), op="dense")


# Lowering: the programs an accelerator would compile, at a realistic block/row size of 32 for L = 1024.
LOWERING_LENGTH, LOWERING_HEADS, LOWERING_DIM = 1024, 2, 64
LOWERING_OPS = {
    "fixed": lambda q, k, v: combiner.fixed(q, k, v, block_size=32, causal=True, implementation="pallas"),
    "sparse_fixed": lambda q, k, v: sparse.fixed(q, k, v, block_size=32, causal=False,
                                                 implementation="pallas"),
    "axial_rowmajor": lambda q, k, v: combiner.axial(q, k, v, row_length=32, direction="rowmajor",
                                                     causal=True, implementation="pallas"),
    "axial_vertical": lambda q, k, v: combiner.axial(q, k, v, row_length=32, direction="vertical",
                                                     causal=True, implementation="pallas"),
    "axial_horizontal": lambda q, k, v: combiner.axial(q, k, v, row_length=32, direction="horizontal",
                                                       causal=False, implementation="pallas"),
    "mixture": lambda q, k, v: combiner.mixture(q, k, v, row_length=32, causal=True,
                                                implementation="pallas"),
    "logsparse": lambda q, k, v: combiner.logsparse(q, k, v, causal=False, implementation="pallas"),
    "sparse_logsparse": lambda q, k, v: sparse.logsparse(q, k, v, causal=True, implementation="pallas"),
    "routed_causal": lambda q, k, v: combiner.routed(
        q, k, v, cluster_ids=jnp.arange(q.size // q.shape[-1]).reshape(q.shape[:3]) % 32, num_clusters=32,
        causal=True, implementation="pallas"),
    "routed_op": lambda q, k, v: ops_registry.get("combiner_routed").fn(
        q, k, v, causal=False, num_clusters=32, implementation="pallas"),
}
# The Triton custom call carries no cross-version compatibility guarantee, so export must be told to allow it.
TRITON_OK = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


# The slowest lowerings (logsparse and the mixture for CUDA, sparse logsparse for TPU) run with -m slow.
SLOW_LOWERINGS = {("logsparse", "cuda"), ("mixture", "cuda"), ("sparse_logsparse", "tpu"),
                  ("logsparse", "tpu")}


@pytest.mark.all_platforms
@pytest.mark.parametrize("name,platform", [
    pytest.param(name, platform, marks=pytest.mark.slow if (name, platform) in SLOW_LOWERINGS else ())
    for name in sorted(LOWERING_OPS) for platform in ("tpu", "cuda")])
def test_lowers_for_accelerators(name, platform):
  check_lowering(name, platform)


def check_lowering(name, platform):
  fn = LOWERING_OPS[name]

  def fwd_bwd(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

  spec = jax.ShapeDtypeStruct((1, LOWERING_LENGTH, LOWERING_HEADS, LOWERING_DIM), jnp.bfloat16)
  marker = "tpu_custom_call" if platform == "tpu" else "xla.gpu.triton"
  for f in (fn, fwd_bwd):
    export = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=TRITON_OK)
    exported = export(spec, spec, spec)
    assert marker in exported.mlir_module(), f"{name}: no Pallas kernel in the {platform} program"


def test_registry_and_model_config_carry_the_implementation():
  """Ops that take `implementation` declare it in their registration (`fused`); the model passes
  `config.model.attention.implementation` to them and rejects a specific choice for an op without one."""
  from attention_core import registry as ops_registry
  from configs import base
  from models import transformer

  for name in ("combiner_fixed", "combiner_logsparse", "combiner_axial_rowmajor", "combiner_axial_vertical",
               "combiner_axial_horizontal", "combiner_mixture", "combiner_mixture_joint", "sparse_fixed",
               "sparse_logsparse", "sparse_axial", "combiner_fixed_select"):
    assert ops_registry.takes_implementation(ops_registry.get(name)), name
  assert not ops_registry.takes_implementation(ops_registry.OpSpec("plain", lambda q, k, v, *, causal: q))

  def tiny(name, implementation, task="lm"):
    c = base.base_config().model
    c.num_layers, c.features, c.num_heads, c.mlp_dim = 1, 16, 2, 32
    c.attention = base.attention_config(name)
    c.attention.implementation = implementation
    return transformer.build_model(c, task=task, vocab_size=11, seq_len=8, num_classes=2)

  assert base.attention_config().implementation == "auto"
  model = tiny("combiner_fixed", "xla")
  batch = {"inputs": jnp.ones((1, 8), jnp.int32), "mask": jnp.ones((1, 8), bool)}
  assert np.isfinite(np.asarray(model(batch, deterministic=True))).all()
  # YOSO's modules wrap its ops like the Combiner ones but its ops have no implementation choice.
  without = [n for n in ops_registry.names() if n.startswith("yoso")
             and not ops_registry.takes_implementation(ops_registry.get(n))]
  if without:
    with pytest.raises(ValueError, match="does not take 'implementation'"):
      tiny(without[0], "pallas", task="classify")
