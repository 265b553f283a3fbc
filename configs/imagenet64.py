"""ImageNet 64x64 density estimation (12288 sub-pixel tokens), bits/dim on the validation set.

Command:   python train.py --config configs/imagenet64.py:attention=combiner_axial_vertical \
             --workdir workdirs/imagenet64_axial --config.data.data_dir ~/tensorflow_datasets
Paper:     Table 1 (ablation, the CIFAR-10 architecture: 6 layers, width 512, 8 heads; Appendix E.2):
           combiner_axial_* / combiner_mixture 3.585, combiner_fixed 3.654, combiner_logsparse 3.795,
           sparse_fixed 3.696, sparse_axial 4.032, sparse_logsparse 4.351 bits/dim. Table 4 (3.42): `main` =
           30 layers, width 768, 1.2M cosine steps (Appendix E.2; 12 heads and MLP 4x768 are our choices,
           and so are the scanned blocks recomputed in the backward pass, `model.remat=full`).
Expected:  ~3.59 bits/dim for the default after 400k steps.
Cost:      several TPU-days (12288-token sequences); the smoke variant (`:smoke`: 8x8 images, generated ones
           when the dataset is not prepared) runs in seconds on a CPU.
"""

from configs import images, routing_paper

MAIN = dict(layers=30, features=768, heads=12, mlp_dim=4 * 768, dropout=0.0, lr=1e-3, steps=1_200_000)


def get_config(arg: str | None = None):
  # `routing_paper`: the Routing Transformer paper's model and optimizer (configs/routing_paper.py).
  arg, paper = routing_paper.split_flag(arg)  # paper: the flag's own keys, None without the flag
  c = images.image_config("imagenet64", (64, 64, 3), arg, MAIN)
  if paper is not None:
    routing_paper.apply(c, routing_paper.IMAGENET64, arg, paper, images.IMAGE_KEYS, images.IMAGE_FLAGS)
  return c
