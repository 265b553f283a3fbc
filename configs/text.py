"""Shared settings of the text configs (wiki40b.py LM, c4.py MLM): paper Appendix E.3/E.5."""

from configs import arguments, base

TEXT_KEYS = ()  # flags of the text configs (none yet)


def text_config(name: str, arg: str | None):
  """12 layers, width 768, 12 heads, MLP 4x768, pre-norm; Adam + clipping, cosine with 10k warmup; batch 128,
  125k steps; sequence length 2048 (or 8192: `seq_len=8192`)."""
  c = base.base_config()
  c.data.name = name
  c.data.seq_len = 2048
  c.eval_split = "validation"
  c.model.num_layers = 12
  c.model.features = 768
  c.model.num_heads = 12
  c.model.mlp_dim = 4 * 768
  c.model.dropout_rate = 0.0
  c.model.attention = base.attention_config("combiner_fixed")
  c.optimizer.name = "adam"
  c.optimizer.lr = 5e-4  # not stated in the paper
  c.optimizer.schedule = "cosine"
  c.optimizer.warmup_steps = 10_000
  c.optimizer.clip_norm = 1.0
  c.train.batch_size = 128
  c.train.eval_batch_size = 128
  c.train.num_steps = 125_000
  c.train.log_every = 100
  c.train.eval_every = 5000
  c.train.eval_batches = 100
  c.train.checkpoint_every = 2000
  values, flags = arguments.parse_arg(arg, flags=TEXT_KEYS)
  if "smoke" in flags:
    arguments.shrink_for_smoke(c, seq_len=64)
  arguments.apply_common(c, values)
  arguments.route_every_head(c)  # Routing-2k of Tables 2 and 6
  return c
