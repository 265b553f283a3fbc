"""The embedded default: a small Combiner classifier on `synthetic_recall` (generated on the fly, no download).

Command:   python train.py            (the same as: python train.py --config configs/default.py)
Task:      key-value retrieval at length 512 (data/synthetic.py): the query at position 0 must find, among 8 pair
           tokens spread over the sequence, the one with its key and output that pair's value (10 classes).
Expected:  accuracy rises from chance (10%) to well above it within ~2 minutes on a 2-core CPU.
Cost:      ~2 minutes on 2 CPU cores; seconds on one accelerator.
Variants:  configs/default.py:attention=dense   (any registry name), `smoke` (a few steps, for tests).
"""

from configs import base


def get_config(arg: str | None = None):
  c = base.base_config()
  c.data.name = "synthetic_recall"
  c.data.seq_len = 512
  c.data.num_keys = 16
  c.data.num_values = 10
  c.data.num_pairs = 8
  c.data.num_filler = 8
  c.data.train_examples = 1_000_000
  c.data.eval_examples = 512
  c.model.num_layers = 2
  c.model.features = 64
  c.model.num_heads = 4
  c.model.mlp_dim = 128
  c.model.classifier_pool = "CLS"  # position 0 holds the query token
  c.model.attention = base.attention_config("combiner_fixed")
  c.optimizer.name = "adam"
  c.optimizer.lr = 2e-3
  c.optimizer.schedule = "constant"
  c.optimizer.warmup_steps = 50
  c.train.batch_size = 16
  c.train.eval_batch_size = 64
  c.train.num_steps = 1200
  c.train.log_every = 100
  c.train.eval_every = 400
  c.train.eval_batches = -1
  c.train.checkpoint_every = 400
  values, flags = base.parse_arg(arg)
  if "smoke" in flags:
    base.shrink_for_smoke(c, seq_len=64)
    c.data.eval_examples = 16
  base.apply_common(c, values)
  return c
