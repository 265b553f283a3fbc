"""Input-pipeline throughput: examples/s of every data pipeline on generated (mock) data, on this CPU.

    python -m scripts.benchmark --mode input                       # every pipeline, batch 8, 5 s each
    python -m scripts.benchmark --mode input --datasets cifar10,wiki40b --batch_size 32 --seconds 10
    python -m scripts.benchmark --mode input --read_threads 4      # grain's record-reading threads

For each dataset, `data.testing.mock_data` makes a small generated copy (TFDS mock records, LRA files in the
official layout, a prepared Wiki-40B/C4 directory with its SentencePiece model), then the real pipeline
(`data.create_dataset(config, "train", ...)`: shuffling sampler, decoding, tokenization, packing, MLM
corruption, batching) is iterated: one warm-up batch, then as many batches as fit in `--seconds`. Reported:
examples/s (= rows/s; for packed text one row is one packed sequence), tokens/s, ms per batch. Sequence
lengths are the paper configs' (`--seq_len` overrides the text/LRA ones). Per-record costs are the real ones;
mock text documents are shorter than real ones (packing work per token is the same).

Compare with what a training step consumes: input is never the bottleneck when
examples/s >= 10 x (batch / step time) of the training run (`--mode train`).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from typing import Any

import ml_collections

DATASETS = ("cifar10", "imagenet64", "wiki40b", "c4", "lra_listops", "lra_text", "lra_retrieval", "lra_image",
            "lra_pathfinder", "listops_synthetic")
SEQ_LEN = {"wiki40b": 2048, "c4": 2048}


def parse(extra: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m scripts.benchmark --mode input")
  parser.add_argument("--datasets", default=",".join(DATASETS))
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--seconds", type=float, default=5.0, help="time budget per pipeline")
  parser.add_argument("--seq_len", type=int, default=None, help="override for text and LRA text-like tasks")
  parser.add_argument("--read_threads", type=int, default=None, help="default: data.pipeline's choice")
  parser.add_argument("--num_examples", type=int, default=64, help="records in each mock split")
  return parser.parse_args(extra)


def measure(name: str, opts: argparse.Namespace, tmp: str, seed: int) -> dict[str, Any]:
  import data
  from data import testing

  with testing.mock_data(name, tmp, num_examples=opts.num_examples) as data_dir:
    fields: dict[str, Any] = {"name": name, "data_dir": data_dir}
    if opts.read_threads is not None:
      fields["read_threads"] = opts.read_threads
    if name in SEQ_LEN:
      fields["seq_len"] = opts.seq_len or SEQ_LEN[name]
    elif opts.seq_len and name in ("lra_listops", "lra_text", "lra_retrieval", "listops_synthetic"):
      fields["seq_len"] = opts.seq_len
    config = ml_collections.ConfigDict({"data": fields})
    info = data.dataset_info(config)
    start = time.perf_counter()
    it = iter(data.create_dataset(config, "train", batch_size=opts.batch_size, seed=seed, shard_index=0,
                                  shard_count=1))
    next(it)
    first = time.perf_counter() - start
    batches = 0
    start = time.perf_counter()
    while True:
      next(it)
      batches += 1
      elapsed = time.perf_counter() - start
      if elapsed >= opts.seconds:
        break
  rows = batches * opts.batch_size
  return {
    "dataset": name, "task": info.task, "seq_len": info.seq_len, "batch": opts.batch_size, "batches": batches,
    "examples_per_s": rows / elapsed, "tokens_per_s": rows * info.seq_len / elapsed,
    "ms_per_batch": 1000 * elapsed / batches, "first_batch_s": first,
  }


def main(args: argparse.Namespace) -> dict[str, str]:
  from scripts import benchmark

  opts = parse(list(getattr(args, "extra", []) or []))
  names = [n.strip() for n in opts.datasets.split(",") if n.strip()]
  unknown = sorted(set(names) - set(DATASETS))
  if unknown:
    raise SystemExit(f"--datasets: unknown {unknown}; allowed: {list(DATASETS)}")
  logging.getLogger("data").setLevel(logging.ERROR)  # mock data triggers resize/truncation notices
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name in names:
      row = measure(name, opts, tmp, int(getattr(args, "seed", 0)))
      print(f"{name:<18} {row['examples_per_s']:>10.1f} examples/s  {row['tokens_per_s']:>12.0f} tokens/s  "
            f"{row['ms_per_batch']:>8.2f} ms/batch", flush=True)
      rows.append(row)
  columns = [("dataset", "dataset"), ("task", "task"), ("seq_len", "L"), ("batch", "batch"),
             ("examples_per_s", "examples/s"), ("tokens_per_s", "tokens/s"), ("ms_per_batch", "ms/batch"),
             ("first_batch_s", "first batch (s)")]
  header = benchmark.header_info(args, device="cpu (input pipelines only)")
  header["input_flags"] = vars(opts)
  return benchmark.write_report(
    rows, columns, getattr(args, "out_dir", "bench_out"), "benchmark_input", header=header,
    title="Input pipelines: examples/s on generated data",
    notes=["mock data (data.testing.mock_data); one example = one row of the batch (packed text: one sequence)",
           "target: >= 10x the examples/s the matching training step consumes"],
  )
