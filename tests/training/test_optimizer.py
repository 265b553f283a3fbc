"""training/optimizer.py: every `config.optimizer.name` builds an optax optimizer that descends a quadratic
under its warm-up schedule and clipping, and an unknown name is one clear error."""

import jax
import jax.numpy as jnp
import pytest

from configs import base
from training import optimizer


@pytest.mark.parametrize("name", ["adam", "adamw", "adafactor", "adagrad"])
def test_each_optimizer_descends(name):
  c = base.base_config()
  c.optimizer.name, c.optimizer.lr, c.optimizer.warmup_steps, c.train.num_steps = name, 0.1, 2, 50
  tx, schedule = optimizer.make_optimizer(c)
  params = {"w": jnp.full((4, 4), 3.0)}
  loss = lambda p: jnp.sum(p["w"] ** 2)  # noqa: E731
  state = tx.init(params)
  for _ in range(20):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
  assert float(loss(params)) < 0.9 * 16 * 9 and float(schedule(0)) == 0.0  # from 144


def test_unknown_optimizer_names_the_choices():
  c = base.base_config()
  c.optimizer.name = "sgd"
  with pytest.raises(ValueError, match=r"config.optimizer.name must be one of \['adafactor', 'adagrad'"):
    optimizer.make_optimizer(c)
