"""CIFAR-10 density estimation (3072 sub-pixel tokens, raster order, channels innermost), bits/dim on the test
set.

Command:   python train.py --config configs/cifar10.py:attention=combiner_axial_vertical,layers=6 \
             --workdir workdirs/cifar10_axial --config.data.data_dir ~/tensorflow_datasets
Paper:     Table 1 (ablation, 6 layers, width 512, 8 heads, lr 1e-3, batch 32, 400k steps; Appendix E.1):
           combiner_axial_* 3.050, combiner_mixture 3.040, combiner_fixed 3.321, combiner_logsparse 3.366,
           sparse_fixed 3.408, sparse_axial 3.666, sparse_logsparse 4.253 bits/dim; 12-layer Combiner-Mixture
           (`layers=12,attention=combiner_mixture`) 2.885. Table 4 (2.77, Combiner-Axial): `main` = Child et
           al.'s 128-layer architecture and 1.2M cosine steps (Appendix E.1).
Expected:  ~3.05 bits/dim for the default (combiner_axial_vertical, 6 layers) after 400k steps.
Cost:      about 4 days on a TPU v2-8 at the paper's batch (400k steps at ~1 step/s); the smoke variant
           (`:smoke`: a tiny model on 8x8 images, generated ones when CIFAR-10 is not prepared) runs in
           seconds.
The mlp width (2048) and the cosine/warmup schedule of the ablation are not stated in the paper: our choices.

`main` (Table 4): the Combiner paper gives only "the same architecture as introduced in Child et al." and
1,200,000 cosine steps. The architecture values are those of Child et al. 2019 ("Generating Long Sequences
with Sparse Transformers", section 7, CIFAR-10): 128 layers, d = 256, 2 heads, a half-size feed-forward
network (2d = 512 instead of 4d), dropout 0.25, learning rate 3.5e-4. Their half-size query-key projections
cannot be expressed here (queries, keys and values share head_dim = 128). Like them, `main` recomputes each
block's activations in the backward pass (`model.remat=full`, with the blocks scanned).
"""

from configs import images, routing_paper

MAIN = dict(layers=128, features=256, heads=2, mlp_dim=512, dropout=0.25, lr=3.5e-4, steps=1_200_000)


def get_config(arg: str | None = None):
  # `routing_paper`: the Routing Transformer paper's model and optimizer (configs/routing_paper.py).
  arg, paper = routing_paper.split_flag(arg)  # paper: the flag's own keys, None without the flag
  c = images.image_config("cifar10", (32, 32, 3), arg, MAIN)
  if paper is not None:
    routing_paper.apply(c, routing_paper.CIFAR10, arg, paper, images.IMAGE_KEYS, images.IMAGE_FLAGS)
  return c
