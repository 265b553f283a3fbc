"""Device memory of attention forward+backward on a TPU, from the real TPU compiler run ahead of time here.

    python -m scripts.tpu_memory --lengths 16384,65536 --ops splash,splash_contract,combiner_fixed
    python -m scripts.tpu_memory --lengths 16384 --ops dense,flash_legacy,sparse_fixed,sparse_fixed_splash

Compiles jax.vjp of each op (bfloat16, batch 1, 16 heads, head_dim 128, causal, the cotangent an input as in
training) for one chip of `--topology` with libtpu and prints the temporaries XLA allocates
(`memory_analysis().temp_size_in_bytes`) and their ratio to Splash attention's in the op contract's layout
("splash_contract": [batch, L, heads, d] transposed to Splash's [heads, L, d]); "splash" is Splash on its own
layout. A registered op runs its TPU kernel ("pallas", or "auto" for the ops whose TPU kernel is Splash:
`dense`, `local`, `longformer`); "flash_legacy" is JAX's older Pallas TPU flash kernel in the contract's
layout (the benchmark's TPU flash baseline), "sparse_fixed_splash" the `sparse_fixed` pattern (own block plus
the summary positions j mod s = s - 1) as a Splash mask. Block/row sizes are sqrt(L) rounded to a power of
two, as the benchmark's; other plan parameters are the op's automatic ones.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention_baselines import dense as dense_module
from attention_baselines import splash as splash_op
from attention_core import registry as ops_registry
from runtime import cli
from scripts import compile_tpu  # noqa: F401  (libtpu for this process: scripts/compile_tpu.py)

HEADS, HEAD_DIM = 16, 128
KERNELS = ("splash", "splash_contract", "sparse_fixed_splash", "flash_legacy")  # beside the registered ops


def _splash(length: int):
  mask = masks.MultiHeadMask([masks.CausalMask((length, length)) for _ in range(HEADS)])
  return splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1)


class _SummaryMask(masks._ComputableMask):  # noqa: SLF001  (Splash's own masks subclass it)
  """Sparse Transformer "fixed" (causal): own block of `block` plus the positions j mod block = block - 1."""

  def __init__(self, length: int, block: int):
    self.block = block

    def allows(q_ids, kv_ids):
      div = (lambda x: x // block) if isinstance(q_ids, np.ndarray) else (lambda x: jax.lax.div(x, block))
      own = div(q_ids) == div(kv_ids)
      summary = kv_ids - div(kv_ids) * block == block - 1
      return (q_ids >= kv_ids) & (own | summary)

    super().__init__(shape=(length, length), mask_function=allows)

  def __eq__(self, other):
    return isinstance(other, _SummaryMask) and (self.shape, self.block) == (other.shape, other.block)

  def __hash__(self):
    return hash((type(self), self.shape, self.block))


def _contract_layout(kernel):
  """A Splash kernel on [heads, L, d] as (q, k, v) [1, L, heads, d] -> [1, L, heads, d], q scaled first."""
  heads_first = lambda x: jnp.swapaxes(x[0], 0, 1)  # noqa: E731  [1, L, h, d] -> [h, L, d]
  scale = (1 / np.sqrt(HEAD_DIM)).astype(np.float32)
  return lambda q, k, v: jnp.swapaxes(kernel(heads_first(q) * scale.astype(q.dtype), heads_first(k),
                                             heads_first(v)), 0, 1)[None]


def _implementation(spec) -> str:
  """The value of the op's `implementation` that runs its TPU kernel when lowered for TPU (its registration's
  `fused` path)."""
  return "pallas" if "pallas" in spec.fused.values_on("tpu") else "auto"


def op_fn(name: str, length: int):
  """(q, k, v) -> out in the op's layout, and that layout's shape."""
  block = 1 << round(np.log2(np.sqrt(length)))
  if name == "splash":
    return _splash(length), (HEADS, length, HEAD_DIM)
  shape = (1, length, HEADS, HEAD_DIM)
  if name == "splash_contract":
    return _contract_layout(_splash(length)), shape
  if name == "sparse_fixed_splash":
    tile = splash_op.tile(length, splash_op.Pattern(causal=True))  # summaries are in every tile: the widest
    sizes = splash.BlockSizes(tile, tile, tile, tile, tile, tile, tile, tile)
    mask = masks.MultiHeadMask([_SummaryMask(length, block)] * HEADS)
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)
    return _contract_layout(kernel), shape
  if name == "flash_legacy":
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    def legacy(q, k, v):
      qh, kh, vh = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # [1, heads, L, d]
      out = tpu_flash.flash_attention(qh, kh, vh, causal=True, sm_scale=HEAD_DIM**-0.5,
                                      block_sizes=dense_module.tpu_block_sizes(length))
      return jnp.swapaxes(out, 1, 2)  # [1, L, heads, d]
    return legacy, shape
  spec = ops_registry.get(name)
  params = {k: v for k, v in spec.params(length).items() if not hasattr(v, "shape")}  # plan parameters
  params.update({k: block for k in ("block_size", "row_length") if k in params})
  implementation = _implementation(spec)
  return (lambda q, k, v: spec.fn(q, k, v, causal=True, implementation=implementation, **params)), shape


def temp_bytes(name: str, length: int, device) -> int:
  fn, shape = op_fn(name, length)
  mesh = jax.sharding.Mesh(np.array([device]), ("x",))
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P()))

  def fwd_bwd(q, k, v, ct):
    _, vjp = jax.vjp(fn, q, k, v)
    return vjp(ct)

  return jax.jit(fwd_bwd).lower(x, x, x, x).compile().memory_analysis().temp_size_in_bytes


def main(argv: list[str]) -> int:
  """Bad flags: one `ERROR:` line on stderr, exit 2 (runtime/cli.py)."""
  return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
  parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lengths", default="16384,65536")
  parser.add_argument("--ops", default="splash,splash_contract,combiner_fixed")
  parser.add_argument("--topology", default="v5e",
                      help="a TPU generation: " + ", ".join(compile_tpu.GENERATIONS))
  args = parser.parse_args(argv)
  cli.one_of("--topology", args.topology, compile_tpu.GENERATIONS)
  try:
    lengths = [int(n) for n in args.lengths.split(",")]
  except ValueError:
    raise cli.UsageError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
  names = args.ops.split(",")
  for name in names:
    cli.one_of("--ops", name, [*KERNELS, *ops_registry.names()])
  gen = compile_tpu.GENERATIONS[args.topology]
  device = compile_tpu.devices(compile_tpu.Slice(gen, min(gen.shapes)))[0]
  print("| op | L | temporaries MiB | / splash_contract |\n|---|---|---|---|")
  for length in lengths:
    ref = temp_bytes("splash_contract", length, device)
    for name in names:
      got = ref if name == "splash_contract" else temp_bytes(name, length, device)
      ratio = f"{got / ref:.2f}" if ref else "-"  # short sequences may need no temporaries at all
      print(f"| {name} | {length} | {got / 2**20:.0f} | {ratio} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
