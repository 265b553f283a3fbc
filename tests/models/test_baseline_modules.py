"""The baselines' Flax modules: Performer redraws its random features on schedule, BigBird draws one
pattern per layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _module(name, layer=None, **fields):
  from flax import nnx

  from configs import base
  from models import registry

  cfg = base.attention_config(name)
  for key, value in fields.items():
    cfg[key] = value
  return registry.build(cfg, layer=layer, features=8, num_heads=2, head_dim=4, causal=True,
                        dtype=jnp.float32, rngs=nnx.Rngs(0))


def test_performer_module_redraws_its_features_on_schedule():
  m = _module("performer", redraw_every=2)
  x = jax.random.normal(jax.random.key(0), (1, 5, 8))
  first = np.asarray(m.random_features[...])
  assert first.shape == (256, 4)
  m(x, None, deterministic=True)  # evaluation never redraws
  assert np.array_equal(np.asarray(m.random_features[...]), first)
  m(x, None, deterministic=False)  # step 0: keeps the initial draw
  m(x, None, deterministic=False)  # step 1
  assert np.array_equal(np.asarray(m.random_features[...]), first)
  m(x, None, deterministic=False)  # step 2: redrawn
  assert not np.array_equal(np.asarray(m.random_features[...]), first)
  with pytest.raises(ValueError, match="redraw_every"):
    _module("performer", redraw_every=-1)


def test_bigbird_module_draws_one_pattern_per_layer():
  assert _module("bigbird", layer=3).plan_params["seed"] == 3
  assert _module("bigbird", layer=None).plan_params["seed"] == 0
