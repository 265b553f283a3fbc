"""Registers the baselines: their pure ops, plan parameters, model inputs, fused paths, modules, decoders and
benchmark stand-ins."""

import jax
import jax.numpy as jnp

from attention_baselines import dense, dense_seq_parallel, splash
from attention_baselines.adaptive_span import adaptive_span
from attention_baselines.adaptive_span import auto_params as adaptive_span_params
from attention_baselines.adaptive_span import window as adaptive_span_window
from attention_baselines.adaptive_span_decode import ADAPTIVE_SPAN
from attention_baselines.bigbird import bigbird
from attention_baselines.bigbird_decode import BIGBIRD
from attention_baselines.blockbert import blockbert
from attention_baselines.bp_transformer import auto_params as bp_transformer_params
from attention_baselines.bp_transformer import bp_transformer
from attention_baselines.dense import dense_xla
from attention_baselines.dense_decode import DENSE
from attention_baselines.etc import auto_params as etc_params
from attention_baselines.etc import etc
from attention_baselines.linear import DEFAULT_CHUNK as LINEAR_CHUNK
from attention_baselines.linear import linear
from attention_baselines.linear_decode import LINEAR
from attention_baselines.linformer import PROJ_DIM as LINFORMER_PROJ_DIM
from attention_baselines.linformer import linformer
from attention_baselines.local import local
from attention_baselines.local_decode import LOCAL
from attention_baselines.longformer import longformer
from attention_baselines.longformer_decode import LONGFORMER
from attention_baselines.moba import auto_params as moba_params
from attention_baselines.moba import moba
from attention_baselines.moba_decode import MOBA
from attention_baselines.none import none
from attention_baselines.nsa import auto_params as nsa_params
from attention_baselines.nsa import nsa
from attention_baselines.nsa_decode import NSA
from attention_baselines.nystromformer import nystromformer
from attention_baselines.performer import DEFAULT_CHUNK as PERFORMER_CHUNK
from attention_baselines.performer import performer
from attention_baselines.performer_decode import PERFORMER
from attention_baselines.reformer import reformer
from attention_baselines.sinkhorn import sinkhorn
from attention_baselines.synthesizer import synthesizer_dense, synthesizer_random
from attention_baselines.transformer_xl import transformer_xl
from attention_baselines.transformer_xl_decode import TRANSFORMER_XL
from attention_core.registry import (
  CHUNKS,
  FLAG,
  FLOAT,
  INT,
  PALLAS,
  POSITIVE,
  TUPLE,
  FusedPath,
  OpSpec,
  Param,
  Shape,
  register,
  sqrt_pow2,
)

# Fused paths whose values the ops' modules define: cuDNN / Splash flash attention, and Splash alone.
FLASH = FusedPath.declare(dense.IMPLEMENTATIONS, platforms=dense.IMPLEMENTATION_PLATFORMS)
SPLASH = FusedPath.declare(splash.IMPLEMENTATIONS, platforms=splash.IMPLEMENTATION_PLATFORMS)

register(OpSpec("dense", dense.dense, description="exact softmax attention, O(L^2)",
                decode=DENSE, seq_parallel=dense_seq_parallel.dense, fused=FLASH))
register(OpSpec("dense_xla", dense_xla,
                description="jax.nn.dot_product_attention (XLA), O(L^2), for comparison"))


def _fixed_key(length: int, shape: Shape) -> dict:
  """A fixed key for the benchmark (models own their keys and draw fresh ones)."""
  return {"rng": jax.random.key(0)}


# m = 256 features (the paper's setting), drawn for the benchmark from a fixed key; models own and redraw
# their features.
register(OpSpec("performer", performer,
                params=lambda length: {"num_features": 256, "chunk_size": PERFORMER_CHUNK},
                bench_inputs=_fixed_key, module="models.performer_attention:PerformerAttention",
                description="Performer FAVOR+, 256 positive orthogonal random features, O(L*m*d)",
                decode=PERFORMER, inputs=("features", "rng"),
                plan={"num_features": POSITIVE, "chunk_size": POSITIVE, "row_chunks": CHUNKS}))
register(OpSpec("linear", linear, params=lambda length: {"chunk_size": LINEAR_CHUNK},
                description="linear transformer, elu+1 features, O(L*d^2)", decode=LINEAR,
                plan={"chunk_size": POSITIVE, "row_chunks": CHUNKS}))
register(OpSpec("local", local, params=lambda length: {"block_size": sqrt_pow2(length)},
                description="block-local attention (own block), O(L*b*d)", decode=LOCAL,
                plan={"block_size": POSITIVE, "row_chunks": CHUNKS}, fused=SPLASH))
register(OpSpec("longformer", longformer,
                params=lambda length: {"window": sqrt_pow2(length), "global_positions": (0,)},
                description="Longformer sliding window (w each side) + global tokens, O(L*w*d)",
                decode=LONGFORMER, plan={"window": INT, "global_positions": TUPLE, "row_chunks": CHUNKS},
                fused=SPLASH))
register(OpSpec("bigbird", bigbird,
                params=lambda length: {"block_size": min(64, sqrt_pow2(length)), "global_blocks": (0, -1),
                                       "num_random_blocks": 3},
                description="BigBird ITC: 3 window + 2 global + 3 random blocks, O(L*8b*d)", decode=BIGBIRD,
                module="models.bigbird_attention:BigBirdAttention",
                plan={"block_size": POSITIVE, "global_blocks": TUPLE, "num_random_blocks": INT, "seed": INT,
                      "row_chunks": CHUNKS}))
register(OpSpec("none", none, description="no attention (zeros): the feed-forward-only reference"))
# Learned or sampled baselines: the registered op takes its weights and keys explicitly; bench_inputs(length)
# makes fixed stand-ins for the benchmark (their modules own the real ones).
REFORMER_CHUNK = 64
LEARNED = "models.learned_baselines_attention"


def _normal(seed: int, shape: tuple[int, ...], fan_in: int) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32) / jnp.sqrt(float(fan_in))


def _reformer_params(length: int) -> dict:
  # reformer-pytorch's setting (bucket_size 64): chunks of 64, as many buckets as chunks, 2 rounds.
  chunks = -(-length // REFORMER_CHUNK)
  return {"n_hashes": 2, "chunk_size": REFORMER_CHUNK, "n_buckets": max(2, chunks + chunks % 2)}


def _sinkhorn_inputs(length: int, shape: Shape) -> dict:
  blocks, d = -(-length // sqrt_pow2(length)), shape.head_dim
  return {"sort_w1": _normal(3, (1, d, d), d), "sort_b1": jnp.zeros((1, d)),
          "sort_w2": _normal(4, (1, d, blocks), d), "sort_b2": jnp.zeros((1, blocks))}


def _synthesizer_inputs(length: int, shape: Shape) -> dict:
  d = shape.head_dim
  return {"w1": _normal(5, (1, d, d), d), "b1": jnp.zeros((1, d)), "w2": _normal(6, (1, d, length), d),
          "b2": jnp.zeros((1, length))}


register(OpSpec(
    "reformer", reformer, params=_reformer_params, bench_inputs=_fixed_key,
    module=f"{LEARNED}:ReformerAttention", inputs=("rng",),
    plan={"n_hashes": POSITIVE, "n_buckets": Param(int, 1, optional=True), "chunk_size": POSITIVE,
          "row_chunks": CHUNKS},
    description="Reformer LSH attention, shared QK, 2 hashes, chunks of 64 (own + previous chunk), "
                "O(L*n_hashes*chunk*d)"))
register(OpSpec(
    "linformer", linformer, causal=False,
    bench_inputs=lambda length, shape: {
        "proj_k": _normal(1, (LINFORMER_PROJ_DIM, length), LINFORMER_PROJ_DIM),
        "proj_v": _normal(2, (LINFORMER_PROJ_DIM, length), LINFORMER_PROJ_DIM)},
    module=f"{LEARNED}:LinformerAttention", inputs=("proj_k", "proj_v"),
    description="Linformer, K and V projected along the length to k=256, O(L*k*d), bidirectional only"))
register(OpSpec(
    "sinkhorn", sinkhorn, params=lambda length: {"block_size": sqrt_pow2(length)},
    bench_inputs=_sinkhorn_inputs, module=f"{LEARNED}:SinkhornAttention",
    plan={"block_size": POSITIVE, "sinkhorn_iters": INT, "temperature": FLOAT},
    inputs=("sort_w1", "sort_b1", "sort_w2", "sort_b2"),
    description="sparse Sinkhorn attention, blocks of ~sqrt(L), own block + Sinkhorn-sorted block, "
                "O(L*block*d + (L/block)^2*block*d)"))
register(OpSpec(
    "synthesizer", synthesizer_dense, bench_inputs=_synthesizer_inputs,
    module=f"{LEARNED}:SynthesizerAttention", inputs=("w1", "b1", "w2", "b2"),
    description="dense synthesizer, per-token MLP logits over positions, O(L^2)"))
register(OpSpec(
    "synthesizer_random", synthesizer_random,
    bench_inputs=lambda length, shape: {"logits": _normal(7, (1, length, length), length)},
    module=f"{LEARNED}:RandomSynthesizerAttention", inputs=("logits",),
    description="random synthesizer, one [L, L] logits matrix per head, O(L^2)"))
register(OpSpec(
    "nystromformer", nystromformer, causal=False,
    params=lambda length: {"num_landmarks": 64, "pinv_iterations": 6},
    plan={"num_landmarks": POSITIVE, "pinv_iterations": INT},
    description="Nystromformer, 64 segment-mean landmarks, 6-step iterative pseudo-inverse, O(L*m*d), "
                "bidirectional only"))


NSA_MLPS = tuple(f"cmp_{side}_{part}" for side in ("key", "value") for part in ("pos", "w1", "b1", "w2"))


def _nsa_inputs(length: int, shape: Shape) -> dict:
  """Stand-ins for the compression MLPs (each of hidden size and output the width it compresses: head_dim
  for keys, value_dim (default head_dim) for values; shared by the heads); the gates stay 1/3."""
  size = nsa_params(length)["compress_block"]
  out = {}
  for side, seed, dim in (("key", 8, shape.head_dim), ("value", 12, shape.value_dim or shape.head_dim)):
    out.update({f"cmp_{side}_pos": _normal(seed, (1, size, dim), dim),
                f"cmp_{side}_w1": _normal(seed + 1, (1, size * dim, dim), size * dim),
                f"cmp_{side}_b1": jnp.zeros((1, dim)),
                f"cmp_{side}_w2": _normal(seed + 2, (1, dim, dim), dim)})
  return out


register(OpSpec(
    "nsa", nsa, bidirectional=False, params=nsa_params, bench_inputs=_nsa_inputs, decode=NSA,
    module="models.nsa_attention:NSAAttention", inputs=("gates", *NSA_MLPS), fused=PALLAS,
    plan={"compress_block": POSITIVE, "compress_stride": POSITIVE, "select_block": POSITIVE,
          "num_selected": INT, "window": INT, "query_chunks": CHUNKS},
    description="Native Sparse Attention: gated compressed (l=32, stride 16), top-16 selected (64-token "
                "blocks; n >= 3 counts the own, previous and first blocks, always selected) and "
                "sliding-window (512) branches, causal; without gates each branch weighs 1/3; "
                "O(L*(L/16 + n*64 + 512)*d)"))
register(OpSpec(
    "moba", moba, params=moba_params, decode=MOBA, fused=PALLAS,
    plan={"block_size": POSITIVE, "top_k": INT, "query_chunks": CHUNKS},
    description="MoBA: own block + top-k blocks by mean-pooled key score (k=3, B=min(512, L/16)), one "
                "softmax, O(L*k*B*d)"))


def _adaptive_span_inputs(length: int, shape: Shape) -> dict:
  """A stand-in span shared by the heads (the model learns one per head): 256 tokens, a quarter of shorter
  sequences; stand-in relative position embeddings shared by the heads, one per distance a key is read at."""
  plan = adaptive_span_params(length)
  distances = adaptive_span_window(plan["max_span"], plan["ramp"])
  return {"spans": jnp.full((1,), float(min(256, max(1, length // 4))), jnp.float32),
          "positions": _normal(14, (1, distances, shape.head_dim), shape.head_dim)}


register(OpSpec(
    "adaptive_span", adaptive_span, params=adaptive_span_params, bench_inputs=_adaptive_span_inputs,
    decode=ADAPTIVE_SPAN, module="models.adaptive_span_attention:AdaptiveSpanAttention",
    plan={"max_span": Param(int, 0), "ramp": FLOAT, "block_size": POSITIVE}, inputs=("spans", "positions"),
    memory=True, fused=PALLAS,
    description="adaptive attention span: a learned soft span per head (R=32), clamped to [0, max_span] "
                "(default max_span = L), key blocks beyond the largest span skipped, O(L*(max z + R)*d)"))


register(OpSpec(
    "blockbert", blockbert, causal=False, params=lambda length: {"num_blocks": 2},
    module="models.blockbert_attention:BlockBERTAttention",
    plan={"num_blocks": POSITIVE, "row_chunks": CHUNKS}, inputs=("shifts",),
    description="BlockBERT: n = 2 blocks (n above L is cut to L), each head attends from block a to block "
                "a + s_h mod n (shifts=None: most heads s = 0, about one in six shifted), O(L*(L/n)*d), "
                "bidirectional only"))


def _etc_inputs(length: int, shape: Shape) -> dict:
  """A stand-in relative-bias table shared by the heads (the model learns one per head)."""
  return {"rel_bias": _normal(13, (1, 2 * etc_params(length)["max_distance"] + 3), 1)}


register(OpSpec(
    "etc", etc, causal=False, params=etc_params, bench_inputs=_etc_inputs,
    module="models.etc_attention:ETCAttention", inputs=("rel_bias", "global_q", "global_k", "global_v"),
    plan={"segment_length": POSITIVE, "radius": INT, "max_distance": INT, "hard_g2l": FLAG,
          "return_global": FLAG},
    description="ETC global-local: l2l radius 84 + l2g to one global token per 32 tokens, relative position "
                "biases (k=12; one scalar per label and head, not ETC's relative key vectors), hard g2l mask "
                "(hard_g2l=True); returns the long tokens' output only (return_global=True: also the global "
                "tokens'), O(L*(2r + L/32)*d), bidirectional only"))


TRANSFORMER_XL_INPUTS = ("r", "u", "v_bias")


def _transformer_xl_inputs(length: int, shape: Shape) -> dict:
  """Stand-ins for the projected relative embeddings r [length, heads, head_dim] (distance d in row d) and
  the biases u, v [heads, head_dim] (the model projects sinusoids and learns the biases)."""
  heads, d = shape.heads, shape.head_dim
  return {"r": _normal(14, (length, heads, d), d), "u": _normal(15, (heads, d), d),
          "v_bias": _normal(16, (heads, d), d)}


register(OpSpec(
    "transformer_xl", transformer_xl, bidirectional=False, params=lambda length: {"clamp_len": -1},
    bench_inputs=_transformer_xl_inputs, decode=TRANSFORMER_XL,
    module="models.transformer_xl_attention:TransformerXLAttention", plan={"clamp_len": INT},
    inputs=TRANSFORMER_XL_INPUTS, memory=True,
    description="Transformer-XL relative positional attention (4 terms, u, v), O(L*(M+L)*d)"))
register(OpSpec(
    "compressive", transformer_xl, bidirectional=False, params=lambda length: {"clamp_len": -1},
    bench_inputs=_transformer_xl_inputs, decode=TRANSFORMER_XL,
    module="models.compressive_attention:CompressiveAttention", plan={"clamp_len": INT},
    inputs=TRANSFORMER_XL_INPUTS, memory=True,
    description="Compressive Transformer: Transformer-XL attention over [compressed; memory; segment], "
                "O(L*(n_cm+M+L)*d)"))


def _bp_transformer_inputs(length: int, shape: Shape) -> dict:
  """Stand-in relative vectors shared by the heads (the model learns them per head, per layer)."""
  k, t = bp_transformer_params(length)["context"], max(1, (max(length, 2) - 1).bit_length())  # t = log2 n
  d = shape.head_dim
  return {"rel_self": _normal(17, (1, d), d), "rel_left": _normal(18, (1, t, k, d), d),
          "rel_right": _normal(19, (1, t, k, d), d), "rel_anc": _normal(20, (1, t, d), d)}


register(OpSpec(
    "bp_transformer", bp_transformer, params=bp_transformer_params, bench_inputs=_bp_transformer_inputs,
    module="models.bp_transformer_attention:BPTransformerAttention", plan={"context": POSITIVE},
    inputs=("rel_self", "rel_left", "rel_right", "rel_anc", "graph"),
    description="BP-Transformer: binary-partition tree, each token reads itself and k = 4 nodes per "
                "level and side, span nodes their tokens, relative vectors, O(k*L*log(L/k)*d)"))
