"""How many device operations an attention's forward+backward compiles to on a TPU, against dense attention.

    python -m scripts.tpu_structure                                   # the Combiner plans, 4K and 16K, v5e
    python -m scripts.tpu_structure --ops combiner_fixed,nsa --lengths 4096 --generations v4,v6e
    python -m scripts.tpu_structure --directions causal --markdown
    python -m scripts.tpu_structure --heads 12 --head_dim 64 --lengths 4096     # the paper models' heads
    python -m scripts.tpu_structure --ops combiner_routed --lengths 4096 --directions causal --breakdown

Compiles jax.grad of sum(op(q, k, v)) for one chip of each generation with libtpu ahead of time (bfloat16,
batch 1, 16 heads of head_dim 128 unless --heads / --head_dim say otherwise, `implementation="auto"`, block
and row sizes sqrt(L) rounded to a power of two, the op's other automatic parameters and its benchmark
stand-ins for model-owned arguments) and prints,
per op, length and direction: the device operations the compiled program executes
(`attention_core.hlo.device_ops`: each an HBM round trip on a TPU), its custom calls (kernels), its fusions,
the temporaries XLA allocates in HBM, and two ratios: device ops over dense attention's (Splash on TPU) at the
same shape, temporaries over the bytes of q + k + v. `--cotangent input` takes the output's cotangent as an
argument (a layer's backward in training) instead of the gradients of the sum, whose broadcast cotangent XLA
may materialise once per layout its readers take. `--breakdown` adds, after each row, its device ops grouped
by opcode and origin (`attention_core.hlo.device_op_breakdown`: the JAX primitive and kernel each comes from,
"XLA" for what the compiler added): where a count above dense attention's comes from. Exit status 0, or 2
for a bad flag (one line).
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention_core import contract, hlo
from attention_core import registry as ops_registry
from runtime import cli
from scripts import compile_tpu  # noqa: F401  (libtpu for this process: scripts/compile_tpu.py)

HEADS, HEAD_DIM, DTYPE = 16, 128, jnp.bfloat16
COMBINER = ("combiner_fixed", "combiner_logsparse", "combiner_axial_rowmajor", "combiner_axial_vertical",
            "combiner_axial_horizontal", "combiner_mixture", "combiner_mixture_joint", "sparse_fixed",
            "sparse_logsparse", "sparse_axial", "combiner_fixed_select")
BASELINE = "dense"


def op_fn(name: str, length: int, causal: bool, heads: int = HEADS, head_dim: int = HEAD_DIM):
  """(q, k, v) -> out, the op at `length` with its automatic parameters (block/row sizes sqrt(L), a power of
  two) and benchmark stand-ins, under implementation "auto" where it takes one."""
  spec = ops_registry.get(name)
  block = 1 << round(np.log2(np.sqrt(length)))
  params = ops_registry.bench_params(spec, length, batch=1, heads=heads, head_dim=head_dim,
                                     value_dim=head_dim, dtype=DTYPE)
  params.update({k: block for k in ("block_size", "row_length") if k in params})
  return lambda q, k, v: spec.fn(q, k, v, causal=causal, **params)


def measure(name: str, length: int, causal: bool, device: Any, heads: int = HEADS,
            cotangent: str = "sum", head_dim: int = HEAD_DIM) -> dict[str, float]:
  """Device ops, custom calls, fusions and temporary bytes of the op's forward+backward on `device`.
  cotangent: "sum", the gradients of sum(out) (XLA makes the cotangent, a broadcast of ones, and may make it
  once per layout its readers take, as temporaries); "input", the cotangent an argument, as a layer gets it
  in training."""
  fn = op_fn(name, length, causal, heads, head_dim)
  mesh = jax.sharding.Mesh(np.array([device]), ("x",))
  x = jax.ShapeDtypeStruct((1, length, heads, head_dim), DTYPE, sharding=NamedSharding(mesh, P()))

  def fwd_bwd(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

  def vjp(q, k, v, ct):
    return jax.vjp(fn, q, k, v)[1](ct)

  with contract.traced_for("tpu"):  # the TPU choices, whatever platform the caller traces for
    lowered = jax.jit(fwd_bwd).lower(x, x, x) if cotangent == "sum" else jax.jit(vjp).lower(x, x, x, x)
  compiled = lowered.compile()
  text = compiled.as_text()
  counts = hlo.device_ops(text)
  return {"ops": counts.ops, "custom_calls": counts.custom_calls, "fusions": counts.fusions,
          "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
          "breakdown": hlo.device_op_breakdown(text)}


def qkv_bytes(length: int, heads: int = HEADS, head_dim: int = HEAD_DIM) -> int:
  return 3 * length * heads * head_dim * jnp.dtype(DTYPE).itemsize


def device(generation: str) -> Any:
  """A compile-only device: one chip of the generation's smallest slice."""
  gen = compile_tpu.GENERATIONS[generation]
  return compile_tpu.devices(compile_tpu.Slice(gen, min(gen.shapes)))[0]


def rows(names: list[str], lengths: list[int], directions: list[bool], generations: list[str],
         cotangent: str = "sum", heads: int = HEADS, head_dim: int = HEAD_DIM):
  """Yields one result dict per (generation, length, direction, op), the dense baseline first."""
  shape = {"heads": heads, "head_dim": head_dim}
  for gen_name in generations:
    chip = device(gen_name)
    for length in lengths:
      for causal in directions:
        base = measure(BASELINE, length, causal, chip, cotangent=cotangent, **shape)
        for name in [BASELINE] + [n for n in names if n != BASELINE]:
          spec = ops_registry.get(name)
          if not (spec.causal if causal else spec.bidirectional):
            continue
          got = base if name == BASELINE else measure(name, length, causal, chip, cotangent=cotangent,
                                                      **shape)
          yield {"op": name, "generation": gen_name, "length": length, "causal": causal, **got,
                 "ops_ratio": got["ops"] / base["ops"],
                 "temp_ratio": got["temp_bytes"] / qkv_bytes(length, heads, head_dim)}


def main(argv: list[str]) -> int:
  parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--ops", default=",".join(COMBINER), help="registered attention names")
  parser.add_argument("--lengths", default="4096,16384")
  parser.add_argument("--directions", default="causal,bidirectional")
  parser.add_argument("--generations", default="v5e", help=", ".join(compile_tpu.GENERATIONS))
  parser.add_argument("--cotangent", default="sum", choices=("sum", "input"),
                      help="sum: gradients of sum(out); input: the output's cotangent an argument (training)")
  parser.add_argument("--heads", type=int, default=HEADS)
  parser.add_argument("--head_dim", type=int, default=HEAD_DIM)
  parser.add_argument("--markdown", action="store_true", help="a markdown table (docs/benchmarks.md)")
  parser.add_argument("--breakdown", action="store_true",
                      help="each row's device ops by opcode and origin, after the row (after the table with "
                           "--markdown)")
  args = parser.parse_args(argv)
  for flag, value in (("--heads", args.heads), ("--head_dim", args.head_dim)):
    if value < 1:
      print(f"ERROR: {flag} must be at least 1, got {value}", file=sys.stderr)
      return 2
  names = [n for n in args.ops.split(",") if n]
  known = ops_registry.names()
  generations = args.generations.split(",")
  for flag, values, allowed in (("--ops", names, known),
                                ("--generations", generations, list(compile_tpu.GENERATIONS)),
                                ("--directions", args.directions.split(","), ["causal", "bidirectional"])):
    bad = [v for v in values if v not in allowed]
    if bad:
      print(f"ERROR: {flag}: {', '.join(bad)} not one of {', '.join(allowed)}", file=sys.stderr)
      return 2
  try:
    lengths = [int(n) for n in args.lengths.split(",")]
  except ValueError:
    print(f"ERROR: --lengths must be comma-separated integers, got {args.lengths!r}", file=sys.stderr)
    return 2
  directions = [d == "causal" for d in args.directions.split(",")]
  header = ("| op | TPU | L | direction | device ops | custom calls | fusions | temporaries MiB | "
            "ops / dense | temporaries / (q+k+v) |")
  print(header + "\n|" + "---|" * 10 if args.markdown else header.replace("|", " ").strip(), flush=True)
  later = []  # the breakdowns, after a markdown table
  for r in rows(names, lengths, directions, generations, args.cotangent, args.heads, args.head_dim):
    cells = [r["op"], r["generation"], r["length"], "causal" if r["causal"] else "bidirectional", r["ops"],
             r["custom_calls"], r["fusions"], f"{r['temp_bytes'] / 2**20:.1f}", f"{r['ops_ratio']:.2f}",
             f"{r['temp_ratio']:.2f}"]
    line = " | ".join(str(c) for c in cells)
    print(f"| {line} |" if args.markdown else line, flush=True)
    if args.breakdown:
      parts = [f"{' '.join(str(c) for c in cells[:4])}: {r['ops']} device ops"]
      parts += [f"  {n:6d}  {op:<20s} {where}" for n, op, where in r["breakdown"]]
      if args.markdown:
        later.append("\n".join(parts))
      else:
        print("\n".join(parts[1:]), flush=True)
  if later:
    print("\n```\n" + "\n\n".join(later) + "\n```")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
