"""Transformer-XL (Dai et al., ACL 2019): segment recurrence, relative positional attention, byte-level LM.

Command:   python train.py --config configs/transformer_xl.py --workdir workdirs/transformer_xl
Paper:     the enwik8 base model (the authors' `pytorch/run_enwik8_base.sh`, kimiyoung/transformer-xl):
           12 layers, d_model 512, 8 heads of d_head 64, d_inner 2048,
           dropout 0.1, attention dropout 0.0, Adam lr 2.5e-4 with no warmup and a cosine decay to 0 over
           400,000 steps, gradient clipping 0.25 (its train.py default), batch 22, training segments
           (tgt_len) 512 with mem_len 512; evaluation with mem_len 2100 (segments of 80, clamp_len 820,
           same_length). Result: 1.06 bpc on enwik8 test (Table 2 of the paper, 41M parameters; 41.25M
           here).
This config: that model and optimisation on enwik8 (data/characters.py; prepare it with `python -m
           data.prepare enwik8 --data_dir DIR`), `data.ordered=True` (row i of each batch continues row i of
           the last; a stream's start clears its row's memory). `text8` trains the same model on text8 (the
           paper reports text8 for its 24-layer model only: 1.08 bpc, Table 3). Differences: this
           codebase's blocks are pre-LayerNorm (the paper's base model is post-LN), evaluation reads
           segments of the training length 512 with eval_mem_len 2100 and the automatic clamp_len (none),
           Adam's b2 / eps are PyTorch's defaults (0.999, 1e-8). Batch 22 needs a data-parallel size that
           divides it (1, 2, 11 or 22 devices; `batch_size=24` for 8).
Cost:      the paper trains on 4 GPUs for days; `:smoke` (1 layer, width 32, segments of 64 with mem_len 64,
           eval_mem_len 128, a few steps) runs in seconds on a CPU.
Variants:  `text8`, `attention=...` (a module that takes a memory), `mem_len=...`, `eval_mem_len=...`,
           `seq_len=...`, `smoke` (on the generated enwik8 or text8 stand-in when the data is missing).
"""

import ml_collections

from configs import arguments, base


def get_config(arg: str | None = None):
  c = base.base_config()
  c.data.name = "enwik8"
  c.data.seq_len = 512  # the paper's tgt_len
  c.data.ordered = True
  c.eval_split = "validation"
  c.model.num_layers = 12
  c.model.features = 512
  c.model.num_heads = 8
  c.model.head_dim = 64
  c.model.mlp_dim = 2048
  c.model.dropout_rate = 0.1
  c.model.position_embedding = "none"  # the attention's relative positions
  c.model.mem_len = 512
  c.model.eval_mem_len = 2100
  c.model.attention = base.attention_config("transformer_xl")
  c.model.attention.dropout_rate = 0.0  # dropatt
  paper_optimisation(c)
  values, flags = arguments.parse_arg(arg, extra=("mem_len", "eval_mem_len"), flags=("text8",))
  if "text8" in flags:
    c.data.name = "text8"
  if "smoke" in flags:
    arguments.shrink_for_smoke(c, seq_len=64)
    c.model.head_dim = None
    c.model.dropout_rate = 0.0
    c.model.mem_len = 64
    c.model.eval_mem_len = 128
    c.optimizer.lr = 1e-3
  for key in ("mem_len", "eval_mem_len"):
    if key in values:
      c.model[key] = int(values.pop(key))
  arguments.apply_common(c, values)
  return c


def paper_optimisation(c: ml_collections.ConfigDict) -> None:
  """The enwik8 base model's optimisation and schedule (the authors' script; see the module docstring)."""
  c.optimizer.name = "adam"
  c.optimizer.lr = 2.5e-4
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.eps = 1e-8
  c.optimizer.schedule = "cosine"
  c.optimizer.warmup_steps = 0
  c.optimizer.end_lr_ratio = 0.0
  c.optimizer.clip_norm = 0.25
  c.train.batch_size = 22
  c.train.eval_batch_size = 22
  c.train.num_steps = 400_000
  c.train.log_every = 200
  c.train.eval_every = 4000
  c.train.eval_batches = -1
  c.train.checkpoint_every = 4000
