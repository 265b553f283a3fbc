r"""Trains an experiment config: jit over a named device mesh, orbax checkpoints with exact resume.

    python train.py                            # the embedded default (configs/default.py), ~2 min CPU
    python train.py --config configs/cifar10.py:attention=combiner_axial_vertical --workdir workdirs/c10 \
        --config.optimizer.lr=3e-4 --gin_bindings "attention.deepsets = True"

- Mesh: `jax.make_mesh((data, seq, model), ("data", "seq", "model"))` (sizes from `config.mesh`, -1 = the
  rest; seq > 1 splits each sequence over devices in the attention ops that support it); parameters
  are created already sharded by the logical-axis rule table `config.sharding_rules`; the train step is
  `jax.jit` with in/out shardings and donated state; batches are sharded over "data".
- State: parameters (`nnx.Param`, the only differentiated variables), the other module state (e.g. routing
  centroids, updated by the module in the forward pass), optax state and the step. Per-step randomness comes
  from `fold_in(key(seed), step)`, reseeding the modules' "dropout"/"attention" streams, so resume is exact.
- Checkpoints: orbax `CheckpointManager` in `<workdir>/checkpoints` (every `train.checkpoint_every` steps, the
  last `train.keep_checkpoints` kept, atomic, saved before the evaluation of the same step), with the grain
  data-iterator state. Rerunning with the same workdir resumes from the newest checkpoint that restores with
  finite values, after checking the config against the run's (`resume.py`). SIGTERM (preemption) saves a
  checkpoint and exits 0. A NaN/Inf loss or gradient stops the run with a clear message; the last good
  checkpoint stays (the bad step is never applied nor saved). A non-finite final evaluation exits non-zero.
- Output: a tqdm bar (step, loss, steps/s, ETA), metric lines on stdout, TensorBoard summaries in
  `<workdir>/tensorboard` (tensorboardX), the resolved config in `<workdir>/config.json`, final eval metrics
  in `<workdir>/metrics.json`. The workdir may be `gs://` (files: runtime/paths.py; arrays: orbax).
- Processes: `--multihost` on Cloud TPU pods; elsewhere `--coordinator_address --num_processes --process_id`
  (runtime/distributed.py). Each process feeds its own shard of every global batch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import resume
from combiner import seq_parallel
from configs import base as config_base
from core import sharding
from models import metrics as metrics_lib
from models import transformer
from runtime import distributed, paths

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")
REST = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))  # non-gradient module state carried through the step


class TrainingDiverged(RuntimeError):
  """Raised when the loss or the gradients are not finite."""


# -----------------------------------------------------------------------------------------------------------
# Data


def dataset_info(config: ml_collections.ConfigDict) -> Any:
  import data

  return data.dataset_info(config)


def create_dataset(config: ml_collections.ConfigDict, split: str, *, batch_size: int, seed: int,
                   **kw: Any) -> Any:
  import data

  return data.create_dataset(config, split, batch_size=batch_size, seed=seed, **kw)


# -----------------------------------------------------------------------------------------------------------
# Mesh and sharding


def make_mesh(config: ml_collections.ConfigDict, devices: list | None = None) -> jax.sharding.Mesh:
  """Mesh (data, seq, model) from `config.mesh`; at most one size may be -1 (the devices the others leave)."""
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  names = ("data", "seq", "model")
  sizes = [int(config.mesh.get(name, 1)) for name in names]
  if sizes.count(-1) > 1:
    raise ValueError("config.mesh: at most one of data/seq/model may be -1")
  if -1 in sizes:
    sizes[sizes.index(-1)] = n // max(1, -math.prod(sizes))
  if min(sizes) < 1 or math.prod(sizes) != n:
    given = {name: config.mesh.get(name, 1) for name in names}
    raise ValueError(f"config.mesh {given} does not fit the {n} devices")
  auto = (jax.sharding.AxisType.Auto,) * 3
  return jax.make_mesh(tuple(sizes), names, axis_types=auto, devices=devices)


def logical_to_mesh(spec: Any, shape: tuple[int, ...], rules: dict[str, Any], mesh: jax.sharding.Mesh) -> P:
  """Maps logical axis names to mesh axes; a dimension the mesh axis does not divide stays replicated."""
  names = tuple(spec) if spec is not None else ()
  out = []
  used = set()
  for dim, name in zip(shape, names + (None,) * (len(shape) - len(names)), strict=True):
    axis = rules.get(name) if name is not None else None
    if axis is not None and (axis in used or dim % mesh.shape[axis] != 0):
      axis = None
    if axis is not None:
      used.add(axis)
    out.append(axis)
  return P(*out)


def state_shardings(abstract_state: Any, rules: dict[str, Any], mesh: jax.sharding.Mesh) -> Any:
  """NamedShardings for an nnx.State from each variable's `out_sharding` logical axes (default replicated)."""

  def one(x):
    axes = x.get_metadata().get("out_sharding") if isinstance(x, nnx.Variable) else None
    value = x.get_value() if isinstance(x, nnx.Variable) else x
    sharding = NamedSharding(mesh, logical_to_mesh(axes, tuple(value.shape), rules, mesh))
    return x.replace(sharding) if isinstance(x, nnx.Variable) else sharding

  return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


# -----------------------------------------------------------------------------------------------------------
# Optimizer


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
  else:
    raise ValueError(f"config.optimizer.name must be one of ['adafactor', 'adam', 'adamw'], got {o.name!r}")
  if o.clip_norm and o.clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), tx)
  return tx, schedule


# -----------------------------------------------------------------------------------------------------------
# The experiment: model, sharded state, jitted steps


@dataclasses.dataclass
class TrainState:
  params: Any  # nnx.State of nnx.Param
  rest: Any  # nnx.State of the other module variables (not RngState)
  opt_state: Any
  step: int


class Experiment:
  """Everything that does not depend on the workdir: mesh, model definition, shardings, jitted steps."""

  def __init__(self, config: ml_collections.ConfigDict, *, devices: list | None = None, info: Any = None):
    """info: the dataset's `DatasetInfo` (default: `data.dataset_info(config)`)."""
    self.config = config
    self.info = dataset_info(config) if info is None else info
    self.task = self.info.task
    self.mesh = make_mesh(config, devices)
    # Attention ops split the sequence over the "seq" axis (combiner.seq_parallel) when it is > 1.
    seq_parallel.set_default_mesh(self.mesh if self.mesh.shape["seq"] > 1 else None)
    self.rules = {name: axis for name, axis in config.sharding_rules}
    model_cfg = config.model
    if self.info.image_shape is not None and model_cfg.get("image_shape") is None:
      model_cfg = ml_collections.ConfigDict(model_cfg.to_dict())
      model_cfg.image_shape = tuple(self.info.image_shape)
    self.model_cfg = model_cfg

    def build():
      return transformer.from_info(model_cfg, self.info, seed=int(config.seed))

    self._build = build
    abstract = nnx.eval_shape(build)
    self.graphdef, abs_params, abs_rng, abs_rest = nnx.split(abstract, nnx.Param, nnx.RngState, ...)
    self.empty_rest = abs_rest if not jax.tree.leaves(abs_rest) else None
    self.param_shardings = state_shardings(abs_params, self.rules, self.mesh)
    self.rest_shardings = state_shardings(abs_rest, self.rules, self.mesh)
    self.replicated = NamedSharding(self.mesh, P())
    self.rng_shardings = jax.tree.map(lambda _: self.replicated, abs_rng)
    self.tx, self.schedule = make_optimizer(config)
    abs_opt = jax.eval_shape(self.tx.init, abs_params)
    self.opt_shardings = self._opt_shardings(abs_opt, abs_params)
    self.batch_sharding = NamedSharding(self.mesh, P("data"))
    self.data_size = self.mesh.shape["data"]
    self._train_step = None
    self._eval_step = None

  def _opt_shardings(self, abs_opt: Any, abs_params: Any) -> Any:
    """Optimizer moments shaped like their parameter share its sharding; everything else is replicated."""
    try:
      return optax.tree_map_params(
          self.tx, lambda leaf, sh, ref: sh if tuple(leaf.shape) == tuple(ref.shape) else self.replicated,
          abs_opt, self.param_shardings, abs_params, transform_non_params=lambda _: self.replicated,
          is_leaf=lambda x: isinstance(x, nnx.Variable))
    except (ValueError, TypeError):  # a state optax cannot map: replicate (correct, less memory-efficient)
      return jax.tree.map(lambda _: self.replicated, abs_opt)

  # -- state -------------------------------------------------------------------------------------------------

  def init_state(self) -> TrainState:
    """Fresh parameters created directly with their shardings (jit with out_shardings), and optimizer
    state."""

    def init():
      model = self._build()
      _, params, rng, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
      return params, rng, rest

    params, rng, rest = jax.jit(init, out_shardings=(self.param_shardings, self.rng_shardings,
                                                     self.rest_shardings))()
    self.rng_state = rng
    opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
    return TrainState(params, rest, opt_state, 0)

  def init_rng_state(self) -> None:
    """The model's rng-stream state alone (the checkpoint holds parameters, not streams), sharded."""

    def init():
      return nnx.split(self._build(), nnx.Param, nnx.RngState, ...)[2]

    self.rng_state = jax.jit(init, out_shardings=self.rng_shardings)()

  def abstract_state(self) -> dict[str, Any]:
    """The checkpoint target: shapes, dtypes and shardings of every saved array."""

    def with_sharding(abs_tree, shardings):
      return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_tree,
                          shardings)

    def init():
      model = self._build()
      _, params, _, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
      return params, rest

    abs_params, abs_rest = jax.eval_shape(init)
    abs_opt = jax.eval_shape(self.tx.init, abs_params)
    return {"params": with_sharding(abs_params, self.param_shardings),
            "rest": with_sharding(abs_rest, self.rest_shardings),
            "opt_state": with_sharding(abs_opt, self.opt_shardings)}

  # -- batches -----------------------------------------------------------------------------------------------

  def global_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Host-local NumPy batch -> global jax.Arrays sharded over the "data" mesh axis."""
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
            for k, v in batch.items()}

  # -- steps -------------------------------------------------------------------------------------------------

  def _model(self, params: Any, rng: Any, rest: Any, key: jax.Array) -> nnx.Module:
    model = nnx.merge(self.graphdef, params, rng, rest, copy=True)  # fresh variables in this trace
    k_drop, k_att = jax.random.split(key)
    nnx.reseed(model, dropout=k_drop, attention=k_att)
    return model

  def _build_train_step(self) -> Callable:
    task, aux_w = self.task, float(self.config.aux_loss_weight)
    base_key = jax.random.key(int(self.config.seed))
    tx, schedule = self.tx, self.schedule

    def train_step(params, rest, opt_state, rng, step, batch):
      key = jax.random.fold_in(base_key, step)

      def loss_fn(params):
        model = self._model(params, rng, rest, key)
        logits = model(batch, deterministic=False)
        loss, sums = metrics_lib.loss_and_sums(task, logits, batch)
        sown = nnx.pop(model, nnx.Intermediate)
        aux = sum((jnp.sum(jnp.asarray(v)) for path, v in jax.tree_util.tree_leaves_with_path(sown)
                   if "aux_loss" in jax.tree_util.keystr(path)), jnp.zeros((), jnp.float32))
        total = loss + aux_w * aux
        new_rest = nnx.state(model, REST)
        return total, (loss, aux, sums, new_rest)

      (total, (loss, aux, sums, new_rest)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      grad_norm = optax.global_norm(grads)
      finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
      updates, new_opt = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      # A non-finite step is never applied: the host stops on `finite` and the state stays the last good one.
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
      out = {"loss": total, "task_loss": loss, "aux_loss": aux, "grad_norm": grad_norm, "lr": schedule(step),
             "finite": finite, **sums}
      return keep(new_params, params), keep(new_rest, rest), keep(new_opt, opt_state), out

    batch_sh = self.batch_sharding
    # Traced with the mesh in JAX's context: attention ops run on each device's batch rows and heads.
    return jax.jit(
        sharding.traced_in(self.mesh, train_step),
        in_shardings=(self.param_shardings, self.rest_shardings, self.opt_shardings, self.rng_shardings,
                      self.replicated, batch_sh),
        out_shardings=(self.param_shardings, self.rest_shardings, self.opt_shardings, self.replicated),
        donate_argnums=(0, 1, 2))

  def jitted_train_step(self) -> Callable:
    """The jitted, donated step (params, rest, opt_state, rng, step, batch) -> (params, rest, opt_state, out),
    built once; `scripts.compile_tpu` lowers it ahead of time."""
    if self._train_step is None:
      self._train_step = self._build_train_step()
    return self._train_step

  def abstract_rng_state(self) -> Any:
    """Shapes, dtypes and shardings of the rng-stream state (the step's `rng` argument), nothing allocated."""
    abs_rng = jax.eval_shape(lambda: nnx.split(self._build(), nnx.Param, nnx.RngState, ...)[2])
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_rng,
                        self.rng_shardings)

  def train_step(self, state: TrainState, batch: dict[str, np.ndarray]) -> tuple[TrainState, dict[str, Any]]:
    step = self.jitted_train_step()
    params, rest, opt, out = step(state.params, state.rest, state.opt_state, self.rng_state,
                                  jnp.asarray(state.step, jnp.int32), self.global_batch(batch))
    return TrainState(params, rest, opt, state.step + 1), out

  def _build_eval_step(self) -> Callable:
    task = self.task
    eval_key = jax.random.key(int(self.config.eval_seed))

    def eval_step(params, rest, rng, batch):
      model = self._model(params, rng, rest, eval_key)  # fixed seed: evaluation is deterministic
      logits = model(batch, deterministic=True)
      _, sums = metrics_lib.loss_and_sums(task, logits, batch)
      first = next(iter(batch.values()))
      valid = batch["valid"] if "valid" in batch else jnp.ones(first.shape[:1], bool)  # [batch]
      return {**sums, "examples": jnp.sum(valid.astype(jnp.int32))}

    return jax.jit(sharding.traced_in(self.mesh, eval_step),
                   in_shardings=(self.param_shardings, self.rest_shardings, self.rng_shardings,
                                 self.batch_sharding), out_shardings=self.replicated)

  def evaluate(self, state: TrainState, split: str | None = None, max_batches: int | None = None) -> dict:
    """Metrics over `split` (default config.eval_split), at most `max_batches` batches (-1/None = all)."""
    if self._eval_step is None:
      self._eval_step = self._build_eval_step()
    split = split or self.config.eval_split
    if max_batches is None:
      max_batches = int(self.config.train.eval_batches)
    bs = self.per_host(int(self.config.train.eval_batch_size))
    loader = create_dataset(self.config, split, batch_size=bs, seed=int(self.config.seed), shuffle=False,
                            num_epochs=1)
    totals: dict[str, float] = {}
    n = 0
    for batch in loader:
      if 0 <= max_batches <= n:
        break
      sums = jax.device_get(self._eval_step(state.params, state.rest, self.rng_state,
                                            self.global_batch(batch)))
      for k, v in sums.items():
        totals[k] = totals.get(k, 0.0) + float(v)
      n += 1
    if n == 0:
      raise ValueError(f"split {split!r} of {self.config.data.name!r} produced no batches")
    examples = int(totals.pop("examples"))
    out = metrics_lib.summarize(self.task, totals)
    out["num_batches"] = n
    out["num_examples"] = examples
    out["whole_split"] = max_batches < 0 or n < max_batches
    return out

  def per_host(self, global_batch: int) -> int:
    if global_batch % self.data_size:
      raise ValueError(f"batch size {global_batch} is not divisible by the data-parallel mesh size "
                       f"{self.data_size}")
    if global_batch % jax.process_count():
      raise ValueError(f"batch size {global_batch} is not divisible by the {jax.process_count()} hosts")
    return global_batch // jax.process_count()


# -----------------------------------------------------------------------------------------------------------
# Checkpoints


def checkpoint_manager(workdir: str, config: ml_collections.ConfigDict, *, read_only: bool = False) -> Any:
  import orbax.checkpoint as ocp

  options = ocp.CheckpointManagerOptions(max_to_keep=int(config.train.keep_checkpoints), create=not read_only,
                                         read_only=read_only, enable_async_checkpointing=False)
  return ocp.CheckpointManager(paths.path(workdir) / "checkpoints", options=options,
                               item_names=("state", "data", "meta"))


def _state_tree(state: TrainState) -> dict[str, Any]:
  tree = {"params": state.params, "opt_state": state.opt_state}
  if jax.tree.leaves(state.rest):  # orbax refuses empty subtrees
    tree["rest"] = state.rest
  return tree


def save_checkpoint(mgr: Any, state: TrainState, data_iter: Any | None) -> None:
  import grain
  import orbax.checkpoint as ocp

  items = {"state": ocp.args.StandardSave(_state_tree(state)),
           "meta": ocp.args.JsonSave({"step": state.step})}
  if data_iter is not None:
    items["data"] = grain.checkpoint.CheckpointSave(data_iter)
  mgr.save(state.step, args=ocp.args.Composite(**items), force=True)
  mgr.wait_until_finished()


def restore_checkpoint(mgr: Any, exp: Experiment, data_iter: Any | None,
                       step: int | None = None) -> TrainState:
  """Restores `step` (default the latest) into a sharded TrainState and, when given, the data iterator.

  Raises resume.UnrestorableCheckpoint naming the step directory when its files do not restore or the restored
  parameters / optimizer state are not finite.
  """
  import grain
  import orbax.checkpoint as ocp

  step = mgr.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {mgr.directory}")
  target = exp.abstract_state()
  if not jax.tree.leaves(target["rest"]):
    del target["rest"]
  items = {"state": ocp.args.StandardRestore(target), "meta": ocp.args.JsonRestore()}
  if data_iter is not None:
    from data import pipeline  # a state of the other input engine: a clear error instead of grain's

    pipeline.check_iterator_checkpoint(paths.join(mgr.directory, str(step)), data_iter, exp.config)
    items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
  step_dir = paths.join(mgr.directory, str(step))
  try:
    restored = mgr.restore(step, args=ocp.args.Composite(**items))
    tree = restored["state"]
    resume.check_finite(tree["params"], "parameters")
    resume.check_finite(tree["opt_state"], "optimizer state")
    restored_step = int(restored["meta"]["step"])
  except Exception as e:  # missing or damaged files, a corrupt data-iterator state, non-finite values
    raise resume.UnrestorableCheckpoint(f"checkpoint {step_dir} does not restore: {type(e).__name__}: "
                                        f"{resume.short(e)}") from e
  if not hasattr(exp, "rng_state"):
    exp.init_rng_state()
  rest = tree["rest"] if "rest" in tree else exp.empty_rest
  return TrainState(tree["params"], rest, tree["opt_state"], restored_step)


# -----------------------------------------------------------------------------------------------------------
# The training loop


class _Preemption:
  """SIGTERM sets a flag; the loop saves a checkpoint at the next step boundary and exits cleanly."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread (e.g. some test runners): no handler, nothing to restore
      self._previous = None
    return self

  def _handle(self, signum, frame):
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _say(bar: Any, line: str) -> None:
  """A metrics line on stdout that does not break the progress bar, flushed (stdout is often a pipe)."""
  bar.write(line, file=sys.stdout)
  sys.stdout.flush()


def _fingerprint(batch: dict[str, np.ndarray]) -> str:
  import hashlib

  h = hashlib.sha1()
  for k in sorted(batch):
    h.update(k.encode())
    h.update(np.ascontiguousarray(batch[k]).tobytes())
  return h.hexdigest()[:16]


def summary_writer(logdir: str) -> Any:
  """A tensorboardX writer for a local or `gs://` logdir (runtime/paths.py)."""
  return paths.summary_writer(logdir)


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes `<workdir>/config.json` (train_and_evaluate writes it through the checks of `resume`)."""
  resume.write_json(paths.join(workdir, "config.json"), resume.config_dict(config))


def load_config(workdir: str, step: int | None = None) -> ml_collections.ConfigDict:
  """The config the run in `workdir` trained checkpoint `step` with (default: its latest config)."""
  d = resume.saved_config_dict(paths.path(workdir), step)
  if d is None:
    raise FileNotFoundError(f"no config.json in {workdir}: is it a train.py workdir?")
  c = ml_collections.ConfigDict(d)
  if c.model.get("image_shape") is not None:
    c.model.image_shape = tuple(c.model.image_shape)
  c.sharding_rules = tuple(tuple(r) for r in c.sharding_rules)
  with c.model.attention.unlocked():
    c.model.attention.params = ml_collections.ConfigDict(c.model.attention.get("params") or {},
                                                         type_safe=False)
  return c


class NonFiniteEvaluation(RuntimeError):
  """Raised when the final evaluation is not finite (its metrics are written, null for the bad values)."""


def restore_or_init(mgr: Any, exp: Experiment, data_iter: Any, *, set_aside: bool) -> TrainState:
  """The newest checkpoint that restores (broken newer steps are reported and, with `set_aside`, moved out of
  the way), or a fresh state when there is none."""
  steps = list(mgr.all_steps())
  if not steps:
    return exp.init_state()
  move = None
  if set_aside and jax.process_index() == 0:
    move = lambda step: resume.move_aside(mgr.directory, step)  # noqa: E731
  state = resume.restore_newest(steps, lambda step: restore_checkpoint(mgr, exp, data_iter, step),
                                mgr.directory, say=lambda line: print(line, flush=True), set_aside=move)
  mgr.reload()
  print(f"resumed from {mgr.directory} at step {state.step}", flush=True)
  return state


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, devices: list | None = None,
                       stop_after: int | None = None, batch_log: list | None = None,
                       progress: bool = True, allow_config_change: bool = False) -> dict[str, Any]:
  """Trains to `config.train.num_steps` (resuming from `workdir`), evaluates, and returns a dict with always
  the same keys: step, start_step, preempted (stopped early with a checkpoint: SIGTERM or `stop_after`),
  metrics (the final evaluation, as written to metrics.json; empty when preempted), state and experiment.

  stop_after: leave after this many steps of this process, saving a checkpoint (a planned preemption).
  batch_log: if a list, receives (step, fingerprint of the host batch) per step (tests check data order).
  allow_config_change: continue a run whose model/data config differs (the change is recorded in the workdir).
  """
  import tqdm

  config_base.validate(config)
  workdir = os.fspath(paths.path(workdir))  # local (made absolute) or gs://
  # Before anything is written: a workdir of another run, or a different experiment, is refused.
  config_diff = resume.check_workdir(workdir, config, allow_change=allow_config_change)
  paths.makedirs(workdir)
  is_main = jax.process_index() == 0
  if is_main and not config_diff:
    resume.record_config(workdir, config, {}, 0)  # a new run's config.json, first of all its files
  exp = Experiment(config, devices=devices)
  num_steps = int(config.train.num_steps)
  loader = create_dataset(config, "train", batch_size=exp.per_host(int(config.train.batch_size)),
                          seed=int(config.seed))
  data_iter = iter(loader)
  mgr = checkpoint_manager(workdir, config)
  exp.init_rng_state()
  state = restore_or_init(mgr, exp, data_iter, set_aside=True)
  if is_main and config_diff:
    resume.record_config(workdir, config, config_diff, state.step)
    if state.step:
      print(f"config changed when resuming at step {state.step} (recorded in {resume.HISTORY}): "
            + ", ".join(sorted(config_diff)), flush=True)
  start = state.step
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  print(f"task={exp.task} data={config.data.name} attention={config.model.attention.name} "
        f"params={n_params:,} mesh={dict(exp.mesh.shape)} steps={start}->{num_steps} workdir={workdir}",
        flush=True)

  writer = summary_writer(paths.join(workdir, "tensorboard")) if is_main else None

  def log_scalars(prefix: str, values: dict[str, Any], step: int) -> None:
    if writer is not None:
      for k, v in values.items():
        if isinstance(v, (int, float)) and math.isfinite(v):
          writer.add_scalar(f"{prefix}/{k}", v, step)
      writer.flush()

  ckpt_every = int(config.train.checkpoint_every)
  log_every, eval_every = int(config.train.log_every), int(config.train.eval_every)
  bar = tqdm.tqdm(total=num_steps, initial=start, disable=not (progress and is_main), dynamic_ncols=True,
                  unit="step", file=sys.stderr)
  acc: dict[str, float] = {}
  acc_n, t_last, last_saved = 0, time.time(), start if mgr.latest_step() is not None else None
  steps_this_run = 0
  result: dict[str, Any] = {"step": start, "start_step": start, "preempted": False, "metrics": {},
                            "state": state, "experiment": exp}
  try:  # the bar, the summary writer and the checkpoint manager close once, however the run ends
    with _Preemption() as preempt:
      while state.step < num_steps:
        batch = next(data_iter)
        if batch_log is not None:
          batch_log.append((state.step, _fingerprint(batch)))
        step_before = state.step
        state, out = exp.train_step(state, batch)
        out = jax.device_get(out)
        if not bool(out["finite"]):
          where = (f"the last good checkpoint (step {last_saved}) in {mgr.directory} is intact"
                   if last_saved is not None else "no checkpoint was saved before it")
          raise TrainingDiverged(f"non-finite loss ({float(out['loss'])}) or gradient norm "
                                 f"({float(out['grad_norm'])}) at step {step_before}; training stopped and "
                                 f"{where}. Lower the learning rate, enable clipping, or use float32.")
        steps_this_run += 1
        for k in ("loss", "aux_loss", "grad_norm"):
          acc[k] = acc.get(k, 0.0) + float(out[k])
        for k in ("nll_sum", "weight_sum", "correct_sum"):
          if k in out:
            acc[k] = acc.get(k, 0.0) + float(out[k])
        acc_n += 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(out['loss']):.4f}", refresh=False)
        if state.step % log_every == 0 or state.step == num_steps:
          now = time.time()
          train_m = metrics_lib.summarize(exp.task, acc)
          line = {"loss": acc["loss"] / acc_n, "aux_loss": acc["aux_loss"] / acc_n,
                  "grad_norm": acc["grad_norm"] / acc_n, "lr": float(out["lr"]),
                  "steps_per_s": acc_n / max(now - t_last, 1e-9)}
          line.update({k: v for k, v in train_m.items() if k != "loss"})
          _say(bar, f"step {state.step}: " + " ".join(f"{k}={v:.4g}" for k, v in line.items()))
          log_scalars("train", line, state.step)
          acc, acc_n, t_last = {}, 0, now
        # The checkpoint comes first: an evaluation that fails must not lose the step it evaluates.
        stop = stop_after is not None and steps_this_run >= stop_after
        if preempt.requested or stop or state.step % ckpt_every == 0 or state.step == num_steps:
          save_checkpoint(mgr, state, data_iter)
          last_saved = state.step
        if preempt.requested or stop:
          why = "SIGTERM" if preempt.requested else f"stop_after={stop_after}"
          _say(bar, f"{why}: saved checkpoint at step {state.step} in {mgr.directory}; rerun to resume")
          result.update(step=state.step, preempted=True, state=state)
          return result
        if eval_every > 0 and state.step % eval_every == 0 and state.step < num_steps:
          eval_metrics = exp.evaluate(state)
          _say(bar, f"eval {config.eval_split} @ {state.step}: " + format_metrics(eval_metrics))
          log_scalars(f"eval_{config.eval_split}", eval_metrics, state.step)
          t_last = time.time()
    bar.close()
    if mgr.latest_step() != state.step:
      save_checkpoint(mgr, state, data_iter)
    eval_metrics = exp.evaluate(state)
    eval_metrics.update(step=state.step, split=config.eval_split, start_step=start)
    print(f"final eval {config.eval_split} @ {state.step}: " + format_metrics(eval_metrics), flush=True)
    log_scalars(f"eval_{config.eval_split}", {k: v for k, v in eval_metrics.items() if isinstance(v, float)},
                state.step)
    if is_main:
      resume.write_json(paths.join(workdir, "metrics.json"), eval_metrics)
    result.update(step=state.step, metrics=eval_metrics, state=state)
  finally:
    bar.close()
    if writer is not None:
      writer.close()
    mgr.close()  # waits for the checkpoint writes in flight
  bad = sorted(k for k, v in result["metrics"].items() if isinstance(v, float) and not math.isfinite(v))
  if bad:
    raise NonFiniteEvaluation(f"the final evaluation at step {state.step} is not finite ({', '.join(bad)}); "
                              f"the checkpoint of step {state.step} in {mgr.directory} is kept")
  return result


# -----------------------------------------------------------------------------------------------------------
# Command line


def format_metrics(metrics: dict[str, Any]) -> str:
  """`k=v` pairs; the batch and example counts say what an evaluation figure covers."""
  return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def _flags():
  from absl import flags
  from ml_collections import config_flags

  config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "experiment config file (path[:arg])",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "checkpoints, summaries and config; default workdirs/<config>-<time>")
  flags.DEFINE_multi_string("gin_file", [], "gin files binding attention constructor fields (ablations)")
  flags.DEFINE_multi_string("gin_bindings", [], "gin bindings, e.g. 'attention.deepsets = True'")
  distributed.define_flags()  # --multihost, --coordinator_address, --num_processes, --process_id
  flags.DEFINE_bool("progress", True, "show the progress bar")
  flags.DEFINE_bool("list", False, "list the attention names, the configs and their arguments, then exit")
  flags.DEFINE_bool("allow_config_change", False, "resume a workdir although model/data fields of the config "
                    "differ from its run's (the change is recorded in config_history.json)")
  return flags.FLAGS


def main(argv: list[str]) -> None:
  del argv
  from absl import flags as absl_flags
  from absl import logging

  from models import gin_bridge

  logging.set_verbosity(logging.WARNING)  # orbax and grain log every save at INFO
  flags = absl_flags.FLAGS
  if flags.list:
    print(listing())
    return
  distributed.initialize_from_flags(flags)
  config = flags.config
  with config.unlocked():
    gin_bridge.apply(config, flags.gin_file, flags.gin_bindings)
  workdir = flags.workdir
  if workdir is None:
    name = os.path.splitext(os.path.basename(config_path_of(flags)))[0]
    workdir = os.path.join("workdirs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
  info = dataset_info(config)
  chance = chance_accuracy(config, info)
  print(f"training {config.data.name} -> {workdir}"
        + (f" (chance accuracy: {100 * chance:.1f}%)" if chance else ""), flush=True)
  try:
    result = train_and_evaluate(config, workdir, progress=flags.progress,
                                allow_config_change=flags.allow_config_change)
  except (TrainingDiverged, NonFiniteEvaluation, resume.ConfigMismatch, resume.UnrestorableCheckpoint) as e:
    print(f"ERROR: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  if "accuracy" in result["metrics"] and chance:
    print(f"accuracy {100 * result['metrics']['accuracy']:.1f}% vs chance {100 * chance:.1f}%", flush=True)


def listing() -> str:
  """What a command line can choose: attention names, config files with their first docstring line, and each
  config's arguments (`--config FILE:key=value,flag`)."""
  import glob
  import importlib

  from models import ops_registry, registry

  lines = ["attention (--config FILE:attention=NAME):"]
  for name in registry.names():
    spec = ops_registry.OPS.get(name)
    lines.append(f"  {name:<28} {spec.description if spec else ''}".rstrip())
  lines.append("configs (--config FILE[:ARGS]; any field also as --config.FIELD=VALUE):")
  for path in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "*.py"))):
    module = importlib.import_module(f"configs.{os.path.splitext(os.path.basename(path))[0]}")
    if not hasattr(module, "get_config"):
      continue  # shared settings, not an experiment
    try:
      module.get_config("__list__")
    except config_base.UnknownConfigArgument as e:
      keys, flags = e.keys, e.flags
    paper = getattr(module, "routing_paper", None)  # the Routing paper's variant, read before the parser
    if paper is not None:
      keys, flags = keys + [f"{k}= (with {paper.FLAG})" for k in paper.KEYS], flags + [paper.FLAG]
    rel = os.path.relpath(path, os.path.dirname(os.path.abspath(__file__)))
    lines.append(f"  {rel:<22} {(module.__doc__ or '').strip().splitlines()[0]}")
    lines.append(f"  {'':<22} keys: {', '.join(k if '=' in k else k + '=' for k in keys)}")
    lines.append(f"  {'':<22} flags: {', '.join(flags)}")
  return "\n".join(lines)


def chance_accuracy(config: ml_collections.ConfigDict, info: Any) -> float | None:
  if config.data.name == "synthetic_recall":
    from data import synthetic

    return synthetic.chance(config)
  return 1.0 / info.num_classes if info.num_classes else None


def config_path_of(flags: Any) -> str:
  from ml_collections import config_flags

  try:
    return config_flags.get_config_filename(flags["config"])
  except Exception:
    return DEFAULT_CONFIG


if __name__ == "__main__":
  from absl import app

  _flags()
  app.run(main)
