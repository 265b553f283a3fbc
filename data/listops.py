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
generated from its own seed (config seed, split, i), so it is random access, needs no preparation and is
identical on every host and after a resume.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from data import pipeline
from data.info import DatasetInfo

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
  raise RuntimeError(f"ListOps generator found no tree of length {min_length}..{max_length} in {max_tries} tries "
                     f"(max_depth={max_depth}, max_args={max_args})")


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


# ---------------------------------------------------------------------------------------------------------------
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
    return f"GeneratedListOps(split={self.split}, size={self.size}, seed={self.data_seed}, params={self.params})"


class _Encode:
  def __init__(self, seq_len: int, parens: bool):
    self.seq_len = seq_len
    self.parens = parens
    self.counter = pipeline.Counter("listops_synthetic")

  def __call__(self, record) -> dict[str, np.ndarray]:
    tokens, label = record
    ids, mask = pad_to(encode(tokens, parens=self.parens), self.seq_len, self.counter)
    return {"inputs": ids, "mask": mask, "label": np.int32(label)}


def dataset_info(config: Any) -> DatasetInfo:
  p = _params(config)
  seq_len = int(pipeline.cfg_get(config, "seq_len", p["max_length"]))
  sizes = {s: int(pipeline.cfg_get(config, f"num_{s}", n)) for s, n in SPLIT_SIZES.items()}
  return info("listops_synthetic", seq_len, sizes)


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index=None, shard_count=None,
                   shuffle=None, num_epochs=None):
  if split not in SPLIT_SIZES:
    raise ValueError(f"split must be one of {sorted(SPLIT_SIZES)}, got {split!r}")
  di = dataset_info(config)
  # The data itself depends on data_seed only, so every run and host sees the same examples; `seed` orders them.
  source = GeneratedSource(split, di.split_sizes[split], int(pipeline.cfg_get(config, "data_seed", 0)),
                           _params(config))
  return pipeline.make_loader(
    source, [pipeline.Example(_Encode(di.seq_len, bool(pipeline.cfg_get(config, "listops_parens", False))))],
    split=split, batch_size=batch_size, seed=seed,
    shard_index=shard_index, shard_count=shard_count, shuffle=shuffle, num_epochs=num_epochs, config=config,
  )
