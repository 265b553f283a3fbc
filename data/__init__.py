"""Input pipelines: one entry point for every experiment config.

    loader = data.create_dataset(config, "train", batch_size=32, seed=0)
    it = iter(loader)                    # grain DatasetIterator
    batch = next(it)                     # dict of NumPy arrays, leading dim = per-host batch
    state = it.get_state(); it.set_state(state)   # exact resume (train.py checkpoints it with orbax)
    info = data.dataset_info(config)     # task, vocab_size, seq_len, num_classes, special ids

`config.data.name` picks a module from `DATASETS`; each module provides
`create_dataset(config, split, *, batch_size, seed, shard_index, shard_count, shuffle, num_epochs)` and
`dataset_info(config)`. Adding a dataset is one line in the table (modules are imported lazily, so a missing
optional module only fails for the datasets that need it).

Batch layouts (every batch also carries `valid` bool [B]: False for the rows that pad the last evaluation
batch to the full batch size; training batches are always full and all-valid):
  image, lm:  inputs int32 [B, L], mask bool [B, L], weights float32 [B, L], segment_ids int32 [B, L]
  mlm:        inputs (corrupted) int32 [B, L], targets int32 [B, L], weights float32 [B, L] (1 = predicted),
              mask bool [B, L], segment_ids int32 [B, L] (at most `max_segments` per row)
  classify:   inputs int32 [B, L], mask bool [B, L], label int32 [B]
  retrieval:  inputs1, mask1, inputs2, mask2 ([B, L] each), label int32 [B]
Padding is always given by `mask` (True = real token); token value 0 is an ordinary token (a black pixel, a
NUL byte).

config.data fields read here (all optional except `name`): data_dir (TFDS data directory; LRA unpacked inside
it or `lra_dir`), seq_len, worker_count (grain worker processes, default 0), read_threads, prefetch,
virtual_records (benchmarks: a small split presented at a real split's size, data.records.VirtualRecords),
cache_in_memory (MB, default 512: small splits of lra_text, lra_image, lra_listops and the listops_synthetic
cache are held in RAM; 0 = never); images: random_flip; text (also imdb, sst5): spm_model, vocab_size (32000;
sst5 8000), tfds_version, max_segments, mlm_rate; LRA: lra_dir, skip_malformed, listops_parens, difficulty,
resolution; listops_synthetic: min_length, max_length, max_depth, max_args, op_p,
num_train/num_validation/num_test, data_seed, cache_dir (default data_dir; each split generated once there);
ordered (bool: the Transformer-XL order of an LM token stream, data.ordered); stand_in (bool: when the data is
missing, read the generated stand-in of `data.testing.mock_data` instead, saying so in one line; the `smoke`
variants set it). Offline stand-ins for every dataset: `data.testing.mock_data`; preparation of the real ones:
`python -m data.prepare`. """

from __future__ import annotations

import atexit
import contextlib
import copy
import importlib
import os
import shutil
import tempfile
from typing import Any

from data.info import DATASETS, DatasetInfo

__all__ = ["DATASETS", "DatasetInfo", "create_dataset", "dataset_info", "resolved_config"]



def _module(config: Any):
  name = config.data.name
  if name not in DATASETS:
    raise ValueError(f"config.data.name={name!r} is not a known dataset; allowed: {sorted(DATASETS)}")
  return importlib.import_module(DATASETS[name])


def create_dataset(
  config: Any,
  split: str,
  *,
  batch_size: int,
  seed: int,
  shard_index: int | None = None,
  shard_count: int | None = None,
  shuffle: bool | None = None,
  num_epochs: int | None = None,
):
  """A grain IterDataset over `split` ("train", "validation", "test") of
  `config.data.name`.

  shard_index/shard_count default to jax.process_index()/jax.process_count(). shuffle defaults to
  split == "train"; num_epochs defaults to None (repeat forever) for "train" and 1 otherwise. `batch_size` is
  the per-host batch. An endless batched stream is global: host `shard_index` reads rows
  [shard_index * batch_size, (shard_index + 1) * batch_size) of each global batch of
  batch_size * shard_count examples, the same examples for any host count (data/pipeline.py, `make_loader`).
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  kw = dict(batch_size=batch_size, seed=seed, shard_index=shard_index, shard_count=shard_count,
            shuffle=shuffle, num_epochs=num_epochs)
  return _resolve(config, split, kw)[1]


def resolved_config(config: Any, split: str = "train") -> Any:
  """The config `create_dataset` reads `split` with: with `config.data.stand_in` and the data missing, the
  generated stand-in's copy (its data_dir holds the stand-in's files, such as the SentencePiece model a smoke
  run trained with; they last until the process exits); otherwise `config` itself (returned without reading
  anything when `stand_in` is not set)."""
  if not _wants_stand_in(config):
    return config
  return _resolve(config, split, dict(batch_size=1, seed=0))[0]


def _resolve(config: Any, split: str, kw: dict[str, Any]) -> tuple[Any, Any]:
  """(the config read, its dataset): `config`'s own, or the stand-in's when its data is missing."""
  try:
    return config, _create(config, split, kw)
  except FileNotFoundError as e:
    if not _wants_stand_in(config):
      raise
    missing = e
  with _stand_in(config, missing) as stand_in_config:
    return stand_in_config, _create(stand_in_config, split, kw)


def _create(config: Any, split: str, kw: dict[str, Any]):
  """The dataset's own pipeline, or with `config.data.ordered` its ordered LM stream (data.ordered)."""
  from data import ordered

  if ordered.enabled(config):
    return ordered.create_dataset(config, split, **kw)
  return _module(config).create_dataset(config, split, **kw)


def dataset_info(config: Any) -> DatasetInfo:
  """Static facts about `config.data.name` (no data is read)."""
  return _module(config).dataset_info(config)


# ------------------------------------------------------------------------------------------------------------
# Stand-ins for missing data (`config.data.stand_in`, set by the smoke variants)

_STAND_IN_ROOT: list[str] = []  # one temporary directory per process, removed at exit
_STAND_IN_SAID: set[str] = set()


def _wants_stand_in(config: Any) -> bool:
  data = config.data
  value = data.get("stand_in", False) if hasattr(data, "get") else getattr(data, "stand_in", False)
  return bool(value)


@contextlib.contextmanager
def _stand_in(config: Any, missing: Exception):
  """A copy of `config` reading the generated stand-in of its dataset (`data.testing.mock_data`), written once
  per process into a temporary directory; TFDS-backed sets are patched while their source is opened."""
  from data import testing

  name = str(config.data.name)
  if not _STAND_IN_ROOT:
    _STAND_IN_ROOT.append(tempfile.mkdtemp(prefix="stand_in_data_"))
    atexit.register(shutil.rmtree, _STAND_IN_ROOT[0], True)
  if name not in _STAND_IN_SAID:
    first = str(missing).split(";")[0]
    print(f"data: {first}; using the generated stand-in (data.testing.mock_data), not the real dataset",
          flush=True)
  with contextlib.ExitStack() as stack:
    if name in testing.TFDS_BACKED or name not in _STAND_IN_SAID:
      data_dir = stack.enter_context(testing.mock_data(name, _STAND_IN_ROOT[0]))
    else:  # files written by the first call
      data_dir = os.path.join(_STAND_IN_ROOT[0], f"mock_{name}")
    _STAND_IN_SAID.add(name)
    out = copy.deepcopy(config)
    with out.unlocked() if hasattr(out, "unlocked") else contextlib.nullcontext():
      out.data.data_dir = data_dir
      if getattr(out.data, "lra_dir", None) is not None:
        out.data.lra_dir = None
    yield out
