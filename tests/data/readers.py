"""The data tests' shorthands: a config holding only `config.data`, and every batch of a split."""

from __future__ import annotations

import ml_collections

import data


def data_config(name: str, data_dir: str | None = None, **fields) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"data": {"name": name, "data_dir": data_dir, **fields}})


def split_batches(config, split="validation", batch_size=4, **kw):
  kw.setdefault("shard_index", 0)
  kw.setdefault("shard_count", 1)
  return list(data.create_dataset(config, split, batch_size=batch_size, seed=0, **kw))
