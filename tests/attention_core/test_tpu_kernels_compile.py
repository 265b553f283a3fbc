"""Every fused attention kernel compiles for TPUs, forward and backward, at the shapes the configs train at.

libtpu runs the real TPU compiler (Mosaic included) ahead of time on this CPU host (`scripts.compile_tpu`'s
compile-only devices), so no TPU is needed. The ops are the registry's ops with an accelerated path
(`attention_core.registry.fused_path`: those taking `implementation` or `formulation`); the shapes are derived
from every config in configs/ and its variants (flags, LRA tasks, the sequence lengths the docstrings name) as
the model resolves them: the sequence length, the op's automatic plan parameters `params(L)`, the heads
(a kernel's VMEM blocks hold up to 8), head_dim = features / heads, the model dtype and the direction of its
task; plus EDGE_CASES (2 heads). Each (generation, case, op) is one compile of jax.grad of the op's sum.
The fast run compiles REPRESENTATIVE per op on v5e, `-m slow` on every generation (grid_params), `-m
tpu_grid` the grid. Skipped where libtpu is not installed (requirements-tpu-compile.txt).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import inspect
import os
import re

import pytest

from scripts import compile_tpu  # libtpu for this process (scripts/compile_tpu.py)

pytest.importorskip("libtpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import data  # noqa: E402
from attention_core import registry as ops_registry  # noqa: E402
from attention_core import sharding  # noqa: E402
from configs import arguments  # noqa: E402
from models.transformer import CAUSAL_TASKS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
GENERATIONS = tuple(compile_tpu.GENERATIONS)  # v4, v5e, v5p, v6e
BATCH, HEADS = 2, 2
PLAN_KEYS = ("block_size", "row_length")  # plan parameters an edge case may override
KERNEL_MARKER = "tpu_custom_call"  # a Mosaic kernel in the lowered program

# {op: ({argument: the kernel value compiled}, whether its causal form runs kernels)} from the registrations
# (attention_core.registry.fused_path): a new op with a kernel is compiled here without being named.
FUSED = {name: ({path.argument: path.kernels[0]}, path.causal)
         for name, path in ops_registry.fused_ops().items() if path.kernels}


@dataclasses.dataclass(frozen=True)
class Case:
  length: int
  head_dim: int
  dtype: str
  causal: bool
  value_dim: int | None = None  # None = head_dim
  masked: bool = False
  plan: int | None = None  # overrides the op's automatic block_size / row_length
  heads: int = HEADS  # a config's own head count: the kernels run up to 8 heads per program (VMEM)
  source: str = ""  # the configs it comes from (not part of the identity)

  @property
  def id(self) -> str:
    parts = [f"L{self.length}", f"d{self.head_dim}"]
    if self.value_dim is not None:
      parts.append(f"e{self.value_dim}")
    parts.append({"float32": "f32", "bfloat16": "bf16"}.get(self.dtype, self.dtype))
    parts.append("causal" if self.causal else "bidi")
    if self.masked:
      parts.append("mask")
    if self.plan is not None:
      parts.append(f"plan{self.plan}")
    if self.heads != HEADS:
      parts.append(f"h{self.heads}")
    return "-".join(parts)


def _docstrings(module) -> list[str]:
  """The config module's docstrings and those of the configs modules it builds on (text.py, images.py)."""
  mods = [module] + [m for m in vars(module).values() if inspect.ismodule(m)
                     and m.__name__.startswith("configs.") and m.__name__ != "configs.base"]
  return [m.__doc__ or "" for m in mods] + [f.__doc__ or "" for m in mods for f in vars(m).values()
                                            if inspect.isfunction(f)]


def config_variants(module) -> list[str]:
  """The config arguments worth a shape: none, each flag (as `train.py --list` finds them), each LRA task
  with each of those, and each `seq_len=N` the docstrings name (the paper's 8K text rows)."""
  keys, flags = [], []
  try:
    module.get_config("__list__")
  except arguments.UnknownConfigArgument as e:
    keys, flags = e.keys, list(e.flags)
  paper = getattr(module, "routing_paper", None)
  if paper is not None:
    flags.append(paper.FLAG)
  lengths = sorted({int(n) for doc in _docstrings(module) for n in re.findall(r"\bseq_len=(\d+)", doc)})
  tasks = [f"task={t}" for t in getattr(module, "SETTINGS", {})] if "task" in keys else [""]
  extras = [""] + flags + [f"seq_len={n}" for n in lengths]
  return [",".join(x for x in (task, extra) if x) for task in tasks for extra in extras]


def config_cases() -> list[Case]:
  """(length, head_dim, dtype, causal) of every config variant, deduplicated; source names the variants."""
  found: dict[Case, list[str]] = {}
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
    module = importlib.import_module(f"configs.{os.path.splitext(os.path.basename(path))[0]}")
    if not hasattr(module, "get_config"):
      continue
    for arg in config_variants(module):
      try:
        c = module.get_config(arg)
        info = data.dataset_info(c)
      except ValueError:
        continue  # a combination the config rejects (e.g. a length an LRA image task cannot have)
      m = c.model
      case = Case(int(info.seq_len), int(m.head_dim or m.features // m.num_heads), str(m.dtype),
                  info.task in CAUSAL_TASKS, heads=int(m.num_heads))
      found.setdefault(case, []).append(f"{os.path.basename(path)}:{arg}")
  return [dataclasses.replace(case, source=" ".join(src)) for case, src in sorted(
      found.items(), key=lambda kv: dataclasses.astuple(kv[0]))]


# Beyond the configs: blocks and rows not a multiple of 128, a ragged length, a key mask, value_dim !=
# head_dim, bfloat16 next to the configs' float32.
EDGE_CASES = [
    Case(1024, 64, "bfloat16", True, plan=96),
    Case(2304, 64, "bfloat16", False, plan=192),
    Case(1000, 64, "bfloat16", True, plan=96, masked=True),  # 1000 = 10 blocks of 96 + 40
    Case(2100, 64, "float32", False, masked=True),
    Case(2048, 128, "bfloat16", True, value_dim=64),
    Case(2048, 64, "bfloat16", False, value_dim=128),
    Case(3072, 128, "bfloat16", True),
]
# The fast run's one case per op and generation: ragged (2100 = 32 blocks of 64 + 52), masked, bfloat16,
# past YOSO's dense-counts backward (the pair-sum kernel); causal where the op's causal form has kernels.
REPRESENTATIVE = Case(2100, 64, "bfloat16", True, masked=True)


def _applies(name: str, case: Case) -> bool:
  spec = ops_registry.get(name)
  _, causal_kernels = FUSED[name]
  if case.causal and not (spec.causal and causal_kernels):
    return False
  if not case.causal and not spec.bidirectional:
    return False
  if case.plan is not None and not any(k in spec.params(case.length) for k in PLAN_KEYS):
    return False  # a plan override means nothing to an op without blocks or rows
  return True


def _params(name: str, case: Case) -> dict:
  spec = ops_registry.get(name)
  params = ops_registry.bench_params(spec, case.length, batch=BATCH, heads=case.heads,
                                     head_dim=case.head_dim, value_dim=case.value_dim, dtype=case.dtype)
  if case.plan is not None:
    params.update({k: case.plan for k in PLAN_KEYS if k in params})
  return {**params, **FUSED[name][0]}


FAST_GENERATION = "v5e"  # the fast run compiles the representative case here
SLOW_GENERATIONS = ("v4",)  # `-m slow` also here, every op (the least VMEM)
# `-m slow` compiles the representative case of the ops not in SLOW_TO_COMPILE on the remaining generations
# too (about 3 minutes of compiles). SLOW_TO_COMPILE, with `-m slow` on v5e and v4 only (elsewhere with
# `-m tpu_grid`): logsparse takes about a minute; the others repeat a kernel family the fast run compiles
# already (mixture, the vertical and the horizontal plans: the axial kernels of rowmajor; the sketched and
# `_c` YOSO variants: YOSO's tables; local and longformer: dense's Splash kernel with another mask; nsa,
# ~20 s: moba's selected-blocks kernel, twice).
SLOW_TO_COMPILE = ("combiner_logsparse", "sparse_logsparse", "combiner_mixture", "combiner_mixture_joint",
                   "combiner_axial_horizontal", "combiner_axial_vertical", "yoso_c", "yoso_sketch",
                   "yoso_sketch_c", "local", "longformer", "nsa")


def grid_params() -> list:
  """The representative case of every fused op on every generation (fast on FAST_GENERATION but for
  SLOW_TO_COMPILE; slow on SLOW_GENERATIONS, and on the others but for SLOW_TO_COMPILE), then every config and
  edge case (`-m tpu_grid`, outside CI: about two thousand compiles)."""
  fast, slow, grid = [], [], []
  cases = config_cases() + EDGE_CASES
  for gen in GENERATIONS:
    for name in FUSED:
      rep = REPRESENTATIVE
      if not _applies(name, rep):
        rep = dataclasses.replace(rep, causal=False)
      if gen == FAST_GENERATION and name not in SLOW_TO_COMPILE:
        marks = []
      elif gen in (FAST_GENERATION, *SLOW_GENERATIONS) or name not in SLOW_TO_COMPILE:
        marks = [pytest.mark.slow]
      else:
        marks = [pytest.mark.tpu_grid]
      (slow if marks else fast).append(pytest.param(gen, rep, name, id=f"{gen}-{rep.id}-{name}", marks=marks))
      for case in cases:
        if _applies(name, case) and case != rep:
          grid.append(pytest.param(gen, case, name, id=f"{gen}-{case.id}-{name}", marks=pytest.mark.tpu_grid))
  return fast + slow + grid


_DEVICES: dict[tuple[str, int], list] = {}


def tpu_devices(gen: str, chips: int = 1) -> list:
  """Compile-only devices of a `chips`-chip slice of generation `gen` (v4 and v5p: of their smallest slice, 4
  chips, when one is asked for)."""
  shapes = compile_tpu.GENERATIONS[gen].shapes
  chips = chips if chips in shapes else min(c for c in shapes if c >= chips)
  if (gen, chips) not in _DEVICES:
    _DEVICES[gen, chips] = compile_tpu.devices(compile_tpu.Slice(compile_tpu.GENERATIONS[gen], chips))
  return _DEVICES[gen, chips]


def lowered(names: list[str], case: Case, mesh: jax.sharding.Mesh, spec: P | None = None, batch: int = BATCH):
  """jax.grad (q, k, v) of the sum of the ops' outputs, lowered for the mesh's TPU devices as TPUs trace."""
  spec = P() if spec is None else spec
  placed = NamedSharding(mesh, spec)
  qk = jax.ShapeDtypeStruct((batch, case.length, case.heads, case.head_dim), case.dtype, sharding=placed)
  v = jax.ShapeDtypeStruct((batch, case.length, case.heads, case.value_dim or case.head_dim), case.dtype,
                           sharding=placed)
  mask = jax.ShapeDtypeStruct((batch, case.length), jnp.bool_, sharding=NamedSharding(mesh, P(*spec[:2])))

  def loss(q, k, v, mask):
    total = 0.0
    for name in names:
      out = sharding.attend(ops_registry.get(name).fn, q, k, v, mask=mask if case.masked else None,
                            causal=case.causal, **_params(name, case))
      total = total + out.astype(jnp.float32).sum()
    return total

  return jax.jit(sharding.traced_in(mesh, jax.grad(loss, argnums=(0, 1, 2)))).lower(qk, qk, v, mask)


@pytest.mark.parametrize("gen,case,name", grid_params())
def test_fused_kernels_compile_for_tpu(gen, case, name):
  mesh = jax.sharding.Mesh(np.array(tpu_devices(gen)[:1]), ("data",))
  try:
    program = lowered([name], case, mesh)
  except ValueError as e:
    if "does not apply" not in str(e):
      raise
    pytest.skip(compile_tpu.first_line(e))  # the op's own answer: no fused kernel for these inputs
  assert KERNEL_MARKER in program.as_text(), f"{name} at {case.id}: no TPU kernel in the program"
  try:
    program.compile()
  except Exception as e:  # noqa: BLE001  (the compiler's error, one line, with the case that raised it)
    pytest.fail(f"{gen} {name} {case.id} ({case.source or 'edge case'}): {compile_tpu.first_line(e)}",
                pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("name,case", [
    ("combiner_axial_vertical", Case(12288, 64, "float32", True, heads=12, source="imagenet64.py:main")),
    ("combiner_mixture", Case(8192, 64, "float32", True, heads=12, source="wiki40b.py:seq_len=8192"))])
def test_twelve_heads_fit_v4_vmem(name, case):
  """12 heads of 64 in float32, as the paper's ImageNet-64 and 8K-token models have. All 12 in one program
  (12 is not a multiple of 8), the axial backward's windows overflowed a v4 core's 16 MiB of VMEM; in blocks
  of 6 heads, [6, 64] blocks padded to (8, 128) tiles, the mixture's row backward (15 windows) did. Folded
  into 384 lanes (`combiner.frames.Frame.layout`) they fit."""
  mesh = jax.sharding.Mesh(np.array(tpu_devices("v4")[:1]), ("data",))
  lowered([name], case, mesh, batch=1).compile()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["yoso", "yoso_sketch"])
def test_yoso_kernels_fit_v4_vmem_in_float32(name):
  """v4 gives a kernel 16 MiB of VMEM. In float32 (matmul operands in two bfloat16 parts) the sketched
  backward's read of 32 hashes' tables, and the exact backward's pair sums over whole rows of 8192 tokens,
  overflowed it; the representative case is bfloat16."""
  case = Case(8192, 64, "float32", False, source="c4.py:seq_len=8192")
  test_fused_kernels_compile_for_tpu("v4", case, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in FUSED if n not in SLOW_TO_COMPILE])
@pytest.mark.parametrize("axis", ["data", "model"])
def test_fused_kernels_compile_sharded_over_chips(axis, name):
  """q, k, v sharded over batch ("data") or heads ("model") on a 4-chip v5e mesh, the ops called as the models
  call them (`attention_core.sharding.attend` under the context mesh): each chip runs the kernel on its
  shard, with no
  all-gather of q, k, v. A bare pallas_call here fails: Mosaic kernels cannot be partitioned."""
  mesh = jax.sharding.Mesh(np.array(tpu_devices("v5e", 4)), (axis,))
  spec = P(axis) if axis == "data" else P(None, None, axis)
  case = dataclasses.replace(REPRESENTATIVE, length=1024, masked=False, heads=4)
  if not _applies(name, case):
    case = dataclasses.replace(case, causal=False)
  compiled = lowered([name], case, mesh, spec, batch=4).compile()
  assert "all-gather" not in compiled.as_text() and "all-to-all" not in compiled.as_text()
