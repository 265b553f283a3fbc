"""C4 masked language modeling (15% masking, at most 2 segments per row), perplexity of the masked tokens.

Command:   python train.py --config configs/c4.py:attention=combiner_axial_vertical \
             --workdir workdirs/c4_axial --config.data.data_dir DIR
             (DIR prepared by `python -m data.prepare`)
Paper:     Table 6 (the Wiki-40B architecture, bidirectional; Appendix E.5): combiner_fixed 5.170 (2k) /
           4.139 (8k), combiner_axial_* 4.809 (2k) / 4.190 (8k), sparse_fixed 5.279, sparse_axial 5.370,
           dense 4.552 (2k), combiner_routed 6.539, routing 6.703.
Expected:  MLM perplexity ~5.2 for the default (combiner_fixed, 2048 tokens) after 125k steps.
Cost:      days on a TPU v3-32 class slice; `:smoke` runs in seconds on a CPU.
"""

from configs import text


def get_config(arg: str | None = None):
  c = text.text_config("c4", arg)
  return c
