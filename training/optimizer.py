"""The learning-rate schedule and the optax optimizer named by `config.optimizer`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax


def make_schedule(config: ml_collections.ConfigDict) -> Callable[[Any], Any]:
  o, steps = config.optimizer, int(config.train.num_steps)
  lr, warmup = float(o.lr), int(o.warmup_steps)
  if o.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1),
                                              end_value=lr * float(o.end_lr_ratio))
  if o.schedule == "rsqrt":
    def rsqrt(step):
      step = jnp.asarray(step, jnp.float32) + 1.0
      w = float(max(warmup, 1))
      return lr * jnp.minimum(1.0, step / w) * jax.lax.rsqrt(jnp.maximum(step, w) / w)
    return rsqrt
  if o.schedule == "constant":
    return optax.join_schedules([optax.linear_schedule(0.0, lr, max(warmup, 1)), optax.constant_schedule(lr)],
                                [max(warmup, 1)])
  raise ValueError("config.optimizer.schedule must be one of ['constant', 'cosine', 'rsqrt'], "
                   f"got {o.schedule!r}")


def make_optimizer(config: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, Callable]:
  o = config.optimizer
  schedule = make_schedule(config)
  if o.name == "adam":
    tx = optax.adam(schedule, b1=o.b1, b2=o.b2, eps=o.eps)
  elif o.name == "adamw":
    tx = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
  elif o.name == "adafactor":
    tx = optax.adafactor(schedule)
  elif o.name == "adagrad":  # the Adaptive Span paper's (no momentum, accumulators from 0)
    tx = optax.adagrad(schedule, initial_accumulator_value=0.0, eps=o.eps)
  else:
    raise ValueError(f"config.optimizer.name must be one of ['adafactor', 'adagrad', 'adam', 'adamw'], "
                     f"got {o.name!r}")
  if o.clip_norm and o.clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), tx)
  return tx, schedule
