"""Adaptive attention span against its definition (attention_baselines/adaptive_span.py), in numpy float64:
forward and gradients (q, k, v and the spans) with key masks, odd lengths and blocks that do not divide them,
causal and bidirectional; keys beyond max z + R are never read (NaN there is inert, the Jacobian is zero)
and the loop runs only over the offsets that reach max z + R; decoding from the ring equals the forward
pass; the module's spans, clamp and penalty; and (slow) a short training run in which the spans shrink on a
task with only local structure and stay long on the recall task."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from attention_baselines import adaptive_span as span_op
from attention_baselines.adaptive_span import adaptive_span
from attention_baselines.adaptive_span_decode import ADAPTIVE_SPAN
from models import adaptive_span_attention, transformer
from tests.attention_baselines.definitions import adaptive_span_jax_reference as jax_reference
from tests.attention_baselines.definitions import adaptive_span_reference as reference
from tests.attention_baselines.definitions import inputs

PLAN = dict(max_span=9, ramp=2.5)
SPANS = np.array([1.3, 6.6])  # two heads; not integers, so no distance sits on the mask's kinks


@functools.cache
def _grads(fn, causal, **kw):
  """jit((q, k, v, spans, mask, cot) -> (gradients of sum(out * cot) w.r.t. q, k, v, spans; out)), one
  compilation per op and plan, shared by the tests below."""

  def loss(q, k, v, z, mask, cot):
    out = fn(q, k, v, mask=mask, spans=z, causal=causal, **PLAN, **kw)
    return jnp.sum(out * cot), out

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


# One case runs fast (causal, a ragged last block); the others repeat it in the other direction and with other
# blocks, each a compilation of the op's forward and backward loops.
@pytest.mark.parametrize("causal,block", [(True, 5), pytest.param(True, 4, marks=pytest.mark.slow),
                                          pytest.param(True, 64, marks=pytest.mark.slow),
                                          pytest.param(False, 5, marks=pytest.mark.slow),
                                          pytest.param(False, 4, marks=pytest.mark.slow)])
def test_forward_and_gradients_equal_the_definition(causal, block):
  """float64, length 13 (blocks of 4 and 5 leave a ragged last one, 64 holds all), random key mask; the
  gradient with respect to the spans included."""
  with jax.enable_x64(True):
    q, k, v, mask = inputs(1, length=13)
    spans = jnp.asarray(SPANS)
    want = reference(q, k, v, mask, spans, causal=causal, **PLAN)
    real = np.asarray(mask)[:, :, None, None]
    cot = jax.random.normal(jax.random.key(2), v.shape, jnp.float64) * real  # real query rows only

    want_grads, _ = _grads(jax_reference, causal)(q, k, v, spans, mask, cot)
    assert np.all(np.abs(np.asarray(want_grads[3])) > 1e-3)  # every head's span is in the gradient
    got_grads, got = _grads(adaptive_span, causal, block_size=block)(q, k, v, spans, mask, cot)
    np.testing.assert_allclose(np.where(real, got, 0.0), np.where(real, want, 0.0), rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.slow  # two more compilations of the op; the clamp's arithmetic is one jnp.clip
def test_spans_are_clamped_and_a_shared_span_broadcasts():
  with jax.enable_x64(True):
    q, k, v, mask = inputs(3, length=9)
    run = jax.jit(lambda z: adaptive_span(q, k, v, mask=mask, spans=z, causal=True, **PLAN))
    got = run(jnp.array([-3.0, 40.0]))
    want = reference(q, k, v, mask, [0.0, 9.0], causal=True, **PLAN)
    real = np.asarray(mask)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(run(jnp.array([2.5])), run(jnp.array([2.5, 2.5])))


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_keys_beyond_the_largest_span_are_never_read(causal):
  """NaN and Inf in the keys and values at distance >= max z + R from a set of queries leave those queries'
  outputs finite and unchanged, and the gradients of their loss finite, zero at the far keys (the op
  compiled for test_forward_and_gradients_equal_the_definition's first case)."""
  with jax.enable_x64(True):
    q, k, v, mask = inputs(1, length=13)
    z = jnp.asarray(SPANS)  # max z + R = 9.1 with R = 2.5: distances >= 10 are unseen
    far = np.arange(13) < 2  # keys 0 and 1
    queries = np.arange(13) >= 11  # 11 - 1 = 10 (bidirectional: the poison is before them all)
    sel = (jnp.asarray(queries)[None, :] & mask)[:, :, None, None]
    cot = jax.random.normal(jax.random.key(2), v.shape, jnp.float64) * sel
    plant = lambda x, value: jnp.where(jnp.asarray(far)[None, :, None, None], value, x)  # noqa: E731
    run = _grads(adaptive_span, causal, block_size=5)
    _, clean = run(q, k, v, z, mask, cot)
    grads, dirty = run(q, plant(k, jnp.nan), plant(v, jnp.inf), z, mask, cot)
    np.testing.assert_array_equal(np.asarray(dirty)[:, queries], np.asarray(clean)[:, queries])
    for g in grads:
      assert np.all(np.isfinite(np.asarray(g)))
    assert not np.any(np.asarray(grads[1])[:, far]) and not np.any(np.asarray(grads[2])[:, far])


def test_the_loop_runs_only_over_offsets_within_the_largest_span():
  """T = floor((max z + R - 1) / block) + 2: the trip count follows the spans, up to the static bound; a key
  at distance exactly max z + R is read (it is in d/dz), as at max z = 97, R = 32, blocks of 64."""
  length, block, ramp = 8192, 64, 32.0
  n = length // block
  plan = (True, ramp, block, n, n, length)
  for zmax, want in ((256.0, 6), (0.0, 2), (32.5, 2), (96.5, 3), (97.0, 4), (97.5, 4), (8192.0, n)):
    got = int(span_op._trip_count(jnp.array([1.0, zmax]), plan))
    assert got == want == min(n, math.floor((zmax + ramp - 1) / block) + 2), (zmax, got, want)
    # no pair of the offset after the last is at most max z + R apart; some pair of the last one is
    if want < n:
      assert want * block - (block - 1) > zmax + ramp >= (want - 1) * block - (block - 1)


@pytest.mark.slow  # fast sibling: tests/attention_core/test_decode.py steps the decoder at its automatic plan
def test_decoding_from_the_ring_equals_the_forward_pass():
  """A ring of ceil(max_span + R) = 12 slots, fewer than the 19 tokens: prefill 7, then step."""
  q, k, v, _ = inputs(5, batch=2, length=19, heads=2, head_dim=4, value_dim=3, dtype=jnp.float32)
  z = jnp.array([7.9, 2.2])

  @jax.jit
  def run(q, k, v):
    full = adaptive_span(q, k, v, causal=True, spans=z, block_size=4, **PLAN)
    cache = ADAPTIVE_SPAN.init_cache(2, 2, 19, 4, 3, jnp.float32, **PLAN)
    cache = ADAPTIVE_SPAN.prefill(cache, q[:, :7], k[:, :7], v[:, :7], spans=z, **PLAN)

    def body(cache, t):
      at = lambda x: jax.lax.dynamic_index_in_dim(x, t, axis=1, keepdims=False)  # noqa: E731
      out, cache = ADAPTIVE_SPAN.step(cache, at(q), at(k), at(v), t, spans=z, **PLAN)
      return cache, out

    cache, outs = jax.lax.scan(body, cache, jnp.arange(7, 19))
    return full, jnp.swapaxes(outs, 0, 1), cache["k"].shape

  full, stepped, ring = run(q, k, v)
  assert ring == (2, 2, 12, 4)
  np.testing.assert_allclose(stepped, full[:, 7:], rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_named():
  q = k = v = np.ones((1, 5, 2, 3), np.float32)
  for kw, name in ((dict(spans=jnp.ones(3)), "'spans'"), (dict(spans=jnp.ones(2), ramp=0), "'ramp'"),
                   (dict(spans=jnp.ones(2), max_span=-1), "'max_span'"),
                   (dict(spans=jnp.ones(2), block_size=0), "'block_size'")):
    with pytest.raises(ValueError, match=name):
      adaptive_span(q, k, v, causal=True, **{"max_span": 4, **kw})


# -- the module -----------------------------------------------------------------------------------------


def _model(seq_len=16, *, span_init=None, span_loss=None, params=None, layers=1, heads=2, features=16,
           vocab=11, seed=0):
  att = {"name": "adaptive_span", "params": params or {}, "dropout_rate": 0.0}
  if span_init is not None:
    att["span_init"] = span_init
  if span_loss is not None:
    att["span_loss"] = span_loss
  cfg = ml_collections.ConfigDict({
      "num_layers": layers, "features": features, "num_heads": heads, "mlp_dim": 2 * features,
      "dropout_rate": 0.0, "dtype": "float32", "position_embedding": "learned", "attention": att})
  return transformer.build_model(cfg, task="lm", vocab_size=vocab, seq_len=seq_len, seed=seed)


def _attention_modules(model):
  return [m for _, m in nnx.iter_graph(model) if isinstance(m, adaptive_span_attention.AdaptiveSpanAttention)]


def test_module_owns_spans_and_sows_their_penalty():
  model = _model(span_init=0.25, span_loss=1e-3, params={"ramp": 4})
  (att,) = _attention_modules(model)
  assert att.max_span == 16 and att.plan_params["ramp"] == 4
  np.testing.assert_allclose(att.spans(), [4.0, 4.0])
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def penalty_and_grad(params):
    def penalty(params):
      m = nnx.merge(graphdef, params, rest, copy=True)
      m({"inputs": jnp.zeros((1, 16), jnp.int32)}, deterministic=True)
      sown = nnx.pop(m, nnx.Intermediate)
      return sum(jnp.sum(v) for p, v in jax.tree_util.tree_leaves_with_path(sown)
                 if "loss_term" in jax.tree_util.keystr(p))

    return jax.value_and_grad(penalty)(params)

  value, grads = penalty_and_grad(params)
  np.testing.assert_allclose(value, 1e-3 * 4.0, rtol=1e-6)  # span_loss * mean_h z_h
  # d/d ratio_h of span_loss * mean_h(max_span * ratio_h) = span_loss * max_span / heads
  span_grad = grads["encoder"]["blocks"][0]["attention"]["span_ratio"][...]
  np.testing.assert_allclose(span_grad, [1e-3 * 16 / 2] * 2, rtol=1e-6)
  with pytest.raises(ValueError, match="span_init"):
    _model(span_init=1.5)


def test_clamp_passes_only_gradients_that_point_back_inside():
  grad = jax.grad(lambda x, c: jnp.sum(adaptive_span_attention.clamp_ratio(x) * c))
  x = jnp.array([-0.1, -0.1, 0.5, 1.2, 1.2])
  c = jnp.array([1.0, -1.0, 1.0, 1.0, -1.0])  # loss slope: descent moves x by -c
  np.testing.assert_array_equal(grad(x, c), [0.0, -1.0, 1.0, 1.0, 0.0])


@pytest.mark.slow  # a whole model compiled twice and decoded token by token
def test_model_decode_equals_forward(decoding_matches_forward):
  model = _model(12, span_init=0.6, params={"ramp": 2, "max_span": 5, "block_size": 4})  # a ring of 7 slots
  decoding_matches_forward(model, 12)


# -- learning the spans (slow) ------------------------------------------------------------------------------


def _local_batch(rng, batch, length, vocab):
  """Pairs (a, a): every second token repeats the one before it, the only structure (weights on the
  repeats)."""
  a = rng.integers(0, vocab, size=(batch, length // 2))
  tokens = np.repeat(a, 2, axis=1)
  weights = np.zeros((batch, length), np.float32)
  weights[:, 1::2] = 1.0
  return {"inputs": jnp.asarray(tokens, jnp.int32), "weights": jnp.asarray(weights)}


def _train_spans(batches, *, vocab, length, steps, record):
  """Adam on the LM loss plus the sown span penalties (as the train step adds them), from spans at max_span
  (= length), with span_loss 1e-3 (the paper's 2e-6 is for runs a thousand times longer); the spans
  [layers, heads] in tokens after each step in `record`."""
  model = _model(length, span_init=1.0, span_loss=1e-3, layers=2, heads=4, features=32, vocab=vocab, seed=1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adam(3e-3)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt, batch):
    def loss_fn(params):
      m = nnx.merge(graphdef, params, rest, copy=True)
      logits = m(batch, deterministic=True)
      nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["inputs"])
      loss = jnp.sum(nll * batch["weights"]) / jnp.sum(batch["weights"])
      sown = nnx.pop(m, nnx.Intermediate)
      return loss + sum(jnp.sum(v) for v in jax.tree.leaves(sown))

    grads = jax.grad(loss_fn)(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  spans = {}
  for i in range(1, steps + 1):
    params, opt = step(params, opt, batches(i))
    if i in record:
      model = nnx.merge(graphdef, params, rest)
      spans[i] = np.stack([np.asarray(m.spans()) for m in _attention_modules(model)])
  return spans


@pytest.mark.slow
def test_spans_shrink_on_local_structure_and_stay_long_on_recall():
  """From max_span = L = 128: with only local structure (every second token repeats the one before) the
  penalty shrinks every span at Adam's full rate; on recall (answers up to 127 tokens back) the first
  layer's spans stop shrinking near 3/4 of L once the task is learned (accuracy ~1 by step 150), while the
  second layer's, which the recall does not need, keep shrinking."""
  from data.synthetic import RecallSource

  length = 128
  rng = np.random.default_rng(0)
  local = _train_spans(lambda i: _local_batch(rng, 16, length, 16), vocab=16, length=length, steps=150,
                       record=(100, 150))
  cfg = ml_collections.ConfigDict({"data": dict(seq_len=length, num_keys=8, num_values=4, num_pairs=4,
                                                num_filler=4, train_examples=10**6, eval_examples=16)})
  source = RecallSource(cfg, "train", 0)

  def recall(i):
    rows = source.read_batch(range(16 * i, 16 * (i + 1)))
    return {"inputs": jnp.asarray(np.stack([r["inputs"] for r in rows])),
            "weights": jnp.asarray(np.stack([r["weights"] for r in rows]))}

  long = _train_spans(recall, vocab=4 + 8 + 8 * 4 + 4, length=length, steps=150, record=(100, 150))
  for name, spans in (("local", local), ("recall", long)):
    for step, z in spans.items():
      print(f"{name} step {step} spans [layer, head]: {z.round(1).tolist()}")
  assert np.all(local[150] < local[100] - 15)  # still shrinking everywhere
  assert long[150][0].mean() > long[100][0].mean() - 2  # the recall layer holds its spans ...
  assert long[150][0].min() > 0.6 * length and long[150][0].min() > local[150].max() + 15
  assert long[150][1].mean() < long[100][1].mean() - 10  # ... and the other layer keeps shrinking
