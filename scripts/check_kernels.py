"""The fused accelerator paths equal the XLA paths they replace, on this machine's accelerator.

    python -m scripts.check_kernels [--length 1000] [--dtype float32] [--only combiner,dense]

The test suite checks the Pallas kernels in interpret mode on CPU; this script runs the same comparisons
compiled for the attached GPU (Triton) or TPU (Mosaic), where tile shapes, lowering rules and the hardware's
matmul precision differ. For every registered op with a fused path (`attention_core.registry.fused_path`: the
Combiner plans and sparse counterparts' implementation="pallas", dense's "flash" (bfloat16 inputs against
"xla" on float32 copies), the Splash baselines' "splash", YOSO's formulation="onehot" and "pallas" against
"sorted" with the same hashes), each value that runs on this platform against the op's XLA value, in every
direction it runs fused, with a random key mask (padded query rows are don't-care: finite, not compared, no
cotangent), max/mean pooling, DeepSets pools and value_dim != head_dim
across the cases where the op takes them, it prints the relative L2 error ||got - want|| / ||want|| of the
output and of the gradients of sum(out * cotangent), and exits 1 when any is above its tolerance or not
finite. Tolerances allow the accelerator's reduced-precision matmul inputs (TF32 for float32, bfloat16), which
put errors near 1e-3; a wrong index or mask gives errors near 1. `python -m scripts.tpu run` runs it on one
chip of worker 0 before training; train.py itself checks the kernel its model uses, at the model's shapes, and
under implementation="auto" falls back to the XLA path when it fails (training/kernel_check.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_core import registry
from runtime import cli
from training.kernel_check import relative_error

TOLERANCE = {"float32": 1e-2, "bfloat16": 5e-2}
# Fused values that take half-precision inputs only (cuDNN flash): run in bfloat16 against the reference on
# float32 copies of the same inputs.
HALF_PRECISION_ONLY = ("flash",)


def _inputs(key: Any, batch: int, length: int, heads: int, head_dim: int, value_dim: int, dtype: Any):
  """Random q, k [b, L, h, head_dim], v and cotangent [b, L, h, value_dim], mask [b, L] (first key real)."""
  keys = jax.random.split(key, 5)
  q, k = (jax.random.normal(kk, (batch, length, heads, head_dim), dtype) for kk in keys[:2])
  v = jax.random.normal(keys[2], (batch, length, heads, value_dim), dtype)
  cot = jax.random.normal(keys[3], v.shape, dtype)
  mask = jax.random.bernoulli(keys[4], 0.8, (batch, length)).at[:, 0].set(True)
  return q, k, v, cot, mask


def _errors(fn_got: Callable[..., Any], fn_want: Callable[..., Any], args: Sequence[Any], cot: Any,
            names: Sequence[str], real: Any) -> dict[str, float]:
  """Relative errors of out and of d sum(out * cot) / d args between two implementations. Padded query rows
  (`real` [batch, length] False) are don't-care under the op contract: they carry no cotangent, and their
  outputs must be finite but are not compared."""
  rows = np.asarray(real)[:, :, None, None]

  def run(fn, *xs):
    out, vjp = jax.vjp(fn, *xs)
    return (out, *vjp(jnp.where(rows, cot, 0).astype(out.dtype)))

  got = jax.jit(functools.partial(run, fn_got))(*args)
  want = jax.jit(functools.partial(run, fn_want))(*args)
  errors = {"out": relative_error(got[0], want[0], rows)}
  errors.update({name: relative_error(a, b) for name, a, b in zip(names, got[1:], want[1:], strict=True)})
  return errors


@dataclasses.dataclass(frozen=True)
class Case:
  """One comparison: op `name` with `argument=value` against `argument=reference`."""
  name: str
  argument: str
  value: str
  reference: str
  causal: bool
  pooling: str | None = None  # the op's `pooling`, when it takes one
  deepsets: bool = False  # differentiated DeepSets pools (pool_q, pool_k), when it takes them
  half_value_dim: bool = False  # value_dim = head_dim / 2

  @property
  def label(self) -> str:
    parts = [self.name, self.value, "vs", self.reference, f"causal={self.causal}"]
    parts += [self.pooling] if self.pooling else []
    parts += ["deepsets"] if self.deepsets else []
    parts += ["e=d/2"] if self.half_value_dim else []
    return " ".join(parts)


def select(only: str | None) -> list[str]:
  """The registered ops with a fused path that `--only` names (an op's name, else a prefix of names such as
  "combiner", "sparse"); all of them for None. ValueError naming a word that matches nothing."""
  fused = sorted(registry.fused_ops())
  if only is None:
    return fused
  chosen = set()
  for word in (w.strip() for w in only.split(",") if w.strip()):
    matches = [word] if word in fused else [n for n in fused if n.startswith(word + "_")]
    if not matches:
      raise ValueError(f"--only: {word!r} names no op with a fused path; choose from {fused} or a prefix "
                       "such as combiner, sparse, yoso")
    chosen.update(matches)
  return sorted(chosen)


def cases(names: Sequence[str], platform: str) -> list[Case]:
  """Every accelerated value on `platform` of each op, in each direction it runs fused, varying the pooling
  (max / mean), DeepSets pools and value_dim != head_dim across cases where the op takes them."""
  out = []
  for name in names:
    spec, path = registry.get(name), registry.fused_path(registry.get(name))
    directions = ([True] if spec.causal and path.causal else []) + ([False] if spec.bidirectional else [])
    for value in path.values_on(platform):
      for causal in directions:
        i = len(out)
        out.append(Case(name, path.argument, value, path.reference, causal,
                        pooling=("max", "mean")[i % 2] if "pooling" in spec.plan else None,
                        deepsets="pool_q" in spec.inputs and i % 3 == 0,
                        half_value_dim=value not in HALF_PRECISION_ONLY and i % 2 == 1))
  return out


def check(case: Case, args: argparse.Namespace, key: Any) -> dict[str, float]:
  """Relative errors of the fused value against the reference for one case (random inputs, a key mask)."""
  spec = registry.get(case.name)
  half = case.value in HALF_PRECISION_ONLY  # run in bfloat16, compared with the reference on float32 copies
  dtype = jnp.bfloat16 if half else jnp.dtype(args.dtype)
  value_dim = args.head_dim // 2 if case.half_value_dim else args.head_dim
  key, sub, pools_key = jax.random.split(key, 3)
  q, k, v, cot, mask = _inputs(sub, 2, args.length, 2, args.head_dim, value_dim, dtype)
  params = registry.bench_params(spec, args.length, batch=2, heads=2, head_dim=args.head_dim,
                                 dtype=str(jnp.dtype(dtype)))
  if case.pooling is not None:
    params["pooling"] = case.pooling
  pools = [jax.random.normal(kk, q.shape, dtype) for kk in jax.random.split(pools_key)] if case.deepsets \
      else []

  def op(value, q, k, v, *pools):
    if value == case.reference and half:
      q, k, v, *pools = (t.astype(jnp.float32) for t in (q, k, v, *pools))
    extra = dict(zip(("pool_q", "pool_k"), pools, strict=False))
    out = spec.fn(q, k, v, causal=case.causal, mask=mask, **{case.argument: value}, **params, **extra)
    return out.astype(jnp.float32) if half else out

  names = ("dq", "dk", "dv") + (("dpool_q", "dpool_k") if case.deepsets else ())
  return _errors(functools.partial(op, case.value), functools.partial(op, case.reference), (q, k, v, *pools),
                 cot.astype(jnp.float32) if half else cot, names, mask)


def main(argv: Sequence[str] | None = None) -> int:
  parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--length", type=int, default=1000)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
  parser.add_argument("--only", default=None,
                      help="comma list of registered ops or name prefixes (combiner, sparse, dense, yoso); "
                           "default: every op with a fused path")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  try:
    names = select(args.only)
  except ValueError as err:
    parser.error(str(err))
  device = jax.local_devices()[0]
  print(f"device: {device.platform} ({device.device_kind}), jax {jax.__version__}, L={args.length}, "
        f"{args.dtype}", flush=True)
  tolerance = TOLERANCE[args.dtype]
  failed = 0
  key = jax.random.key(args.seed)
  start = time.perf_counter()
  for case in cases(names, device.platform):
    key, sub = jax.random.split(key)
    try:
      errors = check(case, args, sub)
    except Exception as err:  # report and go on: one broken lowering should not hide the others
      print(f"ERROR {case.label}: {type(err).__name__}: {str(err)[:2000]}", flush=True)
      failed += 1
      continue
    worst = max(errors.values())
    ok = worst <= tolerance
    failed += not ok
    detail = " ".join(f"{k}={v:.1e}" for k, v in errors.items())
    print(f"{'ok  ' if ok else 'FAIL'} {case.label:56s} {detail}", flush=True)
  print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
  print(f"{failed} failed" if failed else f"all passed (tolerance {tolerance:.0e})")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
