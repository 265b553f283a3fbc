"""BP-Transformer (Ye, Guo, Gan, Qiu and Zhang, 2019, arXiv 1911.04070): attention on a binary partition.

Command:   python train.py --config configs/bp_transformer.py --workdir workdirs/bpt_enwik8
           (enwik8 prepared first: python -m data.prepare enwik8 --data_dir DIR; `text8` likewise)
           python train.py --config configs/bp_transformer.py:imdb --workdir workdirs/bpt_imdb
           (python -m data.prepare imdb --data_dir DIR)
           python train.py --config configs/bp_transformer.py:sst5 --workdir workdirs/bpt_sst5
           (python -m data.prepare sst5 --data_dir DIR; its TFDS builder, the community dataset
           `huggingface:sst`, needs the Hugging Face `datasets` package besides requirements-prepare.txt)
Paper:     character LM: 1.02 bpc on enwik8 test (12 layers, 38M parameters) and 1.11 on text8, matching
           Adaptive Span's small model; classification: 52.71% test accuracy on SST-5 and 92.12% on IMDB (both
           "BP-Transformer + GloVe"). These numbers are the paper's results as listed on paperswithcode, not
           checked against the PDF. Settings from the authors' released configs (yzh119/BPT,
           configs/{enwik8,text8}-512.yml, imdb-4.yml, sst5-2.yml), read, not run:
           - enwik8 / text8: 12 layers, input length 512 (evaluated on windows of 1024), d 512, 8 heads, d_ff
             2048, k = 64 context nodes per level and side, dropout 0.1 (also on attention), relative
             positions, Adam (0.9, 0.98) lr 4.1e-4 with 4000 warm-up steps then a cosine over 400k steps,
             gradient clipping 0.25, batch 64, tied input/output embeddings.
           - IMDB: 5 layers, d 300, 6 heads, d_ff 600, k = 4 (the paper's best k for IMDB), dropout 0.1 in the
             blocks, 0.3 on attention, 0.5 on the embeddings and the classifier; Adam lr 1e-4, constant,
             batch 32, 60 epochs; the training reviews split 90/10 into train and dev; whole reviews (no cut).
           - SST-5: 4 layers, d 300, 6 heads, d_ff 600, k = 2, dropout 0.1, 0.3 on attention, 0.4 on the
             embeddings and the classifier; Adam lr 2.5e-4 decayed x0.98 per epoch, batch 1024 of phrases
             (every subtree of the training trees), 40 epochs.
           Classification reads out the tree's root node; word inputs with frozen 300-d GloVe 840B vectors
           (spaCy tokens, lower-cased).
This config: the same layers, widths, heads, k and lengths, `attention=bp_transformer` with `params.context =
           k`, no absolute positions (the attention's relative vectors; models/bp_transformer_attention.py),
           pre-LN blocks. LM: enwik8 or text8 in shuffled windows of 512 (data/characters.py), evaluated at
           the training length, no auxiliary per-layer losses, untied embeddings: 41.7M parameters (38M in the
           paper), of which the relative vectors take 3.5M (k = 64 per level for log2 512 = 9 levels, per head
           and layer); its blocks scanned and each recomputed in the backward pass (`model.scan_layers`,
           `model.remat=full`: the compiler sees one block of this many-op attention, not twelve).
           Classification (data/text.py): no GloVe here, so the inputs are pieces of a
           SentencePiece vocabulary trained at prepare time on the training split (IMDB 32K, SST-5 8K pieces)
           and embeddings learned from scratch; `[bos] + pieces` cut to seq_len 2048 (IMDB: reviews average
           about 230 words, the longest about 2,500, so only a few are cut; an estimate, not measured here) or
           128 (SST-5 sentences); MEAN pooling over the tokens stands in for the root node (the Encoder drops
           the span nodes after the last block); IMDB's dev split is the last 10% of TFDS's training split;
           SST-5 trains on the 8,544 training sentences only (`huggingface:sst`'s `default` config; the phrase
           labels of its `dictionary` config are not read), with the sentiment value binned into 5 classes at
           0.2/0.4/0.6/0.8 (data.text.sst5_class), in batches of 32 (1024 would be 8 steps an epoch) at a
           constant lr; one dropout rate in the blocks (no separate embedding / classifier dropout); no weight
           decay.
Cost:      not measured at paper scale. `:smoke`, `:text8,smoke`, `:imdb,smoke`, `:sst5,smoke` (1 layer, width
           32, a few steps on the generated stand-in when the data is missing) train and evaluate in about a
           minute on a CPU, mostly compilation.
Variants:  `text8`, `imdb`, `sst5`, `context=K` (k), `seq_len=...`, `attention=...` (another attention on the
           same task; `context` then does not apply), `smoke`; `scan_layers=False,remat=none` unrolls the LM's
           blocks and keeps their activations: no recompute, for several times the HBM per chip and a much
           longer compile (docs/tpu.md).
"""

from configs import arguments, base

# variant -> (data name, seq_len, layers, features, heads, mlp_dim, k, dropout, attention dropout, lr,
#             batch, steps)
SETTINGS = {
  "lm": ("enwik8", 512, 12, 512, 8, 2048, 64, 0.1, 0.1, 4.1e-4, 64, 400_000),
  "imdb": ("imdb", 2048, 5, 300, 6, 600, 4, 0.1, 0.3, 1e-4, 32, 42_188),  # 60 epochs of 22,500 reviews
  "sst5": ("sst5", 128, 4, 300, 6, 600, 2, 0.1, 0.3, 2.5e-4, 32, 10_680),  # 40 epochs of 8,544 sentences
}


def get_config(arg: str | None = None):
  values, flags = arguments.parse_arg(arg, extra=("context",), flags=("text8", "imdb", "sst5"))
  tasks = [t for t in ("imdb", "sst5") if t in flags]
  if len(tasks) > 1 or (tasks and "text8" in flags):
    raise ValueError(f"bp_transformer: pick one of text8, imdb, sst5, got {arg!r}")
  variant = tasks[0] if tasks else "lm"
  name, seq_len, layers, features, heads, mlp, k, dropout, att_dropout, lr, batch, steps = SETTINGS[variant]
  c = base.base_config()
  c.data.name = "text8" if "text8" in flags else name
  c.data.seq_len = seq_len
  c.eval_split = "validation"
  c.model.num_layers = layers
  c.model.features = features
  c.model.num_heads = heads
  c.model.mlp_dim = mlp
  c.model.dropout_rate = dropout
  c.model.position_embedding = "none"  # the attention's relative vectors
  c.model.attention = base.attention_config("bp_transformer")
  c.model.attention.dropout_rate = att_dropout
  c.optimizer.name = "adam"
  c.optimizer.lr = lr
  c.optimizer.b1 = 0.9
  c.optimizer.eps = 1e-8
  c.train.batch_size = batch
  c.train.eval_batch_size = batch
  c.train.num_steps = steps
  c.train.eval_batches = -1
  if variant == "lm":
    c.optimizer.b2 = 0.98
    c.optimizer.schedule = "cosine"
    c.optimizer.warmup_steps = 4000
    c.optimizer.end_lr_ratio = 0.0
    c.optimizer.clip_norm = 0.25
    c.train.log_every = 200
    c.train.eval_every = 4000
    c.train.checkpoint_every = 4000
  else:
    c.data.vocab_size = 32000 if variant == "imdb" else 8000  # data.text.default_vocab
    c.model.classifier_pool = "MEAN"  # stands in for the paper's root-node readout
    c.optimizer.b2 = 0.999
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 0
    c.optimizer.clip_norm = 0.0
    c.train.log_every = 100
    c.train.eval_every = 1000
    c.train.checkpoint_every = 1000
  if "smoke" in flags:
    arguments.shrink_for_smoke(c, seq_len=64 if variant != "sst5" else 32)
    c.model.dropout_rate = 0.0
    c.model.attention.dropout_rate = 0.0
    c.optimizer.lr = 1e-3
    c.optimizer.warmup_steps = 1
    k = min(k, 4)  # the smoke length has 6 levels
    if variant != "lm":
      c.data.vocab_size = 256  # the stand-in's SentencePiece model has 200 pieces
  elif variant == "lm":  # 12 blocks of an op-heavy attention: scanned and recomputed (docs/tpu.md)
    base.scanned_and_recomputed(c)
  context = int(values.pop("context")) if "context" in values else k
  arguments.apply_common(c, values)
  if c.model.attention.name == "bp_transformer":
    c.model.attention.params.context = context
  return c
