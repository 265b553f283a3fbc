"""Record sources and the views the pipelines read them through (data/pipeline.py): a host's shard of a split,
a split presented at another size, fixed-length windows of a token stream, and small splits held in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class StreamWindows:
  """Record i = tokens [i * seq_len, (i + 1) * seq_len) of a 1-D stream (`stream()`): [seq_len]. The stream
  is read on access, so a pickled source stays small (grain's workers) and memory-mapped files stay mapped."""

  def __init__(self, seq_len: int, stream_length: int):
    self.seq_len = seq_len
    self.size = stream_length // seq_len

  def stream(self) -> np.ndarray:
    raise NotImplementedError

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> np.ndarray:
    index = int(index)
    if not 0 <= index < self.size:
      raise IndexError(f"record {index} is outside [0, {self.size})")
    return np.asarray(self.stream()[index * self.seq_len:(index + 1) * self.seq_len])  # [seq_len]


def read_records(source: Any, indices: Sequence[int]) -> list[Any]:
  """source[i] for each i: in one `source.read_batch(indices)` call when the source generates whole batches at
  once (synthetic_recall), else one by one."""
  read_batch = getattr(source, "read_batch", None)
  return read_batch(list(indices)) if read_batch is not None else [source[int(i)] for i in indices]


class ShardView:
  """Records [lo, hi) of `source` for host `shard_index`: equal sizes n // hosts when `equal`, else sizes that
  differ by at most one and together cover every record."""

  def __init__(self, source: Any, shard_index: int, shard_count: int, *, equal: bool):
    n = len(source)
    if equal:
      size = n // shard_count
      self.lo, self.hi = shard_index * size, (shard_index + 1) * size
    else:
      self.lo, self.hi = shard_index * n // shard_count, (shard_index + 1) * n // shard_count
    self.source = source
    self.shard = (shard_index, shard_count)

  def __len__(self) -> int:
    return self.hi - self.lo

  def __getitem__(self, index: int):
    return self.source[self.lo + int(index)]

  def read_batch(self, indices: Sequence[int]) -> list[Any]:
    return read_records(self.source, [self.lo + int(i) for i in indices])

  def __repr__(self) -> str:  # grain checks it on restore: a state only fits the same host layout
    return f"{self.source!r}[{self.lo}:{self.hi}] (shard {self.shard[0]} of {self.shard[1]})"


class VirtualRecords:
  """`source` presented as `size` records, record i being record i % len(source)
  (`config.data.virtual_records`).

  For benchmarks on small generated data: a mock split is timed at the size of the real split it stands for,
  so that what scales with the split (the epoch permutation's memory and its once-per-epoch cost, epochs
  being rarer) is the real one's. (A record order's per-record cost can also depend on the split's size:
  grain's index shuffle costs far more per record on a tiny split than on a real one;
  docs/benchmarks_training.md, "Input pipeline costs".)
  """

  def __init__(self, source: Any, size: int):
    if size < 1:
      raise ValueError(f"config.data.virtual_records must be >= 1, got {size}")
    self.source, self.size = source, size

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int):
    return self.source[int(index) % len(self.source)]

  def read_batch(self, indices: Sequence[int]) -> list[Any]:
    return read_records(self.source, [int(i) % len(self.source) for i in indices])

  def __repr__(self) -> str:
    return f"{self.source!r} as {self.size} records"


class InMemorySource:
  """A random-access source of dict records read once into column arrays (`config.data.cache_in_memory`).

  Reading a record through tfds (an ArrayRecord lookup and a protobuf decode per record) can cost more than a
  small model's step leaves per example (docs/benchmarks_training.md, "Input pipeline costs"); a small split
  read once (one sequential pass) is then served at the cost of a slice. Columns: equal-shaped arrays and
  scalars are stacked, `str`/`bytes` are concatenated with offsets; each record is given back with the types
  the source gave (str stays str, 0-d arrays stay NumPy values), so the per-record functions see the same
  values and the batches are the same.
  """

  def __init__(self, source: Any, name: str):
    self.name, self.size, self.origin = name, len(source), repr(source)
    first = source[0]
    if not isinstance(first, dict):
      raise TypeError(f"InMemorySource needs dict records, got {type(first).__name__}")
    self.text: dict[str, tuple[np.ndarray, np.ndarray, bool]] = {}
    self.arrays: dict[str, np.ndarray] = {}
    columns: dict[str, list[Any]] = {k: [] for k in first}
    for index in range(self.size):  # one sequential pass over the split
      record = source[index]
      for key, column in columns.items():
        column.append(record[key])
    for key, values in columns.items():
      if isinstance(values[0], (str, bytes)):
        is_str = isinstance(values[0], str)
        raw = [v.encode("utf-8") if is_str else bytes(v) for v in values]
        offsets = np.zeros(len(raw) + 1, np.int64)
        np.cumsum([len(r) for r in raw], out=offsets[1:])
        self.text[key] = (np.frombuffer(b"".join(raw), np.uint8), offsets, is_str)
      else:
        self.arrays[key] = np.stack([np.asarray(v) for v in values])

  @staticmethod
  def estimate_bytes(source: Any, sample: int = 64) -> float:
    """Memory the split would take, extrapolated from its first `sample` records."""
    n = len(source)
    k = min(n, sample)
    if k == 0:
      return 0.0
    total = 0
    for i in range(k):
      for value in source[i].values():
        total += len(value) if isinstance(value, (str, bytes)) else np.asarray(value).nbytes + 8
    return total * n / k

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> dict[str, Any]:
    index = int(index)
    out: dict[str, Any] = {key: column[index] for key, column in self.arrays.items()}
    for key, (buf, offsets, is_str) in self.text.items():
      raw = buf[offsets[index]:offsets[index + 1]].tobytes()
      out[key] = raw.decode("utf-8") if is_str else raw
    return out

  def __repr__(self) -> str:  # grain checks it on restore: the same records as the source it was read from
    return f"InMemory({self.origin}, records={self.size})"
