"""The fused accelerator paths equal the XLA paths they replace, on this machine's accelerator.

    python -m scripts.check_kernels [--length 1000] [--dtype float32]

The test suite checks the Pallas kernels in interpret mode on CPU; this script runs the same comparisons
compiled for the attached GPU (Triton) or TPU (Mosaic), where tile shapes, lowering rules and the hardware's
matmul precision differ. For every Combiner plan and sparse counterpart (implementation="pallas" against
"xla", with a random key mask, both directions, max/mean pooling, DeepSets pools and value_dim != head_dim),
for `dense` (implementation="flash" against "xla" on the same bfloat16 inputs upcast to float32) and for YOSO
(formulation="onehot" and the fused "pallas" kernels against "sorted", same hashes) it prints the relative
L2 error ||got - want|| / ||want|| of the output and of the gradients of sum(out * cotangent), and exits 1
when any is above its tolerance or not finite. Tolerances allow the accelerator's reduced-precision matmul
inputs (TF32 for float32, bfloat16), which put errors near 1e-3; a wrong index or mask gives errors near 1.
`python -m scripts.tpu run` runs it on one chip of worker 0 before training; train.py itself checks the
kernel its model uses, at the model's shapes, and under implementation="auto" falls back to the XLA path when
it fails (training/kernel_check.py).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TOLERANCE = {"float32": 1e-2, "bfloat16": 5e-2}


def _relative_error(got: Any, want: Any) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return float("inf")
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _inputs(key: Any, batch: int, length: int, heads: int, head_dim: int, value_dim: int, dtype: Any):
  """Random q, k [b, L, h, head_dim], v and cotangent [b, L, h, value_dim], mask [b, L] (first key real)."""
  keys = jax.random.split(key, 5)
  q, k = (jax.random.normal(kk, (batch, length, heads, head_dim), dtype) for kk in keys[:2])
  v = jax.random.normal(keys[2], (batch, length, heads, value_dim), dtype)
  cot = jax.random.normal(keys[3], v.shape, dtype)
  mask = jax.random.bernoulli(keys[4], 0.8, (batch, length)).at[:, 0].set(True)
  return q, k, v, cot, mask


def _errors(fn_got: Callable[..., Any], fn_want: Callable[..., Any], args: Sequence[Any], cot: Any,
            names: Sequence[str]) -> dict[str, float]:
  """Relative errors of out and of d sum(out * cot) / d args between two implementations."""
  def run(fn, *xs):
    out, vjp = jax.vjp(fn, *xs)
    return (out, *vjp(cot.astype(out.dtype)))

  got = jax.jit(functools.partial(run, fn_got))(*args)
  want = jax.jit(functools.partial(run, fn_want))(*args)
  return {name: _relative_error(a, b) for name, a, b in zip(("out", *names), got, want, strict=True)}


def combiner_cases(length: int) -> list[tuple[str, Callable[..., Any], dict[str, Any]]]:
  """(name, op, keywords) for every Combiner plan and sparse counterpart; block/row 32 (odd tail at 1000)."""
  import combiner
  from combiner import sparse

  size = 32
  plans = [
      ("combiner_fixed", functools.partial(combiner.fixed, block_size=size)),
      ("combiner_logsparse", combiner.logsparse),
      ("combiner_axial_rowmajor", functools.partial(combiner.axial, row_length=size, direction="rowmajor")),
      ("combiner_axial_vertical", functools.partial(combiner.axial, row_length=size, direction="vertical")),
      ("combiner_axial_horizontal",
       functools.partial(combiner.axial, row_length=size, direction="horizontal")),
      ("combiner_mixture", functools.partial(combiner.mixture, row_length=size)),
      ("combiner_mixture_joint", functools.partial(combiner.mixture, row_length=size, normalize="joint")),
  ]
  sparse_plans = [
      ("sparse_fixed", functools.partial(sparse.fixed, block_size=size)),
      ("sparse_axial", functools.partial(sparse.axial, row_length=size)),
      ("sparse_logsparse", sparse.logsparse),
  ]
  cases = []
  for i, (name, fn) in enumerate(plans):
    for causal in (True, False):
      pooling = ("max", "mean")[(i + causal) % 2]
      cases.append((f"{name} causal={causal} {pooling}", fn,
                    {"causal": causal, "pooling": pooling, "deepsets": i % 3 == causal}))
  for name, fn in sparse_plans:
    for causal in (True, False):
      cases.append((f"{name} causal={causal}", fn, {"causal": causal}))
  return cases


def check_combiner(args: argparse.Namespace, key: Any) -> list[tuple[str, dict[str, float]]]:
  dtype = jnp.dtype(args.dtype)
  results = []
  for name, fn, kw in combiner_cases(args.length):
    key, sub, pools_key = jax.random.split(key, 3)
    value_dim = args.head_dim // 2 if "axial" in name else args.head_dim
    q, k, v, cot, mask = _inputs(sub, 2, args.length, 2, args.head_dim, value_dim, dtype)
    kw = dict(kw)
    deepsets = kw.pop("deepsets", False)
    pools = ([jax.random.normal(kk, q.shape, dtype) for kk in jax.random.split(pools_key)]
             if deepsets else [])

    def op(implementation, q, k, v, *pools, fn=fn, kw=kw, mask=mask):
      extra = dict(zip(("pool_q", "pool_k"), pools, strict=False))
      return fn(q, k, v, mask=mask, implementation=implementation, **kw, **extra)

    names = ("dq", "dk", "dv") + (("dpool_q", "dpool_k") if deepsets else ())
    results.append((name + (" deepsets" if deepsets else ""),
                    _errors(functools.partial(op, "pallas"), functools.partial(op, "xla"),
                            (q, k, v, *pools), cot, names)))
  return results


def check_dense(args: argparse.Namespace, key: Any) -> list[tuple[str, dict[str, float]]]:
  from attention_baselines.dense import dense

  results = []
  for causal in (True, False):
    key, sub = jax.random.split(key)
    q, k, v, cot, mask = _inputs(sub, 2, args.length, 2, args.head_dim, args.head_dim, jnp.bfloat16)

    def got(q, k, v, causal=causal, mask=mask):
      return dense(q, k, v, causal=causal, mask=mask, implementation="flash").astype(jnp.float32)

    def want(q, k, v, causal=causal, mask=mask):
      f32 = [t.astype(jnp.float32) for t in (q, k, v)]
      return dense(*f32, causal=causal, mask=mask, implementation="xla")

    results.append((f"dense flash causal={causal} (bfloat16)",
                    _errors(got, want, (q, k, v), cot.astype(jnp.float32), ("dq", "dk", "dv"))))
  return results


def check_yoso(args: argparse.Namespace, key: Any) -> list[tuple[str, dict[str, float]]]:
  from yoso.attention import yoso

  results = []
  for backward_features in (None, 1):
    key, sub, rng = jax.random.split(key, 3)
    q, k, v, cot, mask = _inputs(sub, 2, args.length, 2, args.head_dim, args.head_dim, jnp.float32)

    def op(formulation, q, k, v, rng=rng, mask=mask, backward_features=backward_features):
      return yoso(q, k, v, rng=rng, num_hashes=8, tau=6, mask=mask, formulation=formulation,
                  backward_features=backward_features)

    label = "yoso" if backward_features is None else "yoso_sketch"
    for formulation in ("onehot", "pallas"):
      results.append((f"{label} {formulation} vs sorted",
                      _errors(functools.partial(op, formulation), functools.partial(op, "sorted"),
                              (q, k, v), cot, ("dq", "dk", "dv"))))
  return results


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--length", type=int, default=1000)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
  parser.add_argument("--only", default="combiner,dense,yoso", help="comma list of: combiner, dense, yoso")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  device = jax.local_devices()[0]
  print(f"device: {device.platform} ({device.device_kind}), jax {jax.__version__}, L={args.length}, "
        f"{args.dtype}", flush=True)
  checks = {"combiner": check_combiner, "dense": check_dense, "yoso": check_yoso}
  only = [name.strip() for name in args.only.split(",") if name.strip()]
  unknown = sorted(set(only) - set(checks))
  if unknown:
    parser.error(f"argument --only: unknown {unknown}; choose from {sorted(checks)}")
  tolerance = TOLERANCE[args.dtype]
  failed = 0
  key = jax.random.key(args.seed)
  for name in only:
    key, sub = jax.random.split(key)
    start = time.perf_counter()
    try:
      results = checks[name](args, sub)
    except Exception as err:  # report and go on: one broken lowering should not hide the others
      print(f"{name}: ERROR {type(err).__name__}: {str(err)[:2000]}", flush=True)
      failed += 1
      continue
    for case, errors in results:
      worst = max(errors.values())
      ok = worst <= tolerance
      failed += not ok
      detail = " ".join(f"{k}={v:.1e}" for k, v in errors.items())
      print(f"{'ok  ' if ok else 'FAIL'} {case:48s} {detail}", flush=True)
    print(f"  ({name}: {time.perf_counter() - start:.0f} s)", flush=True)
  print(f"{failed} failed" if failed else f"all passed (tolerance {tolerance:.0e})")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
