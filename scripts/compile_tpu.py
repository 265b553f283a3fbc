r"""Compiles a config's whole train step for a Cloud TPU slice on this machine, before paying for the slice.

    python -m scripts.compile_tpu --config configs/c4.py --topology v5e-16
    python -m scripts.compile_tpu --config configs/cifar10.py:attention=combiner_fixed --topology v4-32 \
        --config.train.batch_size=64
    python -m scripts.compile_tpu --config configs/wiki40b.py --topology v5p     # the smallest v5p slice
    python -m scripts.compile_tpu --list_topologies
    python -m scripts.compile_tpu --docs docs/tpu.md --docs_jobs 4               # the table of docs/tpu.md

libtpu runs the real TPU compiler ahead of time on the host's CPU (`jax.experimental.topologies`), so no TPU
is needed. The step is the one train.py runs: `Experiment` (training/) builds the model, optimizer, state
shardings and mesh (`make_mesh` over the slice's devices) and its jitted, donated step is lowered with
abstract arguments: the sharded state and a global batch of `config.train.batch_size` examples, shapes only
(no data is read). Printed per chip: the HBM the step needs (arguments, temporaries, outputs, generated code)
against the chip's, the step's FLOPs and bytes accessed (XLA's cost analysis), and a roofline estimate of the
step time, max(FLOPs / peak bf16 FLOP/s, bytes / HBM bandwidth), from the per-generation figures of
runtime/tpu_generations.py. The estimate is a lower bound: XLA's cost analysis counts a loop body once and
does not see inside Pallas kernels.

--topology takes a Cloud TPU accelerator type (v4-32, v5e-16 = v5litepod-16, v5p-128, v6e-8: v4 and v5p
names count TensorCores, two per chip, v5e and v6e names count chips), or a generation alone (v5e): then the
smallest slice of it that the step fits is searched. `--num_slices N` compiles for N such slices (multislice,
the data-parallel axes span them). Exit status: 0 when the step compiles and fits, 2 when it does not fit in
HBM or a flag is wrong (one line naming it), 1 when the compiler fails (one line: the config, the topology and
the compiler's first error line). scripts/tpu.py runs this check before it creates a slice.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

# libtpu, the TPU compiler, is for the processes that compile for TPUs, and importing this module is how a
# script or test says it is one. libtpu is installed apart from the environment's packages
# (`pip install --target <venv>/tpu-compiler -r requirements-tpu-compile.txt`; LSA_TPU_COMPILER names another
# directory), so that JAX elsewhere never finds it: a CPU run would otherwise initialise it at every start
# (errors about TPU_WORKER_HOSTNAMES and host bounds) and processes would contend for its lock file. This puts
# that directory on sys.path (a libtpu among the packages is used as it is) and sets libtpu's environment for
# compiling only: the host's devices are never used, every process loads its own libtpu without the lock,
# and libtpu asks no metadata server what TPU it is on.
TPU_COMPILER_ENV = "LSA_TPU_COMPILER"
TPU_COMPILER = os.environ.get(TPU_COMPILER_ENV) or os.path.join(sys.prefix, "tpu-compiler")


def _use_libtpu() -> None:
  if os.path.isdir(TPU_COMPILER) and TPU_COMPILER not in sys.path:
    sys.path.append(TPU_COMPILER)
  for name, value in (("JAX_PLATFORMS", "cpu"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
                      ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_HOST_BOUNDS", "1,1,1"),
                      ("TPU_SKIP_MDS_QUERY", "1")):
    os.environ.setdefault(name, value)
  if "jax" in sys.modules:  # JAX read JAX_PLATFORMS when it was imported: its devices must stay the CPU's
    import jax

    if not jax.config.jax_platforms:
      jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


_use_libtpu()

if __package__ in (None, ""):  # run as a file (scripts/tpu.py does): the repository root is the import root
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime import tpu_generations  # noqa: E402
from runtime.tpu_generations import GENERATIONS as ALL_GENERATIONS  # noqa: E402
from runtime.tpu_generations import Generation, GiB  # noqa: E402

GENERATIONS = {name: g for name, g in ALL_GENERATIONS.items() if g.compile_check}  # those with slice shapes


class BadTopology(ValueError):
  """--topology names no slice this script knows."""


@dataclasses.dataclass(frozen=True)
class Slice:
  gen: Generation
  chips: int
  num_slices: int = 1

  @property
  def name(self) -> str:
    return self.gen.slice_name(self.chips) + (f" x {self.num_slices} slices" if self.num_slices > 1 else "")

  @property
  def topology_name(self) -> str:
    return f"{self.gen.name}:" + "x".join(map(str, self.gen.shapes[self.chips]))


def topology_names() -> list[str]:
  return [g.slice_name(chips) for g in GENERATIONS.values() for chips in g.shapes]


def allowed() -> str:
  return (", ".join(topology_names()) + " (v5litepod-N = v5e-N), or a generation alone ("
          + ", ".join(GENERATIONS) + ") for its smallest slice that fits")


def parse_topology(name: str, num_slices: int = 1) -> tuple[Generation, list[int]]:
  """`v5e-16` -> (v5e, [16]); `v5e` -> (v5e, every slice size, smallest first)."""
  gen_name, _, count = name.strip().lower().partition("-")
  gen = tpu_generations.find(gen_name)
  if gen is None or not gen.compile_check:
    raise BadTopology(f"--topology={name!r} is not one of {allowed()}")
  if num_slices < 1:
    raise BadTopology(f"--num_slices={num_slices} must be at least 1")
  if not count:
    return gen, sorted(gen.shapes)
  n = int(count) if count.isdigit() else 0
  chips = n // 2 if gen.counts_cores else n
  if chips not in gen.shapes or (gen.counts_cores and n % 2):
    raise BadTopology(f"--topology={name!r} is not one of {allowed()}")
  return gen, [chips]


def devices(sl: Slice) -> list[Any]:
  """The slice's compile-only TPU devices (libtpu's topology description), all slices together."""
  from jax.experimental import topologies

  kw: dict[str, Any] = {"chip_config_name": "megacore" if sl.gen.megacore else "default"}
  if sl.chips == 1:
    kw["chips_per_host_bounds"] = (1, 1, 1)
  if sl.num_slices > 1:
    kw["num_slices"] = sl.num_slices
  return list(topologies.get_topology_desc(platform="tpu", topology_name=sl.topology_name, **kw).devices)


# -----------------------------------------------------------------------------------------------------------
# Compiling the train step


@dataclasses.dataclass
class Result:
  """What one compile says; `status` is "fits", "too big" (HBM or mesh) or "fails" (the compiler)."""

  slice: Slice
  status: str
  message: str = ""
  mesh: dict[str, int] = dataclasses.field(default_factory=dict)
  memory: dict[str, int] = dataclasses.field(default_factory=dict)
  flops: float = 0.0
  bytes_accessed: float = 0.0
  program_ops: int = 0  # operations of the step's StableHLO program (`stablehlo_ops`)
  compile_s: float = 0.0  # seconds this host took to lower and compile the step
  scanned_layers: int = 0  # the layers of the step's loop over stacked blocks (models/stacked.py); 0: none
  uncounted_layers: int = 0  # of those, the ones flops and bytes_accessed leave out (`every_layer_counted`)

  @property
  def total(self) -> int:
    return self.memory.get("total", 0)

  @property
  def step_s(self) -> float:
    return max(self.flops / self.slice.gen.peak_flops, self.bytes_accessed / self.slice.gen.hbm_bandwidth)


def batch_shapes(task: str, batch: int, length: int, sharding: Any, sentences: int = 0) -> dict[str, Any]:
  """The global training batch as ShapeDtypeStructs, in the layouts of `data` (its module docstring; HIBERT's
  documents of `sentences` sentences of `length` tokens: data/cnn_dailymail.py)."""
  import jax
  import jax.numpy as jnp

  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  out = {"valid": spec((batch,), jnp.bool_)}
  if task.startswith("hibert_"):
    return {**out, "inputs": spec((batch, sentences, length), jnp.int32),
            "mask": spec((batch, sentences, length), jnp.bool_),
            "sentence_mask": spec((batch, sentences), jnp.bool_),
            "labels": spec((batch, sentences), jnp.int32)}
  tokens, mask = spec((batch, length), jnp.int32), spec((batch, length), jnp.bool_)
  if task == "retrieval":
    return {**out, "inputs1": tokens, "mask1": mask, "inputs2": tokens, "mask2": mask,
            "label": spec((batch,), jnp.int32)}
  out.update(inputs=tokens, mask=mask)
  if task == "classify":
    return {**out, "label": spec((batch,), jnp.int32)}
  out.update(weights=spec((batch, length), jnp.float32), segment_ids=tokens)
  if task == "mlm":
    out["targets"] = tokens
  return out


_OPERATION = re.compile(r'^\s*(?:%[^=]*=\s*)?"?(?:[a-z_]+\.[a-z_.]+|return\b)')  # `%x = stablehlo.add`


def stablehlo_ops(text: str) -> int:
  """The operations of a lowered program (`jax.jit(f).lower(...).as_text()`, StableHLO in MLIR's text
  form): one per line that starts with one, whatever its dialect (stablehlo, func, sdy, ...); a loop body
  counts once."""
  return sum(1 for line in text.splitlines() if _OPERATION.match(line))


def first_line(e: BaseException) -> str:
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return (lines[0] if lines else type(e).__name__)[:400]


def compile_step(config: Any, sl: Slice) -> Result:
  """AOT-compiles train.py's step for `sl` (one `unservable` passes); never raises for a config that does not
  fit or compile."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from models import stacked
  from training.experiment import Experiment

  try:
    exp = Experiment(config, devices=devices(sl))
  except ValueError as e:  # make_mesh: the mesh does not fit this many chips, or cannot be built
    return Result(sl, "too big" if "does not fit" in str(e) else "fails", first_line(e))
  mesh = {k: int(v) for k, v in exp.mesh.shape.items()}
  batch = int(config.train.batch_size)  # `search` passes only slices whose data x fsdp axes divide it
  state = exp.abstract_state()
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(exp.mesh, P()))
  shapes = batch_shapes(exp.task, batch, int(exp.info.seq_len), exp.batch_sharding,
                        int(exp.info.max_segments or 0))
  args = (state["params"], state["rest"], state["opt_state"], exp.abstract_rng_state(), step, shapes)
  if state.get("memory") is not None:  # segment recurrence: the step also reads and returns the memory
    shapes["reset"] = jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=shapes["valid"].sharding)
    args += (state["memory"],)
  start = time.perf_counter()
  try:
    lowered = exp.jitted_train_step().lower(*args)
    compiled = lowered.compile()
  except Exception as e:  # the compiler's error (XlaRuntimeError, Mosaic, ...), reported in one line
    line = first_line(e)
    fits = not any(s in line for s in ("RESOURCE_EXHAUSTED", "Ran out of memory"))
    return Result(sl, "fails" if fits else "too big", line, mesh)
  m = compiled.memory_analysis()
  memory = {"arguments": int(m.argument_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
            "outputs": int(m.output_size_in_bytes - m.alias_size_in_bytes),
            "code": int(m.generated_code_size_in_bytes)}
  memory["total"] = sum(memory.values())
  cost = compiled.cost_analysis()
  cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
  depth = stacked.depths(exp.abstract_model)
  layers = max(depth) if len(depth) == 1 else 0
  r = Result(sl, "fits", "", mesh, memory, float(cost.get("flops", 0.0)),
             float(cost.get("bytes accessed", 0.0)), stablehlo_ops(lowered.as_text()),
             time.perf_counter() - start, scanned_layers=layers,
             uncounted_layers=layers - _counted(layers, int(config.model.get("scan_unroll", 1))))
  if r.total > sl.gen.hbm_bytes:
    r.status = "too big"
    r.message = (f"needs {r.total / GiB:.2f} GiB of HBM per chip, a {sl.gen.name} chip has "
                 f"{sl.gen.hbm_bytes // GiB}")
  return r


def search(config: Any, gen: Generation, sizes: list[int], num_slices: int,
           count_layers: bool = True) -> tuple[Result, list[Result]]:
  """The smallest of `sizes` (chips, ascending) the step fits or fails to compile on, and the smaller slices
  compiled on the way that it does not fit; when it fits none, the largest. Slices whose mesh the config
  cannot build, or whose data x fsdp axes do not divide the global batch, are passed over without compiling;
  others are tried smallest first, since most configs fit their generation's smallest slice (one compile),
  then bisected (a step's HBM per chip does not grow with the slice), so a search compiles once, or about
  1 + log2(len(sizes)) times. Searching a generation (several sizes), a slice whose chips the global batch
  cannot split over gives the chips it leaves to the seq axis (`with_seq_axis`), so that a config with a
  small or odd batch is still told the slice it needs and the mesh that serves it. count_layers: the result's
  FLOPs and bytes count every layer of a scanned model (`every_layer_counted`, one more compile)."""
  candidates, refused = [], None
  for chips in sizes:
    sl = Slice(gen, chips, num_slices)
    why = unservable(config, sl)
    if why is None:
      candidates.append((sl, config))
    elif len(sizes) > 1 and (seq_config := with_seq_axis(config, sl)) is not None:
      candidates.append((sl, seq_config))
    elif refused is None:
      refused = Result(sl, "too big", why)
  if not candidates:
    return refused, []

  def compile_at(i: int) -> Result:
    return compile_step(candidates[i][1], candidates[i][0])

  def counted(i: int, r: Result) -> Result:
    return every_layer_counted(candidates[i][1], r) if count_layers else r

  results = {0: compile_at(0)}
  if results[0].status != "too big" or len(candidates) == 1:
    return counted(0, results[0]), []
  lo, hi = 1, len(candidates) - 1
  while lo < hi:
    mid = (lo + hi) // 2
    results[mid] = compile_at(mid)
    if results[mid].status == "too big":
      lo = mid + 1
    else:
      hi = mid
  found = results.get(lo) or compile_at(lo)
  return counted(lo, found), [r for i, r in sorted(results.items()) if i < lo]


def _counted(layers: int, unroll: int) -> int:
  """How many layers XLA's cost analysis counts in a scan over `layers` with `unroll` layers per iteration:
  the loop's body once (`unroll` layers) and the remainder, which jax.lax.scan runs after the loop."""
  trips, remainder = divmod(layers, unroll)
  return (unroll if trips else 0) + remainder


def every_layer_counted(config: Any, r: Result) -> Result:
  """`r` with a scanned model's every layer in its FLOPs and bytes. XLA's cost analysis counts a loop's body
  once, so for a step whose blocks are scanned (`model.scan_layers`) it sees one layer of L. The step is
  compiled again on the same slice with twice the layers per loop iteration (`model.scan_unroll`); the
  difference is one layer's forward and backward, added for each layer the first compile did not count."""
  layers, unroll = r.scanned_layers, int(config.model.get("scan_unroll", 1))
  if r.status != "fits" or not r.uncounted_layers:
    return r
  wider = config.copy_and_resolve_references()
  wider.model.scan_unroll = 2 * unroll
  r2 = compile_step(wider, r.slice)
  if not r2.memory:  # the larger body failed to compile: the loop's layers stay counted once
    return r
  per = _counted(layers, 2 * unroll) - _counted(layers, unroll)  # >= 1: some layers are uncounted
  missing = r.uncounted_layers
  return dataclasses.replace(
      r, flops=r.flops + missing * max(r2.flops - r.flops, 0.0) / per,
      bytes_accessed=r.bytes_accessed + missing * max(r2.bytes_accessed - r.bytes_accessed, 0.0) / per,
      compile_s=r.compile_s + r2.compile_s, uncounted_layers=0)


def with_seq_axis(config: Any, sl: Slice) -> Any | None:
  """The config with the chips of `sl` that its global batch cannot split over on the seq axis (each sequence
  split over them: sequence parallelism), the rest data-parallel; None when the config sets its own seq or
  model axis, or when the batch splits over every chip already."""
  if int(config.mesh.get("seq", 1)) != 1 or int(config.mesh.get("model", 1)) != 1:
    return None
  chips, batch = sl.chips * sl.num_slices, int(config.train.batch_size)
  data = max(d for d in range(1, chips + 1) if chips % d == 0 and batch % d == 0)
  if data == chips:
    return None
  out = config.copy_and_resolve_references()
  out.mesh.seq = chips // data
  return out if unservable(out, sl) is None else None


def unservable(config: Any, sl: Slice) -> str | None:
  """Why the config cannot run on the slice before any compile (its mesh, its global batch), else None."""
  from training import mesh as mesh_lib

  try:
    sizes = dict(zip(mesh_lib.AXES, mesh_lib.mesh_sizes(config, sl.chips * sl.num_slices), strict=True))
  except ValueError as e:
    return first_line(e)
  batch = int(config.train.batch_size)
  data = sizes["data"] * sizes["fsdp"]
  if batch % data:
    return (f"global batch {batch} is not divisible by the {data}-way data-parallel axes (data x fsdp); "
            f"--config.mesh.seq=N splits each sequence over N of the chips instead")
  return None


# -----------------------------------------------------------------------------------------------------------
# Output


def _gib(n: int) -> str:
  return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.2f} MiB"


def _seconds(s: float) -> str:
  return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def bound(r: Result) -> str:
  g = r.slice.gen
  return "compute" if r.flops / g.peak_flops >= r.bytes_accessed / g.hbm_bandwidth else "HBM bandwidth"


def report(label: str, r: Result, batch: int) -> str:
  """The human-readable table of one compile that fits (or that fits the compiler, not the HBM)."""
  g, sl = r.slice.gen, r.slice
  mesh = " ".join(f"{k}={v}" for k, v in r.mesh.items())
  chips = sl.chips * sl.num_slices
  lines = [f"{label} on {sl.name} ({chips} chip{'s' if chips > 1 else ''}, topology {sl.topology_name}, "
           f"mesh {mesh}, global batch {batch})",
           f"{'per chip':<34}{'':>14}",
           f"  {'HBM: arguments':<32}{_gib(r.memory['arguments']):>14}",
           f"  {'HBM: temporaries':<32}{_gib(r.memory['temporaries']):>14}",
           f"  {'HBM: outputs (not donated)':<32}{_gib(r.memory['outputs']):>14}",
           f"  {'HBM: generated code':<32}{_gib(r.memory['code']):>14}",
           f"  {'HBM: total':<32}{_gib(r.total):>14}  of {g.hbm_bytes // GiB} GiB "
           f"({100 * r.total / g.hbm_bytes:.1f}%)",
           f"  {'step FLOPs':<32}{r.flops:>14.4g}",
           f"  {'step bytes accessed':<32}{r.bytes_accessed:>14.4g}",
           f"  {'roofline step time':<32}{_seconds(r.step_s):>14}  ({bound(r)}-bound at "
           f"{g.peak_flops / 1e12:g} TFLOP/s, {g.hbm_bandwidth / 1e9:g} GB/s)",
           f"{'step program':<34}{r.program_ops:>14,}  StableHLO operations",
           f"{'lowered and compiled here in':<34}{_seconds(r.compile_s):>14}"]
  if r.uncounted_layers:
    lines.insert(-2, f"  (FLOPs and bytes count {r.scanned_layers - r.uncounted_layers} of the "
                     f"{r.scanned_layers} scanned layers: --count_layers counts them all)")
  return "\n".join(lines)


MARKDOWN_HEADER = ("| config | TPU | compiles | HBM per chip | smallest slice | roofline step time |\n"
                   "|---|---|---|---|---|---|")


def markdown_row(label: str, gen: Generation, r: Result) -> str:
  if r.status == "fails":
    cells = [f"fails to compile on {r.slice.name}: {r.message.replace('|', '/')}", "", "", ""]
  elif r.status == "too big":
    cells = [f"does not fit on {r.slice.name}: {r.message.replace('|', '/')}", "", "", ""]
  else:
    where = r.slice.name + (f" (`mesh.seq={r.mesh['seq']}`)" if r.mesh.get("seq", 1) > 1 else "")
    cells = ["yes", f"{r.total / GiB:.2f} of {gen.hbm_bytes // GiB} GiB", where,
             f"{_seconds(r.step_s)} ({bound(r)})"]
  return f"| `{label}` | {gen.name} | " + " | ".join(cells) + " |"


# -----------------------------------------------------------------------------------------------------------
# docs/tpu.md

# The paper variants of every experiment config (every configs/ file with a get_config), the quickest to
# compile first.
DOC_CONFIGS = (
  "configs/default.py", "configs/pystdlib.py", "configs/lra.py:task=listops", "configs/lra.py:task=text",
  "configs/lra.py:task=retrieval", "configs/lra.py:task=image", "configs/lra.py:task=pathfinder",
  "configs/cifar10.py", "configs/cifar10.py:routing_paper", "configs/c4.py", "configs/wiki40b.py",
  "configs/imagenet64.py", "configs/imagenet64.py:routing_paper", "configs/wiki40b.py:seq_len=8192",
  "configs/c4.py:seq_len=8192", "configs/imagenet64.py:main", "configs/cifar10.py:main",
  "configs/transformer_xl.py", "configs/compressive.py", "configs/compressive.py:pg19",
  "configs/adaptive_span.py", "configs/adaptive_span.py:large", "configs/hibert.py:pretrain",
  "configs/hibert.py:summarise", "configs/bp_transformer.py", "configs/bp_transformer.py:imdb",
  "configs/bp_transformer.py:sst5", "configs/blockbert.py", "configs/blockbert.py:seq_len=1024",
)
DOC_TIMEOUT_S = 7200  # one (config, generation) search (a bound on a runaway compile, not a budget)
NOT_MEASURED = "not measured yet"

DOC_INTRO = """# Which TPU slice each paper config needs

Generated by `python -m scripts.compile_tpu --docs docs/tpu.md`: the whole train step of each config (its
paper variant, as train.py would run it, at its own global batch) compiled ahead of time by the TPU compiler
for each generation, searching the smallest slice the step fits (`--topology v5e` etc.). "HBM per chip" is
what that slice's chips need (arguments, temporaries, outputs, code) against their HBM. The step time is a
roofline estimate, max(FLOPs / peak bf16 FLOP/s, bytes accessed / HBM bandwidth), per chip: a lower bound,
since XLA's cost analysis counts a loop body once and does not see inside Pallas kernels. The loop over a
scanned model's layers is the exception: the step is compiled a second time with two layers per iteration
(`model.scan_unroll=2`), and the difference, one layer's forward and backward, is counted for every layer.
Slices are searched over the generation's sizes; where the config's global batch cannot split over a slice's
chips (the mesh's data x fsdp must divide it), the chips it leaves go to the seq axis (each sequence split
over them, and the parameters and optimizer state with the fsdp axis), and the row names that mesh
(`mesh.seq=N`: train with `--config.mesh.seq=N`).
Check one config and slice before creating it: `python -m scripts.compile_tpu --config configs/X.py --topology
v5e-16` (scripts/tpu.py does so itself). On a 2-core host one compile takes from seconds to a few minutes; the
deepest model, `cifar10.py:main` (128 layers), compiles for v5e-4 in about a minute and a half (85 s; a step
of 4,028 StableHLO operations, as many as at 32 layers): its blocks are scanned with their parameters stacked
on a layers axis, so the compiler sees one block and one optimizer update whatever the depth. Compressive
and Adaptive Span's `large` model scan their blocks and recompute them likewise (the 36-layer PG-19 model
compiles for v5p-8 in about two minutes), and so does BP-Transformer's language model (v5p-8: a step of
11,552 StableHLO operations, about four and a half minutes for the two compiles of `--count_layers`).
`--docs docs/tpu.md` compiles the rows the table does not hold (delete a row, or the file, to measure it
again) and keeps the others; `--docs_jobs 4` measures four rows at once, on a host with the cores for them.

"""


def measured_rows(path: str) -> dict[tuple[str, str], str]:
  """(config, generation) -> its row, for the rows of an existing table that hold a measurement."""
  if not os.path.exists(path):
    return {}
  rows = {}
  with open(path) as f:
    for line in f:
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if line.startswith("| `") and len(cells) > 2 and NOT_MEASURED not in cells[2]:
        rows[(cells[0].strip("`"), cells[1])] = line.rstrip("\n")
  return rows


def write_docs(path: str, configs: tuple[str, ...] = DOC_CONFIGS, jobs: int = 1) -> int:
  """One subprocess of this module per (config, generation) with --markdown, `jobs` at a time, for the rows
  the table at `path` does not hold yet (delete a row, or the file, to measure it again); the file is
  rewritten after each row, so an interrupted run keeps the rows it finished and the next run goes on from
  there. A compile uses the host's cores unevenly (the TPU compiler is mostly one thread), so on a host with
  cores to spare several searches at once finish the table sooner."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = measured_rows(path)
  table = {(label, gen): done.get((label, gen), f"| `{label}` | {gen} | {NOT_MEASURED} | | | |")
           for label in configs for gen in GENERATIONS}
  lock = threading.Lock()

  def measure(key: tuple[str, str]) -> None:
    label, gen = key
    cmd = [sys.executable, "-m", "scripts.compile_tpu", "--config", label, "--topology", gen, "--markdown"]
    try:
      out = subprocess.run(cmd, cwd=root, text=True, capture_output=True, check=False, timeout=DOC_TIMEOUT_S)
      row = next((line for line in out.stdout.splitlines() if line.startswith("| `")), None)
      why = (out.stderr.strip().splitlines() or ["no output"])[-1][:300]
    except subprocess.TimeoutExpired:
      row, why = None, f"{NOT_MEASURED} (the slice search takes over {DOC_TIMEOUT_S // 60} minutes here)"
    with lock:
      table[key] = row or f"| `{label}` | {gen} | {why.replace('|', '/')} | | | |"
      print(table[key], flush=True)
      with open(path, "w") as f:
        f.write(DOC_INTRO + "\n".join([MARKDOWN_HEADER, *table.values()]) + "\n")

  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    for future in [pool.submit(measure, key) for key in table if key not in done]:
      future.result()
  return 0


# -----------------------------------------------------------------------------------------------------------
# Command line


def _flags():
  from absl import flags

  from training import command_line, config_io

  command_line.define_config_flag(config_io.DEFAULT_CONFIG)
  flags.DEFINE_multi_string("gin_file", [], "gin files binding attention constructor fields (as train.py)")
  flags.DEFINE_multi_string("gin_bindings", [], "gin bindings, e.g. 'attention.deepsets = True'")
  flags.DEFINE_string("topology", None, "Cloud TPU accelerator type (v4-32, v5e-16, v5p-128, v6e-8) or a "
                      "generation alone (v5e: the smallest slice that fits)")
  flags.DEFINE_integer("num_slices", 1, "compile for this many such slices (multislice)")
  flags.DEFINE_bool("list_topologies", False, "list the accelerator types --topology takes, then exit")
  flags.DEFINE_bool("count_layers", True, "a scanned model: compile its step once more, with two layers per "
                    "loop iteration, so that its FLOPs and bytes (the roofline) count every layer, not one")
  flags.DEFINE_bool("markdown", False, "print one row of the docs/tpu.md table instead of the report")
  flags.DEFINE_string("docs", None, "write the table of every paper config by generation to this file")
  flags.DEFINE_integer("docs_jobs", 1, "with --docs: how many rows to measure at once (one process each)")
  return flags.FLAGS


def fail(message: str, code: int) -> None:
  print(message, file=sys.stderr, flush=True)
  sys.exit(code)


def main(argv: list[str]) -> None:
  del argv
  from absl import flags as absl_flags
  from absl import logging

  from runtime import cli
  from training import command_line

  logging.set_verbosity(logging.ERROR)
  flags = absl_flags.FLAGS
  if flags.list_topologies:
    for g in GENERATIONS.values():
      names = ", ".join(g.slice_name(c) for c in g.shapes)
      print(f"{g.name}: {names}  ({g.hbm_bytes // GiB} GiB HBM, {g.peak_flops / 1e12:g} TFLOP/s bf16, "
            f"{g.hbm_bandwidth / 1e9:g} GB/s per chip)")
    return
  if flags.docs:
    cli.at_least("--docs_jobs", flags.docs_jobs, 1)
    sys.exit(write_docs(flags.docs, jobs=flags.docs_jobs))
  cli.at_least("--num_slices", flags.num_slices, 1)
  if not flags.topology:
    raise cli.UsageError(f"--topology is required: one of {allowed()}")
  try:
    gen, sizes = parse_topology(flags.topology, flags.num_slices)
  except BadTopology as e:
    raise cli.UsageError(str(e)) from None
  config = command_line.checked_config(flags)
  label = flags["config"].config_filename
  r, skipped = search(config, gen, sizes, flags.num_slices, flags.count_layers)
  batch = int(config.train.batch_size)
  if flags.markdown:
    print(markdown_row(label, gen, r), flush=True)
  elif r.memory:
    print(report(label, r, batch), flush=True)
  smaller = f" (it does not fit {', '.join(s.slice.name for s in skipped)})" if skipped else ""
  if r.status == "fails":
    fail(f"{label} on {r.slice.name}: fails to compile: {r.message}{smaller}", 1)
  if r.status == "too big":
    where = r.slice.name if len(sizes) == 1 else f"any {gen.name} slice up to {r.slice.name}"
    fail(f"{label} does not fit on {where}: {r.message}", 2)


if __name__ == "__main__":
  from runtime import cli

  cli.run_absl(main, _flags)
