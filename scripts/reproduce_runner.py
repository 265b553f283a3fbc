"""Running a table's rows (scripts/reproduce.py): each row's config and train.py command at a scale, its
workdir, and the runs themselves, in this process, in worker processes, as subprocesses or on Cloud TPU."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from runtime import cli, paths
from scripts.reproduce_tables import Row
from training import status as run_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALES = ("smoke", "cpu", "paper")
RUN_INFO = "reproduce.json"  # written into each row's workdir after its run: what ran, where, with what
# Arguments dropped from a row's config string at smoke scale: the smoke variant's own model and length win.
SMOKE_DROPS = ("layers", "features", "heads", "mlp_dim", "seq_len", "steps", "batch_size", "main",
               "routing_heads", "routing_layers", "window", "clusters")
SMOKE_OVERRIDE_DROPS = ("train.eval_batch_size", "train.eval_batches")  # row overrides smoke drops
# cpu scale: config arguments appended to the row's (they win), by config file; minutes on 2 CPU cores.
_CPU_MODEL = "layers=2,features=128,heads=4,mlp_dim=512,batch_size=8,steps=600"
CPU_ARGS = {
  "configs/cifar10.py": _CPU_MODEL + ",image_size=16",
  "configs/imagenet64.py": _CPU_MODEL + ",image_size=16",
  "configs/wiki40b.py": _CPU_MODEL + ",seq_len=512",
  "configs/c4.py": _CPU_MODEL + ",seq_len=512",
  "configs/lra.py": "layers=2,features=64,heads=2,mlp_dim=128,batch_size=16,steps=600",
  "configs/pystdlib.py": "",  # the config is CPU-sized already
}
_CPU_ROUTING = "layers=2,features=128,heads=8,mlp_dim=512,batch_size=8,steps=600,image_size=16"

CAUSAL_TASKS = ("lm", "image")  # decoders; the other tasks run bidirectional attention


@functools.cache
def unavailable(row: Row) -> str | None:
  """Why the row cannot run yet (its attention is not registered, or has no form for the row's direction), or
  None when it can."""
  from attention_core import registry as ops_registry
  from models import registry

  if row.attention not in registry.names():
    return f"not implemented: attention {row.attention!r}"
  if row.attention in ops_registry.names():
    import data

    spec = ops_registry.get(row.attention)
    causal = data.dataset_info(build_config(row, "paper")).task in CAUSAL_TASKS
    if not (spec.causal if causal else spec.bidirectional):
      direction = "causal" if causal else "bidirectional"
      return f"not implemented: attention {row.attention!r} has no {direction} form"
  return None


def implemented(row: Row) -> bool:
  return unavailable(row) is None


def _split_config(config: str) -> tuple[str, list[str]]:
  path, _, arg = config.partition(":")
  return path, [a for a in arg.split(",") if a]


def config_string(row: Row, scale: str) -> str:
  """The row's `--config` value at `scale`."""
  if scale not in SCALES:
    raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
  path, items = _split_config(row.config)
  if scale == "smoke":
    items = [a for a in items if a.partition("=")[0] not in SMOKE_DROPS] + ["smoke"]
  elif scale == "cpu":
    extra = (row.cpu_args if row.cpu_args is not None
             else _CPU_ROUTING if "routing_paper" in items else CPU_ARGS.get(path, ""))
    keys = {a.partition("=")[0] for a in extra.split(",") if a}
    items = [a for a in items if a.partition("=")[0] not in keys] + [a for a in extra.split(",") if a]
  return f"{path}:{','.join(items)}" if items else path


WORKDIR_ROOT = "{workdir_root}"  # in a row's overrides: the --workdir_root of the run


def overrides(row: Row, scale: str, root: str | None = None) -> list[str]:
  """The row's `--config.*` flags at `scale`: smoke drops those of SMOKE_OVERRIDE_DROPS (the smoke variant's
  evaluation batches win, e.g. over the Transformer-XL row's single stream, which a multi-device mesh cannot
  split). `{workdir_root}` becomes `root` (absolute when local); without a root, flags naming it are left
  out (the config's default)."""
  out = []
  for o in row.overrides:
    if scale == "smoke" and o.removeprefix("--config.").partition("=")[0] in SMOKE_OVERRIDE_DROPS:
      continue
    if WORKDIR_ROOT in o:
      if root is None:
        continue
      o = o.replace(WORKDIR_ROOT, root if paths.is_uri(root) else os.path.abspath(root))
    out.append(o)
  return out


def workdir(row: Row, scale: str, root: str, seed: int = 0) -> str:
  return paths.join(root, row.table, row.id, scale if seed == 0 else f"{scale}-seed{seed}")


def train_argv(row: Row, scale: str, wd: str, seed: int = 0, root: str | None = None) -> list[str]:
  """train.py's arguments for the row (without the interpreter); root: the --workdir_root."""
  argv = ["train.py", "--config", config_string(row, scale), "--workdir", wd, *overrides(row, scale, root)]
  if seed:
    argv.append(f"--config.seed={seed}")
  return argv


def tpu_argv(row: Row, scale: str, wd: str, seed: int, tpu_args: str, allow_dirty: bool = False,
             root: str | None = None) -> list[str]:
  """`python -m scripts.tpu run` for the row (train.py's own flags after `--`); allow_dirty: ship the git
  HEAD although the tree has uncommitted changes (scripts.tpu refuses it otherwise)."""
  name = re.sub(r"[^a-z0-9-]+", "-", f"{row.table}-{row.id}-{seed}")[:60].strip("-")
  argv = [sys.executable, "-m", "scripts.tpu", "run", "--name", name, *shlex.split(tpu_args),
          *(["--allow_dirty"] if allow_dirty else []), "--config", config_string(row, scale), "--workdir", wd]
  extra = [*overrides(row, scale, root)] + ([f"--config.seed={seed}"] if seed else [])
  return argv + (["--", *extra] if extra else [])


def build_config(row: Row, scale: str, root: str | None = None) -> Any:
  """The row's resolved config (get_config + overrides), checked against the attention registry; root: the
  --workdir_root (see `overrides`)."""
  from models import registry

  path, _, arg = config_string(row, scale).partition(":")
  module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
  c = module.get_config(arg or None)
  for flag in overrides(row, scale, root):
    key, _, value = flag.removeprefix("--config.").partition("=")
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    current = node.get(leaf, None)
    if isinstance(current, bool):
      if value.lower() not in ("true", "false"):
        raise cli.UsageError(f"{flag}: {key} takes true or false")
      node[leaf] = value.lower() == "true"
    elif isinstance(current, (int, float)):
      node[leaf] = type(current)(value)
    elif value.lower() in ("true", "false"):  # a new field (a module's own): read as train.py's flags read it
      node[leaf] = value.lower() == "true"
    else:
      node[leaf] = int(value) if value.lstrip("-").isdigit() else value
  registry.check_fields(c.model.attention)
  registry.get_module(str(c.model.attention.name))
  return c


def finished(wd: str) -> bool:
  return paths.exists(paths.join(wd, "metrics.json"))


def _run_info(row: Row, scale: str, seed: int, argv: list[str]) -> dict[str, Any]:
  import platform

  info = {"table": row.table, "row": row.label, "scale": scale, "seed": seed, "command": shlex.join(argv),
          "python": platform.python_version(),
          "started": datetime.datetime.now().isoformat(timespec="seconds")}
  try:
    import data

    version = data.dataset_info(build_config(row, scale)).version
    if version:
      info["data_version"] = version
  except Exception:  # the run itself reports what is wrong with the data
    pass
  return info


def _train_in_process(row: Row, scale: str, wd: str, seed: int, progress: bool, root: str | None = None
                      ) -> None:
  """train.py's training and final evaluation in this process (no interpreter and JAX start per row)."""
  from training import loop

  config = build_config(row, scale, root)
  if seed:
    config.seed = seed
  loop.train_and_evaluate(config, wd, progress=progress)


@dataclasses.dataclass
class _Job:
  row: Row
  scale: str
  seed: int
  wd: str
  argv: list[str]
  head: str
  root: str | None = None


def _run_one(job: _Job, launcher: str, in_process: bool, progress: bool) -> tuple[bool, float]:
  """Runs one job; (finished, seconds). Exceptions of in-process runs are reported, not raised."""
  start = time.time()
  if in_process and launcher == "local":
    try:
      _train_in_process(job.row, job.scale, job.wd, job.seed, progress, job.root)
      rc = 0
    except Exception as e:  # report and go on with the next row
      print(f"{job.head}: {type(e).__name__}: {e}", flush=True)
      rc = 1
  else:
    rc = subprocess.call(job.argv, cwd=ROOT)
  took = time.time() - start
  ok = rc == 0 and (launcher != "local" or finished(job.wd))
  if ok:  # after the run: train.py refuses a workdir that holds files of anything but its own run
    paths.write_json(paths.join(job.wd, RUN_INFO), _run_info(job.row, job.scale, job.seed, job.argv))
  print(f"{job.head}: {_outcome(job, launcher, ok, rc)} after {took:.0f}s", flush=True)
  return ok, took


def _outcome(job: _Job, launcher: str, ok: bool, rc: int) -> str:
  """How a run ended, in words: done, stopped before its last step with a checkpoint to resume from (train.py
  exits 0 after SIGTERM or a planned stop, with a `preempted` status record), or failed."""
  if ok:
    return "done"
  stopped = run_status.record_path(job.wd, "preempted")
  if rc == 0 and launcher == "local" and paths.exists(stopped):
    r = paths.read_json(stopped)
    return (f"stopped at step {r.get('step')} ({r.get('reason')}); run it again to resume from its "
            f"checkpoint")
  return f"FAILED (exit status {rc})"


def _generate_shared_data(jobs: Sequence[_Job]) -> None:
  """Generates the cached ListOps splits (data/listops.py) that the jobs read, once, before any runs: rows
  training side by side would otherwise generate the same split at once, and the first to finish removes the
  shards that the other may still be reading. Every CPU generates (the rows start after)."""
  from data import listops

  done = set()
  for job in jobs:
    try:
      c = build_config(job.row, job.scale, job.root)
    except Exception:  # the row's own run reports what is wrong with its config
      continue
    if c.data.name != "listops_synthetic":
      continue
    for split in ("train", str(c.eval_split)):
      path = listops.cache_path(c, split)
      if path is None or path in done:
        continue
      done.add(path)
      listops.build_cache(c, split, workers=1 if job.scale == "smoke" else os.cpu_count(),
                          progress=job.scale != "smoke")


def _worker(job: _Job, progress: bool) -> bool:  # a process of the --jobs pool
  return _run_one(job, "local", True, progress)[0]


def run_rows(selected: list[Row], scale: str, root: str, *, seeds: int = 1, launcher: str = "local",
             tpu_args: str = "", dry_run: bool = False, progress: bool = True, in_process: bool = False,
             jobs: int = 1, allow_dirty: bool = False) -> list[str]:
  """Runs the implemented rows; returns the labels of the failed ones.

  Rows whose command is the same as another row's at this scale (e.g. the 6- and 12-layer rows of one
  attention, once `smoke` drops the layer count) train once; the others get a copy of its metrics.
  in_process: train in this process (`launcher="local"` only), the fast way for many small runs; jobs > 1:
  that many worker processes train rows side by side (in-process runs each; no progress bars).
  """
  missing: dict[str, int] = {}
  for r in selected:
    if not implemented(r):
      why = unavailable(r).removeprefix("not implemented: attention ")
      missing[why] = missing.get(why, 0) + 1
  if missing:
    print(f"[skip] {sum(missing.values())} rows not implemented yet: "
          + ", ".join(f"{why} ({n})" for why, n in sorted(missing.items())), flush=True)
  todo = [(r, s) for r in selected if implemented(r) for s in range(seeds)]
  source: dict[tuple[str, ...], str] = {}  # command without the workdir -> the workdir that runs it
  pending: list[_Job] = []
  copies: list[tuple[_Job, str]] = []
  for i, (row, seed) in enumerate(todo, 1):
    wd = workdir(row, scale, root, seed)
    head = f"[{i}/{len(todo)}] {row.table} / {row.label} ({scale}{f', seed {seed}' if seed else ''})"
    key = tuple(a for a in train_argv(row, scale, "", seed, root) if a)
    if not dry_run and finished(wd):  # (a dry run touches no storage)
      print(f"{head}: finished already ({paths.join(wd, 'metrics.json')})", flush=True)
      source.setdefault(key, wd)
      continue
    if launcher == "tpu":
      argv = tpu_argv(row, scale, wd, seed, tpu_args, allow_dirty, root)
    else:
      argv = [sys.executable, *train_argv(row, scale, wd, seed, root)]
      argv += [] if progress else ["--noprogress"]
    job = _Job(row, scale, seed, wd, argv, head, root)
    if key in source and launcher == "local":
      copies.append((job, source[key]))
      continue
    source[key] = wd
    print(f"{head}: {shlex.join(argv)}", flush=True)
    pending.append(job)
  if dry_run:
    for job, same in copies:
      print(f"{job.head}: the same command as {same}", flush=True)
    return []
  failed = []
  if launcher == "local":
    _generate_shared_data(pending)
  if jobs > 1 and launcher == "local" and len(pending) > 1:
    import concurrent.futures
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")  # JAX in forked children is unsafe
    # Rows side by side on one accelerator: each process takes its share of the device's memory instead of
    # JAX's default 75% for the first (the workers inherit this environment; CPUs ignore it).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / jobs:.3f}")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=spawn) as pool:
      results = list(pool.map(_worker, pending, [False] * len(pending)))
  else:
    results = [_run_one(job, launcher, in_process, progress)[0] for job in pending]
  failed += [f"{job.row.table} / {job.row.label}" for job, ok in zip(pending, results, strict=True) if not ok]
  for job, same in copies:
    if not finished(same):
      failed.append(f"{job.row.table} / {job.row.label}")
      continue
    print(f"{job.head}: the same command as {same}: its metrics are this row's", flush=True)
    paths.makedirs(job.wd)
    info = paths.read_json(paths.join(same, RUN_INFO)) if paths.exists(paths.join(same, RUN_INFO)) else {}
    paths.write_json(paths.join(job.wd, RUN_INFO), {**info, "row": job.row.label, "same_as": same})
    paths.write_json(paths.join(job.wd, "metrics.json"), paths.read_json(paths.join(same, "metrics.json")))
  return failed
