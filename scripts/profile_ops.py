"""Where an op's forward+backward time goes on this machine's accelerator: device time per kernel.

    python -m scripts.profile_ops --ops combiner_fixed,combiner_mixture --length 16384 [--top 15]

Runs each registered op's jitted forward+backward (the benchmark's shapes and defaults: batch 1, causal,
`--dtype`) a few times under `jax.profiler.trace` with a Perfetto trace, then sums the device events of the
timed calls by kernel name and prints the largest: the Pallas kernels by their kernel function's name, XLA's
fusions by theirs. The sum against the wall time per call says how much is launch gaps and host overhead.
Needs an accelerator (on CPU the trace holds host threads only).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from runtime import cli


def device_kernel_times(trace_path: str) -> tuple[collections.Counter, int]:
  """({kernel name: summed µs}, event count) of the complete events of a Perfetto trace's device processes."""
  with gzip.open(trace_path) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  device_pids = {e["pid"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"
                 and "/device:" in str(e.get("args", {}).get("name", ""))}
  totals: collections.Counter = collections.Counter()
  count = 0
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e:
      totals[e["name"]] += float(e["dur"])
      count += 1
  return totals, count


def op_step(name: str, length: int, *, heads: int, head_dim: int, dtype: str, causal: bool,
            implementation: str | None = None) -> tuple[Any, list[Any], str]:
  """(jitted grad of sum(op(q, k, v) * cot) w.r.t. q, k, v, [q, k, v, cot] random [1, L, heads, head_dim],
  the direction run) for a registered op with the benchmark's parameters."""
  import jax
  import jax.numpy as jnp

  from attention_core import registry as ops_registry
  from scripts.benchmark_worker import op_forward

  forward, mode, _ = op_forward(ops_registry.get(name), length, causal=causal, batch=1, heads=heads,
                                head_dim=head_dim, dtype=dtype, implementation=implementation)

  def loss(q, k, v, cot):
    return jnp.sum((forward(q, k, v) * cot).astype(jnp.float32))

  keys = jax.random.split(jax.random.key(0), 4)
  xs = [jax.random.normal(k, (1, length, heads, head_dim), jnp.dtype(dtype)) for k in keys]
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), xs, mode


def profile(name: str, length: int, args: argparse.Namespace) -> None:
  import jax

  step, xs, mode = op_step(name, length, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
                             causal=args.causal, implementation=args.implementation)
  jax.block_until_ready(step(*xs))
  start = time.perf_counter()
  for _ in range(args.calls):
    jax.block_until_ready(step(*xs))
  wall_ms = (time.perf_counter() - start) / args.calls * 1e3
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(args.calls):
        jax.block_until_ready(step(*xs))
    paths = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
      print(f"{name}: no Perfetto trace written", flush=True)
      return
    totals, count = device_kernel_times(paths[0])
  device_ms = sum(totals.values()) / 1e3 / args.calls
  print(f"\n{name} L={length} {mode}: wall {wall_ms:.3f} ms/call, device kernels {device_ms:.3f} "
        f"ms/call, {count / args.calls:.0f} kernels/call", flush=True)
  for kernel, us in totals.most_common(args.top):
    share = 100 * us / max(sum(totals.values()), 1)
    print(f"  {us / args.calls / 1e3:8.3f} ms  {share:5.1f}%  {kernel[:110]}")


def main(argv: Sequence[str] | None = None) -> int:
  parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--ops", required=True, help="comma list of registered ops")
  parser.add_argument("--length", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--causal", default="true", choices=("true", "false"))
  parser.add_argument("--implementation", default=None, help="passed to ops that take one")
  parser.add_argument("--calls", type=int, default=5)
  parser.add_argument("--top", type=int, default=15)
  args = parser.parse_args(argv)
  args.causal = args.causal == "true"
  for name in [n.strip() for n in args.ops.split(",") if n.strip()]:
    try:
      profile(name, args.length, args)
    except Exception as err:  # one failing op should not hide the others
      print(f"{name}: ERROR {type(err).__name__}: {str(err)[:1000]}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
