"""What the Combiner plans compile to on a TPU, measured by the real compiler: few device operations, little
memory.

Each plan's forward+backward (jax.grad of the sum of its output; bfloat16, 8 heads of 128, block and row
sizes sqrt(L), implementation "auto") is compiled ahead of time with libtpu for one v5e chip
(`scripts.tpu_structure`) and its program measured: the device operations it executes
(`attention_core.hlo.device_ops`, each an HBM round trip on a TPU) stay within 1.5x those of dense
attention (Splash) at the same shape, and its HBM temporaries within the bytes of q + k + v. One causal
case per plan at 2048 tokens here; the table at 4K and 16K in both directions (docs/benchmarks.md) comes
from `python -m scripts.tpu_structure`. Skipped where libtpu is not installed
(requirements-tpu-compile.txt).
"""

from __future__ import annotations

import functools

import pytest

from scripts import compile_tpu  # noqa: F401  (libtpu for this process: scripts/compile_tpu.py)

pytest.importorskip("libtpu")

from scripts import tpu_structure  # noqa: E402

LENGTH, HEADS = 2048, 8
OPS_BOUND = 1.5  # x dense attention's device ops
PLANS = tuple(n for n in tpu_structure.COMBINER)


@functools.cache
def _dense() -> dict[str, float]:
  return tpu_structure.measure("dense", LENGTH, True, tpu_structure.device("v5e"), HEADS)


@pytest.mark.parametrize("name", PLANS)
def test_plan_compiles_to_few_device_ops_and_little_memory(name):
  got = tpu_structure.measure(name, LENGTH, True, tpu_structure.device("v5e"), HEADS)
  dense = _dense()
  assert got["custom_calls"] >= 1, f"{name}: no kernel in the TPU program"
  assert got["ops"] <= OPS_BOUND * dense["ops"], (name, got, dense)
  assert got["temp_bytes"] <= tpu_structure.qkv_bytes(LENGTH, HEADS), (name, got)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_routed_plan_compiles_to_its_kernels(causal):
  """The routed plan: its nearest-centroid kernel (`routing.nearest_kernel`), then Combiner-Fixed's kernels
  over the rank order (bidirectional) or its own two (`combiner.routed_kernels`, causal), within the plans'
  1.5x; temporaries within q + k + v."""
  got = tpu_structure.measure("combiner_routed", LENGTH, causal, tpu_structure.device("v5e"), HEADS)
  dense = _dense()
  # five kernels either way: the nearest centroids, then two passes forward and two backward
  assert got["custom_calls"] >= 5, f"combiner_routed: its kernels are not in the TPU program: {got}"
  assert got["ops"] <= OPS_BOUND * dense["ops"], (got, dense)
  assert got["temp_bytes"] <= tpu_structure.qkv_bytes(LENGTH, HEADS), got


@pytest.mark.slow  # ~1 min of libtpu compiles
@pytest.mark.parametrize("name", ["combiner_mixture", "combiner_axial_vertical", "combiner_logsparse"])
def test_paper_heads_stay_within_the_bounds(name):
  """12 heads of 64, as the paper's ImageNet-64 and 8K-token models have: the kernels read them folded into
  384-lane blocks (`combiner.frames.Frame.layout`). As blocks [6, 64] of their own axis, padded to (8, 128)
  tiles, XLA copied every frame array into that layout, and the mixture's temporaries exceeded q + k + v."""
  chip = tpu_structure.device("v5e")
  got = tpu_structure.measure(name, LENGTH, True, chip, 12, head_dim=64)
  dense = tpu_structure.measure("dense", LENGTH, True, chip, 12, head_dim=64)
  assert got["ops"] <= OPS_BOUND * dense["ops"], (name, got, dense)
  assert got["temp_bytes"] <= tpu_structure.qkv_bytes(LENGTH, 12, 64), (name, got)


@pytest.mark.slow  # ~25 s of libtpu compile
def test_selected_spans_fit_vmem_at_16k():
  """Combiner-Fixed with selected spans at 16K tokens (128 blocks): the keys' backward reads a head's whole
  table of choices, which fits VMEM only with the queries on the lanes (slots on the lanes padded 4 to 128:
  132 MiB of VMEM for 128 on a v5e)."""
  got = tpu_structure.measure("combiner_fixed_select", 16384, True, tpu_structure.device("v5e"), 16)
  assert got["custom_calls"] >= 1 and got["temp_bytes"] <= tpu_structure.qkv_bytes(16384, 16), got


@pytest.mark.slow  # ~40 s of libtpu compile
@pytest.mark.parametrize("name", ["combiner_mixture_joint", "combiner_logsparse"])
def test_layer_backward_temporaries_stay_within_qkv_at_16k(name):
  """At 16K tokens, as a layer's backward runs in training (the output's cotangent an argument): the joint
  mixture never holds its vertical and horizontal per-position summaries together (its row pass's backward
  runs in two parts), and bidirectional logsparse reads the reversed sequence in its kernels (no reversed
  copies of q, k, v, do and o). The bound allows the log-sum-exp rows beside the three arrays' worth (dense
  attention itself takes 1.01x here)."""
  got = tpu_structure.measure(name, 16384, False, tpu_structure.device("v5e"), 16, cotangent="input")
  assert got["custom_calls"] >= 1 and got["temp_bytes"] <= 1.01 * tpu_structure.qkv_bytes(16384, 16), got


def test_breakdown_accounts_for_every_device_op(capsys):
  """`--breakdown` lists each row's device ops by opcode and origin: they sum to the row's count, the plan's
  kernels are named, and with --markdown the lists follow the table, whose rows stay contiguous."""
  argv = ["--ops", "combiner_fixed", "--lengths", "1024", "--directions", "causal", "--heads", "8",
          "--breakdown"]
  assert tpu_structure.main(argv) == 0
  lines = capsys.readouterr().out.splitlines()[1:]  # the header first
  rows = [i for i, line in enumerate(lines) if not line.startswith(" ")]
  assert [lines[i].split(" | ")[0] for i in rows] == ["dense", "combiner_fixed"]
  for start, end in zip(rows, rows[1:] + [len(lines)], strict=True):
    listed = [line.split() for line in lines[start + 1:end]]
    assert sum(int(parts[0]) for parts in listed) == int(lines[start].split(" | ")[4]) > 0
  fixed = lines[rows[1] + 1:]
  assert any(line.split()[1] == "custom-call" and line.endswith("/pallas_call") for line in fixed), fixed

  assert tpu_structure.main(argv + ["--markdown"]) == 0
  out = capsys.readouterr().out
  table, listing = out.split("\n```\n", 1)
  assert all(line.startswith("|") for line in table.splitlines()) and len(table.splitlines()) == 4
  assert listing.startswith("dense v5e 1024 causal: ") and "\ncombiner_fixed v5e 1024 causal: " in listing
