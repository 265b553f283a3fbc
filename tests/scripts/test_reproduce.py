"""scripts/reproduce.py: every table row's config builds, the row fixes hold, results are collected; the slow
tests lower the smoke form of every implemented row's train and evaluation steps, and run the runner end to
end on a representative row of each kind."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import ml_collections
import numpy as np
import pytest

import data
from configs import cifar10, lra, routing_paper, wiki40b
from models import registry
from runtime import cli
from scripts import reproduce
from scripts import reproduce_report as report
from scripts import reproduce_runner as runner
from scripts import reproduce_tables as paper

ROWS = [r for rows in paper.tables().values() for r in rows]
IMPLEMENTED = [r for r in ROWS if runner.implemented(r)]


def test_rows_are_well_formed():
  ids = [(r.table, r.id) for r in ROWS]
  assert len(ids) == len(set(ids))
  assert {"combiner-1", "combiner-2", "combiner-3", "combiner-4", "combiner-5", "combiner-6", "routing-1",
          "routing-4", "yoso-3", "pystdlib"} <= set(paper.tables())
  assert [r.attention for r in paper.tables()["pystdlib"]] == [
      *paper.PYSTDLIB_ROWS, "transformer_xl", "compressive", "adaptive_span"]
  for r in ROWS:
    assert r.metric in ("bits_per_dim", "perplexity", "accuracy", "bits_per_byte")
    assert r.attention in registry.names() or not runner.implemented(r)


@pytest.mark.parametrize("scale", runner.SCALES)
def test_every_implemented_row_builds(scale):
  for r in IMPLEMENTED:
    c = runner.build_config(r, scale)  # get_config + overrides + attention field checks
    assert str(c.model.attention.name) == r.attention, r
    if scale == "smoke":
      assert c.train.num_steps <= 10 and c.data.seq_len <= 1024, r


def test_row_fixes():
  c = cifar10.get_config("routing_paper,attention=dense")
  registry.check_fields(c.model.attention)
  assert c.model.num_layers == 12 and dict(c.model.attention.params) == {}
  c = cifar10.get_config("routing_paper,routing_heads=0,window=512")
  assert c.model.attention.routing_heads == 0 and c.model.attention.params.window == 512
  c = lra.get_config("task=text,yoso_paper,attention=dense")
  registry.check_fields(c.model.attention)
  assert "tau" not in c.model.attention.params and c.model.features == 64
  c = lra.get_config("task=listops_synthetic,yoso_paper")
  assert c.model.attention.params.num_hashes == 32 and c.train.num_steps == 5000
  assert lra.get_config("task=pathfinder").data.difficulty == "curv_contour_length_9"  # pathfinder-32 "inter"
  main = cifar10.get_config("main")
  m = main.model
  assert (m.num_layers, m.features, m.num_heads, m.mlp_dim) == (128, 256, 2, 512)
  assert main.model.dropout_rate == 0.25 and main.train.num_steps == 1_200_000
  assert main.model.scan_layers and main.model.remat == "full"
  text = wiki40b.get_config("attention=routing")
  assert text.model.attention.routing_heads == text.model.num_heads  # no local heads in the comparison
  assert cifar10.get_config("").model.attention.get("membership") is None  # unset: the module's default
  assert routing_paper.split_flag("smoke,window=8") == ("smoke,window=8", None)


def test_smoke_images_are_small():
  c = cifar10.get_config("smoke")
  assert c.data.seq_len == 8 * 8 * 3 and tuple(c.model.image_shape) == (8, 8, 3) and c.data.stand_in


def test_stand_in_only_when_asked(tmp_path, capsys):
  c = cifar10.get_config("smoke")
  c.data.data_dir = str(tmp_path / "empty")
  batch = next(iter(data.create_dataset(c, "train", batch_size=2, seed=0, shard_index=0, shard_count=1)))
  assert batch["inputs"].shape == (2, 192)
  assert "generated stand-in" in capsys.readouterr().out
  c.data.stand_in = False
  with pytest.raises(FileNotFoundError, match="prepare it with"):
    data.create_dataset(c, "train", batch_size=2, seed=0, shard_index=0, shard_count=1)


def test_list_and_collect(tmp_path, capsys, monkeypatch):
  assert reproduce.main(["--table", "combiner-2", "--list", "--scale", "cpu"]) == 0
  out = capsys.readouterr().out
  assert "Combiner-Fixed-2k: paper 17.7" in out and "train.py --config configs/wiki40b.py:" in out
  rows = paper.tables()["combiner-2"]
  fixed = next(r for r in rows if r.label == "Combiner-Fixed-2k")
  wd = runner.workdir(fixed, "cpu", str(tmp_path))
  os.makedirs(wd)
  with open(os.path.join(wd, "metrics.json"), "w") as f:
    json.dump({"perplexity": 20.0, "loss": 3.0, "step": 600}, f)
  assert reproduce.main(["--table", "combiner-2", "--collect", "--scale", "cpu", "--workdir_root",
                         str(tmp_path)]) == 0
  md = (tmp_path / "results-combiner-2-cpu.md").read_text()
  assert "| Combiner-Fixed-2k | 17.700 | 20.000 | 2.300 | 1 | 600 |" in md
  csv_text = (tmp_path / "results-combiner-2-cpu.csv").read_text()
  assert csv_text.splitlines()[0].startswith("table,row,metric,paper,ours,std,delta,seeds,steps,scale,date")
  assert "not implemented: attention 'performer'" in md or all(runner.implemented(r) for r in rows)
  records = report.collect(rows, "cpu", str(tmp_path))
  assert sum(r["status"] == "ok" for r in records) == 1
  # a finished row is skipped by --run
  assert runner.run_rows([fixed], "cpu", str(tmp_path)) == []
  assert "finished already" in capsys.readouterr().out
  monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help lines at the terminal's width, even at hyphens
  with pytest.raises(SystemExit) as e:  # the help names the files --collect writes
    reproduce.main(["--help"])
  help_text = capsys.readouterr().out
  assert e.value.code == 0 and "results-<scale>" not in help_text
  assert help_text.count("results-<table>-<scale>") == 2  # the description and --collect's own help


def test_curves_and_plot(tmp_path, capsys):
  """--plot reads each row's evaluation scalars from its TensorBoard events (the later file of a resumed run
  wins a step logged twice; other splits and train scalars are ignored) and averages the seeds."""
  from runtime import paths

  rows = paper.tables()["pystdlib"][:2]
  for seed, losses in ((0, {100: 2.0, 200: 1.5}), (1, {100: 3.0, 200: 2.5})):
    wd = runner.workdir(rows[0], "cpu", str(tmp_path), seed)
    os.makedirs(wd)
    with open(os.path.join(wd, "config.json"), "w") as f:
      json.dump({"eval_split": "validation"}, f)
    first = paths.summary_writer(os.path.join(wd, "tensorboard"))
    first.add_scalar("eval_validation/loss", 9.0, 200)  # overwritten by the resumed run below
    first.add_scalar("train/loss", 9.0, 100)
    first.add_scalar("eval_test/loss", 9.0, 100)
    first.close()
    time.sleep(1.1)  # event file names carry the second they were opened
    second = paths.summary_writer(os.path.join(wd, "tensorboard"))
    for step, loss in losses.items():
      second.add_scalar("eval_validation/loss", loss, step)
    second.close()
  found = report.curves(rows, "cpu", str(tmp_path), seeds=2)
  assert list(found) == [rows[0]]
  ln2 = math.log(2.0)
  np.testing.assert_allclose(np.array(found[rows[0]]), [[100, 2.5 / ln2], [200, 2.0 / ln2]], rtol=1e-6)
  assert reproduce.main(["--table", "pystdlib", "--plot", "--scale", "cpu", "--seeds", "2", "--workdir_root",
                         str(tmp_path)]) == 0
  assert "plotted 1 rows" in capsys.readouterr().out
  assert (tmp_path / "curves-pystdlib-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tpu_launcher_commands(capsys):
  rows = [r for r in paper.tables()["combiner-4"] if runner.implemented(r)]
  failed = runner.run_rows(rows[:1], "paper", "gs://bucket/r", launcher="tpu",
                              tpu_args="--zone us-central2-b --accelerator v4-32", dry_run=True)
  assert failed == []
  out = capsys.readouterr().out
  assert "scripts.tpu run --name combiner-4-cifar-10-combiner-axial-0 --zone us-central2-b" in out
  assert "--workdir gs://bucket/r/combiner-4/cifar-10-combiner-axial/paper" in out


def test_metric_units():
  assert report.metric_value("accuracy", {"accuracy": 0.5}) == 50.0
  assert report.metric_value("bits_per_byte", {"loss": 0.6931471805599453}) == pytest.approx(1.0)
  assert report.metric_value("perplexity", {}) is None


# ------------------------------------------------------------------------------------------------------------
# Every row at smoke scale. Training all ~180 distinct rows took 24 minutes of the slow CI run; what that
# proved is checked here in two parts, at a fraction of the cost:
# - each row's program: the row's smoke config builds its model, and its real jitted train and evaluation
#   steps trace and lower (no compile) on the shapes of the batches its data pipeline yields (one
#   parametrized case per distinct command; `test_every_row_step_lowers`);
# - the runner end to end (`test_smoke_runner_end_to_end`): `--table all --run --collect` trains, evaluates
#   and collects the REPRESENTATIVE rows, which cover every config file, model task, config argument and
#   override of the rows (asserted by `test_representative_rows_cover_every_kind`), while every other row's
#   workdir already holds metrics, as in a resumed sweep: they are skipped as finished and collected.
# What training every row added beyond these is tested where it belongs: each attention's numerics in each
# kind of model (finite loss and gradients, causality) by tests/models/test_transformer.py's
# test_every_attention_forward_backward and test_every_attention_every_task, training and evaluating on each
# data pipeline by tests/configs/test_configs.py::test_config_smoke_run_and_eval.


def _smoke_command(row):
  return tuple(runner.train_argv(row, "smoke", ""))


# The listops-bidirectional rows differ from one another in the attention alone, which
# tests/models/test_transformer.py runs in the classifier: one of them (its representative) stands for all.
LISTOPS_LOWERED = ("listops-bidirectional", "dense")
LOWERED = [r for r in IMPLEMENTED
           if r.table != paper.LISTOPS_TABLE or (r.table, r.label) == LISTOPS_LOWERED]
_FIRST: dict[tuple[str, ...], paper.Row] = {}
for _r in LOWERED:
  _FIRST.setdefault(_smoke_command(_r), _r)
DISTINCT_SMOKE = list(_FIRST.values())  # the first row of each distinct smoke command

# (table, label) of the rows the end-to-end test trains. Routing Table 4's two rows have the same smoke
# command (smoke drops `routing_heads`): the runner trains it once and copies the metrics.
REPRESENTATIVE = (
    ("combiner-1", "cifar10 Combiner-Fixed 6L"),  # image
    ("combiner-3", "Combiner-DeepSets-Max-8k"),  # lm, deepsets, pooling
    ("combiner-5", "listops Sinkhorn Trans."),  # classify
    ("combiner-5", "retrieval Reformer"),  # dual encoder
    ("combiner-6", "Combiner-Routing-2k"),  # mlm
    ("routing-4", "Routing Transformer"), ("routing-4", "Local Transformer (24 layers, 16 heads)"),
    ("yoso-3", "pathfinder *YOSO-16"),  # an override, yoso_paper
    ("pystdlib", "yoso"),
    ("pystdlib", "compressive"),  # segment recurrence, a compressed memory; its evaluation memory sweep
    ("pystdlib", "adaptive_span"),  # a module's own fields and plan parameters set by overrides
    LISTOPS_LOWERED,  # listops_1024, the generated splits cached under the workdir root
)


def _representative():
  by_key = {(r.table, r.label): r for r in IMPLEMENTED}
  return [by_key[k] for k in REPRESENTATIVE]


def _data_key(config) -> str:
  return json.dumps(config.data.to_dict(), sort_keys=True, default=str)


def _kind(row):
  """What makes a row's program other than its attention: config file, model task, the config arguments it
  sets (`task`, `yoso_paper`, `deepsets`, `pooling`, ...) and the fields it overrides."""
  c = runner.build_config(row, "smoke")
  path, _, args = runner.config_string(row, "smoke").partition(":")
  flags = {a.partition("=")[0] for a in args.split(",") if a} - {"attention"}
  return path, data.dataset_info(c).task, flags, {o.partition("=")[0] for o in row.overrides}


def test_representative_rows_cover_every_kind():
  reps = _representative()
  assert len(reps) == len(REPRESENTATIVE) and len(set(reps)) == len(reps)
  kinds = [_kind(r) for r in IMPLEMENTED]
  covered = [_kind(r) for r in reps]
  for i, what in enumerate(("config file", "task")):
    missing = {k[i] for k in kinds} - {k[i] for k in covered}
    assert not missing, f"no representative row has the {what} {missing}: add one to REPRESENTATIVE"
  for i, what in ((2, "config argument"), (3, "override")):
    missing = set().union(*(k[i] for k in kinds)) - set().union(*(k[i] for k in covered))
    assert not missing, f"no representative row has the {what} {missing}: add one to REPRESENTATIVE"
  assert len({_smoke_command(r) for r in reps}) == len(reps) - 1, "one pair with the same command (copied)"
  others = {_smoke_command(r) for r in IMPLEMENTED if r not in reps}
  assert not others & {_smoke_command(r) for r in reps}  # they are trained, not copied from a finished row
  assert {_smoke_command(r) for r in LOWERED} == {_smoke_command(r) for r in DISTINCT_SMOKE}


_BATCHES: dict[str, tuple[dict, dict]] = {}  # data config -> (train batch, eval batch), this process's cache


def _batch_shapes(config, exp):
  """The shapes and dtypes of the first train batch and first evaluation batch the row's pipeline yields,
  as global arrays sharded like train.py's."""
  key = _data_key(config) + f"/{config.train.batch_size}/{config.train.eval_batch_size}/{config.eval_split}"
  if key not in _BATCHES:
    seed, train_bs = int(config.seed), exp.per_host(int(config.train.batch_size))
    train = next(iter(data.create_dataset(config, "train", batch_size=train_bs, seed=seed)))
    eval_bs = exp.per_host(int(config.train.eval_batch_size))  # as Experiment.evaluate reads the split
    evaluation = next(iter(data.create_dataset(config, config.eval_split, batch_size=eval_bs, seed=seed,
                                               shuffle=False, num_epochs=1)))
    _BATCHES[key] = ({k: (v.shape, v.dtype) for k, v in train.items()},
                     {k: (v.shape, v.dtype) for k, v in evaluation.items()})
  import jax

  return tuple({k: jax.ShapeDtypeStruct(shape, dtype, sharding=exp.batch_sharding)
                for k, (shape, dtype) in b.items()} for b in _BATCHES[key])


@pytest.mark.slow
@pytest.mark.parametrize("row", DISTINCT_SMOKE, ids=lambda r: f"{r.table}/{r.id}")
def test_every_row_step_lowers(row):
  """The row's smoke config builds train.py's Experiment, and its jitted train step and evaluation step trace
  and lower with the abstract sharded state and the shapes of the row's own data: every implemented row
  (each distinct command once) would run."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from training import recurrence
  from training.experiment import Experiment

  config = runner.build_config(row, "smoke")
  exp = Experiment(config)
  train_batch, eval_batch = _batch_shapes(config, exp)
  state = exp.abstract_state()
  rng = exp.abstract_rng_state()
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(exp.mesh, P()))
  memory, eval_memory = (), ()  # segment recurrence (mem_len > 0): the steps take the memory last
  if exp.mem_len:
    memory = (recurrence.abstract(exp.abstract_model, exp.mesh, int(config.train.batch_size), exp.mem_len),)
  if exp.eval_mem_len:
    eval_memory = (recurrence.abstract(exp.abstract_model, exp.mesh, int(config.train.eval_batch_size),
                                       exp.eval_mem_len),)
  traced = exp.jitted_train_step().trace(state["params"], state["rest"], state["opt_state"], rng, step,
                                         train_batch, *memory)
  params, rest, opt_state, out = traced.out_info[:4]
  shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
  assert shapes(params) == shapes(state["params"]) and shapes(rest) == shapes(state["rest"])
  assert shapes(opt_state) == shapes(state["opt_state"])
  assert all(out[k].shape == () for k in ("loss", "task_loss", "grad_norm", "finite")), out
  traced.lower()
  evaluated = exp._build_eval_step().trace(state["params"], state["rest"], rng, eval_batch, *eval_memory)
  sums = evaluated.out_info[0] if eval_memory else evaluated.out_info
  assert "examples" in sums and all(v.shape == () for v in sums.values())
  evaluated.lower()


@pytest.mark.slow
def test_smoke_runner_end_to_end(tmp_path, capsys):
  """`--table all --scale smoke --run --collect` as a user runs it, resuming a sweep in which every row but
  the representative ones has finished: those train (in-process, side by side), evaluate offline on the
  stand-in data and write their metrics; the identical command is trained once; every implemented row is
  collected from its metrics, the others are reported as not implemented."""
  root = str(tmp_path / "r")
  reps = _representative()
  seeded = {}
  for i, r in enumerate(IMPLEMENTED):
    if r in reps:
      continue
    value = seeded[r] = 1.0 + i / 1000  # a row's own number, to find it in the collection
    wd = runner.workdir(r, "smoke", root)
    os.makedirs(wd)
    with open(os.path.join(wd, "metrics.json"), "w") as f:
      json.dump({"loss": value * math.log(2.0), "accuracy": value / 100, "perplexity": value,
                 "bits_per_dim": value, "step": 4}, f)
  status = reproduce.main(["--table", "all", "--scale", "smoke", "--run", "--collect", "--noprogress",
                           "--workdir_root", root])
  out = capsys.readouterr().out
  assert status == 0, out[-3000:]
  assert out.count("finished already") == len(seeded)
  assert out.count("the same command as") == 1, out[-3000:]
  records = report.collect(ROWS, "smoke", root)
  assert [r["row"] for r in records if r["status"] != "ok"] == [r.label for r in ROWS if r not in IMPLEMENTED]
  assert len(IMPLEMENTED) > 150
  by_label = {(rec["table"], rec["row"]): rec for rec in records}
  for r, value in seeded.items():
    assert by_label[(r.table, r.label)]["ours"] == pytest.approx(value), r
  for r in reps:  # trained to the smoke config's last step, evaluated, its command recorded
    rec = by_label[(r.table, r.label)]
    assert rec["steps"] == runner.build_config(r, "smoke").train.num_steps, rec
    assert math.isfinite(rec["ours"]), rec
    with open(os.path.join(runner.workdir(r, "smoke", root), runner.RUN_INFO)) as f:
      info = json.load(f)
    assert info["row"] == r.label and ("same_as" in info or "--config" in info["command"]), info
  with open(os.path.join(root, "results-all-smoke.md")) as f:
    assert f.read().count("| ok") == len(IMPLEMENTED)


@pytest.mark.parametrize("name", ["transformer_xl", "compressive", "adaptive_span"])
def test_memory_rows_match_the_table(name):
  """The memory rows (Transformer-XL, Compressive, Adaptive Span) have the other pystdlib rows' model,
  optimizer, steps and bytes per step, a query sees up to as many bytes (segment + memory, compressed slots
  counted at their rate, = window), and their validation covers the same bytes."""
  rows = {r.attention: r for r in paper.tables()["pystdlib"]}
  xl, dense = (runner.build_config(rows[n], "cpu") for n in (name, "dense"))
  for key in ("num_layers", "features", "num_heads", "mlp_dim", "dropout_rate"):
    assert xl.model[key] == dense.model[key], key
  assert xl.optimizer.to_dict() == dense.optimizer.to_dict()
  assert xl.train.num_steps == dense.train.num_steps and xl.train.eval_every == dense.train.eval_every
  assert xl.train.batch_size * xl.data.seq_len == dense.train.batch_size * dense.data.seq_len
  rate = xl.model.attention.get("compression_rate", None) or 0
  context = xl.data.seq_len + xl.model.mem_len + xl.model.get("compressed_mem_len", 0) * rate
  assert context == dense.data.seq_len
  if name == "adaptive_span":
    assert xl.model.attention.params.max_span == context and xl.model.attention.relative_positions is True
  assert xl.data.ordered is True and xl.model.position_embedding == "none"
  assert set(report.memory_rows(list(rows.values()), "cpu")) == {
      rows[n] for n in ("transformer_xl", "compressive", "adaptive_span")}
  # The ordered validation is one stream (eval batch 1): its first segments are the dense row's first windows.
  assert xl.train.eval_batch_size == 1
  smoke = runner.build_config(rows[name], "smoke")  # the smoke variant's evaluation batches
  assert smoke.train.eval_batch_size == 8 and smoke.train.eval_batches == 2
  assert (xl.train.eval_batches * xl.data.seq_len
          == dense.train.eval_batches * dense.train.eval_batch_size * dense.data.seq_len)


def test_bool_override_and_eval_mem_lens_flag(capsys):
  row = dataclasses.replace(next(r for r in paper.tables()["pystdlib"] if r.attention == "dense"),
                            overrides=("--config.data.ordered=false",))
  assert runner.build_config(row, "cpu").data.ordered is False
  with pytest.raises(cli.UsageError, match="true or false"):
    runner.build_config(dataclasses.replace(row, overrides=("--config.data.ordered=1",)), "cpu")
  with pytest.raises(SystemExit) as e:
    reproduce.main(["--table", "pystdlib", "--eval_mem_lens", "-1"])
  assert e.value.code == 2
  assert "--eval_mem_lens must be >= 0" in capsys.readouterr().err


def test_eval_mem_len_config():
  from training import evaluate

  c = runner.build_config(next(r for r in paper.tables()["pystdlib"] if r.attention == "dense"), "cpu")
  with pytest.raises(cli.UsageError, match="without segment recurrence"):
    evaluate.with_eval_mem_len(c, 512)
  c.model.mem_len = 512
  with pytest.raises(cli.UsageError, match=">= 0"):
    evaluate.with_eval_mem_len(c, -1)
  assert evaluate.with_eval_mem_len(c, 0).model.eval_mem_len == 0


@pytest.mark.slow
def test_eval_memory_sweep(tmp_path, capsys):
  """The Transformer-XL row at smoke scale trains, then `--eval_mem_lens` evaluates its last checkpoint: with
  the config's own memory (1536) it repeats train.py's final evaluation exactly, without memory (0) it
  differs; the table and CSV are written and the per-memory JSON lands in the workdir."""
  root = str(tmp_path)
  argv = ["--table", "pystdlib", "--rows", "transformer_xl", "--scale", "smoke", "--workdir_root", root]
  assert reproduce.main([*argv, "--run", "--noprogress"]) == 0
  assert reproduce.main([*argv, "--eval_mem_lens", "0", "1536"]) == 0
  assert "evaluated 2 (row, memory) pairs" in capsys.readouterr().out
  row = next(r for r in paper.tables()["pystdlib"] if r.attention == "transformer_xl")
  wd = runner.workdir(row, "smoke", root)
  with open(os.path.join(wd, "metrics.json")) as f:
    final = json.load(f)
  with open(os.path.join(root, "eval-memory-pystdlib-smoke.csv")) as f:
    lines = f.read().splitlines()
  assert lines[0].startswith("table,row,eval_mem_len,bits_per_byte,loss,step")
  loss = {int(line.split(",")[2]): float(line.split(",")[4]) for line in lines[1:]}
  assert loss[1536] == pytest.approx(final["loss"], rel=1e-6) and abs(loss[0] - loss[1536]) > 1e-4
  assert os.path.exists(os.path.join(wd, f"eval_validation_{final['step']}_2batches_mem0.json"))
  assert "| 1536 |" in (tmp_path / "eval-memory-pystdlib-smoke.md").read_text()


def test_config_dict_overrides():
  r = next(r for r in paper.tables()["yoso-3"] if r.attention == "yoso_sketch")
  c = runner.build_config(r, "paper")
  assert c.model.attention.params.num_hashes == 16
  assert isinstance(c, ml_collections.ConfigDict)


def test_identical_commands_train_once(tmp_path, capsys):
  rows = [r for r in paper.tables()["combiner-1"] if r.label.startswith("cifar10 Combiner-Mixture")]
  assert len(rows) == 2
  assert runner.train_argv(rows[0], "smoke", "") == runner.train_argv(rows[1], "smoke", "")
  wd = runner.workdir(rows[0], "smoke", str(tmp_path))
  os.makedirs(wd)
  with open(os.path.join(wd, "metrics.json"), "w") as f:
    json.dump({"bits_per_dim": 7.5, "step": 4}, f)
  assert runner.run_rows(rows, "smoke", str(tmp_path)) == []
  assert "the same command as" in capsys.readouterr().out
  records = report.collect(rows, "smoke", str(tmp_path))
  assert [r["ours"] for r in records] == [7.5, 7.5]


# ------------------------------------------------------------------------------------------------------------
# The bidirectional ListOps table

LISTOPS_ROWS = paper.tables()[paper.LISTOPS_TABLE]


def _expected_bidirectional() -> set[str]:
  """Registered attentions with a bidirectional form (the registry's own flag), less dense's comparison-only
  duplicate and the decoder-only memory systems."""
  from attention_core import registry as ops_registry

  names = set(registry.names()) - {"dense_xla", "transformer_xl", "compressive", "nsa"}
  return {n for n in names if n not in ops_registry.names() or ops_registry.get(n).bidirectional}


def test_listops_rows_are_the_bidirectional_registry():
  from attention_core import registry as ops_registry

  labels = [r.label for r in LISTOPS_ROWS]
  assert set(labels) == _expected_bidirectional() and len(labels) == len(set(labels))
  assert {"dense", "none", "combiner_fixed", "yoso_c", "linformer"} <= set(labels)
  for name in ("transformer_xl", "compressive", "nsa"):  # causal-only in the registry as well
    assert not ops_registry.get(name).bidirectional
  assert all(r.attention == r.label and r.paper is None and r.metric == "accuracy" for r in LISTOPS_ROWS)
  # dense first; each Combiner plan right after its sparse pattern or another plan of it; then alphabetical
  assert labels[0] == "dense"
  assert labels[1:4] == ["sparse_fixed", "combiner_fixed", "combiner_fixed_select"]
  for i, name in enumerate(labels):
    if name.startswith("combiner_"):
      assert labels[i - 1].startswith(("sparse_", "combiner_", "routing")), labels
  grouped = {n for g in paper.LISTOPS_GROUPS for n in g}
  rest = [n for n in labels if n not in grouped]
  assert rest == sorted(rest) and labels[-len(rest):] == rest
  assert all(runner.implemented(r) for r in LISTOPS_ROWS)


def test_listops_rows_share_one_setting(tmp_path):
  root = str(tmp_path)

  def setting(c):
    d = c.to_dict()
    d["model"]["attention"] = {"dropout_rate": d["model"]["attention"]["dropout_rate"]}
    return json.dumps(d, sort_keys=True, default=str)

  # scale -> (steps, batch, lr, warmup, dropout, train examples, test examples)
  budgets = {"cpu": (300, 16, 1e-3, 30, 0.0, 4800, 512), "paper": (5000, 32, 1e-4, 1000, 0.1, 96_000, 2000)}
  for scale, (steps, batch, lr, warmup, dropout, num_train, num_test) in budgets.items():
    configs = [runner.build_config(r, scale, root) for r in LISTOPS_ROWS]
    c = configs[0]
    assert all(setting(other) == setting(c) for other in configs), scale
    assert [str(x.model.attention.name) for x in configs] == [r.attention for r in LISTOPS_ROWS]
    assert c.data.name == "listops_synthetic" and c.data.seq_len == 1024
    assert (c.data.min_length, c.data.max_length, c.data.num_test) == (500, 1000, num_test)
    assert (c.data.num_train, c.train.batch_size, c.train.num_steps) == (num_train, batch, steps)
    assert c.eval_split == "test" and c.train.eval_batches == -1  # the whole test split at each evaluation
    m = c.model
    assert (m.num_layers, m.features, m.num_heads, m.mlp_dim, m.classifier_pool) == (2, 64, 2, 128, "MEAN")
    assert m.dropout_rate == dropout and m.attention.dropout_rate == dropout
    assert (c.optimizer.lr, c.optimizer.warmup_steps) == (lr, warmup)
    assert (c.optimizer.schedule, c.optimizer.weight_decay) == ("cosine", 0.0)
    assert c.data.cache_dir == os.path.join(root, "data")  # one cache for every row
    assert data.dataset_info(c).seq_len == 1024 and data.dataset_info(c).task == "classify"
  smoke = runner.build_config(LISTOPS_ROWS[0], "smoke", root)  # the smoke variant's lengths win
  assert (smoke.data.seq_len, smoke.data.max_length, smoke.data.num_train) == (64, 64, 1024)
  assert smoke.train.num_steps <= 10
  assert runner.build_config(LISTOPS_ROWS[0], "cpu").data.cache_dir is None  # no root: no cache flag
  with pytest.raises(ValueError, match="listops_1024"):
    lra.get_config("listops_1024,task=listops")
  with pytest.raises(ValueError, match="cpu_budget is a budget of listops_1024 alone"):
    lra.get_config("cpu_budget")


def test_listops_list_and_collect(tmp_path, capsys):
  root = str(tmp_path)
  assert reproduce.main(["--table", paper.LISTOPS_TABLE, "--list", "--scale", "cpu", "--workdir_root",
                         root]) == 0
  out = capsys.readouterr().out
  assert out.count("listops-bidirectional / ") == len(LISTOPS_ROWS)
  assert f"--config.data.cache_dir={tmp_path}/data" in out
  assert "configs/lra.py:listops_1024,attention=dense,cpu_budget " in out
  dense = LISTOPS_ROWS[0]
  wd = runner.workdir(dense, "cpu", root)
  os.makedirs(wd)
  with open(os.path.join(wd, "metrics.json"), "w") as f:
    json.dump({"accuracy": 0.375, "loss": 1.9, "step": 300}, f)
  # a row stopped part-way (a time limit): its status record and evaluations so far, as train.py leaves them
  from runtime import paths
  from training import status

  stopped = runner.workdir(LISTOPS_ROWS[1], "cpu", root)
  status.Status(stopped).preempted(step=250, reason="SIGTERM")
  with open(os.path.join(stopped, "config.json"), "w") as f:
    json.dump({"eval_split": "test"}, f)
  writer = paths.summary_writer(os.path.join(stopped, "tensorboard"))
  for step, accuracy in ((100, 0.2), (200, 0.3125)):
    writer.add_scalar("eval_test/accuracy", accuracy, step)
  writer.close()
  assert reproduce.main(["--table", paper.LISTOPS_TABLE, "--collect", "--scale", "cpu", "--workdir_root",
                         root]) == 0
  md = (tmp_path / "results-listops-bidirectional-cpu.md").read_text()
  assert "| dense |  | 37.500 |  | 1 | 300 |" in md and md.count("| not run |") == len(LISTOPS_ROWS) - 2
  assert (f"| {LISTOPS_ROWS[1].label} |  |  |  |  |  |  | unfinished (stopped at step 250; last evaluation "
          f"31.25 at step 200) |") in md
  assert (tmp_path / "results-listops-bidirectional-cpu.csv").read_text().count("\n") == len(LISTOPS_ROWS) + 1


@pytest.mark.slow
def test_listops_smoke_rows_end_to_end(tmp_path, capsys):
  """Two rows at smoke scale: the shared splits are generated once under the workdir root before the rows
  train (in this process, one after the other: no interpreter and JAX start per row), and both are
  collected."""
  root = str(tmp_path)
  status = reproduce.main(["--table", paper.LISTOPS_TABLE, "--rows", "dense", "combiner_fixed",
                           "--scale", "smoke", "--run", "--collect", "--noprogress", "--jobs", "1",
                           "--workdir_root", root])
  out = capsys.readouterr().out
  assert status == 0, out[-3000:]
  cached = os.listdir(os.path.join(root, "data", "listops_synthetic"))
  assert sorted(n.split("-")[0] for n in cached) == ["test", "train"], cached  # no shards, no temporaries
  records = report.collect(reproduce.select(paper.LISTOPS_TABLE, ["dense", "combiner_fixed"]), "smoke",
                              root)
  assert [r["status"] for r in records] == ["ok", "ok"]
  assert all(0.0 <= r["ours"] <= 100.0 and r["paper"] is None for r in records), records
  assert "| dense |  |" in (tmp_path / "results-listops-bidirectional-smoke.md").read_text()


def test_a_run_stopped_with_its_checkpoint_is_reported_as_stopped(tmp_path, capsys):
  """train.py exits 0 after SIGTERM, leaving a `preempted` status record: the runner says where it stopped
  and that rerunning resumes (a stand-in program writes the record through training.status, as train.py
  does); a run that exits 0 without finishing or recording a stop is a failure."""
  import sys

  row = LISTOPS_ROWS[0]
  wd = str(tmp_path / "wd")
  stop = ("import sys; from training import status; "
          "status.Status(sys.argv[1]).preempted(step=162, reason='SIGTERM')")
  job = runner._Job(row, "cpu", 0, wd, [sys.executable, "-c", stop, wd], "[1/1] row")
  assert runner._run_one(job, "local", False, False)[0] is False
  out = capsys.readouterr().out
  assert "[1/1] row: stopped at step 162 (SIGTERM); run it again to resume from its checkpoint" in out
  quiet = runner._Job(row, "cpu", 0, str(tmp_path / "other"), [sys.executable, "-c", "pass"], "[1/1] row")
  assert runner._run_one(quiet, "local", False, False)[0] is False
  assert "[1/1] row: FAILED (exit status 0)" in capsys.readouterr().out
