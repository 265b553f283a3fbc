"""CIFAR-10 density estimation (3072 sub-pixel tokens, raster order, channels innermost), bits/dim on the test set.

Command:   python train.py --config configs/cifar10.py:attention=combiner_axial_vertical,layers=6 \
             --workdir workdirs/cifar10_axial --config.data.data_dir ~/tensorflow_datasets
Paper:     Table 1 (ablation, 6 layers, width 512, 8 heads, lr 1e-3, batch 32, 400k steps; Appendix E.1):
           combiner_axial_* 3.050, combiner_mixture 3.040, combiner_fixed 3.321, combiner_logsparse 3.366,
           sparse_fixed 3.408, sparse_axial 3.666, sparse_logsparse 4.253 bits/dim; 12-layer Combiner-Mixture
           (`layers=12,attention=combiner_mixture`) 2.885. Table 4 (2.77) uses Child et al.'s 128-layer model and
           1.2M cosine steps (`main,layers=128,...`), not reproduced by default.
Expected:  ~3.05 bits/dim for the default (combiner_axial_vertical, 6 layers) after 400k steps.
Cost:      about 4 days on a TPU v2-8 at the paper's batch (400k steps at ~1 step/s); the smoke variant
           (`:smoke`: a tiny model on the full 32x32 images) runs in minutes on a CPU.
The mlp width (2048) and the cosine/warmup schedule of the ablation are not stated in the paper: our choices.
"""

from configs import images, routing_paper


def get_config(arg: str | None = None):
  # `routing_paper`: the Routing Transformer paper's model and optimizer (configs/routing_paper.py).
  arg, paper = routing_paper.split_flag(arg)
  c = images.image_config("cifar10", (32, 32, 3), arg)
  if paper:
    routing_paper.apply(c, routing_paper.CIFAR10, arg, images.IMAGE_KEYS)
  return c
