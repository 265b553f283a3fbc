"""Checkpoints: orbax `CheckpointManager` in `<workdir>/checkpoints` with the grain data-iterator state, and
the newest step that restores.

Saves are asynchronous: `save_checkpoint` returns once the arrays are copied off the devices and the
data-iterator state is written (the iterator may advance right after), and orbax writes the arrays in a
background thread while training goes on. A step appears under its number only when all its files are written
(orbax writes into a temporary directory and renames it), so an interrupted write leaves the previous steps as
they were. The next save, a restore, `wait_until_finished` and `close` wait for the write in flight; the loop
waits before it reports a stop and before it returns.

With segment recurrence (`config.model.mem_len` > 0) the state includes the model's memory, so that a resumed
run reads the memory the interrupted one would have read; without it nothing changes.

Each step records a checksum of every array (training/integrity.py), verified on restore. A step that does
not restore (missing or damaged files, a corrupt data-iterator state, arrays whose bits changed after the
write, non-finite parameters or optimizer state) is reported with its directory, and the newest step that
restores is used. Training moves such a step into `<workdir>/unrestorable_checkpoints/` (nothing is
deleted), so that the step can be trained and saved again.

A step whose files are whole but whose arrays are not the model's (a config change of parameter or optimizer
state shapes, which `--allow_config_change` cannot make) is not damage: its metadata is compared with the
model's arrays (in whichever layout of the blocks it was saved in) before its arrays are read, and the restore
stops with CheckpointMismatch, a usage error naming the first differing array; nothing is moved.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

import jax
import ml_collections

from runtime import cli, paths
from training import integrity, layouts
from training.experiment import Experiment, TrainState

UNRESTORABLE = "unrestorable_checkpoints"


class UnrestorableCheckpoint(RuntimeError):
  """No checkpoint step of a workdir restores."""


# -----------------------------------------------------------------------------------------------------------
# Save and restore one step


def _manager_class() -> type:
  """orbax's CheckpointManager, except that it never asks JAX's preemption sync point itself.

  The training loop asks it once per step boundary (training/preemption.py). orbax also asks it, with the
  step being saved, when it finalizes a save in its background thread; that call would set JAX's step counter
  back to an older step, and an agreement computed right then could name a step this process has passed."""
  global _MANAGER
  if _MANAGER is None:
    import orbax.checkpoint as ocp

    class CheckpointManager(ocp.CheckpointManager):
      def reached_preemption(self, step: int) -> bool:
        return False

    _MANAGER = CheckpointManager
  return _MANAGER


_MANAGER = None


def checkpoint_manager(workdir: str, config: ml_collections.ConfigDict, *, read_only: bool = False,
                       asynchronous: bool = True) -> Any:
  """The workdir's checkpoint manager; saves are asynchronous unless `asynchronous=False`."""
  import orbax.checkpoint as ocp

  # Read-only (eval.py, sample.py): no save settings, which orbax would reset with a warning line each.
  keep = {"save_interval_steps": 0, "max_to_keep": None} if read_only else {
      "max_to_keep": int(config.train.keep_checkpoints)}
  options = ocp.CheckpointManagerOptions(create=not read_only, read_only=read_only,
                                         enable_async_checkpointing=asynchronous and not read_only, **keep)
  with _quiet() if read_only else contextlib.nullcontext():  # "Given directory is read only=..."
    return _manager_class()(paths.path(workdir) / "checkpoints", options=options,
                            item_names=("state", "data", "meta"))


@contextlib.contextmanager
def _quiet():
  """absl logging above warnings inside (orbax's notice that a read-only manager is read-only)."""
  from absl import logging

  before = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  try:
    yield
  finally:
    logging.set_verbosity(before)


def state_tree(state: TrainState) -> dict[str, Any]:
  tree = {"params": state.params, "opt_state": state.opt_state}
  if jax.tree.leaves(state.rest):  # orbax refuses empty subtrees
    tree["rest"] = state.rest
  if state.memory is not None:  # segment recurrence: the memory the next step reads (training/recurrence.py)
    tree["memory"] = state.memory
  return tree


def save_checkpoint(mgr: Any, state: TrainState, data_iter: Any | None, *, wait: bool = False) -> None:
  """Starts saving `state` (and the data iterator's position) as step `state.step`, in every process.

  Returns when the state may change: the arrays are copied off the devices and the iterator state is written;
  the arrays are written in the background (with `wait`, this returns once the step is complete)."""
  import grain
  import orbax.checkpoint as ocp

  tree = state_tree(state)
  items = {"state": ocp.args.StandardSave(tree),
           "meta": ocp.args.JsonSave({"step": state.step, "checksums": integrity.checksums(tree)})}
  if data_iter is not None:
    items["data"] = grain.checkpoint.CheckpointSave(data_iter)
  mgr.save(state.step, args=ocp.args.Composite(**items), force=True)
  if wait:
    mgr.wait_until_finished()


def restore_checkpoint(mgr: Any, exp: Experiment, data_iter: Any | None,
                       step: int | None = None) -> TrainState:
  """Restores `step` (default the latest) into a sharded TrainState and, when given, the data iterator.

  Raises UnrestorableCheckpoint naming the step directory when its files do not restore or the restored
  parameters / optimizer state are not finite, and CheckpointMismatch (a usage error) when its arrays are
  not the ones the experiment's config builds.
  """
  import orbax.checkpoint as ocp

  step = mgr.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {mgr.directory}")
  target = exp.abstract_state()
  if not jax.tree.leaves(target["rest"]):
    del target["rest"]
  saved = layouts.saved_arrays(mgr, step)  # the step's metadata, read once
  saved_in = layouts.saved_layout(saved, exp, target)  # a step saved with the blocks in the other layout
  wanted = target if saved_in is None else saved_in
  step_dir = paths.join(mgr.directory, str(step))
  check_arrays(saved, wanted, step, step_dir)  # another model's: not damage
  items = {"state": ocp.args.StandardRestore(wanted), "meta": ocp.args.JsonRestore()}
  if data_iter is not None:
    from data import resume  # a state this pipeline cannot continue: a clear error

    resume.check_iterator_checkpoint(step_dir, data_iter, exp.config)
  try:
    restored = mgr.restore(step, args=ocp.args.Composite(**items))
    if data_iter is not None:  # not grain's handler, which reads only this host count's files
      resume.restore_iterator(step_dir, data_iter)
    tree = restored["state"]
    integrity.verify(tree, restored["meta"].get("checksums"))  # bits changed after the write
    if saved_in is not None:
      tree = layouts.convert(tree, target)  # stacked or split along the layer axis, bit for bit
    check_finite(tree["params"], "parameters")
    check_finite(tree["opt_state"], "optimizer state")
    restored_step = int(restored["meta"]["step"])
  except Exception as e:  # missing or damaged files, a corrupt data-iterator state, non-finite values
    raise UnrestorableCheckpoint(f"checkpoint {step_dir} does not restore: {type(e).__name__}: "
                                 f"{short(e)}") from e
  if exp.rng_state is None:
    exp.init_rng_state()
  rest = tree["rest"] if "rest" in tree else exp.empty_rest
  return TrainState(tree["params"], rest, tree["opt_state"], restored_step, tree.get("memory"))


# -----------------------------------------------------------------------------------------------------------
# A step written for another model: not damage

SECTIONS = {"params": "parameter", "opt_state": "optimizer state", "rest": "module state",
            "memory": "recurrent memory"}  # the state tree's parts, in the order a mismatch is reported


class CheckpointMismatch(cli.UsageError):
  """A checkpoint step whose files are whole but whose arrays (their paths, shapes or dtypes) are not those
  of the model and optimizer the config builds: a config changed beyond what a resumed run can take. The
  config is what to fix, so the step is not set aside (it restores with the config it was trained with)."""


def _described(leaf: Any) -> str:
  return f"{tuple(leaf.shape)} {_dtype_name(leaf.dtype)}"


def _dtype_name(dtype: Any) -> str:
  try:
    return str(jax.numpy.dtype(dtype))
  except TypeError:  # an extended dtype (a PRNG key)
    return str(dtype)


def _same_array(saved: Any, wanted: Any) -> bool:
  if getattr(saved, "shape", None) is None:  # not an array's metadata: the restore decides
    return True
  if tuple(saved.shape) != tuple(wanted.shape):
    return False
  if getattr(saved, "dtype", None) is None or jax.dtypes.issubdtype(wanted.dtype, jax.dtypes.extended):
    return True  # no dtype recorded, or a key (stored as its data): the shape decides
  return _dtype_name(saved.dtype) == _dtype_name(wanted.dtype)


def check_arrays(saved: dict[tuple[str, ...], Any] | None, target: dict[str, Any], step: int,
                 step_dir: str) -> None:
  """Raises CheckpointMismatch naming the first array (parameters first) whose path, shape or dtype in the
  step's metadata `saved` (`layouts.saved_arrays`) differs from `target`, the restore target (in the step's
  own layout when it was saved in the other one: training/layouts.py). Nothing is checked when the metadata
  did not read (None): the restore then reports the damage."""
  if saved is None:
    return
  wanted = layouts.leaf_arrays(target)
  for section in (*SECTIONS, *sorted({p[0] for p in (*saved, *wanted)} - set(SECTIONS))):
    ours = f"the {'optimizer' if section == 'opt_state' else 'model'} this config builds"
    for path in sorted({p for p in (*saved, *wanted) if p[0] == section}):
      name = "/".join(path)
      if path not in saved:
        problem = f"{name} of {ours} is not in it"
      elif path not in wanted:
        problem = f"it holds {name}, which {ours} has not"
      elif not _same_array(saved[path], wanted[path]):
        problem = f"{name} is {_described(saved[path])} there, {_described(wanted[path])} in {ours}"
      else:
        continue
      what = SECTIONS.get(section, section)
      raise CheckpointMismatch(
          f"checkpoint {step_dir} (step {step}) was written for other {what} shapes: {problem}. "
          "--allow_config_change cannot change the shapes of parameters or optimizer state: resume with the "
          "config the run was trained with (or a change that keeps them), or use a new --workdir")


# -----------------------------------------------------------------------------------------------------------
# The newest step that restores


def check_finite(tree: Any, what: str) -> None:
  """Raises ValueError naming the first non-finite leaf of `tree` (restored parameters or optimizer state)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if jax.numpy.issubdtype(jax.numpy.result_type(leaf), jax.numpy.inexact):
      if not bool(jax.numpy.all(jax.numpy.isfinite(leaf))):
        raise ValueError(f"non-finite values in the restored {what} at {jax.tree_util.keystr(path)}")


def restore_newest(steps: Iterable[int], restore: Callable[[int], Any], directory: Any, *,
                   say: Callable[[str], None] = print, set_aside: Callable[[int], str] | None = None,
                   using: str = "resuming from") -> Any:
  """restore(step) for the newest of `steps` that restores; each step whose restore raises
  UnrestorableCheckpoint (naming its directory) is reported and, with `set_aside`, moved out of the way;
  `using` says what is done with the one that restores after those.
  Raises UnrestorableCheckpoint when none restores. `directory` is the checkpoints directory (for the
  message)."""
  failures = []
  _quiet_abandoned_reads()
  for step in sorted(steps, reverse=True):
    try:
      result = restore(step)
    except UnrestorableCheckpoint as e:  # damage: missing files, bad chunks, corrupt JSON, non-finite values
      failures.append(str(e))
      note = f"; moved to {set_aside(step)} (nothing deleted)" if set_aside is not None else ""
      say(f"WARNING: {e}{note}; trying the previous step")
      continue
    if failures:
      say(f"{using} step {step}, the newest checkpoint that restores")
    return result
  raise UnrestorableCheckpoint(f"no checkpoint in {directory} restores:\n  " + "\n  ".join(failures))


def _quiet_abandoned_reads() -> None:
  """A restore that fails part-way leaves reads in flight whose completions, arriving after orbax's event loop
  closed, raise "Event loop is closed" in callbacks nobody awaits: Python would print one traceback per read
  (dozens per damaged step) after the one-line report. Those, and only those, are dropped."""
  previous = sys.unraisablehook
  if getattr(previous, "quiet_abandoned_reads", False):
    return

  def hook(unraisable: Any) -> None:
    if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
      return
    previous(unraisable)

  hook.quiet_abandoned_reads = True
  sys.unraisablehook = hook


def move_aside(checkpoints: Any, step: int) -> str:
  """Moves `<checkpoints>/<step>` into `<workdir>/unrestorable_checkpoints/` and returns where it went."""
  checkpoints = paths.path(checkpoints)
  target_dir = checkpoints.parent / UNRESTORABLE
  target_dir.mkdir(parents=True, exist_ok=True)
  target = target_dir / str(step)
  n = 1
  while target.exists():
    target = target_dir / f"{step}.{n}"
    n += 1
  (checkpoints / str(step)).rename(target)
  return str(target)


def short(e: BaseException, limit: int = 300) -> str:
  text = " ".join(str(e).split())
  return text if len(text) <= limit else text[:limit] + "..."


def restore_or_init(mgr: Any, exp: Experiment, data_iter: Any, *, set_aside: bool) -> TrainState:
  """The newest checkpoint that restores (broken newer steps are reported and, with `set_aside`, moved out of
  the way), or a fresh state when there is none."""
  steps = list(mgr.all_steps())
  if not steps:
    return exp.init_state()
  move = None
  if set_aside and jax.process_index() == 0:
    move = lambda step: move_aside(mgr.directory, step)  # noqa: E731
  state = restore_newest(steps, lambda step: restore_checkpoint(mgr, exp, data_iter, step), mgr.directory,
                         say=lambda line: print(line, flush=True), set_aside=move)
  mgr.reload()
  print(f"resumed from {mgr.directory} at step {state.step}", flush=True)
  return state

# -----------------------------------------------------------------------------------------------------------
# Failed writes: a full disk, a quota, a read-only or failing filesystem, a storage service's refusal


class CheckpointWriteFailed(RuntimeError):
  """Writing a checkpoint failed. The message (one line) names the checkpoints directory, the error and the
  last intact step; `status_fields` are what the run's failed record adds (training/status.py)."""

  def __init__(self, message: str, *, status_fields: dict[str, Any]):
    super().__init__(message)
    self.status_fields = status_fields


def write_error(e: BaseException) -> str | None:
  """`[Errno 28] No space left on device` for an exception that is a failed write (an OSError anywhere in its
  chain, or tensorstore's error, which carries the OS error code in its text); None for anything else."""
  import os
  import re

  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno:
      return f"[Errno {e.errno}] {e.strerror or os.strerror(e.errno)}"
    m = re.search(r"os_error_code='?(\d+)", str(e))
    if m:
      return f"[Errno {m.group(1)}] {os.strerror(int(m.group(1)))}"
    if re.search(r"\b(Error|Failed) writing\b", str(e)):  # a storage service's refusal (gs://)
      return short(str(e).splitlines()[0], 200)
    e = e.__cause__ or e.__context__
  return None


def intact_steps(directory: Any) -> list[int]:
  """The steps in `directory` whose write completed (orbax's finalized steps), oldest first; [] when the
  directory cannot be read."""
  import orbax.checkpoint as ocp

  try:
    return sorted(ocp.utils.checkpoint_steps(paths.path(directory)))
  except Exception:  # an unreadable directory: no step can be vouched for
    return []


def remove_half_written(directory: Any) -> list[str]:
  """Removes the temporary directories of steps whose write did not complete (`<step>.orbax-checkpoint-tmp*`
  on a local disk, where orbax renames a step into place once it is whole) and returns their names. Finished
  steps are not touched. An object store's unfinished step (no rename there) is left for the next restore."""
  import orbax.checkpoint as ocp

  removed = []
  try:
    for entry in paths.path(directory).iterdir():
      if ocp.utils.is_tmp_checkpoint(entry):
        paths.rmtree(entry)
        removed.append(entry.name)
  except Exception as e:  # the report of the failure that got here matters more
    print(f"could not remove a half-written checkpoint in {directory}: {type(e).__name__}: {short(e)}",
          file=sys.stderr, flush=True)
  return removed


class reporting_write_errors:  # noqa: N801 (a context manager, used as `with reporting_write_errors(mgr):`)
  """Around the calls that write or wait for a checkpoint: a failed write becomes CheckpointWriteFailed, once
  process 0 has removed the half-written step (which frees the space the report itself needs)."""

  def __init__(self, mgr: Any):
    self.mgr = mgr

  def __enter__(self) -> None:
    _quiet_failed_writes()

  def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> bool:
    if e is None or isinstance(e, CheckpointWriteFailed) or not isinstance(e, Exception):
      return False
    error = write_error(e)
    if error is None:
      return False
    raise write_failed(self.mgr.directory, error) from e


def write_failed(directory: Any, error: str) -> CheckpointWriteFailed:
  """The report of a failed write in `directory`: the half-written steps removed (process 0), the last
  intact step found."""
  directory = str(directory)
  removed = remove_half_written(directory) if jax.process_index() == 0 else []
  intact = intact_steps(directory)
  last = intact[-1] if intact else None
  gone = f"half-written step {', '.join(n.split('.')[0] for n in removed)} removed; " if removed else ""
  where = (f"the last intact checkpoint is step {last}: free space (or fix the storage) and rerun to resume "
           "from it" if last is not None else
           "no checkpoint was completed: free space (or fix the storage) and rerun to start again")
  return CheckpointWriteFailed(
      f"writing a checkpoint to {directory} failed: {error}; {gone}{where}",
      status_fields={"cause": "checkpoint_write", "checkpoint_dir": directory, "os_error": error,
                     "last_intact_step": last})


def _quiet_failed_writes() -> None:
  """orbax logs a failed background write from each of its threads, with a traceback (a screen per failure),
  and asyncio logs the same failure again for each of orbax's write tasks whose exception nobody retrieved
  ("Task exception was never retrieved"); the loop reports it in one line (CheckpointWriteFailed), so those
  log records, and only those, are dropped, as are the "Event loop is closed" errors of its abandoned writes
  (`_quiet_abandoned_reads`)."""
  import logging

  _quiet_abandoned_reads()

  def keep_absl(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not ("orbax" in record.pathname and exc is not None and write_error(exc) is not None)

  def keep_asyncio(record: logging.LogRecord) -> bool:  # the process writes nothing else through asyncio
    exc = record.exc_info[1] if record.exc_info else None
    return exc is None or write_error(exc) is None

  for name, keep in (("absl", keep_absl), ("asyncio", keep_asyncio)):
    logger = logging.getLogger(name)
    if not any(getattr(f, "quiet_failed_writes", False) for f in logger.filters):
      keep.quiet_failed_writes = True
      logger.addFilter(keep)
