"""Times the Combiner kernels' tile settings (combiner/frames.py) for a few ops on this accelerator.

    python -m scripts.tune_kernels --ops combiner_fixed,combiner_mixture --length 16384

Each variant sets the kernels' tile cap (queries and keys inside a group) and, on GPU, Triton's num_warps /
num_stages in this process, recompiles every op's forward+backward (the benchmark's shapes: batch 1, 16
heads, head_dim 64, causal, bfloat16) and prints the median time per call. Keep the best row's settings in
combiner/frames.py (TILE, GPU_TILE, GPU_PARAMS) for the device it was measured on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

from runtime import cli

VARIANTS = (
    # (tile cap, num_warps, num_stages)
    (128, 4, 2),
    (64, 4, 2),
    (32, 4, 2),
    (128, 8, 2),
    (64, 8, 2),
    (64, 4, 3),
    (128, 4, 3),
)


def time_op(name: str, length: int, args: argparse.Namespace) -> float:
  """Median ms per forward+backward call of the op's Pallas path (causal, the benchmark's shapes)."""
  import jax

  from scripts.profile_ops import op_step

  step, xs, _ = op_step(name, length, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, causal=True,
                        implementation="pallas")
  jax.block_until_ready(step(*xs))
  times = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    jax.block_until_ready(step(*xs))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
  parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--ops", default="combiner_fixed,combiner_mixture")
  parser.add_argument("--length", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args(argv)
  from jax.experimental.pallas import triton as pltriton

  from combiner import frames

  names = [n.strip() for n in args.ops.split(",") if n.strip()]
  print("tile warps stages  " + "  ".join(f"{n:>24s}" for n in names), flush=True)
  for tile, warps, stages in VARIANTS:
    frames.TILE = frames.GPU_TILE = tile
    frames.GPU_PARAMS = pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    cells = []
    for name in names:
      try:
        cells.append(f"{time_op(name, args.length, args):21.3f} ms")
      except Exception as err:  # a variant the lowering rejects
        cells.append(f"{'error ' + type(err).__name__:>24s}")
    print(f"{tile:4d} {warps:5d} {stages:6d}  " + "  ".join(cells), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
