r"""Samples from a train.py checkpoint of a causal model with cached decoding.

    python sample.py --workdir workdirs/default-20261122-050000                   # the default recall task
    python sample.py --workdir DIR --num_samples 16 --temperature 0.9 --top_k 64   # image tasks: a PNG grid
    python sample.py --workdir DIR --prompt "The history of" --top_p 0.9           # language tasks: text

What is written depends on the task of the workdir's config:
- image (cifar10, imagenet64): `<workdir>/samples_<step>.png`, a grid of the sampled images (tokens are
  sub-pixel values in raster order, channels innermost); `--prompt_len` keeps that many sub-pixels of
  validation images (image completion).
- lm on text (wiki40b, pg19: SentencePiece; pystdlib, enwik8: bytes; text8: space and a-z):
  `<workdir>/samples_<step>.txt`, the decoded texts, each continuing `--prompt`, tokenized as the run's data
  pipeline tokenizes (a smoke run without the data: the generated stand-in's SentencePiece model).
- synthetic_recall (the default task): the first half of validation records (the key-value pairs) is the
  prompt; the queries of the second half are read from the record, each answer is sampled, and the recalled
  values are printed next to the right ones (`?` where the model sampled a token that is not a value).
`--prompt` is for lm on text and `--prompt_len` for images; either given to another task is an error.
Attention plans without a cached decoding step (YOSO, bidirectional-only ops) stop with an error naming the
op. The driver is training/sample.py.
"""

from __future__ import annotations

import os
import sys

from runtime import cli


def check_flags(f) -> None:
  """The flags' domains and the workdir, before anything is restored (UsageError naming the flag)."""
  cli.workdir_dir("--workdir", f.workdir, must_exist=True)
  if "://" not in f.workdir:
    cli.check(os.path.isfile(os.path.join(f.workdir, "config.json")),
              f"--workdir {f.workdir} has no config.json: not a train.py workdir")
  cli.at_least("--num_samples", f.num_samples, 1)
  cli.at_least("--temperature", f.temperature, 0, " (0 = greedy)")
  cli.at_least("--top_k", f.top_k, 0, " (0 = all tokens)")
  cli.probability("--top_p", f.top_p)
  cli.at_least("--step", f.step, 0)
  cli.at_least("--prompt_len", f.prompt_len, 0)


def main(argv: list[str]) -> None:
  del argv
  from absl import flags, logging

  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  check_flags(f)
  from training import sample

  sample.run(f.workdir, num_samples=f.num_samples, temperature=f.temperature, top_k=f.top_k, top_p=f.top_p,
             seed=f.seed, step=f.step, prompt=f.prompt, prompt_len=f.prompt_len)


def _flags() -> None:
  from absl import flags

  flags.DEFINE_string("workdir", None, "a train.py workdir", required=True)
  flags.DEFINE_integer("num_samples", 8, "sequences to sample")
  flags.DEFINE_float("temperature", 1.0, "softmax temperature (0 = greedy)")
  flags.DEFINE_integer("top_k", 0, "keep the k most likely tokens (0 = all)")
  flags.DEFINE_float("top_p", 1.0, "nucleus sampling: keep the most likely tokens up to this probability")
  flags.DEFINE_integer("seed", 0, "sampling seed")
  flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
  flags.DEFINE_string("prompt", "", "language tasks on text: the text every sample continues")
  flags.DEFINE_integer("prompt_len", 0, "image tasks: keep this many sub-pixels of validation images")


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  cli.run_absl(main, _flags)
