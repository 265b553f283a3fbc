r"""Sequence-parallel attention on simulated CPU devices: communication and memory from the compiled program.

    python -m scripts.seq_parallel --length 65536            # collective bytes: combiner_fixed vs dense
    python -m scripts.seq_parallel --length 131072 --ops all # every op with a sequence-parallel form
    python -m scripts.seq_parallel --length 1048576 --ops combiner_fixed --dtype bfloat16 --chunk_blocks 1 \
        --run                                                # memory analysis, then one forward+backward

For each op it compiles forward + backward (loss = sum of the outputs, gradients for q, k and v) with the
sequence split over a `seq` mesh axis of `--devices` simulated CPU devices (the op's registered
sequence-parallel form at its automatic plan parameters for L), and prints the bytes each device receives over
all collectives (`attention_core.hlo`, read from the compiled HLO), their ratio to dense's K/V all-gather when
dense is among the ops, the budget 4 x (L / block) x heads x head_dim elements, and XLA's memory analysis (per
device and over all devices). Nothing is executed unless `--run` is given; then the op runs once and the wall
time is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from runtime import cli


def _parse(argv: list[str]) -> argparse.Namespace:
  p = cli.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--length", type=int, default=65536)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--block_size", type=int, default=0, help="0 = sqrt(L) rounded to a power of two")
  p.add_argument("--chunk_blocks", type=int, default=0,
                 help="combiner_fixed, sparse_fixed: query blocks per step on each device (0 = all)")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--ops", default="combiner_fixed,dense",
                 help="comma-separated registry names with a sequence-parallel form, or 'all' (dense first)")
  p.add_argument("--causal", type=int, default=1)
  p.add_argument("--run", action="store_true", help="execute forward+backward once (after the analysis)")
  p.add_argument("--max_gib", type=float, default=10.0,
                 help="--run refuses when the analysis says this many GiB or more over all devices")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
  """Bad flags (an op with no sequence-parallel form, too few devices): one `ERROR:` line, exit 2."""
  return cli.run(_main, argv)


def _main(argv: list[str] | None) -> dict:
  args = _parse(sys.argv[1:] if argv is None else argv)
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
  # JAX (and what imports it) only now: XLA_FLAGS must be set before JAX starts.
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from attention_core import hlo, registry
  from attention_core.registry import sqrt_pow2

  if len(jax.devices()) < args.devices:
    raise cli.UsageError(f"--devices {args.devices}: JAX sees {len(jax.devices())} devices (was XLA_FLAGS "
                         "set with a smaller --xla_force_host_platform_device_count?)")
  mesh = jax.make_mesh((args.devices,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:args.devices])
  length, block = args.length, args.block_size or sqrt_pow2(args.length)
  shape = (args.batch, length, args.heads, args.head_dim)
  dtype = jnp.dtype(args.dtype)
  sharding = NamedSharding(mesh, P(None, "seq"))
  abstract = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for _ in range(3)]
  # Elements of the summaries, which are computed in float32 (the softmax dtype) whatever the input dtype.
  budget = 4 * (length // block) * args.heads * args.head_dim * args.batch * 4
  print(f"jax {jax.__version__}, {args.devices} simulated {jax.devices()[0].platform} devices; L={length} "
        f"block={block} batch={args.batch} heads={args.heads} head_dim={args.head_dim} {args.dtype} "
        f"causal={bool(args.causal)}")
  print(f"budget 4 x (L/block) x heads x head_dim x batch = {budget / 2**20:.3f} MiB per device")
  results = {}
  with_form = [n for n in registry.names() if registry.get(n).seq_parallel is not None]
  names = ["dense"] + [n for n in with_form if n != "dense"] if args.ops == "all" else args.ops.split(",")
  for name in names:  # all refused before the first compile
    if name not in with_form:
      known = "has no sequence-parallel form" if name in registry.names() else "is no registered op"
      raise cli.UsageError(f"--ops: {name!r} {known}; ops with one: {with_form}")
  for name in names:
    spec = registry.get(name)
    op = spec.seq_parallel
    params = spec.params(length)
    if "block_size" in params:
      params["block_size"] = block
    if args.chunk_blocks and name in ("combiner_fixed", "sparse_fixed"):
      params["chunk_blocks"] = args.chunk_blocks
    kw = dict(causal=bool(args.causal), mesh=mesh, **params)

    def loss(q, k, v, op=op, kw=kw):
      return jnp.sum(op(q, k, v, **kw), dtype=jnp.float32)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    t0 = time.perf_counter()
    compiled = step.lower(*abstract).compile()
    compile_s = time.perf_counter() - t0
    traffic = hlo.summary(compiled.as_text())
    mem = compiled.memory_analysis()
    per_device = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                  - mem.alias_size_in_bytes)
    total = per_device * args.devices
    results[name] = {"collective_bytes": traffic["total"], "per_device_bytes": per_device,
                     "total_bytes": total, "params": params}
    kinds = ", ".join(f"{k} {v / 2**20:.3f}" for k, v in traffic.items() if k != "total")
    vs_dense = (f"{traffic['total'] / results['dense']['collective_bytes']:.4f} x dense; "
                if "dense" in results and name != "dense" else "")
    print(f"{name:25s} {params} collectives {traffic['total'] / 2**20:10.3f} MiB per device ({kinds}); "
          f"{vs_dense}{traffic['total'] / budget:.3f} x budget; memory per device: "
          f"args {mem.argument_size_in_bytes / 2**30:.2f} + out {mem.output_size_in_bytes / 2**30:.2f} "
          f"+ temp {mem.temp_size_in_bytes / 2**30:.2f} = {per_device / 2**30:.2f} GiB, "
          f"{total / 2**30:.2f} GiB over {args.devices} devices; compile {compile_s:.1f} s", flush=True)
    if args.run:
      if total / 2**30 >= args.max_gib:
        print(f"{name}: not run, the analysis says {total / 2**30:.2f} GiB >= --max_gib {args.max_gib}")
        continue
      # Inputs are drawn already sharded: no device ever holds a whole sequence.
      draw = jax.jit(lambda key: jax.random.normal(key, shape, dtype), out_shardings=sharding)
      q, k, v = (draw(kk) for kk in jax.random.split(jax.random.key(0), 3))
      t0 = time.perf_counter()
      value, grads = compiled(q, k, v)
      jax.block_until_ready(grads)
      run_s = time.perf_counter() - t0
      finite = bool(jnp.isfinite(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
      results[name]["run_s"] = run_s
      print(f"{name}: forward+backward ran in {run_s:.1f} s, loss {float(value):.6g}, finite={finite}",
            flush=True)
  if "dense" in results:
    for name, r in results.items():
      if name != "dense":
        ratio = r["collective_bytes"] / results["dense"]["collective_bytes"]
        print(f"{name} / dense collective bytes per device: {ratio:.5f} (1/{1 / ratio:.1f})")
  return results


if __name__ == "__main__":
  main()
