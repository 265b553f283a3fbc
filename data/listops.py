"""ListOps: the token vocabulary, an evaluator, and an offline generator of the LRA task.

The generator follows the published process (Nangia & Bowman 2018, as used by Long Range Arena): a tree whose
internal nodes are operators MAX, MIN, MED (integer median) and SM (sum modulo 10) over 2..`max_args`
arguments, leaves are digits 0..9; a node above `max_depth` becomes an operator with probability `op_p`
(0.25 as published) and a digit otherwise; the tree is written in the LRA text form `( ( ( [MAX 2 ) 9 ) ] )`
and kept only when its length lies in [min_length, max_length] (500..2000 as published; rejection sampling
like the original). Length counts operators, digits and `]`, not parentheses: the published generator counts
that way and the LRA input pipeline strips the parentheses, so by default (`config.data.listops_parens=False`)
sequences are the same tokens without parentheses and fit seq_len 2000. The label is the tree's value, 0..9.

`listops_synthetic` serves such examples through the same interface as the LRA files: example i of a split is
generated from its own seed (data_seed, split, i), so it is random access and identical on every host and
after a resume. Generation is slow (rejection sampling, milliseconds per example at the published lengths), so
like the LRA ListOps files each split is generated once: on first use (or by `python -m data.prepare
listops_synthetic --data_dir DIR`) it is written under
`{cache_dir or data_dir}/listops_synthetic/<split>-<key>/` (token ids, offsets, labels as .npy; written to a
temporary directory and renamed, so concurrent hosts and interrupted runs never see a partial cache), `<key>`
hashing every field that changes the examples (data_seed, split size, lengths, depth, arguments, op_p,
parentheses). Later runs memory-map it; the examples are the generator's, bit for bit. With neither
`cache_dir` nor `data_dir` set, examples are generated on access.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import logging
import multiprocessing
import os
import time
import zlib
from typing import Any

import numpy as np
import tqdm

from data import pipeline
from data.info import DatasetInfo
from runtime import cli, paths

log = logging.getLogger("data")

MIN, MAX, MED, SUM_MOD, END = "[MIN", "[MAX", "[MED", "[SM", "]"
OPERATORS = (MAX, MIN, MED, SUM_MOD)
# id 0 is the padding id; padding is still marked by `mask`, never inferred from it.
VOCAB = ("<pad>", "(", ")", END, MAX, MIN, MED, SUM_MOD) + tuple(str(d) for d in range(10))
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}

DEFAULTS = dict(min_length=500, max_length=2000, max_depth=10, max_args=10, op_p=0.25)
SPLIT_SIZES = {"train": 96_000, "validation": 2_000, "test": 2_000}


def apply_op(op: str, args: list[int]) -> int:
  if op == MAX:
    return max(args)
  if op == MIN:
    return min(args)
  if op == MED:
    return int(np.median(args))  # integer part of the median (mean of the middle two for even counts)
  if op == SUM_MOD:
    return sum(args) % 10
  raise ValueError(f"unknown ListOps operator {op!r}; allowed: {OPERATORS}")


class _TooLong(Exception):
  pass


def generate_tree(rng: np.random.Generator, *, max_depth: int, max_args: int, op_p: float, depth: int = 1,
                  budget: list[int] | None = None):
  """A nested (op, [children]) tree or an int leaf; the root has depth 1, operators stop at `max_depth`.

  `budget` ([remaining length]) aborts with _TooLong as soon as the tree is known to exceed it: rejection
  would discard it anyway, so stopping early changes only the cost, not the distribution of accepted trees.
  """
  if depth < max_depth and rng.random() < op_p:
    n = int(rng.integers(2, max_args + 1))
    op = OPERATORS[int(rng.integers(len(OPERATORS)))]
    if budget is not None:
      budget[0] -= 2  # the operator and its `]`
      if budget[0] < 0:
        raise _TooLong
    return (op, [generate_tree(rng, max_depth=max_depth, max_args=max_args, op_p=op_p, depth=depth + 1,
                               budget=budget) for _ in range(n)])
  if budget is not None:
    budget[0] -= 1
    if budget[0] < 0:
      raise _TooLong
  return int(rng.integers(10))


def tree_length(tree) -> int:
  """Published length: operators, digits and `]` (no parentheses)."""
  if isinstance(tree, int):
    return 1
  return 2 + sum(tree_length(c) for c in tree[1])


def tree_value(tree) -> int:
  if isinstance(tree, int):
    return tree
  op, children = tree
  return apply_op(op, [tree_value(c) for c in children])


def tree_depth(tree) -> int:
  """Operator nesting depth (a bare digit has depth 0)."""
  if isinstance(tree, int):
    return 0
  return 1 + max(tree_depth(c) for c in tree[1])


def tree_tokens(tree) -> list[str]:
  """The LRA text form: left-nested pairs, `( ( [OP a ) b ) ... ] )`."""
  if isinstance(tree, int):
    return [str(tree)]
  op, children = tree
  toks = ["(", op] + tree_tokens(children[0]) + [")"]
  for child in children[1:]:
    toks = ["("] + toks + tree_tokens(child) + [")"]
  return ["("] + toks + [END, ")"]


def evaluate(tokens: list[str]) -> int:
  """Value of a ListOps expression in the LRA text form (parentheses optional), by a stack machine."""
  stack: list[list[Any]] = []
  result = None
  for tok in tokens:
    if tok in ("(", ")"):
      continue
    if tok in OPERATORS:
      stack.append([tok])
    elif tok == END:
      if not stack:
        raise ValueError("ListOps: ']' without an open operator")
      op, *args = stack.pop()
      value = apply_op(op, args)
      if stack:
        stack[-1].append(value)
      else:
        result = value
    elif tok.isdigit() and len(tok) == 1:
      if stack:
        stack[-1].append(int(tok))
      else:
        result = int(tok)
    else:
      raise ValueError(f"ListOps: unknown token {tok!r}")
  if stack or result is None:
    raise ValueError("ListOps: unbalanced expression")
  return result


def expression_depth(tokens: list[str]) -> int:
  depth = best = 0
  for tok in tokens:
    if tok in OPERATORS:
      depth += 1
      best = max(best, depth)
    elif tok == END:
      depth -= 1
  return best


def sample(rng: np.random.Generator, *, min_length: int, max_length: int, max_depth: int, max_args: int,
           op_p: float, max_tries: int = 1_000_000) -> tuple[list[str], int]:
  """One (tokens with parentheses, label) with min_length <= tree_length <= max_length, by rejection."""
  for _ in range(max_tries):
    try:
      tree = generate_tree(rng, max_depth=max_depth, max_args=max_args, op_p=op_p, budget=[max_length])
    except _TooLong:
      continue
    if min_length <= tree_length(tree) <= max_length:
      return tree_tokens(tree), tree_value(tree)
  raise RuntimeError(f"ListOps generator found no tree of length {min_length}..{max_length} in {max_tries} "
                     f"tries (max_depth={max_depth}, max_args={max_args})")


def encode(tokens: list[str], where: str = "", parens: bool = False) -> np.ndarray:
  """Token ids; parentheses are dropped unless `parens` (the LRA input pipeline drops them)."""
  if not parens:
    tokens = [t for t in tokens if t not in ("(", ")")]
  try:
    return np.array([TOKEN_ID[t] for t in tokens], np.int32)
  except KeyError as e:
    raise ValueError(f"{where}: unknown ListOps token {e.args[0]!r}; allowed: {VOCAB[1:]}") from None


def pad_to(ids: np.ndarray, seq_len: int,
           counter: pipeline.Counter | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [seq_len], mask [seq_len]); longer inputs are truncated and counted."""
  if ids.shape[0] > seq_len:
    if counter is not None:
      counter.add("truncated", detail=f"{ids.shape[0]} -> {seq_len} tokens")
    ids = ids[:seq_len]
  out = np.zeros(seq_len, np.int32)
  out[: ids.shape[0]] = ids
  mask = np.zeros(seq_len, bool)
  mask[: ids.shape[0]] = True
  return out, mask


def info(name: str, seq_len: int, split_sizes: dict[str, int]) -> DatasetInfo:
  return DatasetInfo(name=name, task="classify", vocab_size=len(VOCAB), seq_len=seq_len,
                     input_vocab_size=len(VOCAB) + 1, cls_id=len(VOCAB), num_classes=10, metric="accuracy",
                     split_sizes=split_sizes)


# ------------------------------------------------------------------------------------------------------------
# listops_synthetic


def _params(config: Any) -> dict[str, Any]:
  return {k: pipeline.cfg_get(config, k, v) for k, v in DEFAULTS.items()}


class GeneratedSource:
  """Random-access source: record i is generated from seed (data_seed, split, i)."""

  def __init__(self, split: str, size: int, data_seed: int, params: dict[str, Any]):
    self.split, self.size, self.data_seed, self.params = split, size, data_seed, params
    self._split_key = zlib.crc32(split.encode())

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> tuple[list[str], int]:
    rng = np.random.default_rng([self.data_seed, self._split_key, int(index)])
    return sample(rng, **self.params)

  def __repr__(self) -> str:  # grain validates the source on restore by repr
    return (f"GeneratedListOps(split={self.split}, size={self.size}, seed={self.data_seed}, "
            f"params={self.params})")


CACHE_VERSION = 1  # bump when the generator or the stored layout changes: old caches are then ignored


def cache_spec(config: Any, split: str) -> dict[str, Any]:
  """Every field that changes the examples of `split` (the cache key hashes exactly this)."""
  if split not in SPLIT_SIZES:
    raise cli.mark_usage(ValueError(f"split must be one of {sorted(SPLIT_SIZES)}, got {split!r}"))
  return {"version": CACHE_VERSION, "split": split, "size": dataset_info(config).split_sizes[split],
          "data_seed": int(pipeline.cfg_get(config, "data_seed", 0)),
          "parens": bool(pipeline.cfg_get(config, "listops_parens", False)),
          **{k: (float(v) if k == "op_p" else int(v)) for k, v in _params(config).items()}}


def cache_path(config: Any, split: str) -> str | None:
  """`{cache_dir or data_dir}/listops_synthetic/<split>-<key>`, None when neither directory is configured."""
  root = pipeline.cfg_get(config, "cache_dir") or pipeline.cfg_get(config, "data_dir")
  if not root:
    return None
  spec = cache_spec(config, split)
  key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
  return paths.join(root, "listops_synthetic", f"{split}-{key}")  # local (absolute) or gs://


def _generate_range(args: tuple[str, int, int, dict[str, Any], bool, int, int]):
  """Token ids (flat), lengths and labels of records [lo, hi) (a worker's share of a split)."""
  split, size, data_seed, params, parens, lo, hi = args
  source = GeneratedSource(split, size, data_seed, params)
  ids, lengths, labels = [], np.zeros(hi - lo, np.int64), np.zeros(hi - lo, np.int8)
  for j, index in enumerate(range(lo, hi)):
    tokens, label = source[index]
    ids.append(encode(tokens, parens=parens))
    lengths[j], labels[j] = ids[-1].shape[0], label
  return np.concatenate(ids).astype(np.uint8), lengths, labels


def build_cache(config: Any, split: str, *, workers: int | None = None, progress: bool = False) -> str:
  """Generates `split` once into its cache directory (no-op when it is there) and returns the directory.

  The split is generated in shards; each finished shard is kept in `<cache dir>.parts/`, so an interrupted run
  resumes with the shards still missing. The cache directory itself appears atomically once every shard is
  there.
  workers: generator processes (spawned, so safe after JAX has started threads; the caller's main module must
  be importable, as for `python -m data.prepare`). Default 1: training on first use generates in-process;
  `data.prepare` passes the CPU count. progress: a progress bar over the shards.
  """
  path = cache_path(config, split)
  if path is None:
    raise ValueError("listops_synthetic: set config.data.cache_dir or config.data.data_dir to cache the "
                     "splits")
  if paths.path(path).is_dir():
    return path
  spec = cache_spec(config, split)
  size = spec["size"]
  workers = max(1, min(int(workers or 1), size))
  per = 1.3e-3 if spec["max_length"] <= 64 else 7e-3
  if workers == 1 and size * per > 60:
    log.warning("listops_synthetic: `python -m data.prepare listops_synthetic --data_dir DIR` generates the "
                "splits with every CPU")
  parts_dir = path + ".parts"
  paths.makedirs(parts_dir)
  params = _params(config)
  bounds = np.linspace(0, size, max(1, min(max(workers * 4, size // 1000), size)) + 1).astype(int)
  shards = [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True) if hi > lo]
  todo = [(split, size, spec["data_seed"], params, spec["parens"], lo, hi) for lo, hi in shards
          if not paths.exists(_part_path(parts_dir, lo, hi))]
  log.warning("listops_synthetic: generating the %s split once (%d examples, %d of %d shards to go, ~%.0f s "
              "on %d process%s) into %s", split, size, len(todo), len(shards),
              size * per * len(todo) / len(shards) / workers, workers, "" if workers == 1 else "es", path)
  start = time.time()
  bar = tqdm.tqdm(total=len(shards), initial=len(shards) - len(todo), desc=f"listops_synthetic {split}",
                  unit="shard", disable=not progress)
  with bar:
    if workers > 1 and todo:
      context = multiprocessing.get_context("spawn")
      with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        for job, part in zip(todo, pool.map(_generate_range, todo), strict=True):
          _save_part(parts_dir, job[-2], job[-1], part)
          bar.update()
    else:
      for job in todo:
        _save_part(parts_dir, job[-2], job[-1], _generate_range(job))
        bar.update()
  parts = []
  for lo, hi in shards:
    with paths.load_npy(_part_path(parts_dir, lo, hi)) as z:
      parts.append((z["tokens"], z["lengths"], z["labels"]))
  tokens = np.concatenate([p[0] for p in parts])
  offsets = np.concatenate([[0], np.cumsum(np.concatenate([p[1] for p in parts]))]).astype(np.int64)
  labels = np.concatenate([p[2] for p in parts])
  # All files appear at once; another host that finished first wins, its files are the same.
  paths.publish_dir(path, {"tokens.npy": paths.npy_bytes(tokens), "offsets.npy": paths.npy_bytes(offsets),
                           "labels.npy": paths.npy_bytes(labels),
                           "spec.json": json.dumps(spec, indent=1, sort_keys=True).encode()})
  paths.rmtree(parts_dir)
  log.warning("listops_synthetic: %s split cached in %.0f s (%d tokens)", split, time.time() - start,
              tokens.shape[0])
  return path


def _part_path(parts_dir: str, lo: int, hi: int) -> str:
  return paths.join(parts_dir, f"{lo:09d}-{hi:09d}.npz")


def _save_part(parts_dir: str, lo: int, hi: int, part: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
  """Writes one finished shard whole (locally: a temporary name, then a rename)."""
  buf = io.BytesIO()
  np.savez(buf, tokens=part[0], lengths=part[1], labels=part[2])
  paths.write_bytes(_part_path(parts_dir, lo, hi), buf.getvalue())


class CachedSource:
  """Random access to a generated split in its cache directory (memory-mapped when over `cap_mb`).

  Record i is (token ids int32 as `encode` returns them, label): the generator's record i, already encoded.
  """

  def __init__(self, path: str, cap_mb: float = 512):
    self.path = path
    # Read into RAM when it fits `config.data.cache_in_memory` (a slice of memory costs less than of a
    # mapping); a gs:// cache is always read into RAM.
    self.tokens = paths.load_npy(paths.join(path, "tokens.npy"), mmap_over_mb=cap_mb)
    self.offsets = paths.load_npy(paths.join(path, "offsets.npy"))
    self.labels = paths.load_npy(paths.join(path, "labels.npy"))
    if self.offsets.shape[0] != self.labels.shape[0] + 1 or self.offsets[-1] != self.tokens.shape[0]:
      raise ValueError(f"listops_synthetic cache {path} is inconsistent (offsets/labels/tokens disagree); "
                       "delete the directory and it is generated again")

  def __len__(self) -> int:
    return self.labels.shape[0]

  def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
    lo, hi = self.offsets[index], self.offsets[index + 1]
    return self.tokens[lo:hi].astype(np.int32), int(self.labels[index])

  def __repr__(self) -> str:  # grain validates the source on restore by repr
    return f"CachedListOps({os.path.basename(self.path)}, records={len(self)})"


class _Encode:
  def __init__(self, seq_len: int, parens: bool):
    self.seq_len = seq_len
    self.parens = parens
    self.counter = pipeline.Counter("listops_synthetic")

  def __call__(self, record) -> dict[str, np.ndarray]:
    tokens, label = record
    ids = tokens if isinstance(tokens, np.ndarray) else encode(tokens, parens=self.parens)  # cached: encoded
    ids, mask = pad_to(ids, self.seq_len, self.counter)
    return {"inputs": ids, "mask": mask, "label": np.int32(label)}


def dataset_info(config: Any) -> DatasetInfo:
  p = _params(config)
  seq_len = int(pipeline.cfg_get(config, "seq_len", p["max_length"]))
  sizes = {s: int(pipeline.cfg_get(config, f"num_{s}", n)) for s, n in SPLIT_SIZES.items()}
  return info("listops_synthetic", seq_len, sizes)


def make_source(config: Any, split: str) -> CachedSource | GeneratedSource:
  """The cached split (built on first use) or, with no cache directory configured, the generator itself."""
  if split not in SPLIT_SIZES:
    raise cli.mark_usage(ValueError(f"split must be one of {sorted(SPLIT_SIZES)}, got {split!r}"))
  if cache_path(config, split) is not None:
    return CachedSource(build_cache(config, split), float(pipeline.cfg_get(config, "cache_in_memory", 512)))
  log.warning("listops_synthetic: no config.data.cache_dir or data_dir, so examples are generated on access "
              "(~1-7 ms each); set one to generate each split once")
  # The data itself depends on data_seed only, so every run and host sees the same examples.
  return GeneratedSource(split, dataset_info(config).split_sizes[split],
                         int(pipeline.cfg_get(config, "data_seed", 0)), _params(config))


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index=None, shard_count=None,
                   shuffle=None, num_epochs=None):
  source = make_source(config, split)  # `seed` orders the examples; the examples depend on data_seed only
  di = dataset_info(config)
  return pipeline.make_loader(
    source, [pipeline.Example(_Encode(di.seq_len, bool(pipeline.cfg_get(config, "listops_parens", False))))],
    split=split, batch_size=batch_size, seed=seed,
    shard_index=shard_index, shard_count=shard_count, shuffle=shuffle, num_epochs=num_epochs, config=config,
  )
