"""Compressive Transformer (Rae et al., 2019, arXiv 1911.05507): Transformer-XL plus a compressed memory.

Command:   python train.py --config configs/compressive.py --workdir workdirs/compressive
           (enwik8 prepared first: python -m data.prepare enwik8 --data_dir DIR)
Paper:     enwik8, 0.97 bpc on test (the paper's abstract) with a 24-layer model (277M parameters, the
           paperswithcode listing). The settings below are from recollection, not checked against the
           paper: d_model 1024, 8 heads, d_ff 3072, training segments
           n_s = 768, memory n_m = 768, compressed memory n_cm = 768, compression rate c = 3, 1D convolution
           compression trained by the attention-reconstruction loss (models/compressive_attention.py). The
           parameter count agrees: 24 x (4 d^2 + 2 d d_ff + d^2 for W_{k,R}) = 276.8M without the compression
           convolutions (3 d^2 per layer more here).
           PG-19 (the paper's book benchmark, the `pg19` variant): 33.6 test word perplexity (Transformer-XL:
           36.3) with 36 layers, n_s = n_m = n_cm = 512, c = 2, conv compression; d_model 1024, 8 heads
           (head 128) and d_ff 4096 are from recollection, not checked against the paper, as is its 32K
           TFDS SubwordTextEncoder vocabulary (here a 32K SentencePiece model, data/text.py: per-token
           numbers differ, per-word ones compare). Word perplexity = exp(summed token NLL / whitespace
           words of the evaluated text), reported by evaluation as `word_perplexity` (models/metrics.py).
This config: that enwik8 model on the ordered byte stream (`data.ordered=True`, data/characters.py), pre-LN
           blocks (the paper's are post-LN), relative positions over [compressed; memory; segment]. The
           optimisation is not in the sources at hand: this config takes Transformer-XL's
           (configs/transformer_xl.py: Adam 2.5e-4, cosine to 0 over 400k steps, clip 0.25, batch 22).
Cost:      the paper trains on 16+ accelerators for days; `:smoke` (1 layer, width 32, segments of 48 with
           mem_len 48 and compressed_mem_len 32, on the generated enwik8 stand-in when enwik8 is missing) runs
           in seconds on a CPU.
Variants:  `pg19` (PG-19, prepared with python -m data.prepare pg19 --data_dir DIR; its `smoke` reads a
           generated book stand-in), `compression=max_pool|mean_pool|conv|dilated_conv|most_used`,
           `compression_rate=...`, `mem_len=...`, `compressed_mem_len=...`, `eval_mem_len=...`,
           `eval_compressed_mem_len=...`, `seq_len=...`, `smoke`.
"""

from configs import arguments, base, transformer_xl


def get_config(arg: str | None = None):
  c = base.base_config()
  c.data.name = "enwik8"
  c.data.seq_len = 768  # n_s
  c.data.ordered = True
  c.eval_split = "validation"
  c.model.num_layers = 24
  c.model.features = 1024
  c.model.num_heads = 8
  c.model.head_dim = 128
  c.model.mlp_dim = 3072
  c.model.dropout_rate = 0.1
  c.model.position_embedding = "none"  # the attention's relative positions
  c.model.mem_len = 768  # n_m
  c.model.compressed_mem_len = 768  # n_cm
  c.model.attention = base.attention_config("compressive")  # its defaults: conv compression, rate c = 3
  c.model.attention.dropout_rate = 0.0
  transformer_xl.paper_optimisation(c)  # not in the sources at hand: Transformer-XL's
  lengths = ("mem_len", "compressed_mem_len", "eval_mem_len", "eval_compressed_mem_len")
  values, flags = arguments.parse_arg(arg, extra=lengths + ("compression", "compression_rate"),
                                      flags=("pg19",))
  if "pg19" in flags:  # the paper's PG-19 model (see the docstring for what is from recollection)
    c.data.name = "pg19"
    c.data.vocab_size = 32000
    c.data.seq_len = 512  # n_s
    c.model.num_layers = 36
    c.model.mlp_dim = 4096
    c.model.mem_len = 512  # n_m
    c.model.compressed_mem_len = 512  # n_cm
    c.model.attention.compression = "conv"
    c.model.attention.compression_rate = 2
  if "smoke" in flags:
    arguments.shrink_for_smoke(c, seq_len=48)
    c.model.head_dim = None
    c.model.dropout_rate = 0.0
    c.model.mem_len = 48
    c.model.compressed_mem_len = 32
    c.optimizer.lr = 1e-3
  else:  # 24-36 layers with their memories: scanned and recomputed, to compile and fit (docs/tpu.md)
    base.scanned_and_recomputed(c)
  for key in lengths:
    if key in values:
      c.model[key] = int(values.pop(key))
  if "compression" in values:
    c.model.attention.compression = values.pop("compression")
  if "compression_rate" in values:
    c.model.attention.compression_rate = int(values.pop("compression_rate"))
  arguments.apply_common(c, values)
  return c
