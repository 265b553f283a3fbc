"""The grain plumbing every dataset shares: sampler, sharding, batching, packing, padding of the last eval
batch, and the data-iterator state in checkpoints.

Determinism and resume: every element the loader yields is a function of the record order (a seeded
permutation of the records, a new one each epoch: `EpochPermutation`) and of the record's stream position,
so `get_state()` / `set_state()` of the iterator continue with exactly the same batches. Per-record
randomness (flips, MLM corruption) is seeded from (seed, stream position), never from a stateful generator.

A batched training stream (endless) is global: one record order over the whole split, global batch s being
stream positions [s * B, (s + 1) * B), of which each host reads its own contiguous rows (`GlobalRows`). The
examples of a step are then the same on any number of hosts, and the iterator state (the global batch index)
is the same on every host, so a run resumes on another host count (`restore_iterator`). Self-batching
pipelines (packed text) make their training stream global the same way: every host packs the same global
batches and keeps its rows (data.text), and their state is the stream position after the last packed record.
Finite splits (evaluation) read a contiguous shard of records per host (`ShardView`) in a per-host order.
Everything runs on grain's dataset engine (`MapDataset` / `IterDataset`).
"""

from __future__ import annotations

import collections
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import numpy as np

from data.order import EpochPermutation, GlobalRows, host_seed, stream_seed
from data.records import InMemorySource, ShardView, VirtualRecords, read_records
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


class _Positions(grain.MapDataset):
  """A MapDataset of `length` elements, element i made by `element(i)`."""

  length: int

  def __len__(self) -> int:
    return self.length

  def element(self, index: int) -> Any:
    raise NotImplementedError

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    if not 0 <= index < self.length:
      raise IndexError(f"element {index} of {self} is outside [0, {self.length})")
    with self._stats.record_self_time():
      return self.element(int(index))


class KeyBatches(_Positions):
  """Element b: the record keys of stream positions [b * batch_size, (b + 1) * batch_size) in
  `EpochPermutation` order, an int array (the last one shorter when the remainder is kept); with `rows`, the
  keys of this host's rows of global batch b (`GlobalRows`; endless streams).

  The record order in one node: grain's range -> shuffle -> repeat -> batch chain made a chain of calls per
  record (its batch reads its parent record by record); this is one vectorised lookup per batch. Batches run
  across epoch boundaries, like a batch after repeat. Its iterator state is grain's MapDataset position
  (checkpointable like any MapDataset).
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

  def element(self, index: int) -> np.ndarray:
    if self.rows is not None:
      return self.order.keys(self.rows.positions(index))
    start = index * self.batch_size
    return self.order.keys(np.arange(start, min(start + self.batch_size, self.total), dtype=np.int64))

  def __str__(self) -> str:
    return f"KeyBatches({self.order!r}, batch_size={self.batch_size}, batches={self.length})"


class ReadBatch:
  """(batch index, record keys) -> batch: reads each `source[key]`, applies the per-record `operations` in
  order and stacks the examples (`PadBatch`).

  RandomMap operations get a generator per record, shared by that record's operations in order: Philox keyed
  by seed + the row's stream position (`batch index * batch_size + j`, or `rows.positions(batch index)[j]`
  for a host's rows of a global stream).
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


class RecordStream(_Positions):
  """Element g: (g, the record at stream position g in `EpochPermutation` order with the per-record
  operations applied) — what a self-batching pipeline packs, record by record (`Packed`)."""

  def __init__(self, order: EpochPermutation, read: ReadBatch, *, num_epochs: int | None):
    super().__init__()
    if num_epochs is not None and num_epochs < 1:
      raise ValueError(f"num_epochs must be None (endless) or >= 1, got {num_epochs}")
    self.order, self.read = order, read
    self.length = sys.maxsize if num_epochs is None else num_epochs * order.num_records

  def element(self, index: int) -> tuple[int, Any]:
    return index, self.read.one(index, self.read.source[self.order.key(index)])

  def __str__(self) -> str:
    return f"RecordStream({self.order!r}, positions={self.length})"


class Packed(grain.IterDataset):
  """The batches `pack(elements)` makes of its parent's (position, record) elements, in order. `pack` is a
  generator function that reads no element beyond those of the batch it yields, so the state after a batch
  is the parent's position after its last record: a resume packs the same batches from there."""

  def __init__(self, parent: grain.IterDataset, pack: Callable[[Iterator[tuple[int, Any]]], Iterator[Any]]):
    super().__init__(parent)
    self.pack = pack

  def __iter__(self) -> grain.DatasetIterator:
    return _PackedIterator(self._parent.__iter__(), self.pack)

  def __str__(self) -> str:
    return f"Packed({self.pack!r})"


class _PackedIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, pack: Callable[..., Iterator[Any]]):
    super().__init__(parent)
    self.pack = pack
    self._state = parent.get_state()
    self._batches = pack(self._parent)

  def __next__(self) -> Any:
    batch = next(self._batches)
    self._state = self._parent.get_state()  # after the batch's last record: where a resume starts
    return batch

  def get_state(self) -> dict[str, Any]:
    return self._state

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state)
    self._state = state
    self._batches = self.pack(self._parent)


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
  pack: Callable[[Iterator[tuple[int, Any]]], Iterator[Any]] | None = None,
) -> grain.IterDataset:
  """Seeded shuffled record order, `operations` per record, then batching; `batch_size` is the host batch.

  Training (an endless stream, `num_epochs=None`) with `batch_size` set is one global stream: an
  `EpochPermutation` of all the split's records (seed from `stream_seed`), global batch s being stream
  positions [s * B, (s + 1) * B) for B = batch_size * shard_count, of which host `shard_index` reads rows
  [shard_index * batch_size, (shard_index + 1) * batch_size) (`GlobalRows`). A step's examples and the
  iterator state (the global batch index) are the same for any number of hosts; every batch is full.
  Evaluation (finite) keeps every record: each host reads its contiguous shard (`ShardView`; host shards may
  differ by one record) in its own order (seed from `host_seed`) and pads its last batch.
  `pack` instead of `batch_size` (text packing): `pack(elements)` makes the batches of the (stream position,
  record) elements (`Packed`); an endless stream is then sharded per host as well (equal shards, records
  beyond an equal split left out of each epoch); data.text asks for shard 0 of 1 on every host and keeps each
  host's rows of the packed global batch, so that its stream does not depend on the host count.

  Record order: a new permutation each epoch, batches running across epoch boundaries; without shuffle, the
  records in order, epoch after epoch. Batched: `KeyBatches` (the record keys of one batch in one lookup),
  each batch of keys read, transformed and stacked by one `ReadBatch` call, an `IterDataset` whose threads
  prefetch whole batches; packed: `RecordStream` read by the threads record by record, then `Packed`.
  Iterators have get_state()/set_state() and are saved by grain.checkpoint (`restore_iterator`).

  Checkpoints written before `EpochPermutation` (grain's index-shuffle order: `MapDataset.shuffle`) hold only
  a batch position, which resumes at the same batch position in the new order: the rest of the interrupted
  epoch comes from the new permutation (some of its records seen twice, others not at all), later epochs are
  whole. Start such runs in a fresh workdir. States of grain.DataLoader are refused
  (`check_iterator_checkpoint`).
  """
  if (batch_size is None) == (pack is None):
    raise ValueError("make_loader takes a batch_size or a pack, one of the two")
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
    # even without drop_remainder, which would lose evaluation records).
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
  order = EpochPermutation(len(source), seed=seed, shuffle=shuffle)
  read = ReadBatch(source, operations, seed=seed, batch_size=batch_size or 1, rows=rows)
  if pack is not None:
    records = RecordStream(order, read, num_epochs=num_epochs)
    options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
    out = Packed(records.to_iter_dataset(options), pack)
  else:
    # Batches of keys before reading leave grain one call per batch instead of a chain of per-record calls.
    ds = KeyBatches(order, num_epochs=num_epochs, batch_size=batch_size, drop_remainder=drop, rows=rows)
    # The buffer counts batches; one under the thread count would leave threads idle (grain warns).
    buffer = max(2, threads, -(-prefetch // batch_size))
    out = ds.map_with_index(read).to_iter_dataset(grain.ReadOptions(num_threads=threads,
                                                                    prefetch_buffer_size=buffer))
  if workers > 0:
    out = out.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return out


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
