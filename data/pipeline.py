"""The grain plumbing every dataset shares: sampler, sharding, batching, padding of the last eval batch.

Determinism and resume: every element the loader yields is a function of the record order (a seeded
permutation of the records, a new one each epoch: `EpochPermutation`, the same on both engines) and of the
record's stream position, so `get_state()` / `set_state()` of the iterator continue with exactly the same
batches. Per-record randomness (flips, MLM corruption) is seeded from (seed, stream position), never from a
stateful generator.

A batched training stream (endless) is global: one record order over the whole split, global batch s being
stream positions [s * B, (s + 1) * B), of which each host reads its own contiguous rows (`GlobalRows`). The
examples of a step are then the same on any number of hosts, and the iterator state (the global batch index)
is the same on every host, so a run resumes on another host count (`restore_iterator`). Self-batching
pipelines (packed text) make their training stream global the same way: every host packs the same global
batches and keeps its rows (data.text). Finite splits (evaluation) read a contiguous shard of records per host
(`ShardView`) in a per-host order.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np
from grain._src.python.experimental.index_shuffle.python import index_shuffle_module

from runtime import cli

log = logging.getLogger("data")

TRAIN_SPLITS = ("train",)
ORDERED_KEY = "ordered_layout"  # marks the iterator state of an ordered LM stream (data.ordered)


def cfg_get(config: Any, key: str, default: Any = None) -> Any:
  """`config.data.<key>` with a default (ConfigDict or plain attribute objects)."""
  data = config.data
  if hasattr(data, "get"):
    value = data.get(key, default)
  else:
    value = getattr(data, key, default)
  return default if value is None else value


def resolve_shards(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
  if shard_index is None or shard_count is None:
    import jax  # only when the caller leaves sharding to the JAX process layout

    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
  if shard_count < 1 or not 0 <= shard_index < shard_count:
    raise ValueError(f"need 0 <= shard_index < shard_count, got shard_index={shard_index}, "
                     f"shard_count={shard_count}")
  return shard_index, shard_count


def missing(path: str, dataset: str, data_dir: str | None, what: str = "dataset") -> FileNotFoundError:
  """The error for data that is not there: names the path and the command that makes it."""
  dd = data_dir or "DIR"
  return cli.mark_usage(FileNotFoundError(
    f"{what} for {dataset!r} not found at {path}; "
    f"prepare it with: python -m data.prepare {dataset} --data_dir {dd}"
  ))


def default_read_threads() -> int:
  """Record-reading threads: 1 on a small machine (on 2 cores more threads only fight over the GIL and read
  slower), up to 8 on large TPU/GPU hosts with I/O to hide."""
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    cpus = os.cpu_count() or 1
  return max(1, min(8, cpus // 4))


def host_seed(seed: int, shard_index: int) -> int:
  """Decorrelates the hosts' shuffles and per-record randomness (their local indices coincide)."""
  return int(np.random.SeedSequence([seed, shard_index]).generate_state(1)[0])


def stream_seed(seed: int) -> int:
  """The seed of a global stream's record order and per-record randomness: host 0's `host_seed`, so that a
  one-host run reads the stream (and resumes the checkpoints) it read when every host had its own stream."""
  return host_seed(seed, 0)


class GlobalRows:
  """Rows [lo, hi) of every global batch of `global_batch` stream positions: the host batch of one host.

  Global batch s holds stream positions [s * global_batch, (s + 1) * global_batch); this host reads positions
  s * global_batch + [lo, hi), the rows its devices hold of the global batch (training/experiment.py places
  host batches by `jax.make_array_from_process_local_data`, host `shard_index` of `shard_count` holding rows
  [shard_index * b, (shard_index + 1) * b), b = global_batch / shard_count).
  """

  def __init__(self, host_batch: int, shard_index: int, shard_count: int):
    if host_batch < 1:
      raise ValueError(f"batch_size must be >= 1, got {host_batch}")
    self.size, self.global_batch = int(host_batch), int(host_batch) * int(shard_count)
    self.lo = int(shard_index) * self.size

  def positions(self, batch_index: int) -> np.ndarray:
    """The stream positions of this host's rows of global batch `batch_index`: [size] int64."""
    return np.arange(self.size, dtype=np.int64) + (int(batch_index) * self.global_batch + self.lo)

  def position(self, local_index: int) -> int:
    """Stream position of this host's `local_index`-th record (rows of consecutive batches, in order)."""
    batch_index, row = divmod(int(local_index), self.size)
    return batch_index * self.global_batch + self.lo + row

  def whole(self) -> bool:
    return self.size == self.global_batch

  def __repr__(self) -> str:
    return f"rows {self.lo}:{self.lo + self.size} of {self.global_batch}"


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
  grain's index shuffle costs far more per record on a tiny split than on a real one; docs/benchmarks.md,
  "Input pipeline costs".)
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
  small model's step leaves per example (docs/benchmarks.md, "Input pipeline costs"); a small split read once
  (one sequential pass) is then served at the cost of a slice. Columns: equal-shaped arrays and scalars are
  stacked, `str`/`bytes` are concatenated with offsets; each record is given back with the types the source
  gave (str stays str, 0-d arrays stay NumPy values), so the per-record functions see the same values and the
  batches are the same.
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


def maybe_in_memory(source: Any, config: Any, name: str) -> Any:
  """`source` read into memory when it fits `config.data.cache_in_memory` (MB, default 512; 0 = never), else
  `source` itself, so large datasets are never loaded into RAM."""
  cap_mb = float(cfg_get(config, "cache_in_memory", 512))
  if cap_mb <= 0 or len(source) == 0:
    return source
  need = InMemorySource.estimate_bytes(source)
  if need > cap_mb * 2**20:
    log.info("%s: %.0f MB is over config.data.cache_in_memory=%g MB, records are read from disk", name,
             need / 2**20, cap_mb)
    return source
  return InMemorySource(source, name)


class PadBatch:
  """Stacks examples; pads a short (last, evaluation) batch to `batch_size` with all-zero rows, valid=False.

  Zero rows have mask False and weights 0, so they drop out of every masked metric; `valid` marks them for the
  per-example ones (accuracy).
  """

  def __init__(self, batch_size: int):
    self.batch_size = batch_size

  def __call__(self, examples: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    out = {}
    n = len(examples)
    for key in examples[0]:
      stacked = np.stack([e[key] for e in examples])
      if n < self.batch_size:
        pad = np.zeros((self.batch_size - n,) + stacked.shape[1:], stacked.dtype)
        stacked = np.concatenate([stacked, pad])
      out[key] = stacked
    return out


class Example(grain.transforms.Map):
  """Wraps a per-record function `fn(record) -> dict`, adding valid=True."""

  def __init__(self, fn: Callable[[Any], dict[str, np.ndarray]]):
    self.fn = fn

  def map(self, element):
    out = self.fn(element)
    out["valid"] = np.bool_(True)
    return out


class SeededExample(grain.transforms.RandomMap):
  """Like `Example` for functions that draw randomness: the rng grain passes is seeded per record index."""

  def __init__(self, fn: Callable[[Any, np.random.Generator], dict[str, np.ndarray]]):
    self.fn = fn

  def random_map(self, element, rng: np.random.Generator):
    out = self.fn(element, rng)
    out["valid"] = np.bool_(True)
    return out


class EpochPermutation:
  """The record order both engines read: stream position g -> record key.

  Position g is offset g % n of epoch g // n, and its key is `permutation(epoch)[offset]`, where
  `permutation(epoch)` is `np.random.default_rng([seed, epoch]).permutation(n)` (shuffled in place in an
  int32 `arange(n)`: the same order; the identity without `shuffle`). Every epoch is a permutation of the
  host's n records, reshuffled per epoch, the same for the same (seed, n).

  Why not grain's index shuffle (`MapDataset.shuffle`, `IndexSampler`): it cycle-walks a domain of at least
  2^16 per record, which is most of a small pipeline's cost; a cached permutation is an array lookup at any
  size, and a batch of positions is one vectorised lookup (timings: docs/benchmarks.md, "Input pipeline
  costs").

  Memory: one int32 key per record for each of at most `cache_epochs` epochs (the current and the next, so a
  batch or the reading threads crossing an epoch boundary do not recompute it): 4 MB per million records per
  epoch, held by every grain worker process. An epoch's permutation is one numpy shuffle, computed once per
  epoch. Splits above `MAX_STORED` records (the host's share; C4 has 365M training documents, which would be
  ~1.5 GB per epoch and worker) use grain's index shuffle keyed by (seed + epoch) instead: no memory, and on a
  domain that large its cycle-walking costs little per record, no longer a pipeline's main cost.
  Thread-safe (grain's reading threads share it); pickled without its cache (worker processes).
  """

  MAX_STORED = 1 << 24  # records: 64 MB per cached epoch

  def __init__(self, num_records: int, *, seed: int, shuffle: bool, cache_epochs: int = 2):
    if num_records < 1:
      raise ValueError(f"num_records must be >= 1, got {num_records}")
    self.num_records, self.seed, self.shuffle = int(num_records), int(seed), bool(shuffle)
    if self.num_records > 2**32:
      raise ValueError(f"num_records must be <= 2^32 per host (grain's index shuffle), got {num_records}")
    self.dtype = np.int32 if self.num_records < 2**31 else np.int64
    self.stored = not self.shuffle or self.num_records <= self.MAX_STORED
    self.cache_epochs = cache_epochs
    self._cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
    self._lock = threading.Lock()

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    del state["_lock"], state["_cache"]
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._cache, self._lock = collections.OrderedDict(), threading.Lock()

  def permutation(self, epoch: int) -> np.ndarray:
    """The record keys of epoch `epoch` in stream order: [num_records] int32 (stored orders only)."""
    if not self.stored:
      raise ValueError(f"{self!r} has {self.num_records} records > MAX_STORED={self.MAX_STORED}: its order "
                       f"is not stored; use keys()")
    epoch = int(epoch)
    with self._lock:  # computed once even when several reading threads reach a new epoch together
      perm = self._cache.get(epoch)
      if perm is None:
        perm = np.arange(self.num_records, dtype=self.dtype)
        if self.shuffle:
          np.random.default_rng([self.seed, epoch]).shuffle(perm)
        self._cache[epoch] = perm
        while len(self._cache) > self.cache_epochs:
          self._cache.popitem(last=False)
      else:
        self._cache.move_to_end(epoch)
      return perm

  def key(self, position: int) -> int:
    epoch, offset = divmod(int(position), self.num_records)
    if not self.stored:
      return self._index_shuffle(epoch, offset)
    return int(self.permutation(epoch)[offset])

  def _index_shuffle(self, epoch: int, offset: int) -> int:
    """Large splits: a keyed bijection of [0, n) per epoch, grain's `MapDataset.shuffle` order."""
    return index_shuffle_module.index_shuffle(offset, max_index=self.num_records - 1,
                                              seed=(self.seed + epoch) % 2**32, rounds=4)

  def keys(self, positions: np.ndarray) -> np.ndarray:
    """Record keys of stream positions, one lookup per epoch they touch."""
    positions = np.asarray(positions, np.int64)  # [count]
    epochs, offsets = np.divmod(positions, self.num_records)  # [count], [count]
    if not self.stored:
      return np.array([self._index_shuffle(int(e), int(o)) for e, o in zip(epochs, offsets, strict=True)],
                      self.dtype)
    if len(positions) == 0 or epochs.min() == epochs.max():  # the common case: a batch inside one epoch
      return self.permutation(epochs[0] if len(positions) else 0)[offsets]
    out = np.empty(len(positions), self.dtype)  # [count]
    for epoch in np.unique(epochs):
      at = epochs == epoch
      out[at] = self.permutation(epoch)[offsets[at]]
    return out

  def __repr__(self) -> str:
    return f"EpochPermutation(num_records={self.num_records}, shuffle={self.shuffle}, seed={self.seed})"


class EpochPermutationSampler:
  """grain.DataLoader sampler (IndexSampler's interface) giving `EpochPermutation`'s order.

  Record index = stream position (the DataLoader runs unsharded: hosts are split by `ShardView`, or, with
  `rows`, index i is this host's i-th record of a global stream, at `rows.position(i)`), and the generator of
  RandomMap operations is Philox keyed by seed + stream position, as IndexSampler makes it; so the 'loader'
  engine yields the 'dataset' engine's batches.
  """

  def __init__(self, num_records: int, *, shuffle: bool, num_epochs: int | None, seed: int,
               rows: GlobalRows | None = None):
    if num_epochs is not None and num_epochs < 1:
      raise ValueError(f"num_epochs must be None (endless) or >= 1, got {num_epochs}")
    if rows is not None and num_epochs is not None:
      raise ValueError("rows of a global stream need an endless stream (num_epochs=None)")
    self.order = EpochPermutation(num_records, seed=seed, shuffle=shuffle)
    self.num_epochs, self.seed = num_epochs, int(seed)
    self.rows = None if rows is None or rows.whole() else rows  # one host's rows: the stream itself
    self.length = sys.maxsize if num_epochs is None else num_epochs * self.order.num_records

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, index: int) -> grain.RecordMetadata:
    if not 0 <= index < self.length:
      raise IndexError(f"sampler index {index} is outside [0, {self.length})")
    position = index if self.rows is None else self.rows.position(index)
    rng = np.random.Generator(np.random.Philox(key=self.seed + position))
    return grain.RecordMetadata(index=index, record_key=self.order.key(position), rng=rng)

  def __repr__(self) -> str:  # grain stores it in the iterator state and compares it on restore
    rows = "" if self.rows is None else f", {self.rows!r}"
    return (f"EpochPermutationSampler(num_records={self.order.num_records}, shuffle={self.order.shuffle}, "
            f"num_epochs={self.num_epochs}, seed={self.seed}{rows})")


class KeyBatches(grain.MapDataset):
  """Element b: the record keys of stream positions [b * batch_size, (b + 1) * batch_size) in
  `EpochPermutation` order, an int array (the last one shorter when the remainder is kept); with `rows`, the
  keys of this host's rows of global batch b (`GlobalRows`; endless streams).

  The 'dataset' engine's record order in one node: grain's range -> shuffle -> repeat -> batch chain made a
  chain of calls per record (its batch reads its parent record by record); this is one vectorised lookup
  per batch. Batches run across epoch boundaries, like a batch after repeat. Its iterator state is grain's
  MapDataset position (checkpointable like any MapDataset).
  """

  def __init__(self, order: EpochPermutation, *, num_epochs: int | None, batch_size: int,
               drop_remainder: bool, rows: GlobalRows | None = None):
    super().__init__()
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_epochs is not None and num_epochs < 1:
      raise ValueError(f"num_epochs must be None (endless) or >= 1, got {num_epochs}")
    if rows is not None and (num_epochs is not None or rows.size != batch_size):
      raise ValueError(f"rows ({rows!r}) need an endless stream and batch_size={rows.size}")
    self.order, self.batch_size, self.rows = order, batch_size, rows
    self.total = sys.maxsize if num_epochs is None else num_epochs * order.num_records  # stream positions
    drop = drop_remainder or num_epochs is None  # an endless stream has no last batch
    self.length = self.total // batch_size if drop else -(-self.total // batch_size)

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    if not 0 <= index < self.length:
      raise IndexError(f"batch index {index} is outside [0, {self.length})")
    start = index * self.batch_size
    with self._stats.record_self_time():
      if self.rows is not None:
        return self.order.keys(self.rows.positions(index))
      return self.order.keys(np.arange(start, min(start + self.batch_size, self.total), dtype=np.int64))

  def __str__(self) -> str:
    return f"KeyBatches({self.order!r}, batch_size={self.batch_size}, batches={self.length})"


class ReadBatch:
  """(batch index, record keys) -> batch: reads each `source[key]`, applies the per-record `operations` in
  order and stacks the examples (`PadBatch`).

  Row j's stream position (`batch index * batch_size + j`, or `rows.positions(batch index)[j]` for a host's
  rows of a global stream) is what grain.DataLoader's sampler (`EpochPermutationSampler`) keys its generator
  with, so RandomMap operations get the generator the DataLoader gives them: Philox keyed by seed + stream
  position, one per record, shared by that record's operations in order.
  """

  def __init__(self, source: Any, operations: Sequence[Any], *, seed: int, batch_size: int,
               rows: GlobalRows | None = None):
    for op in operations:
      if not isinstance(op, (grain.transforms.Map, grain.transforms.RandomMap)):
        raise TypeError(f"per-record operations must be grain.transforms.Map or RandomMap, got {op!r}")
    self.source, self.operations, self.seed = source, list(operations), seed
    self.batch_size, self.stack, self.rows = batch_size, PadBatch(batch_size), rows

  def one(self, index: int, element: Any):
    rng = None
    for op in self.operations:
      if isinstance(op, grain.transforms.RandomMap):
        if rng is None:
          rng = np.random.Generator(np.random.Philox(key=self.seed + index))
        element = op.random_map(element, rng)
      else:
        element = op.map(element)
    return element

  def __call__(self, batch_index: int, keys: np.ndarray) -> dict[str, np.ndarray]:
    first = int(batch_index) * self.batch_size if self.rows is None else self.rows.position(
        int(batch_index) * self.batch_size)
    elements = read_records(self.source, keys.tolist())
    return self.stack([self.one(first + j, e) for j, e in enumerate(elements)])


def make_loader(
  source: Any,
  operations: Sequence[Any],
  *,
  split: str,
  batch_size: int | None,
  seed: int,
  shard_index: int | None,
  shard_count: int | None,
  shuffle: bool | None,
  num_epochs: int | None,
  config: Any,
  engine: str | None = None,
) -> grain.IterDataset | grain.DataLoader:
  """Seeded shuffled record order, `operations` per record, then batching; `batch_size` is the host batch.

  Training (an endless stream, `num_epochs=None`) with `batch_size` set is one global stream: an
  `EpochPermutation` of all the split's records (seed from `stream_seed`), global batch s being stream
  positions [s * B, (s + 1) * B) for B = batch_size * shard_count, of which host `shard_index` reads rows
  [shard_index * batch_size, (shard_index + 1) * batch_size) (`GlobalRows`). A step's examples and the
  iterator state (the global batch index) are the same for any number of hosts; every batch is full.
  Evaluation (finite) keeps every record: each host reads its contiguous shard (`ShardView`; host shards may
  differ by one record) in its own order (seed from `host_seed`) and pads its last batch.
  `batch_size=None` means the operations batch themselves (text packing): an endless stream is then sharded
  per host as well (equal shards, records beyond an equal split left out of each epoch); data.text asks for
  shard 0 of 1 on every host and keeps each host's rows of the packed global batch, so that its stream does
  not depend on the host count.

  Record order: a new permutation each epoch, batches running across epoch boundaries; without shuffle, the
  records in order, epoch after epoch.

  engine: "dataset" (the default when `batch_size` is set): a grain `MapDataset` pipeline: `KeyBatches` (the
    record keys of one batch in one lookup), each batch of keys read, transformed and stacked by one
    `ReadBatch` call, turned into an `IterDataset` whose threads prefetch whole batches;
    "loader" (the only choice for self-batching legacy operations): a `grain.DataLoader` with an
    `EpochPermutationSampler`. Both yield the same batches in the same order (the same record order, and
    RandomMap generators seeded the same way; tests check it); the dataset engine's own cost per record is a
    fraction of the DataLoader's, which pays a thread hand-off, a Philox generator and statistics per record
    (docs/benchmarks.md, "Input pipeline costs"), and that is what keeps small smoke models from waiting for
    input.
    Iterators of both have get_state()/set_state() and are saved by grain.checkpoint (their states are not
    interchangeable: `check_iterator_checkpoint`; only the dataset engine's resumes on another host count:
    `restore_iterator`). `config.data.engine` overrides the default, e.g. "loader" to resume a checkpoint
    written by the loader engine.

  Checkpoints written before `EpochPermutation` (grain's index-shuffle order: `IndexSampler`,
  `MapDataset.shuffle`) cannot continue in their order: a DataLoader state names its `IndexSampler`, and
  `check_iterator_checkpoint` rejects it; a dataset-engine state is only a batch position, which would
  resume at the same batch position in the new order: the rest of the interrupted epoch comes from the new
  permutation (some of its records seen twice, others not at all), later epochs are whole. Start such runs
  in a fresh workdir.
  """
  engine = engine or cfg_get(config, "engine") or ("dataset" if batch_size is not None else "loader")
  if engine not in ("dataset", "loader"):
    raise ValueError(f"engine must be 'dataset' or 'loader', got {engine!r}")
  if engine == "dataset" and batch_size is None:
    raise ValueError("engine='dataset' needs batch_size (self-batching operations run on engine='loader')")
  shard_index, shard_count = resolve_shards(shard_index, shard_count)
  is_train = split in TRAIN_SPLITS
  shuffle = is_train if shuffle is None else shuffle
  if num_epochs is None and not is_train:
    num_epochs = 1
  drop = num_epochs is None  # endless streams: equal, full shards and batches
  if cfg_get(config, "virtual_records") is not None and len(source):
    source = VirtualRecords(source, int(cfg_get(config, "virtual_records")))
  num_records = len(source)
  if num_records == 0:
    raise ValueError(f"split {split!r} of {config.data.name!r} has no records")
  rows = None
  if drop and batch_size is not None:  # a global stream: every host reads the same order, its own rows
    rows = GlobalRows(batch_size, shard_index, shard_count)
    seed = stream_seed(seed)
  else:
    if drop and num_records % shard_count:
      log.info("%s/%s: %d records beyond an equal split over %d hosts are left out of each epoch",
               config.data.name, split, num_records % shard_count, shard_count)
    # Each host reads a contiguous range of records (grain's own sharding floors every shard to n // hosts
    # even without drop_remainder, which would lose evaluation records); the sampler sees the local range.
    source = ShardView(source, shard_index, shard_count, equal=drop)
    if len(source) == 0:
      raise ValueError(f"split {split!r} of {config.data.name!r} has {num_records} records, fewer than the "
                       f"{shard_count} hosts")
    seed = host_seed(seed, shard_index)
  workers = int(cfg_get(config, "worker_count", 0))
  if workers > 0:
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain's worker processes read absl flags; outside absl.app use defaults
      flags.FLAGS.mark_as_parsed()
  threads = int(cfg_get(config, "read_threads", default_read_threads()))
  prefetch = int(cfg_get(config, "prefetch", 64))  # records
  if engine == "dataset":
    order = EpochPermutation(len(source), seed=seed, shuffle=shuffle)
    # Batches of keys before reading leave grain one call per batch instead of a chain of per-record calls.
    ds = KeyBatches(order, num_epochs=num_epochs, batch_size=batch_size, drop_remainder=drop, rows=rows)
    ds = ds.map_with_index(ReadBatch(source, operations, seed=seed, batch_size=batch_size, rows=rows))
    # The buffer counts batches; one under the thread count would leave threads idle (grain warns).
    buffer = max(2, threads, -(-prefetch // batch_size))
    out = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=buffer))
    if workers > 0:
      out = out.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return out
  shard_options = grain.sharding.NoSharding()
  sampler = EpochPermutationSampler(len(source), shuffle=shuffle, num_epochs=num_epochs, seed=seed, rows=rows)
  ops = list(operations)
  if batch_size is not None:
    ops.append(grain.transforms.Batch(batch_size=batch_size, drop_remainder=drop,
                                      batch_fn=PadBatch(batch_size)))
  return grain.DataLoader(
    data_source=source,
    sampler=sampler,
    operations=ops,
    worker_count=workers,
    shard_options=shard_options,
    read_options=grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch),
  )


def check_iterator_checkpoint(step_dir: str, data_iter: Any, config: Any) -> None:
  """Raises ValueError naming the checkpoint when its saved data-iterator state cannot continue this run.

  Two cases: (1) the state is from the other engine: batched datasets ran on grain.DataLoader (engine
  "loader") before they moved to the MapDataset engine; the two states cannot be converted (grain would fail
  with an unrelated TypeError/KeyError). (2) a DataLoader state of grain's `IndexSampler`, the record order
  before `EpochPermutationSampler` (grain would only say the sampler reprs differ). A dataset-engine state
  from before `EpochPermutation` cannot be told apart (it holds only a position; see `make_loader`).
  `step_dir` is the checkpoint step directory holding `data/process_*.json` (grain's orbax handler); nothing
  is checked when it has none.
  """
  import json

  from etils import epath  # the checkpoint may live on gs://

  data_dir = epath.Path(step_dir) / "data"
  files = sorted(data_dir.glob("process_*.json")) if data_dir.exists() else []
  if not files:
    return
  try:
    saved = json.loads(files[0].read_text())
  except ValueError:
    return  # not a grain state we know; grain itself reports it
  check = getattr(data_iter, "check_saved_state", None)  # an ordered stream's state fits only its own layout
  if check is not None:
    check(saved, step_dir)
  elif isinstance(saved, dict) and ORDERED_KEY in saved:
    raise cli.mark_usage(ValueError(f"checkpoint {step_dir} holds an ordered stream's position "
                                    f"({saved[ORDERED_KEY]}); resume it with config.data.ordered=True, or "
                                    f"start a fresh workdir"))
  saved_loader = isinstance(saved, dict) and "last_seen_indices" in saved and "sampler" in saved
  current_loader = not isinstance(data_iter, grain.DatasetIterator)
  index, count = resolve_shards(None, None)
  if saved_loader and current_loader and not (data_dir / state_file(index, count)).exists() \
      and not _agree(files):
    raise ValueError(
      f"checkpoint {step_dir} holds per-host data-iterator states of grain.DataLoader ({files[0].name}, ...: "
      f"engine 'loader', or packed text), written by another number of hosts than this run's {count}; "
      f"such a state continues only on the host count that wrote it. Resume on that many hosts, or start a "
      f"fresh workdir (the dataset engine's batched streams resume on any host count)."
    )
  if saved_loader and str(saved["sampler"]).startswith("IndexSampler("):
    raise ValueError(
      f"checkpoint {step_dir} holds a data-iterator state ({files[0]}) in the record order of grain's "
      f"{saved['sampler']}, which config.data.name={config.data.name!r} no longer produces: records now "
      f"follow an EpochPermutation (seeded numpy permutation per epoch), so this run cannot continue "
      f"with its old batches. Start a fresh workdir; or, to finish this run in its old order, run it with "
      f"the project version from before EpochPermutation (see `git log -- data/pipeline.py`)."
    )
  if saved_loader == current_loader:
    return
  names = {True: "'loader' (grain.DataLoader)", False: "'dataset' (grain MapDataset)"}
  raise ValueError(
    f"checkpoint {step_dir} holds a data-iterator state of engine {names[saved_loader]} ({files[0]}), but "
    f"config.data.name={config.data.name!r} now runs on engine {names[current_loader]}, which cannot restore "
    f"it. To resume this run exactly (both engines give the same batches), set "
    f"--config.data.engine={'loader' if saved_loader else 'dataset'}; or start a fresh workdir."
  )


def _agree(files: Sequence[Any]) -> bool:
  """Whether the saved hosts' iterator states (grain JSON files `state_file`) are every host's and one state:
  a global stream's position."""
  import json

  counts = {f.name.rpartition("-of-")[2].removesuffix(".json") for f in files}
  if len(counts) != 1 or len(files) != int(counts.pop() or 0):
    return False
  states = [json.loads(f.read_text()) for f in files]
  return all(other == states[0] for other in states[1:])


def state_file(process_index: int, process_count: int) -> str:
  """The name grain's orbax handler gives a host's data-iterator state in a checkpoint's `data/` item."""
  return f"process_{process_index}-of-{process_count}.json"


def restore_iterator(step_dir: str, data_iter: Any) -> None:
  """Sets `data_iter` to the state saved in `<step_dir>/data` (after `check_iterator_checkpoint`).

  grain's orbax handler saves one file per host (`state_file`) and restores only the same host's file of the
  same host count. A dataset-engine state is the global batch index, the same on every host (a batched
  training stream is global: `make_loader`), so it is read from this host's file when the host count is
  unchanged, else from the saved hosts' files, which must agree: a run resumes on any host count, continuing
  the same global stream. A DataLoader state is per host; where every host read the same global stream
  (packed text) the saved hosts' states are identical and any host count continues from them, otherwise it
  needs this host's file. Raises (FileNotFoundError, ValueError) when the files are missing, unreadable or
  disagree.
  """
  import json

  from etils import epath  # the checkpoint may live on gs://

  data_dir = epath.Path(step_dir) / "data"
  own = data_dir / state_file(*resolve_shards(None, None))
  is_dataset = isinstance(data_iter, grain.DatasetIterator)
  if own.exists():
    text = own.read_text()
    state = json.loads(text) if is_dataset else text.encode()
  else:
    files = sorted(data_dir.glob("process_*-of-*.json")) if data_dir.exists() else []
    if not files:
      raise FileNotFoundError(f"no data-iterator state for this host in {data_dir} (found: none)")
    if not _agree(files):
      raise ValueError(f"the hosts' data-iterator states in {data_dir} differ ({files[0].name}: "
                       f"{files[0].read_text()[:200]}), so they are not one global stream's position")
    text = files[0].read_text()
    state = json.loads(text) if is_dataset else text.encode()
  data_iter.set_state(state)
  if hasattr(data_iter, "start_prefetch"):
    data_iter.start_prefetch()


class Counter:
  """Counts of dropped/truncated/resized items, logged once when first seen and then every `every` events.

  Nothing in the pipelines is dropped or shortened without passing through one of these.
  """

  def __init__(self, what: str, every: int = 1000):
    self.what = what
    self.every = every
    self.counts: collections.Counter[str] = collections.Counter()

  def add(self, key: str, n: int = 1, detail: str = "") -> None:
    before = self.counts[key]
    self.counts[key] += n
    if before == 0 or before // self.every != self.counts[key] // self.every:
      log.warning("%s: %s so far: %d%s", self.what, key, self.counts[key], f" ({detail})" if detail else "")

