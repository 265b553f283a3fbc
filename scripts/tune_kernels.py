"""Times the block-sparse kernel's tile settings (combiner/flash.py) for a few ops on this accelerator.

    python -m scripts.tune_kernels --ops combiner_fixed,combiner_mixture --length 16384

Each variant sets the module's tile constants (the tile caps of this backend, SPLIT_TILES, and on GPU
num_warps / num_stages) in this process, recompiles every op's forward+backward (the benchmark's shapes:
batch 1, 16 heads, head_dim 64, causal, bfloat16) and prints the median time per call. The GPU defaults in
combiner/flash.py are the best row of such a run on an H100 (docs/benchmarks.md); re-tune for another device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

VARIANTS = (
    # (BLOCK_Q, BLOCK_K, SPLIT_TILES, num_warps, num_stages)
    (128, 128, 8, 4, 2),
    (64, 64, 8, 4, 2),
    (128, 128, 2, 4, 2),
    (128, 128, 1, 4, 2),
    (128, 128, 2, 8, 2),
    (128, 128, 2, 4, 3),
    (128, 64, 2, 4, 2),
    (64, 64, 2, 4, 2),
    (64, 128, 2, 4, 2),
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
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--ops", default="combiner_fixed,combiner_mixture")
  parser.add_argument("--length", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args(argv)
  from jax.experimental.pallas import triton as pltriton

  from combiner import flash

  names = [n.strip() for n in args.ops.split(",") if n.strip()]
  print("block_q block_k split warps stages  " + "  ".join(f"{n:>24s}" for n in names), flush=True)
  for bq, bk, split, warps, stages in VARIANTS:
    flash.BLOCK_Q, flash.BLOCK_K, flash.SPLIT_TILES = bq, bk, split
    flash.GPU_BLOCK_Q, flash.GPU_BLOCK_K = bq, bk
    flash.GPU_PARAMS = pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    cells = []
    for name in names:
      try:
        cells.append(f"{time_op(name, args.length, args):21.3f} ms")
      except Exception as err:  # a variant the lowering rejects
        cells.append(f"{'error ' + type(err).__name__:>24s}")
    print(f"{bq:7d} {bk:7d} {split:5d} {warps:5d} {stages:6d}  " + "  ".join(cells), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
