"""The Routing Transformer paper's image settings (Roy et al., TACL 2021, section 5) as the `routing_paper`
variant.

`configs/cifar10.py:routing_paper` and `configs/imagenet64.py:routing_paper` take the experiment's data
pipeline and evaluation and replace the model and optimizer with the paper's; every other config argument
(`layers=`, `smoke`, `attention=combiner_routed`, ...) still applies on top. The paper trains with Adam
(b1 0.9, b2 0.98), learning rate 2e-4 and the Transformer rsqrt schedule (section 5).

Routing Transformer Table 1 (CIFAR-10, bits/dim; 12 layers, 8 heads, k = 6) rows as arguments:
`attention=dense` (full attention), `routing_heads=0` (local attention only),
`routing_heads=4,routing_layers=2,window=512`, `routing_heads=8,routing_layers=all,window=1024` (routing
only), ...

Membership: these are decoders, so the routing heads use the exactly causal "nearest" membership by default.
The paper's balanced top-k membership leaks future tokens into a decoder's likelihood (see
`routing/attention.py`); to run it as published anyway: `--config.model.attention.membership=balanced_leaky`.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from configs import arguments, base

FLAG = "routing_paper"

# CIFAR-10 (section 5.1 / 6.1): 12 layers, 8 heads; the best model routes in the top 4 layers with 4 routing
# heads, k = 6 clusters and attention window 1024 (the window-512 version reaches 2.975 bits/dim); batch 32,
# 200k steps.
CIFAR10 = dict(layers=12, heads=8, features=512, routing_heads=4, routing_layers=(-4, -3, -2, -1),
               num_clusters=6, window=1024, batch_size=32, steps=200_000, recompute=False)
# ImageNet-64 (section 5.4): 24 layers, 16 heads, half local and half routing in every layer, k = 8 clusters,
# window 2048; 3.425 bits/dim after ~70 epochs. The paper says "batch size 1" on 128 TPU cores, read here as
# one per core (global 128); the width is not stated (1024 = 16 heads x 64 is our choice). `recompute` (also
# ours): the blocks scanned and recomputed in the backward pass (`model.scan_layers`, `model.remat=full`),
# since a step that keeps every layer's 12288-token activations does not fit a v5e chip even at one image per
# chip (docs/tpu.md gives the slices it fits now).
IMAGENET64 = dict(layers=24, heads=16, features=1024, routing_heads=8, routing_layers=None, num_clusters=8,
                  window=2048, batch_size=128, steps=700_000, recompute=True)


# Keys of the Routing Transformer Table 1 ablation, read only with the flag: routing heads per routing layer,
# routing layers counted from the top (`all` = every layer), the attention window (also the local heads'
# block) and the number of clusters.
KEYS = ("routing_heads", "routing_layers", "window", "clusters")


def split_flag(arg: str | None) -> tuple[str, dict[str, str] | None]:
  """(arg without the `routing_paper` flag and its own KEYS, {key: value} of those keys; None without the
  flag)."""
  items = [s.strip() for s in (arg or "").split(",") if s.strip()]
  if FLAG not in items:
    return ",".join(items), None
  rest, own = [], {}
  for item in items:
    key, sep, value = item.partition("=")
    if item == FLAG:
      continue
    if sep and key.strip() in KEYS:
      own[key.strip()] = value.strip()
    else:
      rest.append(item)
  return ",".join(rest), own


def apply(c: ml_collections.ConfigDict, settings: dict[str, Any], arg: str, paper_values: dict[str, str],
          extra_keys: tuple[str, ...], flag_keys: tuple[str, ...]) -> None:
  """Sets the paper's model/optimizer on `c`, then re-applies the user's `arg` so that it wins.

  The attention is "routing" unless `attention=` names another (`dense` for the full-attention row of Table 1,
  `combiner_routed`, ...); the routing fields and plan parameters are set only for the attention that reads
  them.
  """
  values, flags = arguments.parse_arg(arg, extra=extra_keys, flags=flag_keys)
  if "attention" not in values:
    c.model.attention = base.attention_config("routing")
  if "smoke" not in flags:
    c.model.num_layers = settings["layers"]
    c.model.num_heads = settings["heads"]
    c.model.features = settings["features"]
    c.model.mlp_dim = 4 * settings["features"]
    c.train.batch_size = settings["batch_size"]
    c.train.num_steps = settings["steps"]
    if settings["recompute"]:
      c.model.scan_layers = True
      c.model.remat = "full"
    c.optimizer.name = "adam"
    c.optimizer.lr = 2e-4
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.98
    c.optimizer.schedule = "rsqrt"
    c.optimizer.warmup_steps = 4000  # not stated in the paper; the Transformer's default
  c.aux_loss_weight = 1e-4  # commitment loss weight
  scan_given = "scan_layers" in values
  arguments.apply_common(c, values)
  att = c.model.attention
  name = str(att.name)
  clusters = int(paper_values.get("clusters", settings["num_clusters"]))
  window = int(paper_values.get("window", settings["window"]))
  smoke = "smoke" in flags  # the shrunken CPU model: automatic clusters and window for its short sequence
  if name == "routing":
    if not smoke or "clusters" in paper_values:
      att.params.num_clusters = clusters
    if not smoke or "window" in paper_values:
      att.params.window = window
      if "block_size" not in values:
        att.params.block_size = window  # local heads get the same attention budget as routing heads
    if smoke:  # route in the single layer with one of its two heads
      att.routing_heads, att.routing_layers = 1, None
    else:
      att.routing_heads = settings["routing_heads"]
      att.routing_layers = settings["routing_layers"]
    if "routing_heads" in paper_values:
      att.routing_heads = int(paper_values["routing_heads"])
    if "routing_layers" in paper_values:
      top = paper_values["routing_layers"]
      att.routing_layers = None if top == "all" else tuple(range(-int(top), 0))
    if att.routing_layers is not None and not scan_given:
      c.model.scan_layers = False  # routing in some layers only: the blocks differ, so they are not scanned
  elif name == "combiner_routed":  # every head routed, every layer; clusters only
    if not smoke or "clusters" in paper_values:
      att.params.num_clusters = clusters
  elif paper_values:
    raise ValueError(
      f"{sorted(paper_values)} configure routing attention; attention={name!r} does not read them")
