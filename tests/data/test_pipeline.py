"""The pipeline every dataset shares (offline): the record order and its seeded generators, host shards and
the global training stream, resume (also after another host count), refused states of the old
grain.DataLoader engine, and the input benchmark."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import data
from data import order as data_order
from data import pipeline, resume
from tests.data.readers import data_config


@pytest.mark.parametrize("name", ["wiki40b", "c4", "lra_listops"])
def test_iterator_state_restores_identical_continuation(name, text_dirs, lra_dir):
  base = lra_dir if name.startswith("lra") else text_dirs[name]
  config = data_config(name, base, seq_len=32)
  loader = data.create_dataset(config, "train", batch_size=2, seed=7, shard_index=0, shard_count=1)
  it = iter(loader)
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(6)]  # crosses an epoch boundary for the small mock splits
  fresh = iter(data.create_dataset(config, "train", batch_size=2, seed=7, shard_index=0, shard_count=1))
  fresh.set_state(state)
  for want in expected:
    got = next(fresh)
    assert set(got) == set(want)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  other = next(iter(data.create_dataset(config, "train", batch_size=2, seed=8, shard_index=0, shard_count=1)))
  first = next(iter(data.create_dataset(config, "train", batch_size=2, seed=7, shard_index=0, shard_count=1)))
  assert not np.array_equal(other["inputs"] if "inputs" in other else other["inputs1"], first["inputs"])


class _Numbered:
  def __init__(self, n):
    self.n = n

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    return int(i)

  def __repr__(self):
    return f"Numbered({self.n})"


@pytest.mark.parametrize("n,hosts", [(23, 2), (24, 3)])
def test_host_shards_are_disjoint_and_cover_the_split(n, hosts):
  config = data_config("numbered")
  op = pipeline.Example(lambda i: {"inputs": np.array([i], np.int32)})
  seen = []
  for h in range(hosts):
    loader = pipeline.make_loader(_Numbered(n), [op], split="validation", batch_size=4, seed=0, shard_index=h,
                                  shard_count=hosts, shuffle=True, num_epochs=1, config=config)
    ids = [int(x) for b in loader for x, v in zip(b["inputs"][:, 0], b["valid"], strict=True) if v]
    seen.append(ids)
  flat = [i for ids in seen for i in ids]
  assert sorted(flat) == list(range(n))  # disjoint and complete
  # Training shards: equal sizes, still disjoint within an epoch.
  per_host = []
  for h in range(hosts):
    loader = pipeline.make_loader(_Numbered(n), [op], split="train", batch_size=1, seed=0, shard_index=h,
                                  shard_count=hosts, shuffle=True, num_epochs=None, config=config)
    it = iter(loader)
    per_host.append({int(next(it)["inputs"][0, 0]) for _ in range(n // hosts)})
  assert sum(len(s) for s in per_host) == len(set().union(*per_host)) == (n // hosts) * hosts


def test_training_stream_is_global_on_any_host_count(tmp_path):
  """Global batch s of an endless stream is stream positions [s * B, (s + 1) * B) of one record order, host h
  of P reading rows [h * B / P, (h + 1) * B / P): the same examples (and per-record generators) for 1, 2 or
  4 hosts. The state is the global batch index, equal on every host, and a 2-host
  checkpoint's states restore a 1-host iterator to the same place in the stream."""
  n, big, steps = 11, 4, 6  # 6 global batches of 4 run across epochs of 11 records
  config = data_config("numbered")

  def hosts(count):
    return [iter(pipeline.make_loader(_Numbered(n), [_Noisy()], split="train", batch_size=big // count,
                                      seed=3, shard_index=h, shard_count=count, shuffle=True, num_epochs=None,
                                      config=config)) for h in range(count)]

  order = data_order.EpochPermutation(n, seed=data_order.stream_seed(3), shuffle=True)
  want = [order.keys(np.arange(s * big, (s + 1) * big)) for s in range(steps)]  # the index derivation
  runs = {}
  for count in (1, 2, 4):
    its = hosts(count)
    runs[count] = [np.concatenate([next(it)["inputs"] for it in its]) for _ in range(steps)]
    for s in range(steps):
      np.testing.assert_array_equal(runs[count][s][:, 0], want[s])
      np.testing.assert_array_equal(runs[count][s], runs[1][s])  # the generators' draws too
  two = hosts(2)
  for _ in range(3):
    for it in two:
      next(it)
  step_dir = tmp_path / "7"
  (step_dir / "data").mkdir(parents=True)
  for h, it in enumerate(two):
    assert it.get_state() == {"next_index": 3}
    (step_dir / "data" / resume.state_file(h, 2)).write_text(json.dumps(it.get_state()))
  one = hosts(1)[0]
  resume.check_iterator_checkpoint(str(step_dir), one, config)
  resume.restore_iterator(str(step_dir), one)
  for s in range(3, steps):
    np.testing.assert_array_equal(next(one)["inputs"], runs[1][s])
  (step_dir / "data" / resume.state_file(1, 2)).write_text(json.dumps({"next_index": 2}))
  with pytest.raises(ValueError, match="differ"):
    resume.restore_iterator(str(step_dir), hosts(1)[0])


# What grain.DataLoader wrote into a checkpoint's `data/` item (the engine packed text, and before that every
# dataset, ran on), with the sampler of the EpochPermutation order and the one before it.
_DATA_LOADER_STATES = [
  {"version": 2, "last_seen_indices": {"0": 5}, "last_worker_index": -1, "worker_count": 0,
   "sampler": "EpochPermutationSampler(num_records=9, shuffle=True, num_epochs=None, seed=1)",
   "data_source": "Numbered(9)"},
  {"version": 2, "last_seen_indices": {"0": 3}, "last_worker_index": -1, "worker_count": 0,
   "sampler": ("IndexSampler(num_records=9, shard_options=NoSharding(), shuffle=True, num_epochs=None, "
               "seed=1)"),
   "data_source": "Numbered(9)"},
]


@pytest.mark.parametrize("saved", _DATA_LOADER_STATES)
def test_data_loader_states_are_refused_in_one_line(tmp_path, saved):
  """A checkpoint of the grain.DataLoader engine, which this version no longer has, is refused naming the
  checkpoint, in one line; the dataset engine's own states are accepted."""
  config = data_config("numbered")
  op = pipeline.Example(lambda i: {"inputs": np.array([i], np.int32)})
  it = iter(pipeline.make_loader(_Numbered(9), [op], split="train", batch_size=2, seed=0, shard_index=0,
                                 shard_count=1, shuffle=True, num_epochs=None, config=config))
  next(it)
  step_dir = tmp_path / "checkpoints" / "3"
  (step_dir / "data").mkdir(parents=True)
  (step_dir / "data" / resume.state_file(0, 1)).write_text(json.dumps(it.get_state()))
  resume.check_iterator_checkpoint(str(step_dir), it, config)  # this engine's state: accepted
  (step_dir / "data" / resume.state_file(0, 1)).write_text(json.dumps(saved))
  with pytest.raises(ValueError, match=r"checkpoints/3 holds a data-iterator state of grain.DataLoader "
                                       r"\(process_0-of-1.json\).*fresh workdir") as e:
    resume.check_iterator_checkpoint(str(step_dir), it, config)
  assert len(str(e.value).splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wiki40b", "lra_listops"])
def test_worker_processes_resume_exactly(name, text_dirs, lra_dir):
  base = lra_dir if name.startswith("lra") else text_dirs[name]
  config = data_config(name, base, seq_len=32, worker_count=2)
  it = iter(data.create_dataset(config, "train", batch_size=2, seed=3, shard_index=0, shard_count=1))
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(4)]
  fresh = iter(data.create_dataset(config, "train", batch_size=2, seed=3, shard_index=0, shard_count=1))
  fresh.set_state(state)
  for want in expected:
    got = next(fresh)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


class _Noisy(pipeline.SeededExample):
  """A RandomMap whose output shows the generator it got (the engines must seed it alike)."""

  def __init__(self):
    super().__init__(lambda i, rng: {"inputs": np.array([i, rng.integers(1 << 30)], np.int32)})


def _noisy_definition(n: int, records: int, *, split: str, shuffle: bool | None, num_epochs: int | None,
                     seed: int, shard_index: int, shard_count: int, batch_size: int, batches: int) -> list:
  """The batches `make_loader` is defined to give for `_Noisy` over `_Numbered(n)` presented as `records`
  records: EpochPermutation order, record key k holding k % n, each record's generator Philox(seed + its
  stream position); a training stream's host rows of global batches, an evaluation host's contiguous shard
  with its last batch padded."""
  train = split == "train"
  shuffle = train if shuffle is None else shuffle
  num_epochs = None if train else (num_epochs or 1)
  if train:  # a global stream: every host the same order, its own rows
    seed, lo, count = data_order.stream_seed(seed), shard_index * batch_size, records
    step = batch_size * shard_count
  else:
    lo = shard_index * records // shard_count
    count, step = (shard_index + 1) * records // shard_count - lo, batch_size
    seed = data_order.host_seed(seed, shard_index)
  order = data_order.EpochPermutation(count, seed=seed, shuffle=shuffle)
  total = None if train else num_epochs * count
  out = []
  for s in range(batches):
    positions = [s * step + (lo if train else 0) + j for j in range(batch_size)]
    positions = [p for p in positions if total is None or p < total]
    if not positions:
      break
    rows = []
    for p in positions:
      key = order.key(p) + (0 if train else lo)
      rng = np.random.Generator(np.random.Philox(key=seed + p))
      rows.append([key % n, rng.integers(1 << 30)])
    inputs = np.zeros((batch_size, 2), np.int32)
    inputs[:len(rows)] = rows
    out.append({"inputs": inputs, "valid": np.arange(batch_size) < len(rows)})
  return out


@pytest.mark.parametrize("split,shuffle,num_epochs", [("train", None, None), ("validation", True, 2),
                                                      ("validation", None, None)])
def test_batches_are_the_record_order_and_generators_by_definition(split, shuffle, num_epochs):
  config = data_config("numbered", virtual_records=29)  # 29 records cycling 11: also checks VirtualRecords
  loader = pipeline.make_loader(_Numbered(11), [_Noisy()], split=split, batch_size=4, seed=3, shard_index=1,
                                shard_count=2, shuffle=shuffle, num_epochs=num_epochs, config=config)
  got = [b for _, b in zip(range(12), iter(loader), strict=False)]
  want = _noisy_definition(11, 29, split=split, shuffle=shuffle, num_epochs=num_epochs, seed=3, shard_index=1,
                           shard_count=2, batch_size=4, batches=12)
  assert len(got) == len(want) > 2
  for g, w in zip(got, want, strict=True):
    assert set(g) == {"inputs", "valid"}
    np.testing.assert_array_equal(g["inputs"], w["inputs"])
    np.testing.assert_array_equal(g["valid"], w["valid"])
  keys = np.concatenate([b["inputs"][b["valid"], 0] for b in got])
  assert keys.max() < 11 and len(set(keys.tolist())) == 11  # record i is mock record i % 11


def test_dataset_engine_reading_threads_each_get_a_batch(caplog):
  """Several reading threads (a large host's default) read the same batches as one, and grain is given a
  prefetch buffer of at least one batch per thread (with fewer it warns and leaves threads idle)."""
  batches = {}
  for threads in (1, 4):
    config = data_config("numbered", read_threads=threads, prefetch=8)  # 2 batches of 4 records < 4 threads
    loader = pipeline.make_loader(_Numbered(37), [_Noisy()], split="train", batch_size=4, seed=3,
                                  shard_index=0, shard_count=1, shuffle=True, num_epochs=None, config=config)
    with caplog.at_level(logging.WARNING):
      batches[threads] = [b["inputs"] for _, b in zip(range(20), iter(loader), strict=False)]
  assert not [r for r in caplog.records if "prefetch_buffer_size" in r.getMessage()]
  assert len(batches[4]) == 20
  for got, want in zip(batches[4], batches[1], strict=True):
    np.testing.assert_array_equal(got, want)


def test_epoch_permutation_is_a_seeded_reshuffle_per_epoch():
  import pickle

  n = 37
  order = data_order.EpochPermutation(n, seed=5, shuffle=True)
  epochs = [order.keys(np.arange(e * n, (e + 1) * n)) for e in range(4)]
  for keys in epochs:
    assert keys.dtype == np.int32 and sorted(keys.tolist()) == list(range(n))  # each epoch: every record once
  assert len({tuple(keys.tolist()) for keys in epochs}) == 4 and not np.array_equal(epochs[0], np.arange(n))
  assert len(order._cache) <= 2  # only the current and the next epoch are kept
  # The definition: numpy's default_rng([seed, epoch]) permutation of the records.
  np.testing.assert_array_equal(epochs[2], np.random.default_rng([5, 2]).permutation(n))
  stream = np.concatenate(epochs)  # [4 * n]
  # Same seed, fresh cache, positions asked in any order (and after pickling, as worker processes get it).
  again = pickle.loads(pickle.dumps(data_order.EpochPermutation(n, seed=5, shuffle=True)))
  backwards = np.arange(4 * n)[::-1]
  np.testing.assert_array_equal(again.keys(backwards), stream[backwards])
  other_seed = data_order.EpochPermutation(n, seed=6, shuffle=True)
  assert not np.array_equal(other_seed.keys(np.arange(n)), epochs[0])
  # One batch of positions across epoch boundaries (here three epochs) maps each to its own epoch's key.
  positions = np.arange(n - 3, 2 * n + 5)
  np.testing.assert_array_equal(order.keys(positions), stream[positions])
  assert [order.key(p) for p in positions] == stream[positions].tolist()
  plain = data_order.EpochPermutation(n, seed=5, shuffle=False)
  np.testing.assert_array_equal(plain.keys(np.arange(2 * n)), np.arange(2 * n) % n)


def test_epoch_permutation_of_large_splits_is_keyed_not_stored(monkeypatch):
  """Above MAX_STORED records the order is grain's index shuffle per (seed + epoch): no array per epoch."""
  import grain

  monkeypatch.setattr(data_order.EpochPermutation, "MAX_STORED", 50)
  n = 300
  order = data_order.EpochPermutation(n, seed=7, shuffle=True)
  assert not order.stored and data_order.EpochPermutation(50, seed=7, shuffle=True).stored
  epochs = [order.keys(np.arange(e * n, (e + 1) * n)) for e in range(3)]
  for keys in epochs:
    assert keys.dtype == np.int32 and sorted(keys.tolist()) == list(range(n))
  assert len({tuple(keys.tolist()) for keys in epochs}) == 3 and not order._cache
  want = grain.MapDataset.range(n).shuffle(seed=7)  # grain's own order, epoch e reseeded as seed + e
  np.testing.assert_array_equal(epochs[1], [want[n + i] % n for i in range(n)])
  positions = np.arange(n - 4, n + 4)  # across an epoch boundary
  np.testing.assert_array_equal(order.keys(positions), np.concatenate(epochs)[positions])
  assert [order.key(p) for p in positions] == np.concatenate(epochs)[positions].tolist()
  with pytest.raises(ValueError, match="not stored"):
    order.permutation(0)
  plain = data_order.EpochPermutation(n, seed=7, shuffle=False)  # without shuffle: records in sequence
  np.testing.assert_array_equal(plain.keys(np.arange(n + 3)), np.arange(n + 3) % n)


def test_batches_follow_the_epoch_permutation_across_epochs():
  config = data_config("numbered")
  op = pipeline.Example(lambda i: {"inputs": np.array([i], np.int32)})
  loader = pipeline.make_loader(_Numbered(5), [op], split="validation", batch_size=4, seed=2, shard_index=0,
                                shard_count=1, shuffle=True, num_epochs=3, config=config)
  batches = list(loader)
  assert [int(b["valid"].sum()) for b in batches] == [4, 4, 4, 3]  # 15 records, batches across epochs
  got = np.concatenate([b["inputs"][b["valid"], 0] for b in batches])
  order = data_order.EpochPermutation(5, seed=data_order.host_seed(2, 0), shuffle=True)
  np.testing.assert_array_equal(got, order.keys(np.arange(15)))


@pytest.mark.slow  # ~15 s on the 2-core box, mostly compiling the smoke train step
def test_input_benchmark_reports_pipeline_against_smoke_step(tmp_path):
  import json

  from scripts import benchmark, benchmark_input

  args = benchmark.parse_args(["--mode", "input", "--out_dir", str(tmp_path), "--datasets",
                               "synthetic_recall", "--seconds", "0.2", "--repeats", "2", "--rounds", "2"])
  assert benchmark_input.main(args) == 0
  paths = {"json": tmp_path / "benchmark_input.json", "markdown": tmp_path / "benchmark_input.md"}
  (row,) = json.load(open(paths["json"]))["rows"]
  assert row["config"] == "configs/default.py:smoke" and row["seq_len"] == 64 and row["batch"] == 8
  assert row["examples_per_s"] > 0 and row["step_ms"] > 0 and len(row["step_ms_rounds"]) == 2
  assert row["ratio"] == pytest.approx(row["examples_per_s"] * row["step_ms"] / 1000 / 8)
  assert row["target"] == ("yes" if row["ratio"] >= 10 else "no")
  assert "| synthetic_recall |" in open(paths["markdown"]).read()


@pytest.mark.slow  # ~10 s: two smoke trainings (the unit test above covers the check itself)
def test_train_resume_from_a_data_loader_checkpoint_names_the_workdir(tmp_path):
  from configs import default
  from training import loop

  config = default.get_config("smoke,attention=dense")
  config.train.num_steps, config.train.checkpoint_every, config.train.eval_every = 2, 2, 0
  workdir = str(tmp_path / "run")
  assert loop.train_and_evaluate(config, workdir, progress=False)["step"] == 2
  (state,) = (tmp_path / "run" / "checkpoints" / "2" / "data").glob("process_*.json")
  saved = state.read_text()
  state.write_text(json.dumps(_DATA_LOADER_STATES[0]))  # as the grain.DataLoader engine wrote them
  config.train.num_steps = 3
  with pytest.raises(ValueError, match=rf"{workdir}/checkpoints/2 holds a data-iterator state of grain"):
    loop.train_and_evaluate(config, workdir, progress=False)
  state.write_text(saved)
  assert loop.train_and_evaluate(config, workdir, progress=False)["start_step"] == 2
