"""Byte-level language modeling on the Python standard library's sources (data/pystdlib.py), bits per byte.

Command:   python train.py --config configs/pystdlib.py:attention=combiner_axial_vertical \
             --workdir workdirs/pystdlib_axial
Task:      a real corpus available offline everywhere (~30 MB of `.py` files, split by file), at length
           2048: the CPU-scale check of the Combiner paper's orderings (each Combiner plan <= its sparse
           counterpart, mixture <= axial, dense close to Combiner); `python -m scripts.reproduce --table
           pystdlib` runs the rows.
Model:     2 layers, width 128, 4 heads, MLP 512, batch 4 x 2048 bytes, Adam 2e-3 cosine, 500 steps: sized so
           that a row trains in minutes on a CPU core (docs/results.md has the measured times and results).
Cost:      minutes per row on a CPU; `:smoke` (length 256, a few steps) runs in seconds.
Variants:  `attention=...` (any registry name), `seq_len=...`, `smoke`.
"""

import ml_collections

from configs import arguments, base


def get_config(arg: str | None = None):
  c = base.base_config()
  c.data.name = "pystdlib"
  c.data.seq_len = 2048
  c.data.stdlib_dir = ml_collections.FieldReference(None, field_type=str)  # None = this Python's library
  c.eval_split = "validation"  # the curves; `eval.py --split test` for the held-out number
  c.model.num_layers = 2
  c.model.features = 128
  c.model.num_heads = 4
  c.model.mlp_dim = 512
  c.model.dropout_rate = 0.0
  c.model.attention = base.attention_config("combiner_fixed")
  c.optimizer.name = "adam"
  c.optimizer.lr = 2e-3
  c.optimizer.schedule = "cosine"
  c.optimizer.warmup_steps = 50
  c.optimizer.clip_norm = 1.0
  c.train.batch_size = 4
  c.train.eval_batch_size = 4
  c.train.num_steps = 500
  c.train.log_every = 50
  c.train.eval_every = 100
  c.train.eval_batches = 16  # the same 16 x 4 x 2048 bytes (131 KB) of the split at every evaluation
  c.train.checkpoint_every = 100
  values, flags = arguments.parse_arg(arg)
  if "smoke" in flags:
    arguments.shrink_for_smoke(c, seq_len=256)
    c.data.stand_in = False  # always available
  arguments.apply_common(c, values)
  return c
