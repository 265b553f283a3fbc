"""Input-pipeline throughput against what the matching smoke training step consumes, on this CPU.

    python -m scripts.benchmark --mode input                       # every pipeline vs its smoke train step
    python -m scripts.benchmark --mode input --datasets lra_listops,wiki40b --seconds 10 --repeats 20
    python -m scripts.benchmark --mode input --against none        # pipelines only, at the paper lengths
    python -m scripts.benchmark --mode input --datasets lra_text --data cache_in_memory=0
                                                                   # a config.data field

For each dataset, `data.testing.mock_data` makes a small generated copy (TFDS mock records, LRA files in the
official layout, a prepared Wiki-40B/C4 directory with its SentencePiece model), and the dataset's config is
loaded from `SMOKE` (e.g. `configs/lra.py:task=listops,smoke`): the batch size and sequence length the smoke
run trains on (`--against none`: the paper config's length, batch `--batch_size`, no train step). Then:
  1. pipeline: the real pipeline (`data.create_dataset(config, "train", ...)`: shuffling sampler, decoding,
     tokenization, packing, MLM corruption, batching) is iterated: one warm-up batch, then as many batches as
     fit in `--seconds`. The mock records are presented as a split of the real split's size
     (`config.data.virtual_records`, record i = mock record i % n), so that the record order (a stored
     permutation per epoch, grain's index shuffle above `EpochPermutation.MAX_STORED` records) and the
     caches it touches have the real split's size.
  2. step: the smoke config's model and jitted train step are built the way train.py builds them
     (training/experiment.py's `Experiment` on one device, `init_state`, `train_step` on a pipeline batch,
     host-to-device transfer included); after two untimed steps (compile), the median of `--repeats` steps.
  1 and 2 alternate in `--rounds` rounds (fresh pipeline iterator each round); the medians are reported, so
  a change in the machine's load during a run (other jobs) moves both sides of the ratio alike.
Reported: pipeline examples/s (= rows/s; packed text: one row is one packed sequence), the examples/s the step
consumes (batch / step time), their ratio and whether it is at least 10x (input is then never the
bottleneck). Per-record costs are the mock data's (mock text documents are shorter than real ones; TFDS mock
images are generated per access instead of read and decoded).
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

# dataset (a `data.DATASETS` name) -> (configs module, config arg of the smoke run, fields set on top): the
# datasets this benchmark measures. listops_synthetic is the LRA ListOps experiment on the offline generator
# (its split generated once into the mock data directory).
SMOKE: dict[str, tuple[str, str, dict[str, Any]]] = {
  "cifar10": ("cifar10", "smoke", {}),
  "imagenet64": ("imagenet64", "smoke", {}),
  "wiki40b": ("wiki40b", "smoke", {}),
  "c4": ("c4", "smoke", {}),
  "lra_listops": ("lra", "task=listops,smoke", {}),
  "lra_text": ("lra", "task=text,smoke", {}),
  "lra_retrieval": ("lra", "task=retrieval,smoke", {}),
  "lra_image": ("lra", "task=image,smoke", {}),
  "lra_pathfinder": ("lra", "task=pathfinder,smoke", {}),
  "listops_synthetic": ("lra", "task=listops_synthetic,smoke", {}),
  "synthetic_recall": ("default", "smoke", {}),
}
DATASETS = tuple(SMOKE)
TARGET = 10.0  # pipeline examples/s over the smoke step's: input is then never the bottleneck
INPUT_REPEATS = 10  # default timed train steps per round
COLUMNS = (("dataset", "dataset"), ("config", "config"), ("task", "task"), ("seq_len", "L"),
           ("batch", "batch"), ("examples_per_s", "pipeline ex/s"), ("step_ms", "step ms"),
           ("step_examples_per_s", "step ex/s"), ("ratio", "pipeline / step"),
           ("target", f"pipeline >= {TARGET:g}x step"), ("tokens_per_s", "tokens/s"),
           ("ms_per_batch", "ms/batch"), ("first_batch_s", "first batch (s)"))


def build_parser() -> argparse.ArgumentParser:
  """The flags of `--mode input` (beside the shared ones of scripts.benchmark)."""
  from runtime import cli

  parser = cli.ArgumentParser(prog="python -m scripts.benchmark --mode input", add_help=False, debug=False)
  parser.add_argument("--datasets", default=",".join(DATASETS))
  parser.add_argument("--against", choices=("smoke", "none"), default="smoke",
                      help="smoke: shapes of the smoke config and its train step; none: paper lengths, "
                           "no step")
  parser.add_argument("--batch_size", type=int, default=None,
                      help="override (default: the smoke config's batch; 8 with --against none)")
  parser.add_argument("--seconds", type=float, default=5.0, help="time budget per pipeline")
  parser.add_argument("--rounds", type=int, default=3,
                      help="alternating pipeline/step rounds (medians); the pipeline gets --seconds in all")
  parser.add_argument("--seq_len", type=int, default=None,
                      help="override for the text and LRA text-like tasks")
  parser.add_argument("--read_threads", type=int, default=None, help="default: data.pipeline's choice")
  parser.add_argument("--num_examples", type=int, default=64, help="records in each mock split")
  parser.add_argument("--data", default="", help="config.data fields set on every dataset, e.g. "
                      "'cache_in_memory=0,read_threads=2' (values parsed as Python literals where they "
                      "parse)")
  return parser


def parse(extra: list[str], repeats: int | None = None) -> argparse.Namespace:
  """This mode's flags; `repeats` is the shared --repeats (timed train steps per round; default 10 here)."""
  opts = build_parser().parse_args(extra)
  opts.repeats = INPUT_REPEATS if repeats is None else repeats
  return opts


def experiment_config(name: str, opts: argparse.Namespace) -> tuple[Any, str]:
  """(config, its command-line spelling): the smoke config of `name`, or the paper one with --against none."""
  module, arg, fields = SMOKE[name]
  if opts.against == "none":
    arg = ",".join(a for a in arg.split(",") if a != "smoke")
  config = importlib.import_module(f"configs.{module}").get_config(arg)
  fields = dict(fields)
  for item in filter(None, (x.strip() for x in opts.data.split(","))):
    key, _, value = item.partition("=")
    try:
      fields[key.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      fields[key.strip()] = value.strip()
  spelled = f"configs/{module}.py:{arg}" + "".join(f" --config.data.{k}={v}" for k, v in fields.items())
  with config.unlocked():
    for key, value in fields.items():
      config.data[key] = value
    if opts.seq_len and name in ("wiki40b", "c4", "lra_listops", "lra_text", "lra_retrieval",
                                 "listops_synthetic"):
      config.data.seq_len = opts.seq_len
    if opts.batch_size is not None:
      config.train.batch_size = opts.batch_size
    elif opts.against == "none":
      config.train.batch_size = 8
    if opts.read_threads is not None:
      config.data.read_threads = opts.read_threads
  return config, spelled


def measure_pipeline(config: Any, seconds: float, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
  """(throughput fields, the first batch) of `config`'s training pipeline, from a fresh iterator."""
  import data

  batch_size = int(config.train.batch_size)
  info = data.dataset_info(config)
  start = time.perf_counter()
  it = iter(data.create_dataset(config, "train", batch_size=batch_size, seed=seed, shard_index=0,
                                shard_count=1))
  first_batch = next(it)
  first = time.perf_counter() - start
  batches = 0
  start = time.perf_counter()
  while True:
    next(it)
    batches += 1
    elapsed = time.perf_counter() - start
    if elapsed >= seconds:
      break
  del it
  gc.collect()  # the loader's prefetch threads stop before the step is timed
  rows = batches * batch_size
  return {"task": info.task, "seq_len": info.seq_len, "batch": batch_size, "batches": batches,
          "examples_per_s": rows / elapsed, "tokens_per_s": rows * info.seq_len / elapsed,
          "ms_per_batch": 1000 * elapsed / batches, "first_batch_s": first}, first_batch


def step_timer(config: Any, batch: dict[str, Any]) -> Callable[[int], float]:
  """A function timing the smoke train step (median seconds of n steps), built as train.py builds it
  (training's Experiment, init_state, train_step with the host-to-device transfer) on one device, compiled."""
  import jax

  from scripts import benchmark_worker as bench_worker
  from training.experiment import Experiment

  exp = Experiment(config, devices=jax.devices()[:1])
  state = [exp.init_state()]

  def step():
    state[0], out = exp.train_step(state[0], batch)
    return out["loss"]

  for _ in range(2):  # compile (the first step) and settle
    jax.block_until_ready(step())
  return lambda n: bench_worker.median_time(step, n, 60.0, block=jax.block_until_ready)[0]


def measure(name: str, opts: argparse.Namespace, tmp: str, seed: int) -> dict[str, Any]:
  """One row. Pipeline and step are timed in `--rounds` alternating rounds (medians), so that a change of the
  machine's load during the run moves both sides of the ratio alike."""
  import jax

  import data
  from data import testing

  config, spelled = experiment_config(name, opts)
  row: dict[str, Any] = {"dataset": name, "config": spelled}
  rounds = opts.rounds if opts.against == "smoke" else 1
  pipes, steps = [], []
  with testing.mock_data(name, tmp, num_examples=opts.num_examples) as data_dir:
    with config.unlocked():
      config.data.data_dir = data_dir
      split_size = data.dataset_info(config).split_sizes.get("train")
      if split_size:
        config.data.virtual_records = int(split_size)
    timer = None
    for _ in range(rounds):
      fields, batch = measure_pipeline(config, opts.seconds / rounds, seed)
      pipes.append(fields)
      if opts.against == "smoke":
        timer = timer or step_timer(config, batch)
        steps.append(timer(opts.repeats))
  pipe = sorted(pipes, key=lambda f: f["examples_per_s"])[len(pipes) // 2]  # the median round
  row.update(pipe, first_batch_s=min(p["first_batch_s"] for p in pipes),
             pipeline_rounds=[round(p["examples_per_s"], 1) for p in pipes])
  if steps:
    step_s = statistics.median(steps)
    batch_size = int(config.train.batch_size)
    row.update(step_ms=1000 * step_s, step_examples_per_s=batch_size / step_s, steps_timed=opts.repeats,
               step_ms_rounds=[round(1000 * t, 3) for t in steps],
               device=f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind})")
    row["ratio"] = row["examples_per_s"] / row["step_examples_per_s"]
    row["target"] = "yes" if row["ratio"] >= TARGET else "no"
  return row


def main(args: argparse.Namespace) -> int:
  """Runs the benchmark, prints the table and writes `{out_dir}/benchmark_input.{md,json}`; returns the exit
  status (0: scripts.benchmark passes it to sys.exit)."""
  from runtime import cli
  from scripts import benchmark_report as bench_report

  opts = parse(list(getattr(args, "extra", []) or []), getattr(args, "repeats", None))
  names = [n.strip() for n in opts.datasets.split(",") if n.strip()]
  unknown = sorted(set(names) - set(DATASETS))
  if unknown:
    cli.fail(f"--datasets: unknown {unknown}; allowed: {list(DATASETS)}")
  logging.getLogger("data").setLevel(logging.ERROR)  # mock data triggers resize/truncation notices
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name in names:
      row = measure(name, opts, tmp, int(getattr(args, "seed", 0)))
      line = f"{name:<18} L={row['seq_len']:<6} {row['examples_per_s']:>10.1f} examples/s"
      if "ratio" in row:
        line += (f"  step {row['step_ms']:>8.2f} ms = {row['step_examples_per_s']:>8.1f} examples/s  "
                 f"ratio {row['ratio']:>7.2f} ({row['target']})")
      print(line, flush=True)
      rows.append(row)
  device = next((r["device"] for r in rows if r.get("device")), "cpu (input pipelines only)")
  header = bench_report.header_info(args, device=device)
  header["input_flags"] = vars(opts)
  columns = COLUMNS if opts.against == "smoke" else tuple(
    c for c in COLUMNS if c[0] not in ("step_ms", "step_examples_per_s", "ratio", "target"))
  notes = [
    "mock data (data.testing.mock_data) presented as a split of the real split's size; one example = one row "
    "of the batch (packed text: one packed sequence)",
    f"pipeline >= {TARGET:g}x step: pipeline examples/s >= {TARGET:g} x the examples/s the smoke train step "
    "consumes (batch / median step time; training's Experiment on one device, compile excluded)",
  ]
  paths = bench_report.write_report(
    rows, columns, getattr(args, "out_dir", "bench_out"), "benchmark_input", header=header,
    title="Input pipelines: examples/s on generated data against the smoke train step", notes=notes)
  with open(paths["markdown"]) as f:
    print(f.read())
  print(f"written: {paths['markdown']}, {paths['json']}")
  return 0
