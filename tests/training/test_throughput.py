"""Training throughput: model FLOPs against a hand count, the peak FLOP/s table and MFU, the profiler window,
the config check of profile_steps, and a real run that reads its metrics only at log steps."""

import glob
import os
import struct
import traceback

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from flax import nnx
from jax._src import array as jax_array
from jax._src import config as jax_config

from configs import base, validation
from models import transformer
from runtime.cli import UsageError
from tests.training.smoke import smoke
from training import loop, throughput


def _tiny_dense(num_layers=2, features=32, heads=2, head_dim=32, mlp_dim=48):
  cfg = smoke("dense").model
  cfg.num_layers, cfg.features, cfg.num_heads, cfg.head_dim, cfg.mlp_dim = (num_layers, features, heads,
                                                                            head_dim, mlp_dim)
  return cfg


@pytest.mark.parametrize("scan", [False, True])  # blocks stacked: their layer axis is no matrix dimension
def test_model_flops_match_a_hand_count_on_a_tiny_dense_model(scan):
  layers, f, h, d, m, vocab, batch, length = 2, 32, 2, 32, 48, 11, 3, 64
  cfg = _tiny_dense(layers, f, h, d, m)
  cfg.scan_layers = scan
  params = nnx.state(nnx.eval_shape(lambda: transformer.build_model(cfg, task="lm", vocab_size=vocab,
                                                                    seq_len=length)), nnx.Param)
  flops = throughput.model_flops(cfg, task="lm", abstract_params=params, batch=batch, seq_len=length)
  tokens = batch * length
  # Per token: q, k, v, out projections (f x h*d each), the MLP (f x m, m x f), the LM head (f x vocab).
  n = layers * (4 * f * h * d + 2 * f * m) + f * vocab
  assert flops["tokens"] == tokens
  assert flops["non_attention"] == 6 * n * tokens
  # Dense attention, forward: q k^T and p v, 2 * length^2 * d multiply-adds per batch row and head.
  matmuls = layers * 2 * (2 * batch * h * length * length * d)
  assert matmuls <= flops["attention"] / 3 <= 1.25 * matmuls  # plus the softmax's elementwise work
  assert flops["total"] == flops["non_attention"] + flops["attention"]


def test_model_flops_of_a_classifier_count_its_head_per_example():
  cfg = _tiny_dense(1, 16, 2, 8, 24)
  cfg.attention = base.attention_config("dense")
  params = nnx.state(nnx.eval_shape(lambda: transformer.build_model(
      cfg, task="classify", vocab_size=20, seq_len=32, num_classes=3)), nnx.Param)
  flops = throughput.model_flops(cfg, task="classify", abstract_params=params, batch=4, seq_len=32)
  per_token = 4 * 16 * 2 * 8 + 2 * 16 * 24
  per_example = 16 * 24 + 24 * 3  # the pooled MLP: features x mlp_dim, mlp_dim x classes
  assert flops["non_attention"] == 6 * (per_token * 4 * 32 + per_example * 4)


@pytest.mark.parametrize("name,compressed", [("transformer_xl", 0), ("compressive", 1)])
def test_model_flops_count_the_memory_keys(name, compressed):
  """Segment recurrence: each query reads the memory's keys (and the compressed memory's) besides its
  segment's, so a memory as long as the segment doubles the attention's FLOPs, and a compressed memory of that
  length beside it triples them; the rest of the model is unchanged."""
  length = 32

  def flops(mem_len):
    cfg = smoke(name).model
    cfg.mem_len, cfg.position_embedding = mem_len, "none"
    if name == "compressive":
      cfg.compressed_mem_len = compressed * length
    params = nnx.state(nnx.eval_shape(lambda: transformer.build_model(cfg, task="lm", vocab_size=11,
                                                                      seq_len=length)), nnx.Param)
    return throughput.model_flops(cfg, task="lm", abstract_params=params, batch=2, seq_len=length)

  alone, with_memory = flops(0), flops(length)
  assert with_memory["non_attention"] == alone["non_attention"]
  keys = 2 + compressed  # segment lengths of keys per query: the segment, the memory, the compressed memory
  assert 0.9 <= with_memory["attention"] / alone["attention"] / keys <= 1.1, (alone, with_memory)


def test_every_scan_iteration_is_counted():
  x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
  one = 2 * 32 ** 3  # one 32 x 32 matmul

  def looped(x):
    return jax.lax.fori_loop(0, 10, lambda i, a: a @ x, x)

  def nested(x):  # 4 outer iterations of 3 inner ones
    return jax.lax.scan(lambda a, _: (jax.lax.fori_loop(0, 3, lambda i, b: b @ x, a), None), x, None,
                        length=4)[0]

  assert 10 * one <= throughput.function_flops(looped, x) < 10 * one * 1.01
  assert 12 * one <= throughput.function_flops(nested, x) < 12 * one * 1.01


def test_peak_flops_table_and_mfu():
  assert throughput.peak_flops("TPU v4", "bfloat16") == 275e12
  assert throughput.peak_flops("TPU v5 lite", "bfloat16") == 197e12  # v5e
  assert throughput.peak_flops("TPU v5", "bfloat16") == 459e12  # v5p
  assert throughput.peak_flops("TPU v5p", "float32") == 459e12
  assert throughput.peak_flops("TPU v6 lite", "bfloat16") == 918e12  # v6e
  assert throughput.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
  assert throughput.peak_flops("NVIDIA H100 80GB HBM3", "float32") == 494.7e12  # TF32
  assert throughput.peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
  assert throughput.peak_flops("NVIDIA H200", "bfloat16") == 989.4e12
  assert throughput.peak_flops("cpu", "float32") is None
  assert throughput.peak_flops("TPU v4", "float64") is None
  assert throughput.mfu(1e12, 2.0, 275e12, 4) == pytest.approx(2e12 / 1100e12)
  assert throughput.mfu(1e12, 2.0, None, 4) is None
  assert throughput.mfu(None, 2.0, 275e12, 4) is None
  assert throughput.memory(jax.devices("cpu")[:2]) == {}  # the CPU reports none: nothing is logged
  gpu = [_Device({"bytes_in_use": 2e9, "peak_bytes_in_use": 3e9}), _Device({"bytes_in_use": 1e9,
                                                                            "peak_bytes_in_use": 4e9})]
  assert throughput.memory(gpu) == {"mem_gb": 2.0, "peak_mem_gb": 4.0}  # the fullest device of each


class _Device:
  """A device as far as `memory` reads one: what a GPU's `memory_stats()` returns."""

  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


@pytest.mark.parametrize("value", [(3, 3), (4, 2), (-1, 2), (1.5, 4), (1,), (1, 2, 3), (True, 3), (0, 2.0)])
def test_bad_profile_steps_is_one_line_naming_the_field(value):
  c = smoke()
  c.train.profile_steps = value  # the field takes tuples (lists from JSON); values are checked by validate
  with pytest.raises(UsageError) as e:
    validation.validate(c)
  assert str(e.value).startswith("config.train.profile_steps must be") and "\n" not in str(e.value)
  assert "0 <= start < stop" in str(e.value)


def test_good_profile_steps_pass_and_default_is_off():
  c = smoke()
  assert c.train.profile_steps is None
  validation.validate(c)
  c.train.profile_steps = (0, 2)
  validation.validate(c)


def test_profile_window_writes_a_trace(tmp_path):
  window = throughput.ProfileWindow((1, 3), str(tmp_path))
  f = jax.jit(lambda x: x * 2)
  x = jnp.ones(4)
  for step in range(4):
    window.before_step(step)
    x = f(x)
    if window.ends_at(step + 1):
      jax.block_until_ready(x)
      window.close()
      assert step + 1 == 3
  assert not window.active and window.written
  assert glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
  off = throughput.ProfileWindow(None, str(tmp_path / "off"))
  off.before_step(0)
  assert not off.active and not os.path.exists(tmp_path / "off")


def _event_tags(logdir):
  """Tags of the summaries in a TensorBoard event file (TFRecord framing, tensorboardX's protos)."""
  from tensorboardX.proto import event_pb2

  tags = set()
  for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      tags.update(v.tag for v in event.summary.value)
  return tags


def _count_reads_outside_allowed(monkeypatch):
  """Every read of a device array's value on this thread while device-to-host transfers are not allowed (the
  loop allows them where it reads by design: log steps, saves, evaluations). A transfer guard raises on such a
  read on a GPU or TPU; on the CPU the arrays are host memory and the guard never fires, so the reads are
  counted where jax.Array produces its host value."""
  reads = []
  value = jax_array.ArrayImpl._value

  def counted(self):
    if jax_config.transfer_guard_device_to_host.value != "allow":
      reads.append("".join(traceback.format_stack(limit=4)))
    return value.fget(self)

  monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(counted))
  return reads


@pytest.mark.slow  # a real training run (compiles the step and the evaluation): ~15 s on 2 cores
def test_real_run_reads_metrics_only_at_log_steps_and_writes_a_profile(tmp_path, capsys, monkeypatch):
  config = smoke("combiner_fixed", **{"train.num_steps": 6, "train.log_every": 3, "train.checkpoint_every": 6,
                                      "train.profile_steps": (1, 3)})
  reads = _count_reads_outside_allowed(monkeypatch)
  with jax.transfer_guard_device_to_host("disallow_explicit"):
    with loop.testing_hooks(devices=jax.devices()[:1]):
      result = loop.train_and_evaluate(config, str(tmp_path), progress=False)
  assert not reads, reads[0]
  assert result["step"] == 6 and result["fetched_at"] == [3, 6]
  assert result["compile_s"] > 0
  out = capsys.readouterr().out
  assert "first step (compilation included)" in out and "model FLOPs per step" in out
  step_lines = [line for line in out.splitlines() if line.startswith("step ")]
  assert len(step_lines) == 2 and all("tokens_per_s=" in line and "step_ms=" in line for line in step_lines)
  assert "mfu=" not in out  # the CPU has no peak FLOP/s
  assert glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  tags = _event_tags(str(tmp_path / "tensorboard"))
  assert {"train/tokens_per_s", "train/compile_s", "_hparams_/experiment", "config/text_summary"} <= tags


@pytest.mark.slow  # a real run that diverges (~10 s on 2 cores)
def test_divergence_is_read_before_any_later_save(tmp_path):
  # lr 1e30 from step 1 on: the parameters blow up and a later step is non-finite (step 2 here); the save at
  # step 3, before the log step 4, reads the pending steps first and stops the run.
  config = smoke("dense", **{"train.num_steps": 8, "train.log_every": 4, "train.checkpoint_every": 3,
                             "optimizer.lr": 1e30, "optimizer.clip_norm": 0.0})
  with pytest.raises(loop.TrainingDiverged) as e:
    with loop.testing_hooks(devices=jax.devices()[:1]):
      loop.train_and_evaluate(config, str(tmp_path), progress=False)
  message = str(e.value)
  bad = int(message.split(" at step ")[1].split(";")[0])
  saved = sorted(int(p) for p in os.listdir(tmp_path / "checkpoints") if p.isdigit()) \
      if os.path.exists(tmp_path / "checkpoints") else []
  assert bad < 3 and not any(s > bad for s in saved), (bad, saved)  # no state after the bad step is on disk
  assert (f"last good checkpoint (step {saved[-1]})" in message) if saved else ("no checkpoint" in message)


def test_hparams_summary_of_the_config(tmp_path):
  writer = loop.summary_writer(str(tmp_path))
  config = ml_collections.ConfigDict({"train": {"batch_size": 8, "profile_steps": None},
                                      "model": {"x": (1, 2)}})
  loop.write_hparams(writer, config, 0)
  writer.close()
  assert {"_hparams_/experiment", "_hparams_/session_start_info", "config/text_summary"} <= _event_tags(
      str(tmp_path))
