"""The smoke config the training tests run, with dotted-key overrides ("train.num_steps": 6)."""

from configs import default


def smoke(attention_name="combiner_fixed", **overrides):
  c = default.get_config(f"smoke,attention={attention_name}")
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c
