r"""Cached decoding speed: time per token at a position; a whole sequence by decoding vs re-running forward.

    python -m scripts.benchmark_decode                       # the CIFAR-10 ablation model (6 x 512, 8 heads)
    python -m scripts.benchmark_decode --ops dense,combiner_fixed --position 8191 --image_length 0

per_token: one jitted `decode` step of the whole model at `--position` (cache of `--position + 1` tokens; the
step's cost does not depend on the cache contents), median of `--repeats` after warm-up, per op.
generate: `--image_length` tokens (a CIFAR-10 image) sampled by cached decoding (prefill of BOS, then one
compiled scan), against re-running the full forward pass for every token, whose cost is the measured time of
one forward pass at full length times the number of tokens (each re-run costs at most that, causal prefixes
being shorter; the ratio is therefore an upper bound on that baseline's time, stated in the output).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from runtime import cli


def model_config(attention: str, *, layers: int, features: int, heads: int) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({
      "num_layers": layers, "features": features, "num_heads": heads, "mlp_dim": 4 * features,
      "dropout_rate": 0.0, "dtype": "float32", "position_embedding": "learned",
      "attention": {"name": attention, "params": {}, "dropout_rate": 0.0}})


def _median_time(fn, repeats: int) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def per_token(attention: str, position: int, args: argparse.Namespace) -> float:
  from models import transformer
  from models.generate import Decoder

  cfg = model_config(attention, layers=args.layers, features=args.features, heads=args.heads)
  model = transformer.build_model(cfg, task="image", vocab_size=256, seq_len=position + 1)
  dec = Decoder(model)
  state = {"cache": dec.init_cache(1, position + 1)}
  tokens = jnp.zeros((1,), jnp.int32)

  def step():  # the cache is donated to each step and replaced by the one it returns
    logits, state["cache"] = dec.decode(state["cache"], tokens, position)
    return logits

  return _median_time(step, args.repeats)


def whole_sequence(attention: str, length: int, args: argparse.Namespace) -> tuple[float, float]:
  from models import transformer
  from models.generate import Decoder

  cfg = model_config(attention, layers=args.layers, features=args.features, heads=args.heads)
  model = transformer.build_model(cfg, task="image", vocab_size=256, seq_len=length)
  dec = Decoder(model)
  prompt = jnp.zeros((1, 0), jnp.int32)
  cached = _median_time(lambda: dec.generate(jax.random.key(0), prompt, length=length, max_length=length,
                                             temperature=1.0, top_k=0, top_p=1.0), 1)
  forward = jax.jit(lambda state, x: nnx.merge(dec.graphdef, state)({"inputs": x}, deterministic=True))
  x = jnp.zeros((1, length), jnp.int32)
  one = _median_time(lambda: forward(dec.state, x), max(1, args.repeats // 5))
  return cached, one * length


def main() -> None:
  p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--ops", default="dense,combiner_fixed")
  p.add_argument("--position", type=int, default=8191)
  p.add_argument("--image_length", type=int, default=3072, help="0 skips the whole-sequence comparison")
  p.add_argument("--image_op", default="combiner_fixed")
  p.add_argument("--layers", type=int, default=6)
  p.add_argument("--features", type=int, default=512)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--repeats", type=int, default=20)
  args = p.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; model {args.layers} x {args.features}, "
        f"{args.heads} heads, float32, batch 1")
  times = {op: per_token(op, args.position, args) for op in args.ops.split(",")}
  base = times.get("dense")
  for op, t in times.items():
    ratio = f"  {t / base:.3f} x dense" if base else ""
    print(f"per_token  {op:28s} position {args.position}: {t * 1e3:8.2f} ms{ratio}")
  if args.image_length:
    cached, rerun = whole_sequence(args.image_op, args.image_length, args)
    print(f"generate   {args.image_op:28s} {args.image_length} tokens: cached decoding {cached:.1f} s; "
          f"re-running the forward per token (forward at full length x {args.image_length}, an upper bound) "
          f"{rerun:.1f} s; speed-up {rerun / cached:.1f}x")


if __name__ == "__main__":
  main()
