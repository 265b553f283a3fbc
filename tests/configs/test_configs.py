"""Config files: every variant builds, bad names/fields/paths give errors that list the valid options, gin
bindings fold into the config, and (slow) each config file trains a few smoke steps on mock data + eval.py."""

import importlib

import jax
import pytest
from absl import flags

from configs import base, default, lra
from models import gin_bridge, registry
from runtime import cli
from training import command_line, config_io, experiment, loop

CONFIG_FILES = ("default", "cifar10", "imagenet64", "wiki40b", "c4", "lra")
VARIANTS = [(f, "") for f in CONFIG_FILES] + [(f, "smoke") for f in CONFIG_FILES if f != "lra"] + [
  ("lra", f"task={t}") for t in lra.TASKS + ("listops_synthetic",)] + [
  ("lra", f"task={t},smoke") for t in lra.TASKS + ("listops_synthetic",)] + [
  ("transformer_xl", ""), ("transformer_xl", "text8,smoke"), ("compressive", ""), ("compressive", "smoke"),
  ("adaptive_span", ""), ("adaptive_span", "large,text8"), ("adaptive_span", "smoke"),
  ("blockbert", ""), ("blockbert", "seq_len=1024"), ("blockbert", "smoke")] + [
  ("bp_transformer", arg) for arg in ("", "text8", "imdb", "sst5", "smoke", "text8,smoke", "imdb,smoke",
                                      "sst5,smoke")] + [
  ("lra", f"task={t},attention={a}{smoke}") for t in lra.TASKS + ("listops_synthetic",)
  for a in lra.ENCODER_ATTENTIONS for smoke in ("", ",smoke")]


@pytest.mark.parametrize("module,arg", VARIANTS)
def test_every_config_variant_builds(module, arg):
  c = importlib.import_module(f"configs.{module}").get_config(arg)
  assert c.model.attention.name in registry.names()
  assert c.train.batch_size % 8 == 0 or "smoke" in arg or c.train.batch_size >= 8
  assert c.model.features % c.model.num_heads == 0
  if "smoke" in arg:
    assert c.train.num_steps <= 10 and c.model.num_layers == 1
  c2 = importlib.import_module(f"configs.{module}").get_config(
      (arg + "," if arg else "") + "attention=combiner_axial_rowmajor,layers=3,block_size=8,deepsets=true")
  assert (c2.model.attention.name, c2.model.num_layers) == ("combiner_axial_rowmajor", 3)
  assert c2.model.attention.params.block_size == 8 and c2.model.attention.deepsets is True


def test_listops_synthetic_variant_reads_the_generator():
  full, smoke = lra.get_config("task=listops_synthetic"), lra.get_config("task=listops_synthetic,smoke")
  listops = lra.get_config("task=listops")
  assert (full.data.name, full.data.seq_len, full.model.num_layers) == ("listops_synthetic", 2000, 6)
  assert full.optimizer.lr == listops.optimizer.lr and full.train.batch_size == listops.train.batch_size
  assert "min_length" not in full.data  # the published 500..2000
  assert (smoke.data.seq_len, smoke.data.max_length, smoke.data.num_train) == (64, 64, 1024)


def test_paper_defaults():
  from configs import cifar10, wiki40b

  c = cifar10.get_config("")
  assert (c.model.num_layers, c.model.features, c.model.num_heads, c.optimizer.lr, c.train.batch_size,
          c.data.seq_len) == (6, 512, 8, 1e-3, 32, 3072)
  w = wiki40b.get_config("seq_len=8192")
  assert (w.model.num_layers, w.model.features, w.model.num_heads, w.model.mlp_dim, w.train.batch_size,
          w.train.num_steps, w.optimizer.warmup_steps, w.data.seq_len) == (12, 768, 12, 3072, 128, 125_000,
                                                                            10_000, 8192)
  assert lra.get_config("task=pathfinder").model.classifier_pool == "MEAN"


def test_blockbert_paper_settings():
  """BERT-base with BlockBERT's n blocks and 131,072 tokens per batch at both lengths; n and the batch are
  arguments, and num_blocks belongs to attention=blockbert alone."""
  from configs import blockbert

  for arg, length, batch, n in [("", 512, 256, 2), ("seq_len=1024", 1024, 128, 2),
                                ("num_blocks=3", 512, 256, 3), ("seq_len=1024,num_blocks=3", 1024, 128, 3)]:
    c = blockbert.get_config(arg)
    m = c.model
    assert (m.num_layers, m.features, m.num_heads, m.mlp_dim, m.attention.name) == (12, 768, 12, 3072,
                                                                                     "blockbert"), arg
    assert (c.data.name, c.data.seq_len, c.train.batch_size, c.train.eval_batch_size) == ("c4", length, batch,
                                                                                         batch), arg
    assert c.train.batch_size * c.data.seq_len == blockbert.TOKENS_PER_BATCH == 131_072
    assert m.attention.params.num_blocks == n, arg
    # n = 2 halves both lengths; n = 3 takes the paper's blocks of floor(N/3) or ceil(N/3) positions
    assert c.data.seq_len % n == 0 or n == 3, arg
    registry.check_fields(m.attention)
  assert blockbert.get_config("seq_len=1024,batch_size=64").train.batch_size == 64
  assert "num_blocks" not in blockbert.get_config("attention=dense").model.attention.params
  for arg, message in [("attention=dense,num_blocks=2", "parameter of attention=blockbert"),
                       ("seq_len=1000", "131,072 tokens per batch"), ("num_blocks=two", "must be an int"),
                       ("num_blocks=0", ">= 1")]:
    with pytest.raises(cli.UsageError, match=message):
      blockbert.get_config(arg)


@pytest.mark.parametrize("attention", lra.ENCODER_ATTENTIONS)
def test_lra_encoder_fields_are_valid_for_every_task(attention):
  """attention=etc / blockbert on every LRA task: the task's fields (lra.ENCODER_SETTINGS) are set, fit the
  length, and the model and the op accept them at the task's length (shapes only); a field the config sets
  is kept, and the listops_1024 comparison keeps the automatic fields."""
  from flax import nnx

  import data
  from attention_core import registry as ops_registry
  from models import attention as attention_lib
  from models import transformer

  for task in lra.TASKS + ("listops_synthetic",):
    for smoke in ("", ",smoke"):
      c = lra.get_config(f"task={task},attention={attention}{smoke}")
      params, length = c.model.attention.params, int(c.data.seq_len)
      segment_length, radius, num_blocks = lra.ENCODER_SETTINGS[task]
      if attention == "blockbert":
        assert params.num_blocks == num_blocks == 2 and length % num_blocks == 0, (task, smoke)
      else:
        assert (params.segment_length, params.radius) == (segment_length, radius), (task, smoke)
        assert 1 <= segment_length <= length and 1 <= radius <= length, (task, smoke)
        if not smoke:
          assert length % segment_length == 0, task  # whole segments at the task's length
      registry.check_fields(c.model.attention)
      if smoke:
        continue
      info = data.dataset_info(c)
      nnx.eval_shape(lambda c=c, info=info: transformer.from_info(c.model, info))
      spec = ops_registry.get(attention)
      heads, head_dim = int(c.model.num_heads), int(c.model.features) // int(c.model.num_heads)
      qkv = jax.ShapeDtypeStruct((1, length, heads, head_dim), jax.numpy.float32)
      plan = attention_lib.resolve_plan_params(spec, params.to_dict(), length)
      out = jax.eval_shape(lambda q, k, v, plan=plan, spec=spec: spec.fn(q, k, v, causal=False, **plan),
                           qkv, qkv, qkv)
      assert out.shape == (1, length, heads, head_dim), task
  # Left to the op where the config chose (the listops_1024 comparison) or the user set the field.
  c = lra.get_config(f"listops_1024,attention={attention}")
  assert all(v == "auto" for v in c.model.attention.params.values())
  c = lra.get_config(f"task=text,attention={attention}")
  key = "num_blocks" if attention == "blockbert" else "segment_length"
  c.model.attention.params[key] = 8
  lra.encoder_fields(c, "text")
  assert c.model.attention.params[key] == 8


def test_unknown_config_argument_lists_valid_keys():
  with pytest.raises(ValueError, match=r"unknown config argument 'layerz'.*valid: \[.*'layers'"):
    default.get_config("layerz=3")
  with pytest.raises(ValueError, match="lra task must be one of"):
    lra.get_config("task=chess")


def test_unknown_attention_name_lists_valid_names():
  c = default.get_config("smoke,attention=combiner_fixd")
  with pytest.raises(ValueError,
                     match=r"unknown attention 'combiner_fixd'; valid names: \[.*'combiner_fixed'"):
    experiment.Experiment(c, devices=jax.devices()[:1])


def _command_line(argv: list[str]) -> flags.FlagValues:
  """The flags train.py defines for its config, parsed from `argv` (config_flags reads the command line when
  the flag is defined, as train.py does at import)."""
  fv = flags.FlagValues()
  command_line.define_config_flag("configs/default.py", flag_values=fv, sys_argv=argv)
  flags.DEFINE_multi_string("gin_file", [], "", flag_values=fv)
  flags.DEFINE_multi_string("gin_bindings", [], "", flag_values=fv)
  fv(argv)
  return fv


def test_unknown_config_field_is_an_error():
  bad = _command_line(["train.py", "--config=configs/default.py", "--config.model.num_layerz=3"])
  with pytest.raises(cli.UsageError,
                     match=r"--config.model.num_layerz: .*did you mean --config.model.num_layers"):
    command_line.checked_config(bad)
  good = _command_line(["train.py", "--config=configs/default.py", "--config.model.num_layers=3",
                        "--config.model.attention.params.block_size=16"])
  c = command_line.checked_config(good)
  assert c.model.num_layers == 3 and int(c.model.attention.params.block_size) == 16


def test_module_fields_from_the_command_line():
  """A config holds only the module fields it sets; the command line may set any field of the chosen module
  and is checked against the module's declaration (kind, minimum, which module reads it)."""
  base = ["train.py", "--config=configs/default.py:attention=adaptive_span"]
  c = command_line.checked_config(_command_line(base + ["--config.model.attention.span_init=0.5"]))
  assert c.model.attention.span_init == 0.5 and "span_loss" not in c.model.attention
  for arg, message in [("span_init=-1", r"span_init must be >= 0"),
                       ("span_init=fast", r"span_init must be a number"),
                       ("deepsets=True", r"'adaptive_span' does not read it"),
                       ("span_inti=0.5", r"unknown field 'span_inti'")]:
    with pytest.raises(cli.UsageError, match=message):
      command_line.checked_config(_command_line(base + [f"--config.model.attention.{arg}"]))


def test_unknown_attention_field_lists_valid_fields():
  c = default.get_config("smoke")
  with c.model.attention.unlocked():
    c.model.attention.deepset = True
  with pytest.raises(ValueError, match=r"unknown field 'deepset'; valid fields: \[.*'deepsets'"):
    registry.check_fields(c.model.attention)


def test_missing_data_names_the_expected_path(tmp_path):
  from configs import cifar10

  c = cifar10.get_config("smoke")
  # smoke variants otherwise train on a generated stand-in (tests/scripts/test_reproduce.py)
  c.data.stand_in = False
  c.data.data_dir = str(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
    experiment.create_dataset(c, "train", batch_size=8, seed=0)
  c = lra.get_config("task=listops,smoke")
  c.data.stand_in = False
  c.data.data_dir = str(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="lra_release"):
    experiment.create_dataset(c, "train", batch_size=8, seed=0)


def test_gin_bindings_fold_into_config():
  c = default.get_config("attention=combiner_axial_rowmajor")
  bound = gin_bridge.apply(c, gin_bindings=["attention.deepsets = True", "attention.row_length = 16",
                                            "attention.learned_span_key = True"])
  assert bound == {"deepsets": True, "row_length": 16, "learned_span_key": True}
  assert c.model.attention.deepsets is True and c.model.attention.params.row_length == 16
  # A field the config itself sets may not also be bound.
  c = default.get_config("attention=combiner_fixed,block_size=8")
  with pytest.raises(ValueError, match="conflicts with config.model.attention.params.block_size=8"):
    gin_bridge.apply(c, gin_bindings=["attention.block_size = 16"])
  c = default.get_config("attention=combiner_fixed,deepsets=false")
  with pytest.raises(ValueError, match="conflicts with config.model.attention.deepsets"):
    gin_bridge.apply(c, gin_bindings=["attention.deepsets = True"])
  # A field the chosen module does not read is refused with the valid ones.
  c = default.get_config("attention=dense")
  with pytest.raises(ValueError, match=r"has no field 'deepsets'; valid: \[.*'dropout_rate'"):
    gin_bridge.apply(c, gin_bindings=["attention.deepsets = True"])


# ETC and BlockBERT train on one LRA task each (the dual encoder and an image task); every task's fields are
# checked against the model at its real length by test_lra_encoder_fields_are_valid_for_every_task.
# BP-Transformer trains on IMDB (its word-piece classification pipeline; SST-5's stand-in and labels are
# tests/configs/test_bp_transformer.py's, its LM the model sweeps' and the character configs').
SMOKE_RUNS = [("cifar10", ""), ("imagenet64", ""), ("wiki40b", ""), ("c4", ""), ("blockbert", ""),
              ("bp_transformer", "imdb"),
              ("lra", "task=retrieval,attention=etc"), ("lra", "task=pathfinder,attention=blockbert")] + [
  ("lra", f"task={t}") for t in lra.TASKS + ("listops_synthetic",)]


@pytest.mark.slow
@pytest.mark.parametrize("module,arg", SMOKE_RUNS)
def test_config_smoke_run_and_eval(module, arg, tmp_path):
  from data.testing import mock_data
  from training import evaluate as eval_lib

  c = importlib.import_module(f"configs.{module}").get_config((arg + "," if arg else "") + "smoke")
  c.train.num_steps = 2
  with mock_data(c.data.name, str(tmp_path / "data")) as data_dir:
    c.data.data_dir = data_dir
    result = loop.train_and_evaluate(c, str(tmp_path / "run"), progress=False)
    assert result["step"] == 2
    metrics = eval_lib.evaluate_workdir(str(tmp_path / "run"), max_batches=1)
  key = {"image": "bits_per_dim", "lm": "perplexity", "mlm": "perplexity"}.get(result["experiment"].task,
                                                                              "accuracy")
  assert key in metrics and metrics["step"] == 2
  rules = config_io.load_config(str(tmp_path / "run")).sharding_rules
  assert base.SHARDING_RULES == tuple(tuple(r) for r in rules)
