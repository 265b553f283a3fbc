"""The embedded default: a small causal Combiner LM on `synthetic_recall` (generated on the fly, no download).

Command:   python train.py            (the same as: python train.py --config configs/default.py)
Task:      multi-query key-value recall at length 512 (data/synthetic.py): 8 key-value pair tokens lie far
           apart in the first half; every query in the second half must be answered with its key's value,
           found up to 511 positions back (long-range, content-based attention). Loss and accuracy count the
           answers only.
Expected:  answer accuracy rises from chance (10%) to well above it within ~2 minutes on a 2-core CPU.
Cost:      ~2 minutes on 2 CPU cores; seconds on one accelerator.
Variants:  configs/default.py:attention=dense   (any registry name), `smoke` (a few steps, for tests).
"""

from configs import arguments, base


def get_config(arg: str | None = None):
  c = base.base_config()
  c.data.name = "synthetic_recall"
  c.data.seq_len = 512
  c.data.num_keys = 16
  c.data.num_values = 10
  c.data.num_pairs = 8
  c.data.num_filler = 8
  c.data.train_examples = 1_000_000
  c.data.eval_examples = 256
  c.model.num_layers = 2
  c.model.features = 64
  c.model.num_heads = 4
  c.model.mlp_dim = 128
  c.model.attention = base.attention_config("combiner_fixed")
  c.optimizer.name = "adam"
  c.optimizer.lr = 3e-3
  c.optimizer.schedule = "constant"
  c.optimizer.warmup_steps = 50
  c.train.batch_size = 16
  c.train.eval_batch_size = 64
  c.train.num_steps = 600
  c.train.log_every = 50
  c.train.eval_every = 200
  c.train.eval_batches = -1
  c.train.checkpoint_every = 200
  values, flags = arguments.parse_arg(arg)
  if "smoke" in flags:
    arguments.shrink_for_smoke(c, seq_len=64)
    c.data.eval_examples = 16
  arguments.apply_common(c, values)
  return c
