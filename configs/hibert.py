"""HIBERT (Zhang, Wei and Zhou, ACL 2019) on CNN/DailyMail: masked-sentence pretraining, then extractive
summarisation as sentence labelling (models/hibert.py, data/cnn_dailymail.py).

Command:   python train.py --config configs/hibert.py:pretrain --workdir P   (masked-sentence prediction)
           python train.py --config configs/hibert.py:summarise --workdir S \
             --config.model.hibert.init_from=P                  (oracle sentence labels, P's encoder)
           python -m scripts.hibert_rouge --workdir S                 (ROUGE-1/2/L of the top 3 sentences)
Paper:     HIBERT_S: sentence encoder, document encoder and sentence decoder each 6 layers, d 512, 8 heads
           (54.6M parameters); HIBERT_M: 6 layers, d 768, 12 heads. Sentences cut to 50 words, documents to
           30 sentences; 15% of sentences chosen (80% [MASK], 10% kept, 10% a random sentence). Summaries: the
           top T = 3 sentences. Reported CNN/DailyMail ROUGE-1/2/L of HIBERT_M (open-domain pretraining on
           GIGA-CM, then in-domain): 42.37/19.95/38.83 (HIBERT_S a little below it).
Here:      HIBERT_S sizes (`medium` for HIBERT_M's), in-domain pretraining on CNN/DailyMail itself,
           learned position tables, ROUGE from the `rouge-score` package (ROUGE-L summary-level: rougeLsum)
           rather than the ROUGE-1.5.5 script, so expect numbers near, not equal to, the paper's.
Cost:      not measured at paper scale; `smoke` trains offline on the generated stand-in in seconds.
Variants:  `pretrain` | `summarise` (task), `medium` (HIBERT_M sizes), `smoke`; any attention by name
           (`attention=NAME`, the sentence encoder's; the document encoder and decoder use dense).
"""

import ml_collections

from configs import arguments, base

HIBERT_KEYS = ("pretrain", "summarise", "medium")


def get_config(arg: str | None = None):
  c = base.base_config()
  values, flags = arguments.parse_arg(arg, flags=HIBERT_KEYS)
  c.data.name = "cnn_dailymail"
  c.data.task = "hibert_pretrain" if "pretrain" in flags else "hibert_summarise"
  c.data.seq_len = 50  # tokens per sentence, EOS included
  c.data.max_sentences = 30
  c.data.vocab_size = 32000
  c.data.oracle_sentences = 3
  c.eval_split = "validation"
  medium = "medium" in flags
  c.model.num_layers = 6  # the sentence encoder
  c.model.features = 768 if medium else 512
  c.model.num_heads = 12 if medium else 8
  c.model.mlp_dim = 4 * c.model.features
  c.model.dropout_rate = 0.1
  c.model.attention = base.attention_config("dense")
  c.model.hibert = ml_collections.ConfigDict(dict(
      document_layers=6, decoder_layers=6, document_attention="dense", decoder_attention="dense",
      mask_rate=0.15))
  c.model.hibert.init_from = ml_collections.FieldReference(None, field_type=str)  # a pretraining workdir
  c.optimizer.name = "adam"
  c.optimizer.lr = 1e-4  # Adam with warmup; not checked against the paper's optimizer settings
  c.optimizer.schedule = "constant"
  c.optimizer.warmup_steps = 10_000
  c.train.batch_size = 32
  c.train.eval_batch_size = 32
  c.train.num_steps = 100_000
  c.train.log_every = 100
  c.train.eval_every = 5000
  c.train.eval_batches = 100
  c.train.checkpoint_every = 2000
  if "smoke" in flags:
    arguments.shrink_for_smoke(c)
    c.data.seq_len = 16
    c.data.max_sentences = 8
    c.data.vocab_size = 128
    c.model.hibert.document_layers = 1
    c.model.hibert.decoder_layers = 1
    c.model.dropout_rate = 0.0
    c.optimizer.lr = 3e-3
  arguments.apply_common(c, values)
  return c
