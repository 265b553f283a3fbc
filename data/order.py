"""The record order every pipeline reads, and where a host's rows sit in it (data/pipeline.py).

A stream position is an example's place in the record order over all epochs; `EpochPermutation` maps it to a
record key, a seeded reshuffle per epoch, and `GlobalRows` maps a host's rows of global batch s to their
positions, so that a training stream's examples do not depend on the number of hosts.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np
from grain._src.python.experimental.index_shuffle.python import index_shuffle_module


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


class EpochPermutation:
  """The record order every pipeline reads: stream position g -> record key.

  Position g is offset g % n of epoch g // n, and its key is `permutation(epoch)[offset]`, where
  `permutation(epoch)` is `np.random.default_rng([seed, epoch]).permutation(n)` (shuffled in place in an
  int32 `arange(n)`: the same order; the identity without `shuffle`). Every epoch is a permutation of the
  host's n records, reshuffled per epoch, the same for the same (seed, n).

  Why not grain's index shuffle (`MapDataset.shuffle`, `IndexSampler`): it cycle-walks a domain of at least
  2^16 per record, which is most of a small pipeline's cost; a cached permutation is an array lookup at any
  size, and a batch of positions is one vectorised lookup (timings: docs/benchmarks_training.md,
  "Input pipeline costs").

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
