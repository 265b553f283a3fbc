"""The Routing Transformer paper's image settings (Roy et al., TACL 2021, section 5) as the `routing_paper` variant.

`configs/cifar10.py:routing_paper` and `configs/imagenet64.py:routing_paper` take the experiment's data pipeline
and evaluation and replace the model and optimizer with the paper's; every other config argument (`layers=`,
`smoke`, `attention=combiner_routed`, ...) still applies on top. The paper trains with Adam (b1 0.9, b2 0.98),
learning rate 2e-4 and the Transformer rsqrt schedule (section 5).

Membership: these are decoders, so the routing heads use the exactly causal "nearest" membership by default. The
paper's balanced top-k membership leaks future tokens into a decoder's likelihood (see `routing/attention.py`);
to run it as published anyway: `--config.model.attention.membership=balanced`.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from configs import base

FLAG = "routing_paper"

# CIFAR-10 (section 5.1 / 6.1): 12 layers, 8 heads; the best model routes in the top 4 layers with 4 routing heads,
# k = 6 clusters and attention window 1024 (the window-512 version reaches 2.975 bits/dim); batch 32, 200k steps.
CIFAR10 = dict(layers=12, heads=8, features=512, routing_heads=4, routing_layers=(-4, -3, -2, -1), num_clusters=6,
               window=1024, batch_size=32, steps=200_000)
# ImageNet-64 (section 5.4): 24 layers, 16 heads, half local and half routing in every layer, k = 8 clusters,
# window 2048; 3.425 bits/dim after ~70 epochs. The paper says "batch size 1" on 128 TPU cores, read here as one
# per core (global 128); the width is not stated (1024 = 16 heads x 64 is our choice).
IMAGENET64 = dict(layers=24, heads=16, features=1024, routing_heads=8, routing_layers=None, num_clusters=8,
                  window=2048, batch_size=128, steps=700_000)


def split_flag(arg: str | None) -> tuple[str, bool]:
  """(arg without the `routing_paper` flag, whether it was given)."""
  items = [s.strip() for s in (arg or "").split(",")]
  return ",".join(s for s in items if s and s != FLAG), FLAG in items


def apply(c: ml_collections.ConfigDict, settings: dict[str, Any], arg: str,
          flag_keys: tuple[str, ...]) -> None:
  """Sets the paper's model/optimizer on `c`, then re-applies the user's `arg` so that it wins."""
  values, flags = base.parse_arg(arg, flags=flag_keys)
  att = c.model.attention
  if str(att.name) not in ("routing", "combiner_routed"):
    att.name = "routing"
  att.params.num_clusters = settings["num_clusters"]
  att.params.window = settings["window"]
  att.params.block_size = settings["window"]  # local heads get the same attention budget as routing heads
  if "membership" not in att:  # None = the module's default (decoders: "nearest"); overridable from the command line
    att.membership = ml_collections.FieldReference(None, field_type=str)
  if "smoke" in flags:  # keep the shrunken CPU model; route in its single layer with one of its two heads
    att.routing_heads = 1
    att.routing_layers = None
  else:
    att.routing_heads = settings["routing_heads"]
    att.routing_layers = settings["routing_layers"]
    c.model.num_layers = settings["layers"]
    c.model.num_heads = settings["heads"]
    c.model.features = settings["features"]
    c.model.mlp_dim = 4 * settings["features"]
    c.train.batch_size = settings["batch_size"]
    c.train.num_steps = settings["steps"]
    c.optimizer.name = "adam"
    c.optimizer.lr = 2e-4
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.98
    c.optimizer.schedule = "rsqrt"
    c.optimizer.warmup_steps = 4000  # not stated in the paper; the Transformer's default
  c.aux_loss_weight = 1e-4  # commitment loss weight
  base.apply_common(c, values)
  if str(c.model.attention.name) == "combiner_routed":  # every head routed, every layer; clusters only
    for key in ("window", "block_size"):
      if key in c.model.attention.params:
        del c.model.attention.params[key]
    if c.model.attention.get("membership", None) is None and "membership" in c.model.attention:
      del c.model.attention["membership"]
    att.routing_heads = None
    att.routing_layers = None
