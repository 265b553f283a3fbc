"""The sampling driver: cached decoding from a workdir's checkpoint of a causal model.

What is written depends on the task of the workdir's config:
- image (cifar10, imagenet64): `<workdir>/samples_<step>.png`, a grid of the sampled images (tokens are
  sub-pixel values in raster order, channels innermost); `prompt_len` keeps that many sub-pixels of
  validation images (image completion).
- lm on text (wiki40b, pg19: SentencePiece; pystdlib, enwik8: bytes; text8: space and a-z):
  `<workdir>/samples_<step>.txt`, the decoded texts, each continuing `prompt`, tokenized as the run's data
  pipeline tokenizes (`text_codec`; a smoke run without the data: the generated stand-in's SentencePiece
  model).
- synthetic_recall (the default task): the first half of validation records (the key-value pairs) is the
  prompt; the queries of the second half are read from the record, each answer is sampled, and the recalled
  values are printed next to the right ones (`?` where the model sampled a token that is not a value).
`prompt` is for lm on text and `prompt_len` for images; either given to another task is an error.
Attention plans without a cached decoding step (YOSO, bidirectional-only ops) stop with an error naming the
op.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime.cli import UsageError
from training.evaluate import restore_workdir
from training.experiment import create_dataset


def restore_model(workdir: str, step: int | None = None) -> tuple[Any, Any, int]:
  """(experiment, model with the checkpoint's parameters, step)."""
  exp, state, mgr = restore_workdir(workdir, step=step)
  mgr.close()
  exp.init_rng_state()
  return exp, exp.model(state, jax.random.key(0)), state.step


def image_grid(tokens: np.ndarray, shape: tuple[int, int, int], columns: int = 8) -> np.ndarray:
  """tokens [n, H*W*C] sub-pixel values -> one uint8 image [rows*(H+1)-1, cols*(W+1)-1, C] (1-pixel gaps)."""
  h, w, c = shape
  images = np.clip(tokens, 0, 255).astype(np.uint8).reshape(-1, h, w, c)
  n = images.shape[0]
  cols = min(columns, n)
  rows = -(-n // cols)
  grid = np.full((rows * (h + 1) - 1, cols * (w + 1) - 1, c), 255, np.uint8)
  for i, image in enumerate(images):
    r, col = divmod(i, cols)
    grid[r * (h + 1):r * (h + 1) + h, col * (w + 1):col * (w + 1) + w] = image
  return grid


def write_png(path: str, image: np.ndarray) -> None:
  """A minimal PNG writer (8-bit grey or RGB), so sampling needs no imaging library."""
  import struct
  import zlib

  h, w, c = image.shape
  raw = b"".join(b"\x00" + image[y].tobytes() for y in range(h))

  def chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

  color = {1: 0, 3: 2, 4: 6}[c]
  with open(path, "wb") as f:
    f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def _validation_records(exp: Any, n: int) -> list[dict[str, np.ndarray]]:
  source = create_dataset(exp.config, "validation", batch_size=n, seed=int(exp.config.seed))
  batch = next(iter(source))
  return [{k: np.asarray(v[i]) for k, v in batch.items()} for i in range(n)]


def sample_recall(exp: Any, model: Any, *, num_samples: int, temperature: float, top_k: int, top_p: float,
                  seed: int) -> dict[str, Any]:
  """Recall: prefill the pairs, read each query from the record, sample its answer; returns the answers."""
  from data import synthetic
  from models.generate import Decoder, sample_token

  source = synthetic.RecallSource(exp.config, "validation", int(exp.config.seed))
  records = source.read_batch(list(range(num_samples)))
  inputs = np.stack([r["inputs"] for r in records])  # [n, L]
  answer_at = np.asarray(records[0]["weights"]) > 0  # the same positions in every record
  length = inputs.shape[1]
  half = length // 2
  dec = Decoder(model)
  cache = dec.init_cache(num_samples, length)
  logits, cache = dec.prefill(cache, jnp.asarray(inputs[:, :half]))
  logits = logits[:, -1]
  key = jax.random.key(seed)
  sampled = np.zeros_like(inputs)
  for t in range(half, length):
    token = np.asarray(sample_token(jax.random.fold_in(key, t), logits, temperature=temperature, top_k=top_k,
                                    top_p=top_p))
    sampled[:, t] = token
    fed = token if answer_at[t] else inputs[:, t]  # answers are the model's own; queries come from the record
    if t + 1 < length:
      logits, cache = dec.decode(cache, jnp.asarray(fed), t + 1)
  answer_base = synthetic.vocab_size(exp.config) - source.num_values  # answers are the last ids
  got, want = sampled[:, answer_at] - answer_base, inputs[:, answer_at] - answer_base
  return {"recalled": got, "right": want, "accuracy": float(np.mean(got == want))}


def format_recalled(values: np.ndarray) -> str:
  """The recalled values for printing: a sampled token that is not a value (negative here) shows as `?`."""
  return " ".join(str(int(v)) if v >= 0 else "?" for v in values)


def text_codec(config: Any) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str], list[int],
                                     int | None]:
  """(encode, decode, the ids every sample starts with, the id that ends a sample) of an lm config on text,
  as its data pipeline tokenizes it.

  pystdlib and enwik8 are UTF-8 bytes (a pystdlib sample ends at the NUL that separates files), text8 its
  alphabet (data.characters); wiki40b and pg19 their SentencePiece model (a sample is bos + pieces, ended by
  eos), found where the run read it: for a smoke run without the data, the generated stand-in's
  (data.resolved_config). UsageError for a dataset without text, and for a missing SentencePiece model.
  """
  import data
  from data import characters, pystdlib, text, tokenizer
  from data.pipeline import cfg_get, missing
  from runtime import paths

  name = str(config.data.name)
  if name == "pystdlib" or name in characters.SPECS:
    unit = "text8" if name == "text8" else "enwik8"  # pystdlib reads bytes, as enwik8 does

    def encode_chars(prompt: str) -> list[int]:
      if unit == "text8" and set(prompt) - set(characters.TEXT8_ALPHABET):
        raise UsageError(f"--prompt: text8 models read space and a-z only, got {prompt!r}")
      return characters.encode(unit, prompt.encode("utf-8")).astype(int).tolist()

    def decode_chars(ids: list[int]) -> str:
      return characters.decode(unit, np.asarray(ids)).decode("utf-8", "replace")

    return encode_chars, decode_chars, [], pystdlib.SEPARATOR[0] if name == "pystdlib" else None
  if name not in text.SPECS or text.SPECS[name]["task"] != "lm":
    raise UsageError(f"--workdir: sampling text is defined for wiki40b, pg19, pystdlib, enwik8 and text8; "
                     f"the workdir's dataset is {name!r}")
  path = text.spm_path(data.resolved_config(config))
  if not paths.exists(path):
    raise missing(path, name, cfg_get(config, "data_dir"), what="SentencePiece model")
  sp = tokenizer.load(path)
  pieces = sp.get_piece_size()

  def decode_pieces(ids: list[int]) -> str:  # ids beyond the model's pieces (a larger vocab_size) read as unk
    return sp.decode([i if i < pieces else tokenizer.UNK_ID for i in ids])

  return sp.encode, decode_pieces, [tokenizer.BOS_ID], tokenizer.EOS_ID


def run(workdir: str, *, num_samples: int = 8, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
        seed: int = 0, step: int | None = None, prompt: str = "", prompt_len: int = 0) -> dict[str, Any]:
  """Samples from the workdir's checkpoint and writes/prints the result; returns what was produced."""
  from models.generate import generate

  exp, model, step = restore_model(workdir, step)
  info = exp.info
  if info.task not in ("lm", "image"):
    raise UsageError(f"--workdir {workdir}: sampling needs a causal task (lm or image), the workdir's task "
                     f"is {info.task!r}")
  kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
  text_task = info.task == "lm" and info.name != "synthetic_recall"
  if prompt and not text_task:
    raise UsageError(f"--prompt is for language tasks on text (wiki40b, pg19, pystdlib, enwik8, text8); the "
                     f"workdir's dataset is {info.name!r}")
  if prompt_len and info.task != "image":
    raise UsageError(f"--prompt_len is for image tasks (cifar10, imagenet64); the workdir's dataset is "
                     f"{info.name!r}" + ("; use --prompt" if text_task else ""))
  if info.name == "synthetic_recall":
    out = sample_recall(exp, model, num_samples=num_samples, seed=seed, **kw)
    for i, (got, want) in enumerate(zip(out["recalled"], out["right"], strict=True)):
      print(f"sample {i}: recalled {format_recalled(got)}")
      print(f"{'':>{len(str(i)) + 7}}  right    {' '.join(map(str, want))}")
    print(f"recall accuracy {out['accuracy']:.3f} over {out['right'].size} answers", flush=True)
    return out
  key = jax.random.key(seed)
  length = info.seq_len
  if info.task == "image":
    if prompt_len >= length:
      raise UsageError(f"--prompt_len must be < the sequence length {length} (sub-pixels), got {prompt_len}")
    head = np.zeros((num_samples, 0), np.int32)
    if prompt_len:
      head = np.stack([r["inputs"][:prompt_len] for r in _validation_records(exp, num_samples)])
    tokens = np.asarray(generate(model, key, num_samples=num_samples, length=length, prompt=head, **kw))
    path = os.path.join(workdir, f"samples_{step}.png")
    write_png(path, image_grid(tokens, tuple(info.image_shape)))
    print(f"wrote {num_samples} samples to {path}", flush=True)
    return {"tokens": tokens, "path": path}
  encode, decode, start, end_id = text_codec(exp.config)
  ids = start + (encode(prompt) if prompt else [])
  if len(ids) >= length:
    raise UsageError(f"--prompt is {len(ids)} tokens, the model's sequence length is {length}: give a "
                     "shorter prompt")
  head = np.tile(np.asarray(ids, np.int32).reshape(1, -1), (num_samples, 1))
  tokens = np.asarray(generate(model, key, num_samples=num_samples, length=length, prompt=head, **kw))
  texts = []
  for row in tokens:
    row = [int(t) for t in row]
    end = row.index(end_id, len(ids)) if end_id in row[len(ids):] else len(row)
    texts.append(decode(row[len(start):end]))
  path = os.path.join(workdir, f"samples_{step}.txt")
  with open(path, "w") as f:
    f.write("\n\n".join(texts) + "\n")
  for t in texts:
    print(t, "\n", flush=True)
  return {"tokens": tokens, "texts": texts, "path": path}
