"""The Compressive Transformer (models/compressive_attention.py, config.model.compressed_mem_len): the FIFO
and compressed memories and the logits, segment by segment, equal a float64 simulation from the definition
for every compression function; the attention-reconstruction loss changes no gradient but the compression's
and does reach it; configs without a compressing module are errors; the smoke config trains through the
trainer with the memories in its state and (slow) resumes bit for bit from a checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_baselines.transformer_xl import sinusoid
from configs import base, compressive, validation
from models import transformer
from runtime.cli import UsageError
from tests.models.memory_checks import by_segment
from tests.models.test_recurrence import model_config, random_model
from training import checkpoints, evaluate, experiment

VOCAB = 11
BATCH, SEQ, MEM, COMPRESSED, RATE, SEGMENTS = 2, 6, 4, 4, 3, 4


def config(compression, layers=2):
  c = model_config(layers=layers, mem_len=MEM, name="compressive")
  c.num_heads, c.head_dim = 2, 4
  c.compressed_mem_len = COMPRESSED
  c.attention.compression = compression
  c.attention.compression_rate = RATE
  c.attention.reconstruction_loss = 0.5
  return c


# ---- the float64 definition -------------------------------------------------------------------------------

def val(v):
  return np.asarray(v[...], np.float64)


def ln(x, norm):
  c = x - x.mean(-1, keepdims=True)
  return c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-6) * val(norm.scale) + val(norm.bias)


def dense(x, layer, spec):
  return np.einsum(spec, x, val(layer.kernel)) + (0 if layer.bias is None else val(layer.bias))


def gelu(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def softmax(s, allowed):
  s = np.where(allowed, s, -np.inf)
  top = np.max(s, axis=-1, keepdims=True)
  e = np.where(allowed, np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
  return e / np.maximum(e.sum(-1, keepdims=True), 1e-300)


def block(b, x, read, read_valid):
  """One pre-LN block over x [batch, L, features] with the memory `read` [batch, K, features]: the new x and
  the probabilities [batch, heads, L, K + L] (s_ij = ((q_i + u) k_j + (q_i + v) r_{K+i-j}) / sqrt d)."""
  a = b.attention
  hx, ctx = ln(x, b.norm1), ln(np.concatenate([read, x], 1), b.norm1)
  q = dense(hx, a.query, "btf,fhd->bthd")  # [batch, L, heads, d]
  k, v = (dense(ctx, lay, "btf,fhd->bthd") for lay in (a.key, a.value))  # [batch, K + L, heads, d]
  length, total = x.shape[1], ctx.shape[1]
  r = np.einsum("nf,fhd->nhd", np.asarray(sinusoid(total, x.shape[2]), np.float64), val(a.pos_key.kernel))
  dist = total - length + np.arange(length)[:, None] - np.arange(total)[None, :]  # [L, K + L]
  s = (np.einsum("bihd,bjhd->bhij", q + val(a.u), k)
       + np.einsum("bihd,ijhd->bhij", q + val(a.v_bias), r[np.maximum(dist, 0)])) / np.sqrt(q.shape[-1])
  valid = np.concatenate([read_valid, np.ones(x.shape[:2], bool)], 1)  # [batch, K + L]
  p = softmax(s, (dist >= 0)[None, None] & valid[:, None, None, :])
  x = x + dense(np.einsum("bhij,bjhd->bihd", p, v), a.out, "bihd,hdf->bif")
  h = ln(x, b.norm2)
  return x + dense(gelu(dense(h, b.mlp.up, "btf,fm->btm")), b.mlp.down, "btm,mf->btf"), p


def compress(kind, a, evicted, valid, usage):
  """f_c from its definition over groups of RATE: [batch, L / c, features] and validity [batch, L / c]."""
  batch, length, f = evicted.shape
  groups = length // RATE
  zeroed = np.where(valid[..., None], evicted, 0)
  gv = valid.reshape(batch, groups, RATE)
  out_valid = gv.any(-1)
  if kind == "most_used":
    out, keep = np.zeros((batch, groups, f)), np.zeros((batch, groups), bool)
    for row in range(batch):  # highest usage among the valid ones first, then in order
      order = sorted(range(length), key=lambda j: (not valid[row, j], -usage[row, j], j))[:groups]
      out[row], keep[row] = zeroed[row, sorted(order)], valid[row, sorted(order)]
    return out, keep
  g = zeroed.reshape(batch, groups, RATE, f)
  if kind == "max_pool":
    out = np.where(gv[..., None], evicted.reshape(batch, groups, RATE, f), -np.inf).max(2)
  elif kind == "mean_pool":
    out = g.sum(2) / np.maximum(gv.sum(-1), 1)[..., None]
  else:
    h = zeroed
    if kind == "dilated_conv":
      for dilation, lay in zip((1, 2), a.dilated, strict=True):
        before = np.concatenate([np.zeros((batch, dilation, f)), h[:, :-dilation]], 1)  # h[t - d]
        w = val(lay.kernel)  # [2, features, features]
        h = h + np.maximum(before @ w[0] + h @ w[1] + val(lay.bias), 0)
        h = np.where(valid[..., None], h, 0)
    w = val(a.conv.kernel)  # [c, features, features]
    out = sum(h.reshape(batch, groups, RATE, f)[:, :, t] @ w[t] for t in range(RATE)) + val(a.conv.bias)
  return np.where(out_valid[..., None], out, 0), out_valid


def reference(model, kind, tokens):
  """The model over SEGMENTS segments from an empty memory: per segment (logits, per-layer memory)."""
  enc = model.encoder
  layers = [dict(hidden=np.zeros((BATCH, MEM, 16)), valid=np.zeros((BATCH, MEM), bool),
                 compressed=np.zeros((BATCH, COMPRESSED, 16)),
                 compressed_valid=np.zeros((BATCH, COMPRESSED), bool)) for _ in enc.blocks]
  out, previous = [], np.full((BATCH, 1), model.bos_id)
  for s in range(SEGMENTS):
    seg = tokens[:, s * SEQ:(s + 1) * SEQ]
    x = val(enc.embed.embedding)[np.concatenate([previous, seg[:, :-1]], 1)]  # [batch, L, features]
    previous = seg[:, -1:]
    new = []
    for b, mem in zip(enc.blocks, layers, strict=True):
      read = np.concatenate([mem["compressed"], mem["hidden"]], 1)
      read_valid = np.concatenate([mem["compressed_valid"], mem["valid"]], 1)
      both = np.concatenate([mem["hidden"], x], 1)
      both_valid = np.concatenate([mem["valid"], np.ones((BATCH, SEQ), bool)], 1)
      x_next, p = block(b, x, read, read_valid)
      # usage: what the evicted keys (the first L of [memory; x]) get, summed over queries, mean over heads
      usage = p.sum(2).mean(1)[:, COMPRESSED:COMPRESSED + SEQ]
      comp, comp_valid = compress(kind, b.attention, both[:, :SEQ], both_valid[:, :SEQ], usage)
      cm = np.concatenate([mem["compressed"], comp], 1)[:, -COMPRESSED:]
      cm_valid = np.concatenate([mem["compressed_valid"], comp_valid], 1)[:, -COMPRESSED:]
      new.append(dict(hidden=both[:, SEQ:], valid=both_valid[:, SEQ:], compressed=cm,
                      compressed_valid=cm_valid))
      x = x_next
    layers = new
    out.append((dense(ln(x, enc.norm), model.head, "btf,fv->btv"), layers))
  return out


# Each ~4 s on 2 shared cores: the fast run checks conv and most_used (learned parameters, usage), the slow
# run the pools and dilated_conv, with two layers (the second layer's input read the compressed memory).
@pytest.mark.parametrize("kind,layers", [("conv", 1), ("most_used", 1)] + [
    pytest.param(kind, layers, marks=pytest.mark.slow)
    for kind, layers in (("max_pool", 1), ("mean_pool", 1), ("dilated_conv", 2))])
def test_memories_step_by_step_equal_the_definition(kind, layers):
  # Segments of 6 with a FIFO of 4, rate 3 and a compressed FIFO of 4: the first segment evicts 4 empty slots
  # and 2 of its own positions (a half-valid group), the fourth drops the oldest compressed slots.
  with jax.enable_x64(True):
    model = random_model(config(kind, layers=layers), seq_len=SEQ, seed=7)
    tokens = np.asarray(jax.random.randint(jax.random.key(8), (BATCH, SEGMENTS * SEQ), 0, VOCAB))
    got, want = by_segment(model, jnp.asarray(tokens), SEQ, MEM), reference(model, kind, tokens)
    # Which compressed slots are valid: a group with one valid input is (most_used keeps the 2 valid states).
    first = [False, False, True, True] if kind == "most_used" else [False, False, False, True]
    filled = [first, [first[2]] + [True] * 3, [True] * 4, [True] * 4]
    for s, ((logits, memory), (ref_logits, ref_layers)) in enumerate(zip(got, want, strict=True)):
      np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5, err_msg=f"segment {s}")
      for layer, ref in zip(memory["layers"], ref_layers, strict=True):
        for key in ("hidden", "compressed"):
          np.testing.assert_allclose(layer[key], ref[key], rtol=1e-9, atol=1e-9, err_msg=f"{key} {s}")
        for key in ("valid", "compressed_valid"):
          np.testing.assert_array_equal(layer[key], ref[key], err_msg=f"{key}, segment {s}")
        np.testing.assert_array_equal(layer["compressed_valid"], [filled[s]] * BATCH)
      np.testing.assert_array_equal(memory["token"], tokens[:, (s + 1) * SEQ - 1])


@pytest.mark.slow  # ~15 s of CPU: a float64 Jacobian compiled
def test_reconstruction_loss_trains_only_the_compression():
  # The second segment evicts 6 valid states: its task loss and its loss term, differentiated apart (one
  # Jacobian). The total's gradient is their sum, so the loss term leaves every other gradient unchanged.
  with jax.enable_x64(True):
    model = random_model(config("dilated_conv", layers=1), seq_len=SEQ, seed=9)
    tokens = jax.random.randint(jax.random.key(10), (BATCH, 2 * SEQ), 0, VOCAB)
    weights = jax.random.normal(jax.random.key(11), (BATCH, SEQ, VOCAB), jnp.float64)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def losses(params, memory):
      m = nnx.merge(graphdef, params, rest)
      logits, _ = m({"inputs": tokens[:, SEQ:]}, deterministic=False, memory=memory)
      sown = nnx.pop(m, nnx.Intermediate)
      terms = [v for path, v in jax.tree_util.tree_leaves_with_path(sown)
               if "loss_term" in jax.tree_util.keystr(path)]
      assert len(terms) == 1  # one per layer
      return jnp.stack([jnp.sum(logits * weights), terms[0]])

    @jax.jit
    def grads(params):
      m = nnx.merge(graphdef, params, rest)
      memory = m({"inputs": tokens[:, :SEQ]}, deterministic=True, memory=m.init_memory(BATCH, MEM))[1]
      return jax.jacrev(losses)(params, memory), losses(params, memory)

    jacobian, (_, value) = grads(params)
    assert float(value) > 0
    compression = 0
    for path, g in jax.tree_util.tree_leaves_with_path(jacobian):
      name, task, term = jax.tree_util.keystr(path), np.asarray(g[0]), np.asarray(g[1])
      if "'conv'" in name or "'dilated'" in name:  # the compression: only the loss term reaches it
        compression += 1
        assert not task.any() and np.abs(term).max() > 0, name
      else:  # every other parameter: the loss term adds exactly zero to the task loss's gradient
        assert not term.any() and np.abs(task).max() > 0, name
    assert compression == 3 * 2  # conv and the two dilated layers, kernel and bias each


def test_config_errors():
  def build(cfg):
    nnx.eval_shape(lambda: transformer.build_model(cfg, task="lm", vocab_size=VOCAB, seq_len=SEQ))

  c = config("conv")
  c.attention = base.attention_config("transformer_xl")
  with pytest.raises(ValueError, match="compressed_mem_len=4 needs an attention whose module compresses"):
    build(c)
  with pytest.raises(ValueError, match="compression must be one of"):
    build(config("zip"))
  full = compressive.get_config("smoke")
  full.model.mem_len = 0
  with pytest.raises(UsageError, match="compressed_mem_len=32 needs config.model.mem_len > 0"):
    validation.validate(full)
  with jax.enable_x64(True):
    m = random_model(config("mean_pool"), seq_len=8)
    with pytest.raises(ValueError, match="segment length 8 must be a multiple of compression_rate=3"):
      m({"inputs": jnp.zeros((BATCH, 8), jnp.int32)}, deterministic=True, memory=m.init_memory(BATCH, MEM))


def trainer_config():
  c = compressive.get_config("smoke,seq_len=12,mem_len=12,compressed_mem_len=8")
  c.optimizer.warmup_steps = 0
  c.optimizer.schedule = "constant"
  return c


@pytest.mark.slow  # ~40 s on 2 shared cores: the train step's compile
def test_smoke_trains_and_resumes_exactly_through_the_trainer(tmp_path):
  c = trainer_config()
  exp = experiment.Experiment(c, devices=jax.devices()[:1])
  it = iter(experiment.create_dataset(c, "train", batch_size=8, seed=0))
  mgr = checkpoints.checkpoint_manager(str(tmp_path), c)
  state, losses = exp.init_state(), []
  assert state.memory["layers"][0]["compressed"].shape == (8, 8, 32)
  first = jax.tree.map(np.asarray, state.params)
  for step in range(4):
    state, out = exp.train_step(state, next(it))
    losses.append(float(out["loss"]))
    assert np.isfinite(losses[-1])
    assert (out["loss"] > out["task_loss"]) == (step > 0)  # reconstruction loss once states are evicted
    if step == 1:
      checkpoints.save_checkpoint(mgr, state, it, wait=True)
  layer = state.memory["layers"][0]
  assert np.asarray(layer["valid"]).all() and np.asarray(layer["compressed_valid"]).all()
  conv = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)]
  for name, a, b in zip(conv, jax.tree.leaves(first), jax.tree.leaves(state.params), strict=True):
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 0, name  # every parameter trained, conv included
  straight = jax.tree.map(np.asarray, (state.params, state.memory))
  it = iter(experiment.create_dataset(c, "train", batch_size=8, seed=0))
  state = checkpoints.restore_checkpoint(mgr, exp, it)
  mgr.close()
  assert state.step == 2 and np.asarray(state.memory["layers"][0]["compressed_valid"]).any()
  resumed = []
  for _ in range(2):
    state, out = exp.train_step(state, next(it))
    resumed.append(float(out["loss"]))
  assert resumed == losses[2:]
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves((state.params, state.memory)), strict=True):
    np.testing.assert_array_equal(a, b)
  # A reset row empties its compressed memory too.
  reset_state, _ = exp.train_step(state, dict(next(it), reset=np.arange(8) == 0))
  cv = np.asarray(reset_state.memory["layers"][0]["compressed_valid"])
  assert not cv[0].any() and cv[1:].all()


def test_eval_compressed_mem_len_config():
  c = compressive.get_config("smoke")
  assert c.model.eval_compressed_mem_len is None
  c.model.eval_compressed_mem_len = -1
  with pytest.raises(UsageError, match="eval_compressed_mem_len must be >= 0"):
    validation.validate(c)
  c.model.eval_compressed_mem_len, c.model.compressed_mem_len = 16, 0
  with pytest.raises(UsageError, match="eval_compressed_mem_len=16 needs config.model.compressed_mem_len"):
    validation.validate(c)
  # eval.py's --eval_compressed_mem_len
  with pytest.raises(UsageError, match="trained without a compressed memory"):
    evaluate.with_eval_compressed_mem_len(c, 16)
  c.model.compressed_mem_len = 32
  with pytest.raises(UsageError, match="--eval_compressed_mem_len must be >= 0"):
    evaluate.with_eval_compressed_mem_len(c, -1)
  assert evaluate.with_eval_compressed_mem_len(c, 0).model.eval_compressed_mem_len == 0
  validation.validate(c)
  with jax.enable_x64(True):
    m = random_model(config("mean_pool"), seq_len=SEQ)
    for n, want in ((None, COMPRESSED), (COMPRESSED + 3, COMPRESSED + 3)):
      assert m.init_memory(BATCH, MEM, n)["layers"][0]["compressed"].shape == (BATCH, want, 16)
    assert "compressed" not in m.init_memory(BATCH, MEM, 0)["layers"][0]  # 0: the FIFO alone


@pytest.mark.slow  # ~10 s of CPU: the state's init and two evaluation steps compiled
def test_evaluation_with_another_compressed_memory_length():
  # Segments of 12 evict 12 states, 4 compressed slots each: after the third batch 8 are valid, so a
  # compressed memory of 8 (not the training 4) changes the fourth batch's loss.
  c = compressive.get_config("smoke,seq_len=12,mem_len=12,compressed_mem_len=4")
  c.train.eval_batch_size = 2
  c.model.eval_compressed_mem_len = 4
  validation.validate(c)
  exp = experiment.Experiment(c, devices=jax.devices()[:1])
  assert exp.eval_compressed_mem_len == 4
  state = exp.init_state()
  results = {}
  for n in (4, None, 8):  # the configured length, then (set here) the model's own and a longer one
    exp.eval_compressed_mem_len = n
    results[n] = exp.evaluate(state, max_batches=4)
  assert results[None]["num_batches"] == 4
  assert results[4]["loss"] == results[None]["loss"]
  assert np.isfinite(results[8]["loss"]) and results[8]["loss"] != results[None]["loss"]
