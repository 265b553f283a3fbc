"""BlockBERT (Qiu et al., 2019): BERT-base masked-LM pretraining with blockwise attention, on C4.

Command:   python train.py --config configs/blockbert.py --workdir workdirs/blockbert \
             --config.data.data_dir DIR
             (DIR prepared by `python -m data.prepare c4 --data_dir DIR`, as for configs/c4.py)
Paper:     "Blockwise Self-Attention for Long Document Understanding" (Qiu, Ma, Levy, Yih, Wang, Tang; arXiv
           2019, Findings of EMNLP 2020). BERT-base (12 layers, width 768, 12 heads, MLP 3072, uncased
           WordPiece vocabulary) pretrained by masked LM on BookCorpus and English Wikipedia with the tokens
           per batch fixed at B x N = 131,072: N = 512 with B = 256, or N = 1024 with B = 128. Attention cut
           into n = 2 or 3 blocks, each head attending from block a to block (a + s_h) mod n, most heads
           block-diagonal (12 heads: shifts 0:1 as 10:2 for n = 2, 0:1:2 as 10:1:1 for n = 3, the attention's
           default shifts, after the paper's pretraining optima); n = 2 is the better of the two. The baseline
           is RoBERTa pretrained the same way with full attention (`attention=dense` here). The abstract's
           results (against that baseline): 18.7-36.1% less memory and 12.0-25.1% less pretraining time, 27.8%
           less inference time, comparable and sometimes better accuracy. The accuracy is downstream question
           answering after fine-tuning: SQuAD 1.1 and 2.0, and NaturalQA, HotpotQA, SearchQA and TriviaQA
           (longer paragraphs), reported as F1 / EM per task, length and n; those numbers are not restated
           here (read the paper's tables). As recalled, not checked against the paper: BERT's optimisation
           (Adam, peak lr 1e-4, b2 0.999, weight decay 0.01, 10,000 warmup steps then linear decay, dropout
           0.1) and its budget of 1M steps, and RoBERTa's one-sequence input without next-sentence prediction
           for both models.
This config: that model, batch and attention (n = 2) with that optimisation, trained by masked LM on C4
           (data/text.py: a 32K SentencePiece vocabulary, cased; 15% of tokens predicted, 80/10/10
           [MASK]/random/kept; at most 2 documents per row), since this codebase has no BookCorpus / English
           Wikipedia pipeline. Its result is the perplexity of the masked tokens, not the paper's QA scores:
           there is no QA fine-tuning here, so the comparison it supports is BlockBERT against
           `attention=dense` (the RoBERTa row) under the same pretraining, in MLM perplexity, memory and
           time. Differences: the blocks are pre-LayerNorm (BERT is post-LN); cosine decay stands in for
           the linear decay (not among the schedules); learned positions of the training length.
Cost:      BERT-base pretraining: days on a TPU v3-32 class slice; `:smoke` (1 layer, width 32, length 64)
           runs in seconds on a CPU on the generated C4 stand-in.
Variants:  `seq_len=512` (default, batch 256) or `seq_len=1024` (batch 128): the batch follows the length
           to keep 131,072 tokens per batch unless `batch_size=...` is given; `num_blocks=2` (default) or
           `num_blocks=3` (blocks of 170 or 171 positions at length 512, the paper's assignment; the
           attention's `params.num_blocks`, also
           `--config.model.attention.params.num_blocks=3`); per-head shifts by
           `--config.model.attention.shifts=...`; `attention=dense` (the RoBERTa baseline) or any other
           bidirectional attention; `smoke`.
"""

import ml_collections

from configs import arguments, base
from runtime.cli import UsageError

TOKENS_PER_BATCH = 131_072  # B x N, the same for every length
NUM_BLOCKS = 2  # the paper's better setting


def get_config(arg: str | None = None):
  c = base.base_config()
  c.data.name = "c4"
  c.data.seq_len = 512
  c.eval_split = "validation"
  c.model.num_layers = 12
  c.model.features = 768
  c.model.num_heads = 12
  c.model.mlp_dim = 3072
  c.model.dropout_rate = 0.1
  c.model.attention = base.attention_config("blockbert")
  c.model.attention.dropout_rate = 0.1
  paper_optimisation(c)
  values, flags = arguments.parse_arg(arg, extra=("num_blocks",))
  num_blocks = values.pop("num_blocks", None)
  if "smoke" in flags:
    arguments.shrink_for_smoke(c, seq_len=64)
    c.model.dropout_rate = 0.0
    c.model.attention.dropout_rate = 0.0
    c.optimizer.lr = 1e-3
  arguments.apply_common(c, values)
  if "smoke" not in flags and "batch_size" not in values:
    seq_len = int(c.data.seq_len)
    if TOKENS_PER_BATCH % seq_len:
      raise UsageError(f"configs/blockbert.py keeps {TOKENS_PER_BATCH:,} tokens per batch: seq_len={seq_len} "
                       "does not divide it (write batch_size=... as well)")
    c.train.batch_size = c.train.eval_batch_size = TOKENS_PER_BATCH // seq_len
  set_num_blocks(c, num_blocks)
  return c


def set_num_blocks(c: ml_collections.ConfigDict, value: str | None) -> None:
  """`num_blocks=N` (default 2) for attention=blockbert; refused with another attention."""
  if str(c.model.attention.name) != "blockbert":
    if value is not None:
      raise UsageError(f"num_blocks={value} is a parameter of attention=blockbert, got "
                       f"attention={c.model.attention.name}")
    return
  try:
    n = NUM_BLOCKS if value is None else int(value)
  except ValueError:
    raise UsageError(f"config argument num_blocks={value!r}: num_blocks must be an int") from None
  if n < 1:
    raise UsageError(f"num_blocks must be >= 1, got {n}")
  c.model.attention.params.num_blocks = n


def paper_optimisation(c: ml_collections.ConfigDict) -> None:
  """BERT-base's optimisation (as recalled, not checked against the paper; see the module docstring)."""
  c.optimizer.name = "adamw"
  c.optimizer.lr = 1e-4
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.eps = 1e-6
  c.optimizer.weight_decay = 0.01
  c.optimizer.schedule = "cosine"
  c.optimizer.warmup_steps = 10_000
  c.optimizer.end_lr_ratio = 0.0
  c.optimizer.clip_norm = 1.0
  c.train.batch_size = c.train.eval_batch_size = TOKENS_PER_BATCH // 512
  c.train.num_steps = 1_000_000
  c.train.log_every = 100
  c.train.eval_every = 5000
  c.train.eval_batches = 100
  c.train.checkpoint_every = 2000
