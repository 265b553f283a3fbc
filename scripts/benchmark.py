"""Speed and memory of every registered attention op, side by side in one run (docs/design.md section 7).

    python -m scripts.benchmark                           # all ops, L = 1024 .. 65536, causal
    python -m scripts.benchmark --ops dense,combiner_fixed --lengths 256,512,1024 --repeats 3
    python -m scripts.benchmark --causal false --dtype bfloat16 --out_dir bench_bidir
    python -m scripts.benchmark --peers                   # + third-party rows (scripts/benchmark_peers.py)
    python -m scripts.benchmark --mode train ...          # scripts/benchmark_train.py (models/)
    python -m scripts.benchmark --mode input ...          # scripts/benchmark_input.py (data/)

What is measured (`--mode ops`, the default). For every op in `attention_core.registry` (or `--ops`) and every
length, a fresh worker process (`python -m scripts.benchmark --_worker ...`, printing one JSON line) does:
  1. AOT-compiles `jax.jit(op)` (forward) and `jax.jit(grad of sum(op(q, k, v) * cotangent) w.r.t. q, k, v)`
     (forward+backward) from shapes only, and reads XLA's `memory_analysis()`. If arguments + temporaries +
     outputs exceed `--memory_budget_gb`, it stops there: "skipped: > budget". Compile time is never timed.
  2. Draws random q, k, v, cotangent ([batch, length, heads, head_dim]), resets the process's peak-RSS counter
     (Linux: "5" > /proc/self/clear_refs resets VmHWM) and takes the current RSS as the baseline.
  3. Runs each function once (warm-up) and then `--repeats` times with `block_until_ready`; reports the
     median. When one call takes so long that the repeats would exceed `--time_budget_s`, fewer repeats are
     run (>= 1).
  4. Reports the peak-RSS increase over the baseline (VmHWM - baseline), after the forward calls and after all
     calls, XLA's compiled temp + output bytes, and on accelerators the device allocator's peak.
Lengths run in increasing order. An op is not run at a length where its forward+backward, extrapolated from
its last measured length (as L^2 for dense; at the op's own measured growth, clamped to [L, L^2], for the
others), would exceed `--time_budget_s` ("skipped: time > budget"), nor at lengths above one where it was over
the memory budget or killed. Ops that only support `causal=False` run bidirectional under `--causal true`
(column `mode`).

Output (`--out_dir`, default `bench_out/`): `benchmark_ops.md` (table of absolute figures, ratios to dense
from the same run: speedup = dense_time / op_time, mem/dense = op_peak / dense_peak, "n/a" where dense has no
figure at that length; growth = fwd+bwd time(L) / time(L/2)), `benchmark_ops.json` (header + every field of
every row) and `benchmark_ops.png` (time and memory against L, log-log, one line per op). The header gives the
JAX version, device kind, CPU count, date and flags.

The measurement in a worker process is scripts/benchmark_worker.py's; the tables and the plot are
scripts/benchmark_report.py's.

Extension points (for the other packages' helpers):
  * Ops: every registered op appears here by name (how to register one: docs/design.md section 5), at its
    automatic plan parameters, the model's inputs from its registration's `bench_inputs` stand-ins (arrays
    closed over: compile-time constants). An op may return `(out, aux)`: only `out` is timed/diffed.
  * `--mode train` / `--mode input`: imported lazily from `scripts/benchmark_train.py` /
    `scripts/benchmark_input.py`, which define `main(args)`; `args` is this parser's `argparse.Namespace`
    (shared flags: lengths, batch, heads, head_dim, dtype, causal, repeats, out_dir, ops, memory_budget_gb,
    time_budget_s, seed) plus `args.extra`, the list of command-line flags this parser did not know (parse
    them with your own parser). Report through benchmark_report's `write_report(rows, columns, out_dir,
    name, header=header_info(args))` (and `plot_scaling` if useful) so every mode writes the same markdown +
    JSON; `add_ratios` computes ratios to a baseline row. benchmark_worker's `run_worker` and `median_time`
    are reusable for per-process measurements.
  * `--peers [a,b]`: rows from `scripts/benchmark_peers.py` (`PEERS: name -> factory(length, batch, heads,
    head_dim, causal, dtype) -> (fwd, fwdbwd)`), each measured in its own worker like the ops, as rows
    `peer:<name>`; `COUNTERPARTS` there names our ops each peer is compared with in `benchmark_peers.md`
    (ratio = peer time / our time).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from attention_core import (
  registry as ops_registry,  # imports no op package until a lookup (attention_core.registry.load)
)
from runtime import cli
from scripts.benchmark_report import (
  BASELINE,
  PEER_COLUMNS,
  add_ratios,
  format_value,
  header_info,
  op_columns,
  peer_comparisons,
  plot_scaling,
  write_report,
)
from scripts.benchmark_worker import (
  FLASH,
  SKIP_MEMORY,
  SKIP_NO_FLASH,
  row_name,
  run_worker,
  worker_command,
  worker_main,
)

DEFAULT_LENGTHS = tuple(1024 * 2**i for i in range(7))  # 1024 .. 65536

SKIP_TIME = "skipped: time > budget"

_MODE_MODULES = {
  "train": ("scripts.benchmark_train", "scripts/benchmark_train.py", "training throughput (models/ helper)"),
  "input": ("scripts.benchmark_input", "scripts/benchmark_input.py", "input pipelines (data/ helper)"),
}


def parse_bool(text: str | bool) -> bool:
  if isinstance(text, bool):
    return text
  lowered = text.strip().lower()
  if lowered in ("1", "true", "yes", "y", "on"):
    return True
  if lowered in ("0", "false", "no", "n", "off"):
    return False
  raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_lengths(text: str) -> list[int]:
  """"256,512" -> [256, 512] (sorted, unique); every length must be a positive integer."""
  try:
    lengths = sorted({int(t) for t in text.split(",") if t.strip()})
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"--lengths must be comma-separated integers, got {text!r}") from e
  if not lengths or lengths[0] < 1:
    raise argparse.ArgumentTypeError(f"--lengths must be positive integers, got {text!r}")
  return lengths


def parse_names(text: str | None, available: Sequence[str], *, flag: str) -> list[str]:
  """Comma list of names (None or "all" = every available one, in `available`'s order); an unknown name is a
  UsageError that lists the available ones (and the closest one to each typo)."""
  if text is None or text.strip() in ("", "all"):
    return list(available)
  names = [t.strip() for t in text.split(",") if t.strip()]
  unknown = [n for n in names if n not in available]
  if unknown:
    close = {n: difflib.get_close_matches(n, list(available), n=1) for n in unknown}
    hints = [repr(c[0]) if len(unknown) == 1 else f"{c[0]!r} for {n!r}" for n, c in close.items() if c]
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    raise cli.UsageError(f"{flag}: unknown {unknown}{hint}; available: {list(available)}")
  return list(dict.fromkeys(names))


def extrapolation_exponent(name: str, history: Sequence[tuple[int, float]]) -> float:
  """Exponent p in time ~ L^p used to predict the next length: 2 for dense (and when only one point is known),
  otherwise the op's measured growth between its last two lengths, clamped to [1, 2]."""
  if name == BASELINE or len(history) < 2:
    return 2.0
  (l0, t0), (l1, t1) = history[-2], history[-1]
  if l1 <= l0 or t0 <= 0 or t1 <= 0:
    return 2.0
  return min(2.0, max(1.0, math.log(t1 / t0) / math.log(l1 / l0)))


def predict_time(length: int, history: Sequence[tuple[int, float]], exponent: float) -> float | None:
  """Predicted fwd+bwd seconds at `length` from the last (length, seconds) measurement, or None."""
  if not history:
    return None
  last_length, last_time = history[-1]
  return last_time * (length / last_length) ** exponent


def time_skip_reason(name: str, length: int, history: Sequence[tuple[int, float]],
                     budget_s: float) -> str | None:
  """"skipped: time > budget (...)" when the predicted fwd+bwd time at `length` exceeds `budget_s`."""
  predicted = predict_time(length, history, extrapolation_exponent(name, history))
  if predicted is None or predicted <= budget_s:
    return None
  return f"{SKIP_TIME} (~{predicted:.0f} s predicted from L={history[-1][0]})"


def _progress(row: Mapping[str, Any]) -> None:
  print(f"[benchmark] {row['op']:<28} L={row['length']:<6} {row.get('mode') or '':<15} "
        f"fwd {format_value(row.get('fwd_ms')):>8} ms  fwd+bwd {format_value(row.get('fwdbwd_ms')):>8} ms  "
        f"peak {format_value(row.get('peak_mb')):>7} MB  xla {format_value(row.get('xla_mb')):>7} MB  "
        f"{row.get('status')}", flush=True)


def measure_all(args: argparse.Namespace, entries: Sequence[tuple[str, str]],
                notes: list[str] | None = None) -> list[dict[str, Any]]:
  """Rows for every (kind, name) entry at every length, in increasing length, applying the skip rules.

  A flash entry whose worker finds no fused kernel on the device gives no row (its reason goes to `notes`)
  and is not run again.
  """
  rows = []
  history: dict[str, list[tuple[int, float]]] = {}
  stopped: dict[str, str] = {}
  for length in args.lengths:
    for kind, name in entries:
      key = row_name(kind, name)
      row: dict[str, Any] = {"op": key, "length": length}
      # A time skip repeats by itself at larger L (the prediction only grows); memory skips and kills are
      # remembered.
      reason = stopped.get(key) or time_skip_reason(key, length, history.get(key, []), args.time_budget_s)
      if reason and reason.startswith(SKIP_NO_FLASH):
        continue
      if reason:
        row["status"] = reason
      else:
        parsed, failure = run_worker(worker_command(args, kind, name, length),
                                     timeout_s=args.worker_timeout_s)
        row.update(parsed or {"status": failure})
        status = row.get("status", "")
        if status.startswith(SKIP_NO_FLASH):
          if notes is not None:
            notes.append(f"{FLASH} (the backend's fused attention kernel): {status}")
          stopped[key] = status
          continue
        if status.startswith(SKIP_MEMORY):
          stopped[key] = f"{SKIP_MEMORY} (at L={length} already)"
        elif "killed" in status:
          stopped[key] = f"skipped: killed at L={length}"
        elif status == "ok":
          history.setdefault(key, []).append((length, row["fwdbwd_s"]))
      rows.append(row)
      _progress(row)
  return rows


def run_ops_mode(args: argparse.Namespace) -> dict[str, str]:
  available = ops_registry.names()
  names = parse_names(args.ops, [BASELINE] + [n for n in available if n != BASELINE], flag="--ops")
  entries = ([(FLASH, FLASH)] if args.flash else []) + [("op", n) for n in names]
  if args.peers is not None:
    from scripts.benchmark_peers import PEERS

    entries += [("peer", n) for n in parse_names(args.peers, list(PEERS), flag="--peers")]
  print(f"[benchmark] {len(entries)} rows x {len(args.lengths)} lengths: {[n for _, n in entries]}",
        flush=True)
  flash_notes: list[str] = []
  measured = measure_all(args, entries, flash_notes)
  device = next((r["device"] for r in measured if r.get("device")), None)
  accelerator = device is not None and not device.startswith("cpu")
  baseline = FLASH if any(r["op"] == FLASH and r.get("status") == "ok" for r in measured) else BASELINE
  peak = "device_peak_mb" if accelerator else "peak_mb"
  rows = add_ratios(measured, baseline=baseline,
                    memory_fields=((peak, "mem_ratio"), ("xla_mb", "xla_mem_ratio")))
  header = header_info(args, device=device)
  notes = [
    f"shapes: q, k, v [batch={args.batch}, L, heads={args.heads}, head_dim={args.head_dim}], {args.dtype}",
    "fwd / fwd+bwd ms: median of repeats after a warm-up, compile excluded; fwd+bwd = grad of "
    "sum(out * random cotangent) w.r.t. q, k, v",
    "peak MB: the worker process's peak-RSS increase over its baseline after inputs were created "
    "(host memory); device peak MB: the accelerator allocator's peak_bytes_in_use in the op's own process "
    "(inputs included; n/a on CPU); XLA MB: compiled temp + output bytes (max of fwd and fwd+bwd)",
    f"speedup = {baseline} time / op time, mem/{baseline} = op {peak} / {baseline} {peak}, both against "
    f"{baseline} in this run at the same L (n/a: no {baseline} figure there); growth = fwd+bwd time(L) / "
    "time(L/2)",
    "mode with *: the op supports only that direction",
    *flash_notes,
  ]
  paths = write_report(rows, op_columns(baseline), args.out_dir, "benchmark_ops", header=header, notes=notes,
                       title="Attention ops: time and memory")
  paths["png"] = plot_scaling(rows, os.path.join(args.out_dir, "benchmark_ops.png"),
                              title=f"{header['device']}, jax {header['jax']}, batch {args.batch}, heads "
                                    f"{args.heads}, head_dim {args.head_dim}, {args.dtype}, "
                                    f"{'causal' if args.causal else 'bidirectional'}")
  with open(paths["markdown"]) as f:
    print(f.read())
  if args.peers is not None:
    from scripts.benchmark_peers import COUNTERPARTS

    comparisons = peer_comparisons(rows, COUNTERPARTS)
    peer_paths = write_report(comparisons, PEER_COLUMNS, args.out_dir, "benchmark_peers", header=header,
                              title="Peers against our counterpart ops",
                              notes=["ratio = peer time / our time: >= 1 means ours is at least as fast"])
    paths.update(peers_markdown=peer_paths["markdown"], peers_json=peer_paths["json"])
    with open(peer_paths["markdown"]) as f:
      print(f.read())
  print(f"[benchmark] wrote {', '.join(paths.values())}", flush=True)
  return paths


def run_delegated_mode(args: argparse.Namespace) -> Any:
  module_name, path, what = _MODE_MODULES[args.mode]
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name != module_name:
      raise
    raise SystemExit(f"--mode {args.mode} ({what}) needs {path}, which is missing") from None
  return module.main(args)


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(prog="python -m scripts.benchmark", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
  parser.add_argument("-h", "--help", action="store_true",
                      help="show this help (with --mode M: also M's flags)")
  parser.add_argument("--mode", choices=("ops", *_MODE_MODULES), default="ops")
  parser.add_argument("--ops", default=None, help="comma list of registered ops (default: all)")
  parser.add_argument("--lengths", type=parse_lengths, default=list(DEFAULT_LENGTHS),
                      help="comma list (default 1024..65536, powers of 2)")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"))
  parser.add_argument("--causal", type=parse_bool, default=True, help="true|false (default true)")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed calls after one warm-up (median; default 3, --mode input: 10 train steps)")
  parser.add_argument("--out_dir", default="bench_out")
  parser.add_argument("--memory_budget_gb", type=float, default=None,
                      help="GiB; skip an (op, L) whose XLA footprint exceeds it (default: 85%% of this "
                           "machine's memory, or of the accelerator's)")
  parser.add_argument("--time_budget_s", type=float, default=300.0,
                      help="skip an op at L when its predicted fwd+bwd time exceeds this")
  parser.add_argument("--worker_timeout_s", type=float, default=3600.0,
                      help="wall limit of one worker process")
  parser.add_argument("--peers", nargs="?", const="all", default=None,
                      help="also time scripts/benchmark_peers.py PEERS (all, or a comma list)")
  parser.add_argument("--flash", type=parse_bool, default=True,
                      help="also time the backend's fused attention kernel (cuDNN on GPU, the Pallas TPU "
                           "kernel on TPU; none on CPU) and take it as the ratios' baseline (default true)")
  parser.add_argument("--implementation", default=None,
                      help="passed as implementation= to every op whose signature takes it (default: the "
                           "op's own default, 'auto')")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--_kind", choices=("op", "peer", FLASH), default="op", help=argparse.SUPPRESS)
  parser.add_argument("--_name", default=None, help=argparse.SUPPRESS)
  return parser


def print_mode_help(parser: argparse.ArgumentParser, mode: str) -> None:
  """`--mode M --help`: the shared flags, then the flags of mode M's own module."""
  module_name, _, what = _MODE_MODULES[mode]
  parser.print_help()
  print(f"\n--mode {mode} ({what}) also takes:\n")
  importlib.import_module(module_name).build_parser().print_help()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = build_parser()
  argv = list(sys.argv[1:] if argv is None else argv)
  args, extra = parser.parse_known_args(argv)
  if extra and args.mode == "ops":
    parser.error(f"unrecognized arguments: {' '.join(extra)}")
  for flag in ("batch", "heads", "head_dim", "repeats"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
  for flag in ("memory_budget_gb", "time_budget_s", "worker_timeout_s"):
    if getattr(args, flag) is not None and not getattr(args, flag) > 0:
      parser.error(f"--{flag} must be > 0, got {getattr(args, flag)}")
  if args.mode != "input" and args.repeats is None:
    args.repeats = 3
  if args.help:
    if args.mode == "ops":
      parser.print_help()
    else:
      print_mode_help(parser, args.mode)
    parser.exit()
  args.extra = extra
  args._argv = argv
  return args


def main(argv: Iterable[str] | None = None) -> Any:
  args = parse_args(None if argv is None else list(argv))
  if args._worker:
    return worker_main(args)
  if args.mode == "ops":
    run_ops_mode(args)
    return 0
  return run_delegated_mode(args)


if __name__ == "__main__":
  sys.exit(cli.run(main))
