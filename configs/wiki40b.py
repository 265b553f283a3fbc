"""Wiki-40B-En language modeling (SentencePiece 32K, packed documents), perplexity on the validation set.

Command:   python train.py --config configs/wiki40b.py:attention=combiner_fixed,seq_len=8192 \
             --workdir workdirs/wiki40b_fixed_8k --config.data.data_dir DIR
             (DIR prepared by `python -m data.prepare`)
Paper:     Table 2 (12 layers, width 768, 12 heads, batch 128, 125k steps, cosine with 10k warmup, Adam with
           clipping; Appendix E.3): combiner_fixed 17.70 (2k) / 16.60 (8k), combiner_axial_* 17.56 (2k) /
           16.49 (8k), sparse_fixed 18.04 (2k), sparse_axial 20.82 (2k), dense 17.26 (2k). Table 3 (8k,
           DeepSets): `deepsets=true` 16.29 (max) / 16.48 (`pooling=mean`); without: 16.60 (max) / 16.54
           (mean).
Expected:  perplexity ~17.7 for the default (combiner_fixed, 2048 tokens) after 125k steps.
Cost:      days on a TPU v3-32 class slice (batch 128 x 2048 tokens); `:smoke` runs in seconds on a CPU.
The peak learning rate (5e-4) is not stated in the paper: our choice.
"""

from configs import text


def get_config(arg: str | None = None):
  return text.text_config("wiki40b", arg)
