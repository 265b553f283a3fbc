"""The experiment: everything about a run that does not depend on its workdir.

- Model: built from `config.model` and the dataset's `DatasetInfo`; parameters are created already sharded by
  the logical-axis rule table `config.sharding_rules` over the mesh (training/mesh.py).
- State: parameters (`nnx.Param`, the only differentiated variables), the other module state (e.g. routing
  centroids, updated by the module in the forward pass), optax state and the step. Per-step randomness comes
  from `fold_in(key(seed), step)`, reseeding the modules' "dropout"/"attention" streams, so resume is exact.
- Steps: training/steps.py's pure `train_step` and `eval_step`, under `jax.jit` with in/out shardings and
  donated state, traced with the mesh as JAX's context mesh
  (`attention_core.sharding.traced_in`): attention ops run per device on its batch rows and heads, and split
  the sequence over the "seq" axis when it is > 1 (combiner/seq_parallel.py). Batches are sharded over
  ("data", "fsdp"); parameters and optimizer moments over "fsdp" and "seq" by the rules (FSDP,
  training/mesh.py), and the partitioner gathers each layer's weights for its compute.
- Segment recurrence (`config.model.mem_len` > 0): the state also carries the model's memory, which the steps
  take and return (training/recurrence.py).
- Warm start: a model class may name, in its `WARM_START` ("package.module:function"), what a run's state
  passes through before its first step (HIBERT: the encoder of its pretraining run, training/hibert.py), so
  the loop names no task.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
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

from attention_core import sharding
from models import metrics as metrics_lib
from models import tasks
from training import recurrence, steps
from training.mesh import BATCH_AXES, data_parallel_size, make_mesh, state_shardings
from training.optimizer import make_optimizer

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
# The experiment: model, sharded state, jitted steps


@dataclasses.dataclass
class TrainState:
  params: Any  # nnx.State of nnx.Param
  rest: Any  # nnx.State of the other module variables (not RngState)
  opt_state: Any
  step: int
  memory: Any = None  # segment recurrence: the model's memory after the last step (None without)


class Experiment:
  """Everything that does not depend on the workdir: mesh, model definition, shardings, jitted steps."""

  def __init__(self, config: ml_collections.ConfigDict, *, devices: list | None = None, info: Any = None):
    """info: the dataset's `DatasetInfo` (default: `data.dataset_info(config)`)."""
    self.config = config
    self.info = dataset_info(config) if info is None else info
    self.task = self.info.task
    self.mesh = make_mesh(config, devices)
    self.rules = {name: axis for name, axis in config.sharding_rules}
    model_cfg = config.model
    if self.info.image_shape is not None and model_cfg.get("image_shape") is None:
      model_cfg = ml_collections.ConfigDict(model_cfg.to_dict())
      model_cfg.image_shape = tuple(self.info.image_shape)
    self.model_cfg = model_cfg

    self._build = functools.partial(tasks.from_info, model_cfg, self.info, seed=int(config.seed))
    abstract = nnx.eval_shape(self._build)
    self.abstract_model = abstract  # shapes only: what does not need parameters (the memory's layout)
    self.mem_len, self.eval_mem_len = recurrence.lengths(model_cfg)
    self.eval_compressed_mem_len = recurrence.eval_compressed_len(model_cfg)
    self.graphdef, abs_params, abs_rng, abs_rest = nnx.split(abstract, nnx.Param, nnx.RngState, ...)
    self.empty_rest = abs_rest if not jax.tree.leaves(abs_rest) else None
    self.param_shardings = state_shardings(abs_params, self.rules, self.mesh)
    self.rest_shardings = state_shardings(abs_rest, self.rules, self.mesh)
    self.replicated = NamedSharding(self.mesh, P())
    self.rng_shardings = jax.tree.map(lambda _: self.replicated, abs_rng)
    self.tx, self.schedule = make_optimizer(config)
    abs_opt = jax.eval_shape(self.tx.init, abs_params)
    self.opt_shardings = self._opt_shardings(abs_opt, abs_params)
    self.compute_shardings = self._gathered(self.param_shardings), self._gathered(self.rest_shardings)
    self.steps = steps.StepContext(
        self.graphdef, self.task, self.tx, self.schedule, float(config.aux_loss_weight), int(config.seed),
        int(config.eval_seed), None if self.compute_shardings[0] is None else self.compute_shardings)
    self.batch_sharding = NamedSharding(self.mesh, P(BATCH_AXES))
    self.data_size = data_parallel_size(self.mesh)
    self.rng_state = None  # the model's rng streams, made by init_state / init_rng_state
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

  def _gathered(self, shardings: Any) -> Any:
    """The parameters' shardings for compute: split over "model" alone, the data-parallel axes that store
    them (FSDP's "fsdp" and "seq") removed; None when the mesh has none of those, so the step is unchanged.
    Gathering them in the step lets the partitioner keep activations split over the batch: with a weight
    split along its contraction (embed) dimension it would otherwise move activations."""
    if all(dict(self.mesh.shape).get(axis, 1) == 1 for axis in ("fsdp", "seq")):
      return None

    def drop(spec):
      def one(axes):
        kept = tuple(a for a in (axes if isinstance(axes, tuple) else (axes,)) if a == "model")
        return kept[0] if kept else None

      return P(*(one(axes) for axes in spec))

    return jax.tree.map(lambda sh: NamedSharding(self.mesh, drop(sh.spec)), shardings,
                        is_leaf=lambda x: isinstance(x, NamedSharding))

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
    memory = None
    if self.mem_len:
      memory = recurrence.empty(self.abstract_model, self.mesh, int(self.config.train.batch_size),
                                self.mem_len)
    return TrainState(params, rest, opt_state, 0, memory)

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
    out = {"params": with_sharding(abs_params, self.param_shardings),
           "rest": with_sharding(abs_rest, self.rest_shardings),
           "opt_state": with_sharding(abs_opt, self.opt_shardings)}
    if self.mem_len:
      out["memory"] = recurrence.abstract(self.abstract_model, self.mesh, int(self.config.train.batch_size),
                                          self.mem_len)
    return out

  # -- batches -----------------------------------------------------------------------------------------------

  def global_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Host-local NumPy batch -> global jax.Arrays sharded over the data-parallel mesh axes."""
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
            for k, v in batch.items()}

  # -- steps -------------------------------------------------------------------------------------------------

  def model(self, state: TrainState, key: jax.Array) -> nnx.Module:
    """The model with the state's parameters, its random streams seeded from `key` (sampling, ROUGE)."""
    if self.rng_state is None:
      self.init_rng_state()
    return steps.merged_model(self.steps, state.params, self.rng_state, state.rest, key)

  def warm_start(self, state: TrainState) -> TrainState:
    """`state` through the model's declared `WARM_START` before the first step (unchanged without one)."""
    path = type(self.abstract_model).WARM_START
    if path is None:
      return state
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)(self, state)

  def _build_train_step(self) -> Callable:
    in_sh = (self.param_shardings, self.rest_shardings, self.opt_shardings, self.rng_shardings,
             self.replicated, self.batch_sharding)
    out_sh = (self.param_shardings, self.rest_shardings, self.opt_shardings, self.replicated)
    donate = (0, 1, 2)
    if self.mem_len:  # the memory goes in last and comes out last
      mem_sh = recurrence.sharding(self.mesh)
      in_sh, out_sh, donate = in_sh + (mem_sh,), out_sh + (mem_sh,), donate + (6,)
    # Traced with the mesh in JAX's context: attention ops run on each device's batch rows and heads.
    step = sharding.traced_in(self.mesh, functools.partial(steps.train_step, self.steps))
    return jax.jit(step, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)

  def jitted_train_step(self) -> Callable:
    """The jitted, donated step (params, rest, opt_state, rng, step, batch) -> (params, rest, opt_state, out),
    built once; `scripts.compile_tpu` lowers it ahead of time. With segment recurrence it also takes the
    memory last and returns the new one last."""
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
    args = (state.params, state.rest, state.opt_state, self.rng_state, jnp.asarray(state.step, jnp.int32),
            self.global_batch(batch))
    if not self.mem_len:
      params, rest, opt, out = step(*args)
      return TrainState(params, rest, opt, state.step + 1), out
    recurrence.check_batch(state.memory, args[-1])
    params, rest, opt, out, memory = step(*args, state.memory)
    return TrainState(params, rest, opt, state.step + 1, memory), out

  def _build_eval_step(self) -> Callable:
    step = sharding.traced_in(self.mesh, functools.partial(steps.eval_step, self.steps))
    in_sh = (self.param_shardings, self.rest_shardings, self.rng_shardings, self.batch_sharding)
    if self.eval_mem_len:  # (params, rest, rng, batch, memory) -> (sums, memory)
      mem_sh = recurrence.sharding(self.mesh)
      return jax.jit(step, in_shardings=in_sh + (mem_sh,), out_shardings=(self.replicated, mem_sh),
                     donate_argnums=(4,))
    return jax.jit(step, in_shardings=in_sh, out_shardings=self.replicated)

  def evaluate(self, state: TrainState, split: str | None = None, max_batches: int | None = None) -> dict:
    """Metrics over `split` (default config.eval_split), at most `max_batches` batches (-1/None = all)."""
    if self._eval_step is None:
      self._eval_step = self._build_eval_step()
    split = split or self.config.eval_split
    if max_batches is None:
      max_batches = int(self.config.train.eval_batches)
    loader = create_dataset(self.config, split, **self.host_batch(int(self.config.train.eval_batch_size)),
                            seed=int(self.config.seed), shuffle=False, num_epochs=1)
    totals: dict[str, float] = {}
    n = 0
    memory = None  # segment recurrence: empty at the start of every pass, carried over its batches in order
    if self.eval_mem_len:
      memory = recurrence.empty(self.abstract_model, self.mesh, int(self.config.train.eval_batch_size),
                                self.eval_mem_len, self.eval_compressed_mem_len)
    whole = True  # the loader ran out before max_batches: every batch of the split was read
    for batch in loader:
      if 0 <= max_batches <= n:
        whole = False
        break
      args = (state.params, state.rest, self.rng_state, self.global_batch(batch))
      if memory is None:
        sums = jax.device_get(self._eval_step(*args))
      else:
        sums, memory = self._eval_step(*args, memory)
        sums = jax.device_get(sums)
      for k, v in sums.items():
        totals[k] = totals.get(k, 0.0) + float(v)
      n += 1
    if n == 0:
      raise ValueError(f"split {split!r} of {self.config.data.name!r} produced no batches")
    examples = int(totals.pop("examples"))
    out = metrics_lib.summarize(self.task, totals)
    if self.info.metric == "bits_per_byte":  # byte- and character-level text: the papers' unit
      out["bits_per_byte"] = float(out["loss"] / np.log(2.0))
    out["num_batches"] = n
    out["num_examples"] = examples
    out["whole_split"] = whole
    return out

  def per_host(self, global_batch: int) -> int:
    """The rows of a global batch this host's devices hold (`host_batch`)."""
    return self.host_batch(global_batch)["batch_size"]

  def host_batch(self, global_batch: int) -> dict[str, int]:
    """Which rows of a global batch this host reads, as `create_dataset` arguments: host batch size
    b (`batch_size`), and `shard_index`/`shard_count` such that the host holds rows
    [shard_index * b, (shard_index + 1) * b) of the global batch.

    The rows are those of this process's devices under the batch sharding, the host-local batch that
    `global_batch` (jax.make_array_from_process_local_data) expects; a training stream's global batch s is
    then its stream positions [s * global_batch, (s + 1) * global_batch) in order, on any host layout
    (data.order.GlobalRows). Hosts whose devices hold the same rows (a mesh whose data-parallel axes do
    not span them) read the same rows.
    """
    if global_batch % self.data_size:
      raise ValueError(f"batch size {global_batch} is not divisible by the data-parallel mesh size "
                       f"{self.data_size}")
    where = self.batch_sharding.addressable_devices_indices_map((global_batch,))  # device -> (row slice,)
    spans = {index[0].indices(global_batch)[:2] for index in where.values()}
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    covered = np.zeros(global_batch, bool)
    for a, b in spans:
      covered[a:b] = True
    size = hi - lo
    if not covered[lo:hi].all() or global_batch % size or lo % size:
      raise ValueError(f"this host's devices hold rows {sorted(spans)} of the global batch of "
                       f"{global_batch}, not one of equal contiguous blocks; the mesh's device order does "
                       f"not fit the process layout")
    return {"batch_size": size, "shard_index": lo // size, "shard_count": global_batch // size}


