"""scripts/compile_tpu.py as a real subprocess: libtpu compiles the default config's whole train step for a
one-chip v5e slice on this CPU and the table is printed; a config that cannot fit exits 2 with one line, and
so does an unknown --topology, and a bad flag of scripts/tpu_memory.py and tpu_structure.py. Skipped where
libtpu is not installed."""

import os
import subprocess
import sys

import pytest

import scripts.compile_tpu  # noqa: F401  (libtpu for this process, as for the script's own)
from tests.training.test_usage_errors import assert_one_line

pytest.importorskip("libtpu")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def compile_tpu(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "scripts.compile_tpu", *argv], cwd=ROOT, text=True,
                        capture_output=True, timeout=300, check=False)


BAD_TPU_TOOL_FLAGS = [
    (["scripts.tpu_memory", "--topology", "v9"], "--topology 'v9' is not one of ['v4', "),
    (["scripts.tpu_memory", "--lengths", "1k"], "--lengths must be comma-separated integers, got '1k'"),
    (["scripts.tpu_memory", "--ops", "splash,nope"], "--ops 'nope' is not one of ['splash', "),
    (["scripts.tpu_structure", "--heads", "0"], "--heads must be at least 1, got 0"),
    (["scripts.tpu_structure", "--cotangent", "x"], "--cotangent: invalid choice: 'x'"),
    (["scripts.tpu_structure", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("argv,name", BAD_TPU_TOOL_FLAGS, ids=[" ".join(a) for a, _ in BAD_TPU_TOOL_FLAGS])
def test_bad_flags_of_the_tpu_tools_are_one_line_and_exit_2(argv, name):
  """Refused before anything is compiled."""
  proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, text=True, capture_output=True, timeout=120)
  assert_one_line(proc, name)
  assert proc.stdout == ""


def lines(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.strip()]


def test_smoke_config_compiles_and_prints_the_table():
  out = compile_tpu("--config", "configs/default.py:smoke", "--topology", "v5e-1")
  assert out.returncode == 0, out.stderr
  head = "configs/default.py:smoke on v5e-1 (1 chip, topology v5e:1x1, mesh data=1 fsdp=1 seq=1 model=1"
  assert head in out.stdout
  for row in ("HBM: arguments", "HBM: temporaries", "HBM: outputs", "step FLOPs", "step bytes accessed",
              "StableHLO operations", "lowered and compiled here in"):
    assert row in out.stdout
  assert "of 16 GiB" in out.stdout and "roofline step time" in out.stdout
  assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_stacked_blocks_compile_and_their_program_does_not_grow_with_depth():
  """The Table 4 image model's blocks, stacked (scan_layers), at 2 and 8 layers: the TPU compiler compiles
  the step, whose StableHLO program has the same size at both depths (within 5%)."""
  ops = []
  for layers in (2, 8):
    out = compile_tpu("--config", f"configs/cifar10.py:main,smoke,layers={layers}", "--topology", "v5e-1")
    assert out.returncode == 0, out.stderr
    (row,) = [line for line in out.stdout.splitlines() if "StableHLO operations" in line]
    ops.append(int(row.split()[2].replace(",", "")))
  assert ops[1] <= 1.05 * ops[0], ops


@pytest.mark.slow
def test_a_scanned_step_counts_every_layer():
  """XLA's cost analysis counts a loop's body once, so a scanned step's FLOPs and bytes cover one of its
  layers. Counted by a second compile (two layers per loop iteration), they equal the same model's unrolled:
  the FLOPs to 1%, the bytes (besides the loop's own slicing) to 10%. Five layers: the loop's remainder,
  run after it, is counted too. An unscanned step is left as compiled."""
  from configs import cifar10
  from scripts import compile_tpu as ct

  one_chip = ct.Slice(ct.GENERATIONS["v5e"], 1)
  scanned = cifar10.get_config("main,smoke,layers=5")
  raw = ct.compile_step(scanned, one_chip)
  assert raw.status == "fits" and raw.scanned_layers == 5
  counted = ct.every_layer_counted(scanned, raw)
  unrolled_config = cifar10.get_config("main,smoke,layers=5,scan_layers=False")
  unrolled = ct.compile_step(unrolled_config, one_chip)
  assert unrolled.scanned_layers == 0 and ct.every_layer_counted(unrolled_config, unrolled) is unrolled
  assert raw.flops < 0.5 * unrolled.flops  # what the loop hides
  assert counted.flops == pytest.approx(unrolled.flops, rel=0.01)
  assert counted.bytes_accessed == pytest.approx(unrolled.bytes_accessed, rel=0.1)
  assert counted.memory == raw.memory and counted.compile_s > raw.compile_s


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/transformer_xl.py:smoke", "configs/hibert.py:pretrain,smoke"])
def test_configs_with_other_batch_layouts_compile(config):
  """A segment-recurrence config's step also reads and returns the memory (and the batch's reset rows);
  HIBERT's batches are documents of sentences."""
  out = compile_tpu("--config", config, "--topology", "v5e-1")
  assert out.returncode == 0, out.stderr
  assert "HBM: total" in out.stdout and "Traceback" not in out.stderr


def test_the_docs_table_covers_every_config_file():
  """Every configs/ file that defines an experiment (a get_config) has its paper variants in the docs/tpu.md
  table, so a new config is checked for TPU without an edit of the test, and each has a generation where
  its train step compiles and fits (the row names the smallest slice)."""
  import ast

  from scripts import compile_tpu as ct

  listed = {label.partition(":")[0] for label in ct.DOC_CONFIGS}
  configs = os.path.join(ROOT, "configs")
  for name in sorted(os.listdir(configs)):
    if name.endswith(".py"):
      with open(os.path.join(configs, name)) as f:
        tree = ast.parse(f.read())
      if any(isinstance(n, ast.FunctionDef) and n.name == "get_config" for n in tree.body):
        assert f"configs/{name}" in listed, f"configs/{name} is not in scripts/compile_tpu.py DOC_CONFIGS"
  with open(os.path.join(ROOT, "docs", "tpu.md")) as f:
    table = f.read()
  for label in ct.DOC_CONFIGS:
    for gen in ct.GENERATIONS:
      assert f"| `{label}` | {gen} |" in table, (label, gen)
    fits = [gen for gen in ct.GENERATIONS if f"| `{label}` | {gen} | yes |" in table]
    assert fits, f"{label}: the table names no TPU slice it compiles and fits on"


def test_a_config_that_cannot_fit_exits_2_with_one_line():
  out = compile_tpu("--config", "configs/default.py:smoke", "--topology", "v5e-1",
                    "--config.train.batch_size=4194304")
  assert out.returncode == 2
  (line,) = lines(out.stderr)
  assert line.startswith("configs/default.py:smoke does not fit on v5e-1: ")


@pytest.mark.slow
def test_a_batch_the_chips_cannot_split_searches_with_the_seq_axis():
  """v4's smallest slice has 4 chips, which a global batch of 3 cannot split over: the generation search
  gives the chips to the seq axis and names that mesh; a named slice keeps the config's mesh and says how to
  split."""
  args = ("--config", "configs/default.py:smoke", "--config.train.batch_size=3")
  out = compile_tpu(*args, "--topology", "v4")
  assert out.returncode == 0, out.stderr
  head = "on v4-8 (4 chips, topology v4:2x2x1, mesh data=1 fsdp=1 seq=4 model=1, global batch 3)"
  assert head in out.stdout
  row = compile_tpu(*args, "--topology", "v4", "--markdown")
  assert row.returncode == 0 and "| v4-8 (`mesh.seq=4`) |" in row.stdout, row.stderr
  named = compile_tpu(*args, "--topology", "v4-8")
  assert named.returncode == 2 and named.stdout == ""
  (line,) = lines(named.stderr)
  assert "global batch 3 is not divisible by the 4-way" in line and "--config.mesh.seq=N" in line


def test_a_bad_topology_exits_2_with_one_line():
  out = compile_tpu("--config", "configs/default.py:smoke", "--topology", "v5e-3")
  assert out.returncode == 2 and out.stdout == ""
  (line,) = lines(out.stderr)
  assert "--topology='v5e-3'" in line and "v4-32" in line and "v5e-16" in line and "v5p-128" in line


def test_list_topologies():
  out = compile_tpu("--list_topologies")
  assert out.returncode == 0
  assert "v4-8, v4-16, v4-32" in out.stdout and "v5e-1, v5e-4" in out.stdout and "95 GiB" in out.stdout


def test_accelerator_types_map_to_topologies():
  from scripts import compile_tpu as ct

  def topology(name):
    gen, (chips,) = ct.parse_topology(name)
    return ct.Slice(gen, chips).topology_name, ct.Slice(gen, chips).name

  assert topology("v4-32") == ("v4:2x2x4", "v4-32")  # v4 and v5p names count TensorCores: 16 chips
  assert topology("v5p-128") == ("v5p:4x4x4", "v5p-128")
  assert topology("v5litepod-16") == ("v5e:4x4", "v5e-16") and topology("v6e-8") == ("v6e:2x4", "v6e-8")
  gen, sizes = ct.parse_topology("v5e")
  assert gen.name == "v5e" and sizes[0] == 1 and sizes == sorted(sizes)
  for bad in ("v4-9", "v5e-3", "v7-8", "tpu", "v5p-x"):
    with pytest.raises(ct.BadTopology, match="--topology"):
      ct.parse_topology(bad)


@pytest.mark.slow
def test_tpu_memory_reports_temporaries_against_splash():
  """scripts/tpu_memory.py: one short length, Splash and Combiner-Fixed, ratios against Splash in the op
  contract's layout; a bad --topology is one line and exit 2."""
  run = lambda *a: subprocess.run([sys.executable, "-m", "scripts.tpu_memory", *a], cwd=ROOT, text=True,  # noqa: E731
                                  capture_output=True, timeout=600)
  done = run("--lengths", "1024", "--ops", "splash_contract,combiner_fixed")
  assert done.returncode == 0, done.stderr[-2000:]
  rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| combiner_fixed")]
  assert len(rows) == 1 and float(rows[0][2]) >= 0
  bad = run("--topology", "v9")
  assert bad.returncode == 2 and "--topology" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_docs_table_measures_only_the_rows_it_lacks(tmp_path):
  """`--docs` keeps every measured row of an existing table and measures the missing ones: here two at once
  (the default config on v5e and v6e, each searched over the generation's slices the global batch allows)."""
  from scripts import compile_tpu as ct

  rows = [f"| `{label}` | {gen} | yes | 0.01 of 1 GiB | {gen}-x | 1 ms (kept) |"
          for label in ct.DOC_CONFIGS for gen in ct.GENERATIONS]
  missing = [rows.index(f"| `configs/default.py` | {gen} | yes | 0.01 of 1 GiB | {gen}-x | 1 ms (kept) |")
             for gen in ("v5e", "v6e")]
  for i in missing:
    rows[i] = rows[i].split(" yes ")[0] + f" {ct.NOT_MEASURED} | | | |"
  path = tmp_path / "tpu.md"
  path.write_text(ct.DOC_INTRO + ct.MARKDOWN_HEADER + "\n" + "\n".join(rows) + "\n")
  out = compile_tpu("--docs", str(path), "--docs_jobs", "2")  # the two rows at once
  assert out.returncode == 0, out.stderr
  table = [line for line in path.read_text().splitlines() if line.startswith("| `")]
  assert len(table) == len(rows)
  kept = [i for i in range(len(rows)) if i not in missing]
  assert [table[i] for i in kept] == [rows[i] for i in kept]
  for i, gen in zip(missing, ("v5e", "v6e"), strict=True):
    assert table[i].startswith(f"| `configs/default.py` | {gen} | yes | ") and f"{gen}-1" in table[i]
  bad = compile_tpu("--docs", str(path), "--docs_jobs", "0")
  assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["ERROR: --docs_jobs must be >= 1, got 0"]
