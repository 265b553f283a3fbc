"""scripts/benchmark.py: pure logic, a tiny end-to-end run, the worker, modes and presets (pictures:
tests/scripts/test_plot_patterns.py); bad flags of every mode, and of the other measuring scripts
(benchmark_decode, seq_parallel), as one `ERROR:` line and exit 2."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_core import registry as ops_registry
from runtime import cli
from scripts import benchmark as bm
from scripts import benchmark_report as br
from scripts import benchmark_worker as bw
from tests.training.test_usage_errors import assert_one_line

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Two non-dense ops for the end-to-end run: the first two of these that are registered.
E2E_CANDIDATES = ("combiner_fixed", "sparse_axial", "combiner_axial_rowmajor", "combiner_logsparse",
                  "sparse_fixed")


# ------------------------------------------------------------------------------------------------------------
# Pure functions of the benchmark


def test_parse_lengths_sorted_unique_and_rejects_bad():
  assert bm.parse_lengths("128,64, 64") == [64, 128]
  for bad in ("", "0,64", "64,x", "-2"):
    with pytest.raises(argparse.ArgumentTypeError):
      bm.parse_lengths(bad)


def test_parse_names_and_bool():
  available = ["dense", "a", "b"]
  assert bm.parse_names(None, available, flag="--ops") == available
  assert bm.parse_names("all", available, flag="--ops") == available
  assert bm.parse_names("b,dense,b", available, flag="--ops") == ["b", "dense"]
  with pytest.raises(cli.UsageError, match=r"--ops: unknown \['zz'\]; available: \['dense', 'a', 'b'\]"):
    bm.parse_names("a,zz", available, flag="--ops")
  with pytest.raises(cli.UsageError, match=r"unknown \['dens'\] \(did you mean 'dense'\?\)"):
    bm.parse_names("dens", available, flag="--ops")
  assert bm.parse_bool("True") is True and bm.parse_bool("0") is False
  with pytest.raises(argparse.ArgumentTypeError):
    bm.parse_bool("maybe")


def test_op_direction_runs_unsupported_direction_in_the_supported_one():
  assert bw.op_direction(True, True, True) == (True, "causal")
  assert bw.op_direction(True, True, False) == (False, "bidirectional")
  assert bw.op_direction(False, True, True) == (False, "bidirectional*")
  assert bw.op_direction(True, False, False) == (True, "causal*")


def test_extrapolation_exponent_dense_quadratic_others_measured_and_clamped():
  assert bm.extrapolation_exponent("dense", [(1024, 1.0), (2048, 2.0)]) == 2.0
  assert bm.extrapolation_exponent("x", [(1024, 1.0)]) == 2.0
  assert bm.extrapolation_exponent("x", [(1024, 1.0), (2048, 2.0 ** 1.5)]) == pytest.approx(1.5)
  assert bm.extrapolation_exponent("x", [(1024, 1.0), (2048, 8.0)]) == 2.0
  assert bm.extrapolation_exponent("x", [(1024, 1.0), (2048, 1.1)]) == 1.0


def test_time_skip_follows_the_dense_numbers_of_design_section_8():
  history = [(4096, 4.3), (8192, 20.0)]
  assert bm.time_skip_reason("dense", 16384, history, 300.0) is None  # ~80 s
  reason = bm.time_skip_reason("dense", 32768, history, 300.0)  # ~320 s
  assert reason.startswith(bm.SKIP_TIME) and "L=8192" in reason
  assert bm.time_skip_reason("dense", 1024, [], 300.0) is None
  # A sub-quadratic op extrapolates at its own growth: 2 s at 8K growing x2.83 per doubling -> ~45 s at 64K.
  fast = [(4096, 2.0 / 2 ** 1.5), (8192, 2.0)]
  assert bm.time_skip_reason("combiner_fixed", 65536, fast, 50.0) is None
  assert bm.time_skip_reason("combiner_fixed", 65536, fast, 40.0).startswith(bm.SKIP_TIME)


def test_memory_skip_reason():
  assert bw.memory_skip_reason(None, 1e9) is None
  assert bw.memory_skip_reason(1e9, 2e9) is None
  assert bw.memory_skip_reason(3 * bw.GB, 2 * bw.GB).startswith(bw.SKIP_MEMORY)


def test_add_ratios_against_dense_of_same_length_na_when_dense_missing_and_growth():
  rows = [
    {"op": "dense", "length": 64, "fwd_ms": 10.0, "fwdbwd_ms": 30.0, "peak_mb": 200.0, "xla_mb": 100.0},
    {"op": "a", "length": 64, "fwd_ms": 2.0, "fwdbwd_ms": 5.0, "peak_mb": 20.0, "xla_mb": 25.0},
    {"op": "dense", "length": 128, "status": "skipped: > budget", "xla_mb": 400.0},
    {"op": "a", "length": 128, "fwd_ms": 4.0, "fwdbwd_ms": 10.0, "peak_mb": 40.0, "xla_mb": 50.0},
    {"op": "a", "length": 512, "fwd_ms": 16.0, "fwdbwd_ms": 40.0, "peak_mb": 160.0, "xla_mb": 200.0},
  ]
  out = {(r["op"], r["length"]): r for r in br.add_ratios(rows)}
  a64 = out["a", 64]
  assert a64["speedup_fwd"] == pytest.approx(5.0) and a64["speedup_fwdbwd"] == pytest.approx(6.0)
  assert a64["mem_ratio"] == pytest.approx(0.1) and a64["xla_mem_ratio"] == pytest.approx(0.25)
  assert out["dense", 64]["speedup_fwdbwd"] == pytest.approx(1.0)
  a128 = out["a", 128]
  assert a128["speedup_fwd"] is None and a128["speedup_fwdbwd"] is None and a128["mem_ratio"] is None
  assert a128["xla_mem_ratio"] == pytest.approx(50.0 / 400.0)  # dense's compile-time figure still exists
  assert a64["growth"] is None and a128["growth"] == pytest.approx(2.0)
  assert out["a", 512]["growth"] == pytest.approx(2.0)  # (40 / 10) over two doublings
  assert out["dense", 128]["growth"] is None
  assert rows[1].get("speedup_fwd") is None  # inputs are not modified


def test_peer_comparisons_ratio_is_peer_time_over_ours():
  rows = [
    {"op": "routing", "length": 64, "status": "ok", "fwd_ms": 2.0, "fwdbwd_ms": 5.0, "peak_mb": 3.0},
    {"op": "peer:rt", "length": 64, "status": "ok", "fwd_ms": 3.0, "fwdbwd_ms": 10.0, "peak_mb": 9.0},
    {"op": "peer:rt", "length": 128, "status": "ok", "fwd_ms": 6.0, "fwdbwd_ms": 20.0},
    {"op": "routing", "length": 128, "status": bw.SKIP_MEMORY},
  ]
  out = br.peer_comparisons(rows, {"rt": ("routing", "yoso"), "absent": ("routing",)})
  assert [(r["op"], r["length"]) for r in out] == [("routing", 64), ("yoso", 64), ("routing", 128),
                                                   ("yoso", 128)]
  assert out[0]["fwd_ratio"] == pytest.approx(1.5) and out[0]["fwdbwd_ratio"] == pytest.approx(2.0)
  assert out[0]["status"] == "ok" and out[0]["peer_peak_mb"] == 9.0
  assert out[1]["fwd_ratio"] is None and "ours not in this run" in out[1]["status"]
  assert out[2]["fwdbwd_ratio"] is None and bw.SKIP_MEMORY in out[2]["status"]


def test_format_value_and_markdown_table():
  assert [br.format_value(v) for v in (None, float("nan"), 3, 1234.5, 12.345, 1.2345, 0.012345, "a|b")] == \
    ["n/a", "n/a", "3", "1234", "12.3", "1.23", "0.0123", "a/b"]
  table = br.markdown_table([{"op": "dense", "length": 64, "fwd_ms": None}],
                            [("op", "op"), ("length", "L"), ("fwd_ms", "fwd ms")])
  assert table.splitlines() == ["| op | L | fwd ms |", "|---|---|---|", "| dense | 64 | n/a |"]


def test_write_report_markdown_and_json(tmp_path):
  rows = [{"op": "dense", "length": 64, "fwd_ms": 1.5, "extra": [1, 2]}]
  paths = br.write_report(rows, [("op", "op"), ("fwd_ms", "fwd ms")], str(tmp_path / "r"), "demo",
                          header={"jax": "X"}, title="Demo", notes=["a note"])
  md = open(paths["markdown"]).read()
  assert md.startswith("# Demo\n") and "- jax: X" in md and "- a note" in md and "| dense | 1.50 |" in md
  data = json.load(open(paths["json"]))
  assert data["header"] == {"jax": "X"} and data["rows"] == rows
  assert data["columns"][1] == ["fwd_ms", "fwd ms"]


def test_median_time_reduces_repeats_to_the_time_budget(monkeypatch):
  clock = {"t": 0.0, "calls": 0}

  def fn():
    clock["calls"] += 1
    clock["t"] += float(clock["calls"])  # call n takes n seconds

  monkeypatch.setattr(bw.time, "perf_counter", lambda: clock["t"])
  assert bw.median_time(fn, 5, 1000.0) == (4.0, 5)  # warm-up 1 s, then 2..6 s
  clock.update(t=0.0, calls=0)
  assert bw.median_time(fn, 5, 2.5) == (2.5, 2)  # warm-up 1 s -> only two repeats fit
  clock.update(t=0.0, calls=0)
  assert bw.median_time(fn, 5, 0.1) == (2.0, 1)  # never fewer than one


def test_peak_rss_sees_a_freed_allocation():
  rss = bw.PeakRSS()
  assert rss.resettable  # Linux
  block = np.ones(80 * 2**20 // 8)  # 80 MB, touched
  del block
  assert rss.increase_mb() >= 70


def test_op_params_are_the_automatic_parameters_and_the_stand_ins_for_the_shape():
  """`bench_inputs(L, shape)` makes the model inputs' stand-ins for the shape the benchmark runs."""
  spec = ops_registry.OpSpec("toy", lambda q, k, v, *, causal: v, params=lambda length: {"n": length},
                             bench_inputs=lambda length, shape: {"heads": shape.heads})
  assert bw.op_params(spec, 16, batch=1, heads=8, head_dim=4) == {"n": 16, "heads": 8}
  plain = ops_registry.OpSpec("plain", lambda q, k, v, *, causal: v,
                              params=lambda length: {"block_size": length // 4})
  assert bw.op_params(plain, 16, batch=1, heads=8) == {"block_size": 4}


def test_measure_all_applies_time_memory_and_kill_skips_in_length_order(monkeypatch, capsys):
  """Orchestration with fake workers: dense grows quadratically, 'big' exceeds memory at 256, 'oom' dies."""
  launched = []

  def fake_run_worker(command, *, timeout_s):
    name, length = command[command.index("--_name") + 1], int(command[command.index("--lengths") + 1])
    launched.append((name, length))
    if name == "oom" and length >= 128:
      return None, "failed: killed (out of memory?)"
    if name == "big" and length >= 256:
      return {"op": name, "length": length, "status": bw.SKIP_MEMORY + " (XLA needs 30 GiB > 20 GiB)"}, ""
    seconds = (length / 64) ** 2 * (1.0 if name == "dense" else 0.1)
    return {"op": name, "length": length, "status": "ok", "fwd_s": seconds / 3, "fwdbwd_s": seconds,
            "fwd_ms": seconds * 333, "fwdbwd_ms": seconds * 1000}, ""

  monkeypatch.setattr(bm, "run_worker", fake_run_worker)
  args = bm.parse_args(["--lengths", "64,128,256,512", "--time_budget_s", "20"])
  rows = bm.measure_all(args, [("op", "dense"), ("op", "big"), ("op", "oom")])
  status = {(r["op"], r["length"]): r["status"] for r in rows}
  # dense: 1 s, 4 s, 16 s measured; 64 s predicted at 512 > 20 s.
  assert [status["dense", n] for n in (64, 128, 256)] == ["ok"] * 3
  assert status["dense", 512].startswith(bm.SKIP_TIME) and "L=256" in status["dense", 512]
  assert status["big", 256].startswith(bw.SKIP_MEMORY)
  assert status["big", 512] == bw.SKIP_MEMORY + " (at L=256 already)"
  assert status["oom", 128] == "failed: killed (out of memory?)"
  assert status["oom", 256].startswith("skipped: killed")
  assert ("dense", 512) not in launched and ("big", 512) not in launched and ("oom", 256) not in launched
  assert [r["length"] for r in rows] == [64] * 3 + [128] * 3 + [256] * 3 + [512] * 3
  assert capsys.readouterr().out.count("[benchmark] ") == 12  # one progress line per measurement


def test_parse_worker_output_takes_the_last_json_line():
  assert bw.parse_worker_output('warning\n{"a": 1}\nnoise\n{"a": 2}\n') == {"a": 2}
  assert bw.parse_worker_output("no json here") is None


def test_parse_args_rejects_unknown_flags_in_ops_mode_and_forwards_them_otherwise():
  with pytest.raises(SystemExit):
    bm.parse_args(["--bogus", "1"])
  args = bm.parse_args(["--mode", "train", "--layers", "6"])
  assert args.extra == ["--layers", "6"] and args.lengths == list(bm.DEFAULT_LENGTHS) and args.causal is True


def test_delegated_modes_import_lazily_and_name_the_missing_file(monkeypatch, tmp_path):
  (tmp_path / "h1_fake_mode.py").write_text("def main(args):\n  return ('ran', args.extra, args.batch)\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(bm._MODE_MODULES, "train", ("h1_fake_mode", "h1_fake_mode.py", "fake"))
  assert bm.main(["--mode", "train", "--batch", "3", "--steps", "2"]) == ("ran", ["--steps", "2"], 3)
  monkeypatch.setitem(bm._MODE_MODULES, "input", ("h1_missing_mode", "scripts/h1_missing_mode.py", "fake"))
  with pytest.raises(SystemExit, match="scripts/h1_missing_mode.py"):
    bm.main(["--mode", "input"])


def test_peer_worker_reports_one_json_line(monkeypatch):
  calls = []

  def factory(length, batch, heads, head_dim, causal, dtype):
    calls.append((length, batch, heads, head_dim, causal, dtype))
    data = np.random.default_rng(0).normal(size=(length, 8))
    return (lambda: data @ data.T), (lambda: (data @ data.T).sum())

  from scripts import benchmark_peers

  monkeypatch.setitem(benchmark_peers.PEERS, "h1_fake", factory)
  args = bm.parse_args(["--_worker", "--_kind", "peer", "--_name", "h1_fake", "--lengths", "32",
                        "--heads", "2",
                        "--repeats", "2", "--causal", "false"])
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert bw.worker_main(args) == 0
  result = json.loads(out.getvalue().strip().splitlines()[-1])
  assert calls == [(32, 1, 2, 64, False, "float32")]
  assert result["op"] == "peer:h1_fake" and result["status"] == "ok" and result["mode"] == "bidirectional"
  assert result["fwd_ms"] > 0 and result["fwdbwd_ms"] > 0 and result["fwdbwd_repeats"] == 2


def test_torch_pair_returns_fwd_and_fwdbwd(monkeypatch):
  """The PyTorch peers' shared (fwd, fwdbwd) builder, with a stand-in torch: both callables run the attention
  (no_grad for fwd; autograd.grad of <out, cot> for fwdbwd)."""
  import types

  from scripts import benchmark_peers

  seen = []
  grad = lambda out, inputs: seen.append(("grad", out))  # noqa: E731
  fake = types.SimpleNamespace(no_grad=contextlib.nullcontext, autograd=types.SimpleNamespace(grad=grad))
  monkeypatch.setitem(sys.modules, "torch", fake)
  attn = lambda q, k, v: seen.append("attn") or np.ones(3)  # noqa: E731
  pair = benchmark_peers._torch_pair(attn, np.ones(3), np.ones(3), np.ones(3), np.full(3, 2.0))
  assert isinstance(pair, tuple) and len(pair) == 2
  fwd, fwdbwd = pair
  fwd()
  fwdbwd()
  assert seen == ["attn", "attn", ("grad", 6.0)]


# ------------------------------------------------------------------------------------------------------------
# Subprocess runs (the real entry points)


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
  # These runs check the plumbing, not the numbers: unoptimised XLA code compiles about twice as fast.
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0")
  return subprocess.run([sys.executable, "-m", "scripts.benchmark", *argv], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_worker_prints_one_parsable_json_line_and_skips_over_memory_budget():
  common = ["--_worker", "--_name", "dense", "--lengths", "32", "--heads", "2", "--head_dim", "8",
            "--repeats", "1"]
  proc = _run(common + ["--memory_budget_gb", "1e-6"])
  assert proc.returncode == 0, proc.stderr
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["op"] == "dense" and result["length"] == 32 and result["mode"] == "causal"
  assert result["status"].startswith(bw.SKIP_MEMORY) and result["xla_mb"] > 0
  assert "fwd_ms" not in result  # skipped before any input was created

  proc = _run(common + ["--_name", "no_such_op"])
  assert proc.returncode == 1
  assert "unknown attention op 'no_such_op'" in json.loads(proc.stdout.strip().splitlines()[-1])["status"]


@pytest.mark.slow
def test_tiny_benchmark_run_writes_table_json_and_plot(tmp_path):
  from attention_core import registry as ops_registry

  others = [n for n in E2E_CANDIDATES if n in ops_registry.names()][:2]
  assert len(others) == 2, f"need two of {E2E_CANDIDATES} registered, have {ops_registry.names()}"
  out_dir = tmp_path / "bench"
  proc = _run(["--ops", ",".join(["dense"] + others), "--lengths", "64,128", "--heads", "2",
               "--head_dim", "16", "--repeats", "2", "--out_dir", str(out_dir)], timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  progress = [line for line in proc.stdout.splitlines() if line.startswith("[benchmark] ") and " L=" in line]
  assert len(progress) == 6

  data = json.load(open(out_dir / "benchmark_ops.json"))
  assert data["header"]["jax"] and data["header"]["device"].startswith("cpu")
  rows = {(r["op"], r["length"]): r for r in data["rows"]}
  assert set(rows) == {(op, n) for op in ["dense"] + others for n in (64, 128)}
  for (op, length), row in rows.items():
    assert row["status"] == "ok", row
    assert row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0 and row["peak_mb"] >= 0 and row["xla_mb"] > 0
    dense = rows["dense", length]
    assert row["speedup_fwdbwd"] == pytest.approx(dense["fwdbwd_ms"] / row["fwdbwd_ms"])
    assert row["speedup_fwd"] == pytest.approx(dense["fwd_ms"] / row["fwd_ms"])
    if length == 128:
      assert row["growth"] == pytest.approx(row["fwdbwd_ms"] / rows[op, 64]["fwdbwd_ms"])
  assert rows["dense", 64]["speedup_fwdbwd"] == pytest.approx(1.0)

  md = (out_dir / "benchmark_ops.md").read_text()
  header_line = "| " + " | ".join(h for _, h in br.OP_COLUMNS) + " |"
  assert header_line in md and "- jax: " in md and "- device: cpu" in md and "- cpus: " in md
  table_rows = [line for line in md.splitlines() if line.startswith("| ") and line != header_line]
  assert len(table_rows) == 6 and all(line.count("|") == len(br.OP_COLUMNS) + 1 for line in table_rows)
  assert (out_dir / "benchmark_ops.png").read_bytes()[:8] == PNG_MAGIC


# ------------------------------------------------------------------------------------------------------------
# Modes and presets


def test_flash_row_is_dropped_with_a_note_where_the_device_has_no_fused_kernel(monkeypatch):
  def fake_run_worker(command, *, timeout_s):
    name, length = command[command.index("--_name") + 1], int(command[command.index("--lengths") + 1])
    assert "--implementation" in command and command[command.index("--implementation") + 1] == "xla"
    if name == bw.FLASH:
      return {"op": name, "length": length, "status": f"{bw.SKIP_NO_FLASH} on cpu"}, ""
    return {"op": name, "length": length, "status": "ok", "fwd_s": 1.0, "fwdbwd_s": 2.0}, ""

  monkeypatch.setattr(bm, "run_worker", fake_run_worker)
  args = bm.parse_args(["--lengths", "64,128", "--implementation", "xla"])
  notes = []
  rows = bm.measure_all(args, [(bw.FLASH, bw.FLASH), ("op", "dense")], notes)
  assert [(r["op"], r["length"]) for r in rows] == [("dense", 64), ("dense", 128)]
  assert notes == [f"flash (the backend's fused attention kernel): {bw.SKIP_NO_FLASH} on cpu"]
  assert [h for k, h in br.op_columns("flash") if k == "mem_ratio"] == ["mem/flash"]


@pytest.mark.all_platforms
def test_flash_reference_per_backend_and_implementation_keyword():
  assert bw.flash_attention_fn("cpu", causal=True, dtype="bfloat16", length=256, head_dim=64)[0] is None
  fn, reason = bw.flash_attention_fn("gpu", causal=True, dtype="float32", length=256, head_dim=64)
  assert fn is None and "bfloat16" in reason
  assert bw.flash_attention_fn("gpu", causal=True, dtype="bfloat16", length=256, head_dim=64)[0] is not None
  fn, _ = bw.flash_attention_fn("tpu", causal=True, dtype="bfloat16", length=256, head_dim=64)
  shape = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(shape, shape, shape)
  assert "tpu_custom_call" in exported.mlir_module()
  assert ops_registry.takes_implementation(ops_registry.get("dense"))  # as registered, not from a signature
  assert not ops_registry.takes_implementation(ops_registry.get("dense_xla"))


def test_train_presets_fix_the_ablation_shapes():
  from scripts import benchmark_train as bt

  args = bm.parse_args(["--mode", "train", "--preset", "imagenet64", "--lengths", "64"])
  opts = bt.parse(args.extra)
  bt.apply_preset(args, opts)
  assert (args.lengths, args.batch, args.heads, args.dtype) == ([12288], 8, 8, "bfloat16")
  assert (opts.layers, opts.features, opts.mlp_dim) == (6, 512, 2048)
  assert bt.PRESETS["cifar10"]["length"] == 3072 and bt.PRESETS["cifar10"]["batch"] == 32


def test_input_mode_takes_the_shared_repeats_flag_and_its_own_default():
  from scripts import benchmark_input

  args = bm.parse_args(["--mode", "input", "--repeats", "4", "--seconds", "1"])
  assert benchmark_input.parse(args.extra, args.repeats).repeats == 4
  args = bm.parse_args(["--mode", "input"])
  assert benchmark_input.parse(args.extra, args.repeats).repeats == benchmark_input.INPUT_REPEATS
  assert bm.parse_args([]).repeats == 3 and bm.parse_args(["--mode", "train"]).repeats == 3


@pytest.mark.parametrize("mode,flag", [("input", "--datasets"), ("train", "--preset")])
def test_mode_help_shows_the_modes_own_flags(mode, flag, capsys):
  with pytest.raises(SystemExit) as exit_info:
    bm.parse_args(["--mode", mode, "--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  assert "--lengths" in out and flag in out
  assert out.count("show the traceback of a user error") == 1  # the shared --debug, listed once


def test_memory_budget_defaults_to_this_machines_memory():
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  assert bw.memory_budget_bytes(bm.parse_args([])) == pytest.approx(0.85 * ram)
  assert bw.memory_budget_bytes(bm.parse_args(["--memory_budget_gb", "2"])) == 2 * bw.GB
  with pytest.raises(SystemExit):
    bm.parse_args(["--memory_budget_gb", "0"])


@pytest.mark.slow
def test_train_mode_exits_zero_on_success(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "scripts.benchmark", "--mode", "train", "--ops", "dense",
                         "--lengths", "16", "--batch", "2", "--heads", "2", "--head_dim", "8",
                         "--layers", "1", "--features", "16", "--mlp_dim", "16", "--repeats", "1",
                         "--out_dir", str(tmp_path)],
                        capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert (tmp_path / "benchmark_train.md").exists()


def test_input_mode_unknown_dataset_is_one_line_and_exit_2(tmp_path):
  proc = _run(["--mode", "input", "--datasets", "cifar10,nope", "--out_dir", str(tmp_path)])
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert line.startswith("ERROR: --datasets: unknown ['nope']; allowed: ") and "listops_synthetic" in line


BAD_MODE_FLAGS = [
    (["--ops", "nope", "--lengths", "256"],
     "--ops: unknown ['nope'] (did you mean 'none'?); available: ['dense', "),
    (["--ops", "dense,combiner_fixd", "--lengths", "256"], "(did you mean 'combiner_fixed'?)"),
    (["--ops", "dense", "--peers", "nope", "--lengths", "256"], "--peers: unknown ['nope']"),
    (["--mode", "train", "--ops", "nope", "--lengths", "256"], "--ops: unknown ['nope']"),
    (["--mode", "train", "--preset", "bogus"], "--preset: invalid choice: 'bogus'"),
    (["--mode", "train", "--layers", "abc"], "--layers: invalid int value: 'abc'"),
    (["--mode", "input", "--rounds", "x"], "--rounds: invalid int value: 'x'"),
]


@pytest.mark.parametrize("argv,name", BAD_MODE_FLAGS, ids=[" ".join(a) for a, _ in BAD_MODE_FLAGS])
def test_bad_flags_of_every_mode_are_one_line_and_exit_2(argv, name, tmp_path):
  """Refused before any worker starts or anything is written; the modes' own flags too."""
  assert_one_line(_run([*argv, "--out_dir", str(tmp_path / "out")]), name)
  assert not (tmp_path / "out").exists()


BAD_OTHER_FLAGS = [
    (["scripts.benchmark_decode", "--layers", "x"], "--layers: invalid int value"),
    (["scripts.seq_parallel", "--length", "x"], "--length: invalid int value"),
    (["scripts.seq_parallel", "--devices", "2", "--ops", "dense,nope"], "--ops: 'nope' is no registered op"),
    (["scripts.seq_parallel", "--devices", "2", "--ops", "local"],
     "--ops: 'local' has no sequence-parallel form; ops with one: ["),
]


@pytest.mark.parametrize("argv,name", BAD_OTHER_FLAGS, ids=[" ".join(a) for a, _ in BAD_OTHER_FLAGS])
def test_bad_flags_of_the_other_measuring_scripts_are_one_line_and_exit_2(argv, name):
  proc = subprocess.run([sys.executable, "-m", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                        timeout=120)
  assert_one_line(proc, name)
