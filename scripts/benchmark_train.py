"""Training throughput: tokens/s of a full train step (forward, backward, Adam update) per attention.

    python -m scripts.benchmark --mode train --lengths 8192 --recompute true
    python -m scripts.benchmark --mode train --lengths 1024,2048 --ops dense,combiner_fixed --layers 2
    python -m scripts.benchmark --mode train --preset cifar10      # L=3072, batch 32, bfloat16 (the ablation)
    python -m scripts.benchmark --mode train --preset imagenet64   # L=12288, batch 8, bfloat16

The model is the paper's ablation architecture (6 layers, width 512, 8 heads, MLP 2048; `--layers`,
`--features`, `--mlp_dim` change it; `--heads` is the shared flag), a causal LM (or a bidirectional MLM for
ops that only support `causal=False`, see column `mode`) on random tokens (vocabulary 256), batch `--batch`,
`--dtype` compute dtype, via `Experiment` (training/) on one device: the same jitted, donated step `train.py`
runs. Each (attention, length) runs in its own process (`python -m scripts.benchmark_train --_worker ...`,
printing one JSON line): compile, one warm-up step, then the median of `--repeats` steps (fewer when they
would exceed `--time_budget_s`); compile time is never timed. An attention is not run at a length where its
step time, extrapolated from its last measured length (L^2 for dense, its own growth for the others), would
exceed `--time_budget_s`. Reported: ms per step, tokens/s, and `x dense` = tokens/s over dense's at the same
length (same run), and on accelerators the device allocator's peak (`peak_bytes_in_use`, the step's own
process).
`dense` runs the backend's fused kernel where one applies (cuDNN on GPU and the Pallas flash kernel on TPU,
for bfloat16), so its row is the flash-attention Transformer. `--preset` fixes the paper's ablation shapes
(PRESETS: length, batch, layers, width, heads, MLP, bfloat16), overriding those flags.
Output: `<out_dir>/benchmark_train.md` and `.json` (the shared report writer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

DEFAULT_OPS = ("dense", "combiner_fixed", "combiner_logsparse", "combiner_axial_rowmajor",
               "combiner_axial_vertical", "combiner_axial_horizontal", "combiner_mixture", "sparse_fixed",
               "sparse_logsparse", "sparse_axial")
COLUMNS = (("op", "attention"), ("length", "L"), ("mode", "mode"), ("step_ms", "ms/step"),
           ("tokens_per_s", "tokens/s"), ("x_dense", "x dense"), ("device_peak_mb", "device peak MB"),
           ("repeats", "steps timed"), ("status", "status"))
# The ablation shapes of the Combiner paper: CIFAR-10 (32x32x3 bytes) and ImageNet-64 (64x64x3 bytes) as
# sequences, the 6-layer, width-512, 8-head model, bfloat16 compute.
PRESETS = {
  "cifar10": dict(length=3072, batch=32, layers=6, features=512, heads=8, mlp_dim=2048, dtype="bfloat16"),
  "imagenet64": dict(length=12288, batch=8, layers=6, features=512, heads=8, mlp_dim=2048, dtype="bfloat16"),
}


def build_parser() -> argparse.ArgumentParser:
  """The flags of `--mode train` (beside the shared ones of scripts.benchmark)."""
  from runtime import cli

  parser = cli.ArgumentParser(prog="python -m scripts.benchmark --mode train", add_help=False, debug=False)
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--features", type=int, default=512)
  parser.add_argument("--mlp_dim", type=int, default=2048)
  parser.add_argument("--remat", default="none", choices=("none", "full", "minimal"),
                      help="model.remat for every row (jax.checkpoint per block; no memory effect on "
                           "XLA:CPU)")
  parser.add_argument("--preset", default=None, choices=tuple(PRESETS),
                      help="the paper's ablation shape (overrides --lengths, --batch, --heads, --dtype, "
                           "--layers, --features, --mlp_dim)")
  parser.add_argument("--recompute", default="false", choices=("true", "false"),
                      help="model.attention.recompute for every row that supports it: the op is recomputed "
                           "in the backward pass, so dense fits in memory at long L on any backend")
  return parser


def parse(extra: list[str]) -> argparse.Namespace:
  return build_parser().parse_args(extra)


def apply_preset(args: argparse.Namespace, opts: argparse.Namespace) -> None:
  """Overrides the shared and the train-mode flags with `opts.preset`'s shape (no-op without one)."""
  if opts.preset is None:
    return
  preset = PRESETS[opts.preset]
  args.lengths, args.batch, args.heads, args.dtype = [preset["length"]], preset["batch"], preset["heads"], \
      preset["dtype"]
  opts.layers, opts.features, opts.mlp_dim = preset["layers"], preset["features"], preset["mlp_dim"]


def experiment_config(name: str, length: int, *, layers: int, features: int, heads: int, mlp_dim: int,
                      batch: int, dtype: str, causal: bool, remat: str = "none",
                      recompute: bool = False, implementation: str | None = None) -> Any:
  """A config whose model is the benchmark's, on the synthetic task's shapes (no data is read)."""
  from configs import default

  c = default.get_config(f"attention={name}")
  c.data.seq_len = length
  c.data.name = "synthetic_recall"
  c.model.num_layers, c.model.features, c.model.num_heads, c.model.mlp_dim = layers, features, heads, mlp_dim
  c.model.dtype = dtype
  c.model.remat = remat
  if recompute:
    from models import registry

    if "recompute" in registry.configurable_fields(name):
      c.model.attention.recompute = True
  if implementation is not None:
    if "implementation" not in c.model.attention:
      raise ValueError(f"--implementation {implementation}: the config has no "
                       "model.attention.implementation")
    c.model.attention.implementation = implementation
  c.train.batch_size = batch
  c.mesh.data, c.mesh.model = 1, 1
  c.optimizer.warmup_steps = 1
  return c


def worker(args: argparse.Namespace, name: str, length: int, opts: argparse.Namespace) -> dict[str, Any]:
  import jax
  import numpy as np

  from attention_core import registry as ops_registry
  from scripts import benchmark_worker as bench_worker
  from training import experiment

  spec = ops_registry.get(name) if name in ops_registry.names() else None
  causal, mode = True, "causal LM"
  if spec is not None:
    causal, mode = bench_worker.op_direction(spec.causal, spec.bidirectional, bool(args.causal))
  config = experiment_config(name, length, layers=opts.layers, features=opts.features, heads=args.heads,
                             mlp_dim=opts.mlp_dim, batch=args.batch, dtype=args.dtype, causal=causal,
                             remat=opts.remat, recompute=opts.recompute == "true",
                             implementation=args.implementation)
  info = experiment.dataset_info(config)
  if not causal:  # bidirectional-only attention: the same shapes as an MLM encoder
    import dataclasses

    info = dataclasses.replace(info, task="mlm", bos_id=None)
  exp = experiment.Experiment(config, devices=jax.devices()[:1], info=info)
  rng = np.random.default_rng(args.seed)
  tokens = rng.integers(0, info.vocab_size, size=(args.batch, length)).astype(np.int32)
  batch = {"inputs": tokens, "mask": np.ones((args.batch, length), bool),
           "weights": np.ones((args.batch, length), np.float32), "segment_ids": np.ones((args.batch, length),
                                                                                       np.int32)}
  if info.task == "mlm":
    batch["targets"] = tokens
  state = [exp.init_state()]

  def step():
    state[0], out = exp.train_step(state[0], batch)
    return out["loss"]

  seconds, n = bench_worker.median_time(step, args.repeats, args.time_budget_s,
                                 block=lambda x: x.block_until_ready())
  return {"op": name, "length": length, "mode": mode, "step_s": seconds, "step_ms": 1000 * seconds,
          "tokens_per_s": args.batch * length / seconds, "repeats": n, "status": "ok",
          "device_peak_mb": bench_worker._device_peak_mb(), "device": str(jax.devices()[0].device_kind)}


def main(args: argparse.Namespace) -> int:
  from scripts import benchmark as bench
  from scripts import benchmark_report as bench_report
  from scripts import benchmark_worker as bench_worker

  opts = parse(args.extra)
  apply_preset(args, opts)
  names = bench.parse_names(args.ops, _available(), flag="--ops") if args.ops else list(DEFAULT_OPS)
  rows, history = [], {}
  device = None
  for length in args.lengths:
    for name in names:
      row: dict[str, Any] = {"op": name, "length": length}
      reason = bench.time_skip_reason(name, length, history.get(name, []), args.time_budget_s)
      if reason:
        row["status"] = reason
      else:
        command = [sys.executable, "-m", "scripts.benchmark_train", "--_worker", "--_name", name, "--lengths",
                   str(length), "--batch", str(args.batch), "--heads", str(args.heads), "--dtype", args.dtype,
                   "--causal", str(args.causal).lower(), "--repeats", str(args.repeats), "--time_budget_s",
                   str(args.time_budget_s), "--seed", str(args.seed), *args.extra]
        if args.implementation is not None:
          command += ["--implementation", args.implementation]
        parsed, failure = bench_worker.run_worker(command, timeout_s=args.worker_timeout_s)
        row.update(parsed or {"status": failure})
        if row.get("status") == "ok":
          history.setdefault(name, []).append((length, row["step_s"]))
          device = row.get("device", device)
      rows.append(row)
      fmt = bench_report.format_value
      print(f"[benchmark train] {name:<26} L={length:<6} {fmt(row.get('step_ms')):>9} ms/step "
            f"{fmt(row.get('tokens_per_s')):>9} tokens/s  "
            f"device peak {fmt(row.get('device_peak_mb'))} MB  {row.get('status')}", flush=True)
  dense = {r["length"]: r.get("tokens_per_s") for r in rows if r["op"] == "dense"}
  for row in rows:
    base, mine = dense.get(row["length"]), row.get("tokens_per_s")
    row["x_dense"] = mine / base if isinstance(mine, float) and isinstance(base, float) and base > 0 else None
  header = bench_report.header_info(args, device=device)
  header["model"] = (f"{opts.layers} layers, width {opts.features}, {args.heads} heads, MLP {opts.mlp_dim}, "
                     f"batch {args.batch}, {args.dtype}, remat {opts.remat}, attention recompute "
                     f"{opts.recompute}")
  paths = bench_report.write_report(rows, COLUMNS, args.out_dir, "benchmark_train", header=header,
                             title="Training throughput (tokens/s of a train step)",
                             notes=["x dense = tokens/s / dense tokens/s at the same L (same run)"])
  with open(paths["markdown"]) as f:
    print(f.read())
  return 0


def _available() -> list[str]:
  from models import registry

  return registry.names()


def _worker_main(argv: list[str]) -> int:
  from scripts import benchmark as bench

  parser = bench.build_parser()
  args, extra = parser.parse_known_args(argv)
  opts = parse(extra)
  apply_preset(args, opts)
  result: dict[str, Any] = {"op": args._name, "length": args.lengths[0], "status": "error"}
  code = 0
  try:
    result = worker(args, args._name, args.lengths[0], opts)
  except Exception as e:  # reported in the table instead of aborting the whole run
    result["status"] = f"error: {type(e).__name__}: {e}"[:300]
    code = 1
  print(json.dumps(result, default=str), flush=True)
  return code


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  sys.exit(_worker_main(sys.argv[1:]))
