"""The train and eval steps: pure functions of the model state and a batch, as in Flax's examples.

training/experiment.py jits them with their shardings over the mesh and donates the state; what they close
over is the `StepContext` (the model's graph, optimizer, task and seeds), fixed for a run.

- Randomness: step s reseeds every "dropout" and "attention" stream of the model from
  `fold_in(key(seed), s)`, so steps differ and a resumed run repeats them exactly; evaluation reseeds from
  `key(eval_seed)`, so it is deterministic even for random attention.
- Loss: the task's loss, plus `aux_loss_weight` times the modules' sown `aux_loss` values (routing's
  commitment loss), plus their sown `loss_term` values as they are (penalties a module weighs itself).
- A non-finite step is never applied: the state it returns is its input, and its `finite` output tells the
  loop to stop.
- Segment recurrence: the memory goes in last and comes out last (training/recurrence.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models import metrics as metrics_lib
from models import stacked
from training import recurrence

REST = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))  # non-gradient module state carried through the step
METRICS = ("loss", "aux_loss", "grad_norm", "nll_sum", "weight_sum", "correct_sum")  # summed over a window


@dataclasses.dataclass(frozen=True)
class StepContext:
  """What the steps close over: fixed for a run, never traced."""

  graphdef: Any  # the model's nnx.GraphDef
  task: str
  tx: optax.GradientTransformation
  schedule: Callable[[Any], Any]
  aux_loss_weight: float
  seed: int  # of the training steps' randomness
  eval_seed: int  # of every evaluation's
  compute_shardings: tuple[Any, Any] | None  # (params, rest) gathered for compute under FSDP, else None


def merged_model(ctx: StepContext, params: Any, rng: Any, rest: Any, key: jax.Array) -> nnx.Module:
  """The model with `params`, `rest` and fresh random streams from `key`, new variables in this trace. Under
  FSDP the parameters are gathered over "fsdp" and "seq" for compute (the partitioner all-gathers each weight
  for its uses and reduce-scatters its gradient), which keeps activations split over the batch."""
  if ctx.compute_shardings is not None:
    params = jax.lax.with_sharding_constraint(params, ctx.compute_shardings[0])
    rest = jax.lax.with_sharding_constraint(rest, ctx.compute_shardings[1])
  model = nnx.merge(ctx.graphdef, params, rng, rest, copy=True)
  k_drop, k_att = jax.random.split(key)
  stacked.reseed(model, dropout=k_drop, attention=k_att)
  return model


def sown_losses(model: nnx.Module) -> tuple[jax.Array, jax.Array]:
  """(sum of the sown `aux_loss` values, sum of the sown `loss_term` values), float32 scalars."""
  sown = nnx.pop(model, nnx.Intermediate)
  leaves = [(jax.tree_util.keystr(path), v) for path, v in jax.tree_util.tree_leaves_with_path(sown)]

  def total(name: str) -> jax.Array:
    return sum((jnp.sum(jnp.asarray(v)) for path, v in leaves if name in path), jnp.zeros((), jnp.float32))

  return total("aux_loss"), total("loss_term")


def train_step(ctx: StepContext, params: Any, rest: Any, opt_state: Any, rng: Any, step: jax.Array,
               batch: dict[str, jax.Array], memory: Any = None) -> tuple[Any, ...]:
  """One optimizer step -> (params, rest, opt_state, metrics[, memory]); metrics are device scalars: loss
  (the total), task_loss, aux_loss, grad_norm, lr, finite and the task's sums."""
  key = jax.random.fold_in(jax.random.key(ctx.seed), step)
  if memory is not None:
    memory = recurrence.before_step(memory, batch)

  def loss_fn(params):
    model = merged_model(ctx, params, rng, rest, key)
    if memory is None:
      logits, new_memory = model(batch, deterministic=False), None
    else:
      logits, new_memory = model(batch, deterministic=False, memory=memory)
    loss, sums = metrics_lib.loss_and_sums(ctx.task, logits, batch)
    aux, terms = sown_losses(model)
    total = loss + ctx.aux_loss_weight * aux + terms
    return total, (loss, aux, sums, nnx.state(model, REST), new_memory)

  (total, (loss, aux, sums, new_rest, new_memory)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
  updates, new_opt = ctx.tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)

  def keep(new, old):  # a non-finite step is never applied: the state stays the last good one
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)

  out = {"loss": total, "task_loss": loss, "aux_loss": aux, "grad_norm": grad_norm, "lr": ctx.schedule(step),
         "finite": finite, **sums}
  new = keep(new_params, params), keep(new_rest, rest), keep(new_opt, opt_state), out
  return new if memory is None else new + (keep(new_memory, memory),)


def eval_step(ctx: StepContext, params: Any, rest: Any, rng: Any, batch: dict[str, jax.Array],
              memory: Any = None) -> Any:
  """The task's metric sums over one batch and its example count -> sums (, memory with recurrence)."""
  model = merged_model(ctx, params, rng, rest, jax.random.key(ctx.eval_seed))
  if memory is None:
    logits = model(batch, deterministic=True)
  else:
    logits, memory = model(batch, deterministic=True, memory=recurrence.before_step(memory, batch))
  _, sums = metrics_lib.loss_and_sums(ctx.task, logits, batch)
  first = next(iter(batch.values()))
  valid = batch["valid"] if "valid" in batch else jnp.ones(first.shape[:1], bool)  # [batch]
  sums = {**sums, "examples": jnp.sum(valid.astype(jnp.int32))}
  return sums if memory is None else (sums, memory)
