"""Adaptive Attention Span (Sukhbaatar et al., ACL 2019): learned per-head spans over a past-segment cache.

Command:   python train.py --config configs/adaptive_span.py --workdir workdirs/adaptive_span
           (enwik8 prepared first: python -m data.prepare enwik8 --data_dir DIR)
Paper:     enwik8 test bits per character 1.02 with the small model (12 layers) and 0.98 with the large one
           (24 layers); text8 1.11 / 1.07. Average span with S = 8192: 314 (small) and 245 (large), the
           lower layers short, some upper heads thousands of tokens. The settings below
           follow the authors' released scripts (facebookresearch/adaptive-span, enwik8_small.sh /
           enwik8_large.sh) as recalled, not checked against the PDF: small 12 layers, d 512, 8 heads, d_ff
           2048, dropout 0.3; large 24 layers, d 768, 8 heads, d_ff 4096, dropout 0.4; both with a maximum
           span S = 8192 over a cache of the previous 8192 positions, ramp R = 32, span L1 coefficient 2e-6,
           blocks (segments) of 512, batch 64, Adagrad lr 0.07 with 32k linear warm-up steps, gradient
           clipping 0.03, 600k steps (small) / 900k (large).
This config: that model on the ordered enwik8 stream (`data.ordered=True`, data/characters.py; row i of each
           batch continues row i of the last), `attention=adaptive_span` with `model.mem_len = 8192` and
           `params.max_span = 8192` (the span can reach the whole cache), the paper's learned relative
           position embeddings (`relative_positions`, one per distance and layer, shared by the heads) and no
           absolute positions. Differences: pre-LN blocks.
Cost:      the paper trains on 8 GPUs for days; `:smoke` (1 layer, width 32, segments of 64 with a cache of
           64, a few steps on the generated enwik8 stand-in) runs in seconds on a CPU.
Variants:  `large`, `text8`, `max_span=...`, `mem_len=...`, `eval_mem_len=...`, `seq_len=...`, `smoke`.
"""

from configs import arguments, base


def get_config(arg: str | None = None):
  values, flags = arguments.parse_arg(arg, extra=("max_span", "mem_len", "eval_mem_len"),
                                      flags=("large", "text8"))
  large = "large" in flags
  c = base.base_config()
  c.data.name = "text8" if "text8" in flags else "enwik8"
  c.data.seq_len = 512  # the paper's block size
  c.data.ordered = True
  c.eval_split = "validation"
  c.model.num_layers = 24 if large else 12
  c.model.features = 768 if large else 512
  c.model.num_heads = 8
  c.model.mlp_dim = 4096 if large else 2048
  c.model.dropout_rate = 0.4 if large else 0.3
  c.model.position_embedding = "none"
  c.model.mem_len = 8192  # the cache: the largest span S
  c.model.attention = base.attention_config("adaptive_span")
  c.model.attention.relative_positions = True  # the paper's p_{t-r}; positions come from them alone
  c.model.attention.params.max_span = 8192
  c.optimizer.name = "adagrad"
  c.optimizer.lr = 0.07
  c.optimizer.schedule = "constant"  # after the linear warm-up
  c.optimizer.warmup_steps = 32_000
  c.optimizer.clip_norm = 0.03
  c.train.batch_size = 64
  c.train.eval_batch_size = 64
  c.train.num_steps = 900_000 if large else 600_000
  c.train.log_every = 200
  c.train.eval_every = 10_000
  c.train.eval_batches = -1
  c.train.checkpoint_every = 10_000
  if "smoke" in flags:
    arguments.shrink_for_smoke(c, seq_len=64)
    c.model.head_dim = None
    c.model.dropout_rate = 0.0
    c.model.mem_len = 64
    c.model.attention.params.max_span = 64
    c.optimizer.warmup_steps = 1
  if large and "smoke" not in flags:  # 24 layers over a cache of 8192: scanned and recomputed (docs/tpu.md)
    base.scanned_and_recomputed(c)
  if "max_span" in values:
    c.model.attention.params.max_span = int(values.pop("max_span"))
  for key in ("mem_len", "eval_mem_len"):
    if key in values:
      c.model[key] = int(values.pop(key))
  arguments.apply_common(c, values)
  return c
