"""Every registered attention inside the Transformer (LM, MLM, classification), forward and backward, plus
the model-level properties: causality through the whole decoder, padding invariance, logical axes on
parameters."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from attention_core import registry as ops_registry
from configs import base
from models import registry, transformer

LENGTH, VOCAB, CLASSES = 16, 13, 3


def tiny_cfg(name: str, **attention_fields) -> ml_collections.ConfigDict:
  c = base.base_config().model
  c.num_layers, c.features, c.num_heads, c.mlp_dim = 1, 16, 2, 32
  c.attention = base.attention_config(name)
  for k, v in attention_fields.items():
    c.attention[k] = v
  if name in ("routing", "combiner_routed"):
    c.attention.params.num_clusters = 4
  return c


def supported(name: str, causal: bool) -> bool:
  spec = ops_registry.OPS.get(name) if name in ops_registry.names() else None
  if spec is None:  # a module without a pure op of the same name declares nothing: try both
    return True
  return spec.causal if causal else spec.bidirectional


def batch_for(task: str, rng: np.random.Generator) -> dict:
  ids = rng.integers(0, VOCAB, size=(2, LENGTH)).astype(np.int32)
  mask = np.ones((2, LENGTH), bool)
  mask[1, LENGTH - 5:] = False
  b = {"inputs": ids, "mask": mask, "weights": mask.astype(np.float32), "targets": ids[:, ::-1].copy(),
       "label": rng.integers(0, CLASSES, size=2).astype(np.int32), "valid": np.ones(2, bool)}
  return {k: jnp.asarray(v) for k, v in b.items()}


# Attentions whose weights do not depend on the queries (the random synthesizer's learned logits).
QUERY_FREE = {"synthesizer_random", "none"}


def _cases(tasks_for, slow=frozenset()):
  """Every registered attention with its tasks; the names in `slow` marked for the slow run."""
  out = []
  for name in registry.names():
    for task in tasks_for(name):
      marks = pytest.mark.slow if name in slow else ()
      out.append(pytest.param(name, task, id=f"{name}-{task}", marks=marks))
  return out


def _first_supported(name):  # fast: each attention once, as a decoder when it can be one
  return ["lm"] if supported(name, True) else ["mlm"]


def _all_supported(name):
  return [t for t in ("lm", "mlm", "classify") if supported(name, t == "lm")]


# The classifier differs from the masked LM only in its head (pooling, MLP), which no attention sees: the
# attentions reach it through the masked LM's bidirectional encoder, and these run it whole.
CLASSIFY = frozenset({"dense", "combiner_fixed"})


def _other_supported(name):  # the tasks after the first (test_every_attention_forward_backward runs that)
  return [t for t in _all_supported(name) if t not in _first_supported(name)
          and (t != "classify" or name in CLASSIFY)]


# The fast run keeps one or more of each family, the cheapest; these repeat a family covered fast (or are its
# most expensive members: logsparse, the joint mixture, routing) and run with -m slow. An attention registered
# later is not listed here, so it runs fast.
SLOW_FORWARD_BACKWARD = frozenset({
    "adaptive_span", "bigbird", "blockbert", "bp_transformer", "combiner_axial_horizontal",
    "combiner_axial_vertical", "combiner_fixed_select", "combiner_logsparse", "combiner_mixture",
    "combiner_mixture_joint", "combiner_routed", "compressive", "dense_xla", "longformer", "nsa",
    "nystromformer", "performer", "reformer", "routing", "sinkhorn", "sparse_axial", "sparse_logsparse",
    "synthesizer", "synthesizer_random", "transformer_xl", "yoso_c", "yoso_e", "yoso_sketch",
    "yoso_sketch_c"})


@pytest.mark.parametrize("name,task", _cases(_first_supported, SLOW_FORWARD_BACKWARD))
def test_every_attention_forward_backward(name, task):
  check_model(name, task)


@pytest.mark.slow
@pytest.mark.parametrize("name,task", _cases(_other_supported))
def test_every_attention_every_task(name, task):
  """With test_every_attention_forward_backward (each attention's first task, fast or slow): every task the
  attention supports, the classifier for the CLASSIFY names."""
  check_model(name, task)


def check_model(name, task):
  from models import metrics

  model = transformer.build_model(tiny_cfg(name), task=task, vocab_size=VOCAB, seq_len=LENGTH,
                                  num_classes=CLASSES)
  batch = batch_for(task, np.random.default_rng(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  j = LENGTH // 2  # decoders: changing token j must move no logit at positions <= j
  changed = dict(batch, inputs=batch["inputs"].at[:, j].set((batch["inputs"][:, j] + 1) % VOCAB))

  def loss_fn(params):
    m = nnx.merge(graphdef, params, rest, copy=True)
    logits = m(batch, deterministic=False)
    return metrics.loss_and_sums(task, logits, batch)[0], logits

  @jax.jit  # one compilation per case: gradients plus the two deterministic forwards of the causality check
  def run(params):
    value_grad = jax.value_and_grad(loss_fn, has_aux=True)(params)
    # Two copies with one rng state: sampled ops (YOSO's hashes) draw the same randomness for both inputs.
    fresh = [nnx.merge(graphdef, params, rest, copy=True) for _ in range(2)]
    return value_grad, fresh[0](batch, deterministic=True), fresh[1](changed, deterministic=True)

  ((loss, logits), grads), a, b = run(params)
  expected = (2, LENGTH, VOCAB) if task in ("lm", "mlm") else (2, CLASSES)
  assert logits.shape == expected and logits.dtype == jnp.float32
  assert np.isfinite(float(loss))
  leaves = jax.tree.leaves(grads)
  assert all(np.all(np.isfinite(g)) for g in leaves)
  # The attention's query projection receives gradient: the op is really in the computation graph.
  q_grad = grads["encoder"]["blocks"][0]["attention"]["query"]["kernel"][...]
  assert (float(jnp.abs(q_grad).sum()) > 0.0) != (name in QUERY_FREE)
  if task == "lm":  # causality through the whole decoder
    np.testing.assert_allclose(a[:, : j + 1], b[:, : j + 1], atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(a[:, j + 1:] - b[:, j + 1:]).max()) > 1e-6


def test_padding_contents_do_not_matter():
  """MEAN pooling + key masks: random tokens under mask=False change nothing."""
  c = tiny_cfg("combiner_fixed")
  c.classifier_pool = "MEAN"
  model = transformer.build_model(c, task="classify", vocab_size=VOCAB, seq_len=LENGTH, num_classes=CLASSES)
  batch = batch_for("classify", np.random.default_rng(1))
  other = batch["inputs"].at[1, LENGTH - 5:].set((batch["inputs"][1, LENGTH - 5:] + 3) % VOCAB)
  a = model(batch, deterministic=True)
  b = model(dict(batch, inputs=other), deterministic=True)
  np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_retrieval_dual_encoder_and_bf16():
  c = tiny_cfg("combiner_fixed")
  c.dtype = "bfloat16"
  model = transformer.build_model(c, task="retrieval", vocab_size=VOCAB, seq_len=LENGTH, num_classes=2)
  rng = np.random.default_rng(2)
  b = batch_for("classify", rng)
  batch = {"inputs1": b["inputs"], "mask1": b["mask"], "inputs2": b["inputs"][::-1], "mask2": b["mask"][::-1],
           "label": b["label"] % 2}
  out = model(batch, deterministic=True)
  assert out.shape == (2, 2) and out.dtype == jnp.float32 and np.all(np.isfinite(out))
  # Parameters stay float32 under the bf16 compute dtype.
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_parameters_carry_logical_axes():
  model = transformer.build_model(tiny_cfg("combiner_axial_rowmajor", deepsets=True, learned_span_key=True),
                                  task="lm", vocab_size=VOCAB, seq_len=LENGTH)
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  att = specs["encoder"]["blocks"][0]["attention"]

  def axes(v):
    return tuple(v.get_value())

  assert axes(att["query"]["kernel"]) == ("embed", "heads", "kv")
  assert axes(att["out"]["kernel"]) == ("heads", "kv", "embed")
  assert axes(specs["encoder"]["blocks"][0]["mlp"]["up"]["kernel"]) == ("embed", "mlp")
  assert axes(specs["encoder"]["embed"]["embedding"]) == ("vocab", "embed")
  assert axes(specs["head"]["kernel"]) == ("embed", "vocab")
  # DeepSets (separate q and k parameters) and the learned span key exist only when asked for.
  assert "pool_q" in att and "pool_k" in att and "span_key" in att


def test_deepsets_and_span_key_change_the_output():
  """The model-level Combiner options reach the op: the output differs from plain max pooling."""
  batch = batch_for("lm", np.random.default_rng(3))
  outs = []
  for fields in ({}, {"deepsets": True}, {"learned_span_key": True}):
    m = transformer.build_model(tiny_cfg("combiner_axial_rowmajor", **fields), task="lm", vocab_size=VOCAB,
                                seq_len=LENGTH)
    outs.append(m(batch, deterministic=True))
  assert float(jnp.abs(outs[0] - outs[1]).max()) > 1e-4
  assert float(jnp.abs(outs[0] - outs[2]).max()) > 1e-4


def test_unknown_attention_lists_valid_names():
  with pytest.raises(ValueError, match="valid names.*combiner_fixed"):
    transformer.build_model(tiny_cfg("no_such_attention"), task="lm", vocab_size=VOCAB, seq_len=LENGTH)


def test_option_for_wrong_module_is_an_error():
  with pytest.raises(ValueError, match="learned_span_key"):
    transformer.build_model(tiny_cfg("dense", learned_span_key=True), task="lm", vocab_size=VOCAB,
                            seq_len=LENGTH)
  with pytest.raises(ValueError, match="does not take parameter 'block_size'"):
    c = tiny_cfg("combiner_logsparse")
    c.attention.params.block_size = 4
    transformer.build_model(c, task="lm", vocab_size=VOCAB, seq_len=LENGTH)


@pytest.mark.slow  # ~25 s: float64 gradients of three remat settings without jit
def test_remat_gives_the_same_loss_and_gradients():
  """model.remat only changes what is kept for the backward; dropout rngs are threaded identically."""
  rng = np.random.default_rng(3)
  ids = jnp.asarray(rng.integers(0, VOCAB, size=(2, LENGTH)), jnp.int32)
  results = []
  with jax.enable_x64(True):
    for remat in transformer.REMAT:
      c = tiny_cfg("dense")
      c.num_layers, c.dtype, c.dropout_rate, c.remat = 2, "float64", 0.1, remat
      model = transformer.build_model(c, task="lm", vocab_size=VOCAB, seq_len=LENGTH)
      loss, grads = nnx.value_and_grad(lambda m: m({"inputs": ids}, deterministic=False).sum())(model)
      results.append((loss, jax.tree.leaves(nnx.state(grads))))
  (l0, g0), *others = results
  for l1, g1 in others:
    np.testing.assert_allclose(l1, l0, rtol=1e-12)
    for a, b in zip(g0, g1, strict=True):
      np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12)



@pytest.mark.slow
def test_remat_recomputes_the_block_in_the_compiled_backward():
  """model.remat reaches XLA: one jax.checkpoint optimisation barrier per block in the lowered program, and
  the compiled backward recomputes the block: "full" every matmul of it (q, k, v, out projections, q.k^T, the
  two MLP matmuls), "minimal" only the attention core's q.k^T; both recompute the softmax. Of the weighted sum
  of values only its non-finite flag column is needed again, which XLA computes as a reduction, not a dot.
  XLA:CPU's scheduler then hoists the recomputation next to the forward pass, so on CPU
  the compiled temp memory does not drop: no memory saving is asserted here;
  `model.attention.recompute` is the option whose memory saving holds on CPU (the test above)."""
  layers = 2
  batch = {"inputs": jnp.zeros((2, LENGTH), jnp.int32)}
  counts = {}
  for remat in transformer.REMAT:
    c = tiny_cfg("dense")
    c.num_layers, c.remat = layers, remat
    model = transformer.build_model(c, task="lm", vocab_size=VOCAB, seq_len=LENGTH)
    lowered, compiled = _compiled_value_and_grad(model, batch)
    hlo = compiled.as_text()
    counts[remat] = (lowered.as_text().count("optimization_barrier"), len(re.findall(r"\bdot\(", hlo)),
                     len(re.findall(r"\bexponential\(", hlo)))
  (barriers, dots, exps) = counts["none"]
  assert barriers == 0 and exps == layers, counts
  assert counts["minimal"] == (layers, dots + layers, 2 * layers), counts
  assert counts["full"] == (layers, dots + 7 * layers, 2 * layers), counts

@pytest.mark.parametrize("name,deepsets", [
    pytest.param("dense", None, marks=pytest.mark.slow),
    pytest.param("combiner_axial_vertical", True, marks=pytest.mark.slow)])
def test_attention_recompute_gives_the_same_loss_and_gradients(name, deepsets):
  """attention.recompute only changes what the backward keeps (DeepSets pool_q/pool_k still get gradients)."""
  rng = np.random.default_rng(4)
  ids = jnp.asarray(rng.integers(0, VOCAB, size=(2, LENGTH)), jnp.int32)
  mask = jnp.asarray(rng.random((2, LENGTH)) < 0.8)
  results = []
  with jax.enable_x64(True):
    for recompute in (False, True):
      c = tiny_cfg(name, recompute=recompute, deepsets=deepsets)
      c.dtype = "float64"
      model = transformer.build_model(c, task="mlm", vocab_size=VOCAB, seq_len=LENGTH)
      loss, grads = nnx.value_and_grad(
          lambda m: m({"inputs": ids, "mask": mask}, deterministic=True).sum())(model)
      results.append((loss, jax.tree.leaves(nnx.state(grads))))
  (l0, g0), (l1, g1) = results
  np.testing.assert_allclose(l1, l0, rtol=1e-12)
  assert len(g0) == len(g1)
  for a, b in zip(g0, g1, strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12)



def _compiled_value_and_grad(model, batch):
  """jax.jit(value_and_grad(sum of the logits)) over the parameters, lowered and compiled (deterministic)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    return nnx.merge(graphdef, params, rest, copy=True)(batch, deterministic=True).sum()

  lowered = jax.jit(jax.value_and_grad(loss)).lower(params)
  return lowered, lowered.compile()


def test_attention_recompute_lowers_the_compiled_temp_memory():
  """Without recompute the backward keeps every layer's [batch, heads, L, L] probabilities; with it only the
  layer being differentiated has them: XLA's compiled temp memory drops by about (layers - 1) of them."""
  length, layers, heads = 512, 4, 4
  ids = jnp.zeros((1, length), jnp.int32)
  temp = {}
  for recompute in (False, True):
    c = tiny_cfg("dense", recompute=recompute)
    c.num_layers, c.num_heads = layers, heads
    model = transformer.build_model(c, task="mlm", vocab_size=VOCAB, seq_len=length)
    temp[recompute] = _compiled_value_and_grad(model, {"inputs": ids})[1].memory_analysis().temp_size_in_bytes
  probabilities = heads * length * length * 4  # one layer's float32 [1, heads, L, L]
  assert temp[False] - temp[True] >= 0.9 * (layers - 1) * probabilities, temp
  assert temp[True] <= 0.6 * temp[False], temp

def test_attention_recompute_rejects_learned_functions():
  c = tiny_cfg("combiner_axial_rowmajor", recompute=True, learned_span_key=True)
  model = transformer.build_model(c, task="lm", vocab_size=VOCAB, seq_len=LENGTH)
  with pytest.raises(ValueError, match="recompute"):
    model({"inputs": jnp.zeros((1, LENGTH), jnp.int32)}, deterministic=True)


def test_unknown_remat_is_an_error():
  c = tiny_cfg("dense")
  c.remat = "layer"
  with pytest.raises(ValueError, match="model.remat"):
    transformer.build_model(c, task="lm", vocab_size=VOCAB, seq_len=LENGTH)
