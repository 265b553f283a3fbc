"""The NSA module: its compression MLPs and gates are parameters with logical axes that reach the op (the
output equals the op called with them), its plan is fixed at the model's length, it needs a causal model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_baselines.nsa import nsa


def _module(causal=True, seq_len=16, implementation="auto", **params):
  from configs import base
  from models import registry

  cfg = base.attention_config("nsa")
  cfg.implementation = implementation
  for key, value in params.items():
    cfg.params[key] = value
  return registry.build(cfg, seq_len=seq_len, features=8, num_heads=2, head_dim=4, causal=causal,
                        dtype=jnp.float32, rngs=nnx.Rngs(0))


def test_module_output_is_the_op_with_its_weights_and_gates():
  m = _module()
  assert m.plan_params["compress_block"] == 2 and m.plan_params["select_block"] == 4  # auto at L = 16
  assert m.cmp_key_w1[...].shape == (2, 2 * 4, 4) and m.cmp_value_pos[...].shape == (2, 2, 4)
  x = jax.random.normal(jax.random.key(0), (2, 11, 8))  # shorter than seq_len: the plan stays
  mask = jnp.arange(11)[None, :] < jnp.array([[11], [8]])

  @nnx.jit
  def both(m, x, mask):
    q, k, v = m.project(x)
    gates = jax.nn.sigmoid(m.gate(x))
    want = m.out(nsa(q, k, v, causal=True, mask=mask, gates=gates, **m.plan_params, **m.weights()))
    return m(x, mask, deterministic=True), want

  got, want = both(m, x, mask)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  specs = nnx.get_partition_spec(nnx.state(m, nnx.Param))
  assert tuple(specs["cmp_key_w1"].get_value()) == ("heads", None, None)
  assert tuple(specs["gate"]["kernel"].get_value()) == ("embed", "heads", None)


def test_configured_implementation_reaches_the_op():
  """config.model.attention.implementation picks NSA's kernel (traced only: "pallas" is a pallas_call, "xla"
  and "auto" on this CPU are not), so the training kernel check's "xla" fallback holds for NSA models."""
  x = jnp.zeros((1, 16, 8))

  def kernels(implementation):
    m = _module(implementation=implementation)
    return str(jax.make_jaxpr(lambda x: m(x, None, deterministic=True))(x)).count("pallas_call")

  assert kernels("pallas") > 0 and kernels("xla") == 0 and kernels("auto") == 0


def test_learned_parts_receive_gradient():
  m = _module()
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)
  x = jax.random.normal(jax.random.key(1), (1, 16, 8))

  def loss(params):
    return jnp.sum(nnx.merge(graphdef, params, rest)(x, None, deterministic=True) ** 2)

  grads = jax.jit(jax.grad(loss))(params)
  for name in ("cmp_key_w1", "cmp_value_w2", "cmp_key_pos"):
    assert float(jnp.abs(grads[name][...]).sum()) > 0, name
  assert float(jnp.abs(grads["gate"]["kernel"][...]).sum()) > 0


def test_needs_a_causal_model():
  with pytest.raises(ValueError, match="causal=False"):
    _module(causal=False)
