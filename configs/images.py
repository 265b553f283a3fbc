"""Shared settings of the image density-estimation configs (cifar10.py, imagenet64.py): Appendix E.1/E.2."""

from __future__ import annotations

from typing import Any

import ml_collections

from configs import arguments, base

IMAGE_FLAGS = ("main",)  # `main`: the Table 4 model
IMAGE_KEYS = ("image_size",)  # `image_size=N`: images resized to N x N (smaller CPU-scale runs)
SMOKE_IMAGE = (8, 8, 3)  # `smoke`: images resized to 8x8 (192 tokens), a CPU trains on them in seconds


def image_config(name: str, image_shape: tuple[int, int, int], arg: str | None, main: dict[str, Any]):
  """6 layers, width 512, 8 heads, lr 1e-3, batch 32 (the ablation of Table 1); `main` = the Table 4 model
  (`main`: layers, features, heads, mlp_dim, dropout, lr, steps of the caller's dataset)."""
  c = base.base_config()
  c.data.name = name
  c.data.seq_len = image_shape[0] * image_shape[1] * image_shape[2]
  c.data.image_shape = ml_collections.FieldReference(None, field_type=tuple)  # None = the dataset's own
  c.eval_split = "test"
  c.model.num_layers = 6
  c.model.features = 512
  c.model.num_heads = 8
  c.model.mlp_dim = 2048  # not stated in the paper; the usual 4x width
  c.model.dropout_rate = 0.0
  c.model.position_embedding = "factorized"
  c.model.image_shape = image_shape
  c.model.attention = base.attention_config("combiner_axial_vertical")
  c.optimizer.name = "adam"
  c.optimizer.lr = 1e-3
  c.optimizer.schedule = "cosine"
  c.optimizer.warmup_steps = 5000
  c.optimizer.clip_norm = 1.0
  c.train.batch_size = 32
  c.train.eval_batch_size = 32
  c.train.num_steps = 400_000
  c.train.log_every = 100
  c.train.eval_every = 10_000
  c.train.eval_batches = -1
  c.train.checkpoint_every = 2000
  values, flags = arguments.parse_arg(arg, extra=IMAGE_KEYS, flags=IMAGE_FLAGS)
  if "main" in flags:
    c.model.num_layers = main["layers"]
    c.model.features = main["features"]
    c.model.num_heads = main["heads"]
    c.model.mlp_dim = main["mlp_dim"]
    c.model.dropout_rate = main["dropout"]
    # 30-128 layers, scanned, each block recomputed in the backward pass from its input, as Child et al.
    # train their 128-layer CIFAR-10 model (attention and feed-forward activations recomputed).
    base.scanned_and_recomputed(c)
    c.optimizer.lr = main["lr"]
    c.train.num_steps = main["steps"]
  if "smoke" in flags:
    arguments.shrink_for_smoke(c, seq_len=SMOKE_IMAGE[0] * SMOKE_IMAGE[1] * SMOKE_IMAGE[2])
    c.data.image_shape = SMOKE_IMAGE
    c.model.image_shape = SMOKE_IMAGE
  if "image_size" in values:
    size = int(values.pop("image_size"))
    c.data.image_shape = c.model.image_shape = (size, size, image_shape[2])
    c.data.seq_len = size * size * image_shape[2]
  arguments.apply_common(c, values)
  arguments.route_every_head(c)  # the 12-layer routing row of Table 1 (routing_paper sets its own layout)
  return c
