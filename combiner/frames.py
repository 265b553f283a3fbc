"""Frames: how every Combiner kernel lays a plan's sequence out and runs a program over it.

A plan lays the sequence out as a frame of `rows` x `cols` positions (a Combiner-Fixed block, an axial row or
a logsparse tile per frame row). A kernel runs one program per (batch row, block of heads, group), a group
being a frame row or, for a column pass, a frame column.

Frame arrays keep the op contract's layout, [batch, rows * cols, heads, dim], reshaped but never transposed
around the kernels. On TPU (and in interpret mode) a program reads a group of a block of `heads_per_block`
heads, [group length, heads, dim] (a column pass reads the same array as [batch, rows, cols, heads, dim], one
column at a time), from the array in the view `Frame.layout` gives it (6 heads of 64: [.., heads * 64] in
blocks of 384 lanes), and runs its heads one after the other (`each_head`), each copied out of the block in
VMEM; on GPUs a program runs one head, Triton reading its strided tile of [batch, L, heads * dim]. Per-head
arrays are [batch * heads, ...], viewed per head block. `call_kernel` is the one pallas_call every kernel
goes through; `TileLoader` copies other frame rows in from HBM.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from attention_core import pallas
from combiner import tiles
from combiner.tiles import F32

Array = Any
TILE = 128  # query / key tile cap inside a group (TPU lanes; also interpret mode)
GPU_TILE = 64  # smaller tiles keep more Triton programs in flight
GPU_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=2)
HEAD_BLOCK = 8  # heads per program on TPU at most: their blocks fit a v4 core's 16 MiB of VMEM
KINDS = ("block", "last", "prefix", "upto", "all_but_one", "own")
COUNTS = ("vertical_causal", "vertical", "horizontal", "rows")  # how `extra` summaries' members are counted


@dataclasses.dataclass(frozen=True)
class Frame:
  """Geometry shared by a plan's passes. Frame position (r, c) is sequence position r * span + c when
  c < span (the real row length; cols >= span pads it), padding otherwise."""

  batch: int
  heads: int
  length: int  # real sequence length
  rows: int
  cols: int
  span: int
  d: int
  dv: int
  scale: float
  packed: bool  # one head per program, frame arrays [batch, L, heads * dim] (GPUs); else blocks of heads
  platform: str  # "cpu" (interpret mode) | "gpu" | "tpu"
  masked: bool  # validity comes from mask arrays, else from positions alone
  partial_banks: bool = False  # gradients of shared rows as per-group partial sums (GPUs), see below
  out_weight: float = 1.0  # the plan's output is this multiple of the passes' softmax (mean mixture: 1/2)
  # The kernels see the sequence reversed: frame row r is the frame arrays' row rows-1-r, its positions in
  # reverse order (rows flipped in VMEM as they are copied in and out). Heads-blocked frames without padding
  # (length == rows * cols) only; masks and per-head arrays are given in the reversed order.
  reverse: bool = False

  @property
  def tile(self) -> int:
    return GPU_TILE if self.platform == "gpu" else TILE

  @property
  def heads_per_block(self) -> int:
    """Heads one program runs: 1 for heads-packed frames; else HEAD_BLOCK, all the heads when there are
    fewer, or the largest divisor of the heads below HEAD_BLOCK (12 heads: 6, `layout`)."""
    if self.packed:
      return 1
    if self.heads % HEAD_BLOCK == 0:
      return HEAD_BLOCK
    if self.heads < HEAD_BLOCK:
      return self.heads
    return max(n for n in range(1, HEAD_BLOCK) if self.heads % n == 0)

  def layout(self, dim: int, columns: bool = False) -> str:
    """How the kernels see a frame array [.., heads, dim] on TPU and in interpret mode (not heads-packed), in
    blocks of `heads_per_block` heads. A VMEM block's last two axes take whole (8, 128) tiles (float32;
    (16, 128) in bfloat16), so a [hb, dim] block of 6 heads of 64 fills 6 of 8 rows and 64 of 128 lanes: 2.7x
    its bytes. So:
    "fold": [.., heads * dim], blocks of hb * dim lanes, where dim is not a multiple of 128 and hb * dim is
      (or, but for a column pass, hb is all the heads); a column pass's view [batch, rows, cols, heads, dim]
      folds its columns in too, [batch, rows, cols * heads * dim];
    "split": [.., heads / hb, hb, dim], the block's heads an axis of their own, where hb is neither all the
      heads nor a multiple of 8 (Mosaic takes a block's second-minor axis whole or in multiples of 8);
    "heads": [.., heads, dim] as it is.
    Each is a reshape. A model's projections give q, k and v as [.., heads * dim], a row pass's fold; XLA
    tiles a TPU array over its last two axes, so the other views may cost a relayout (a column pass's fold
    one of its own, where padded [hb, dim] blocks cost one in every view)."""
    hb = self.heads_per_block
    if dim % 128 and (hb * dim % 128 == 0 or (hb == self.heads and not columns)):
      return "fold"
    return "split" if hb != self.heads and hb % 8 else "heads"

  def valid(self, r: Array, c: Array) -> Array:
    """Validity of frame position (r, c) from positions alone."""
    return (c < self.span) & (r * self.span + c < self.length)


@dataclasses.dataclass(frozen=True)
class Construct:
  kind: str  # KINDS
  pooling: str  # "max" | "mean" (unused by "last")
  rule: str  # the in-span attention's rule (local ids)
  pools: bool = False  # pool_q / pool_k are arrays of their own (DeepSets), else q and k
  given_keys: bool = False  # "own": the pooled keys come in as an input (a learned function of them)


@dataclasses.dataclass(frozen=True)
class Pass:
  view: str  # "rows" | "cols"
  own: str | None = None  # rule of the group's own keys (local ids); None: not attended
  extra: str | None = None  # rule of the per-position summaries of the group (local ids); None: none
  extra_bank_keys: bool = False  # keys one per frame row ([rows, d], local id = row), values per position
  extra_count: str = "rows"  # COUNTS: their members, for validity without a mask
  bank: str | None = None  # rule of the shared summaries against the group index ("lt" | "ne")
  bank_last: bool = False  # the shared summaries are each group's last position (validity without a mask)
  construct: Construct | None = None
  ext: bool = False  # merge another pass's partial softmax of the same queries
  final: bool = True  # write the normalised output in the output dtype; else a partial (out, lse)
  attend: bool = True

  def groups(self, f: Frame) -> int:
    return f.rows if self.view == "rows" else f.cols

  def glen(self, f: Frame) -> int:
    return f.cols if self.view == "rows" else f.rows

  def tile(self, f: Frame) -> int:
    return min(self.glen(f), f.tile)

  def ids(self, g: Array, local: Array) -> tuple[Array, Array]:
    """Frame (row, col) of local index `local` of group g."""
    return (g, local) if self.view == "rows" else (local, g)


# ---------------------------------------------------------------------------------------------- layouts

def tok_shape(f: Frame, p: Pass, dim: int, dtype: Any) -> jax.ShapeDtypeStruct:
  """A frame array as a pass writes it (`tok_out` gives the frame array back)."""
  if f.packed:
    if p.view == "cols":
      return jax.ShapeDtypeStruct((f.batch, f.rows, f.cols * f.heads * dim), dtype)
    return jax.ShapeDtypeStruct((f.batch, f.rows * f.cols, f.heads * dim), dtype)
  if p.view == "cols":
    return jax.ShapeDtypeStruct((f.batch, f.rows, f.cols, f.heads, dim), dtype)
  return jax.ShapeDtypeStruct((f.batch, f.rows * f.cols, f.heads, dim), dtype)


def tok_in(f: Frame, p: Pass, x: Array) -> Array:
  """A frame array as a pass reads it: a column pass's view is a free reshape of it."""
  if p.view != "cols":
    return x
  return x.reshape(f.batch, f.rows, -1) if f.packed else x.reshape(f.batch, f.rows, f.cols, *x.shape[2:])


def tok_out(f: Frame, p: Pass, x: Array) -> Array:
  if p.view != "cols":
    return x
  return x.reshape(f.batch, f.rows * f.cols, -1) if f.packed else x.reshape(f.batch, f.rows * f.cols,
                                                                             *x.shape[3:])


def grid(f: Frame, groups: int) -> tuple[int, int, int]:
  """(batch, head blocks, groups): the groups innermost, so a head block's shared rows stay in VMEM."""
  return (f.batch, f.heads // f.heads_per_block, groups)


def tok_spec(f: Frame, p: Pass, dim: int) -> pl.BlockSpec:
  glen = p.glen(f)
  if f.packed:
    if p.view == "cols":
      return pl.BlockSpec((None, glen, dim), lambda b, h, g: (b, 0, g * f.heads + h))
    return pl.BlockSpec((None, glen, dim), lambda b, h, g: (b, g, h))
  if p.view == "cols":
    return head_block_spec(f, (None, glen, None), dim, lambda b, h, g: (b, 0, g, h))
  return head_block_spec(f, (None, glen), dim, lambda b, h, g: (b, g, h))


def head_block_spec(f: Frame, lead: tuple, dim: int, index: Any) -> pl.BlockSpec:
  """A block of the program's heads of a frame array (not heads-packed) of `dim` per head, in its
  `f.layout` (the view `call_kernel` gives it): `lead` the block's dims before the heads axis (a column
  pass's ends with its squeezed column), index(b, h, g) the block's index there and at the head block h."""
  hb = f.heads_per_block
  columns = lead[-1] is None
  layout = f.layout(dim, columns)
  if layout == "fold" and columns:  # [batch, rows, cols * heads * dim]: column g's head block h
    def folded(b, h, g):
      *lead_index, column, _ = index(b, h, g)
      return (*lead_index, column * (f.heads // hb) + h)
    return pl.BlockSpec((*lead[:-1], hb * dim), folded)
  if layout == "fold":
    return pl.BlockSpec((*lead, hb * dim), index)
  if layout == "split":
    return pl.BlockSpec((*lead, None, hb, dim), lambda b, h, g: (*index(b, h, g), 0, 0))
  return pl.BlockSpec((*lead, hb, dim), lambda b, h, g: (*index(b, h, g), 0))


def head_view(f: Frame, x: Array) -> Array:
  """A per-head array [batch * heads, ...] as the kernels read it: [batch, head blocks, heads per block,
  ...] (a free reshape; one head per block for heads-packed frames)."""
  hb = f.heads_per_block
  return x.reshape(f.batch, f.heads // hb, hb, *x.shape[1:])


def head_unview(f: Frame, x: Array) -> Array:
  return x.reshape(f.batch * f.heads, *x.shape[3:])


def head_spec(f: Frame, block: tuple, index: Any) -> pl.BlockSpec:
  """A per-head array's block for the program's heads (one head, squeezed, for heads-packed frames):
  `block` and `index(g)` its per-head part (None: squeezed)."""
  hb = None if f.packed else f.heads_per_block
  return pl.BlockSpec((None, None, hb) + block, lambda b, h, g: (b, h, 0) + index(g))


def row_spec(f: Frame, dim: int) -> pl.BlockSpec:
  """The group's own row of a per-head [.., groups, 1, dim]."""
  return head_spec(f, (None, 1, dim), lambda g: (g, 0, 0))


class Rows:
  """Rows of a bank ref [n, 1, dim] as a [n, dim] ref: x[rows] reads, x[rows] += adds."""

  def __init__(self, ref: Any):
    self.ref = ref

  def __getitem__(self, idx: Any) -> Array:
    return self.ref[idx[0], 0, :]

  def __setitem__(self, idx: Any, value: Array) -> None:
    self.ref[idx[0], 0, :] = value


def accumulates_banks(f: Frame) -> bool:
  """Whether gradients of shared rows accumulate over groups in one resident block (a TPU core and the
  interpreter run a grid's programs in order), rather than as per-group partial sums (GPUs)."""
  return not f.partial_banks


# --------------------------------------------------------------------------------------------- programs

def each_head(f: Frame, names: tuple, refs: tuple, outs: tuple, body, tok: tuple, heads: tuple,
              extra: tuple = ()) -> None:
  """body(R, g, head) for every head of the program's block, R its refs by name, g its group, head the
  head's index: a frame array (`tok`) as the head's 2-D ref (copied out of the block into VMEM scratch, after
  `refs`' arguments, and an output's back in after), a per-head array (`heads`) at the head, any other as it
  is. `extra`: names of the scratch refs that follow the copies."""
  n = len(names)
  R = dict(zip(names, refs[:n], strict=True))
  R.update(zip(extra, refs[len(refs) - len(extra):], strict=True))
  # program ids are read outside the heads' loop: the interpreter binds them at the kernel's top level
  g, block = pl.program_id(2), pl.program_id(1)
  if f.packed:
    body(R, g, block)
    return
  cur = dict(zip([m for m in names if m in tok], refs[n:len(refs) - len(extra)], strict=True))
  hb = f.heads_per_block

  def copy(j: Array, name: str, out: bool) -> None:
    dim = cur[name].shape[-1]
    fold = len(R[name].shape) == 2  # a block [glen, hb * dim] (`Frame.layout`), else [glen, hb, dim]
    for jj in range(hb):
      @pl.when(j == jj)
      def _(jj=jj):
        at = (slice(None), slice(jj * dim, (jj + 1) * dim)) if fold else (slice(None), jj, slice(None))
        if out:
          R[name][at] = cur[name][...]
        else:
          cur[name][...] = R[name][at]

  def head(j, carry):
    for name in cur:
      if name not in outs:
        copy(j, name, out=False)
        if f.reverse:
          cur[name][...] = tiles.flip_rows(cur[name][...])
    view = {m: cur[m] if m in cur else (R[m].at[j] if m in heads else R[m]) for m in names}
    body({**view, **{m: R[m] for m in extra}}, g, block * hb + j)
    for name in cur:
      if name in outs:
        if f.reverse:
          cur[name][...] = tiles.flip_rows(cur[name][...])
        copy(j, name, out=True)
    return carry

  lax.fori_loop(0, hb, head, 0)


def compiler_params(f: Frame, accumulate: bool) -> Any:
  sem = ("parallel", "parallel", "arbitrary" if accumulate else "parallel")
  return pltpu.CompilerParams(dimension_semantics=sem)


FRAME_INPUTS = ("q", "k", "v", "pool_q", "pool_k")  # what `TileLoader` may read


def call_kernel(f: Frame, kernel, name: str, groups: int, ins: list[str], specs: list, args: list,
                outs: list[str], out_specs: list, shapes: list, *, tok: tuple, heads: tuple,
                glen: int | None = None, loads: tuple = (), aliases: dict | None = None,
                accumulate: bool = False) -> dict[str, Array]:
  """One pallas_call of a kernel over the frame's groups (grid `grid`), each head of a block run by
  `each_head`: kernel(b, R, g, head). Per-head arrays (`heads`) are viewed per head block; frame arrays
  (`tok`) get per-head VMEM copies of their group ([glen, dim], glen the group length, `cols` by default) on
  TPU. `loads`: frame arrays the kernel reads rows of with `TileLoader` (whole, in HBM on TPU; each gets VMEM
  buffers for its copies). `aliases`: {input index: output index} written in place."""
  names = tuple(ins + outs)
  framed = set(tok) | set(loads)  # frame arrays: viewed in their `f.layout` on TPU and in interpret mode
  dims = {n: a.shape[-1] for n, a in zip(ins, args, strict=True)}
  dims.update({n: s.shape[-1] for n, s in zip(outs, shapes, strict=True)})
  dtypes = {n: a.dtype for n, a in zip(ins, args, strict=True)}
  dtypes.update({n: s.dtype for n, s in zip(outs, shapes, strict=True)})
  out_frames = {n: tuple(s.shape) for n, s in zip(outs, shapes, strict=True)}
  if not f.packed:
    args = [_view(f, a) if n in framed else a for n, a in zip(ins, args, strict=True)]
    specs = [whole_spec(f, a) if n in loads else s for n, s, a in zip(ins, specs, args, strict=True)]
    shapes = [jax.ShapeDtypeStruct(_view_shape(f, s.shape), s.dtype) if n in framed else s
              for n, s in zip(outs, shapes, strict=True)]
  tok = tuple(n for n in tok if n not in loads)
  scratch = []
  if not f.packed:
    scratch = [pltpu.VMEM((glen or f.cols, dims[n]), dtypes[n]) for n in names if n in tok]
  extra = ()
  if f.platform == "tpu":
    hb = f.heads_per_block
    for n in loads:
      block = (hb * dims[n],) if f.layout(dims[n]) == "fold" else (hb, dims[n])
      extra += ("buf_all_" + n, "buf_" + n)
      scratch += [pltpu.VMEM((f.cols, *block), dtypes[n]), pltpu.VMEM((f.cols, dims[n]), dtypes[n])]
  arrays = [head_view(f, a) if n in heads else a for n, a in zip(ins, args, strict=True)]
  hb = f.heads_per_block
  out_shapes = [jax.ShapeDtypeStruct((f.batch, f.heads // hb, hb) + s.shape[1:], s.dtype) if n in heads else s
                for n, s in zip(outs, shapes, strict=True)]
  body = functools.partial(_kernel_entry, kernel=kernel, f=f, names=names, outs=tuple(outs), tok=tok,
                           heads=heads, extra=extra)
  res = pallas.platform_call(
      body, gpu_params=GPU_PARAMS, tpu_params=compiler_params(f, accumulate), platform=f.platform,
      grid=grid(f, groups), in_specs=specs, out_specs=out_specs, out_shape=out_shapes, scratch_shapes=scratch,
      name=name, **({"input_output_aliases": aliases} if aliases else {}),
  )(*arrays)
  res = [head_unview(f, x) if n in heads else x for n, x in zip(outs, res, strict=True)]
  if not f.packed:
    res = [x.reshape(out_frames[n]) if n in framed else x for n, x in zip(outs, res, strict=True)]
  return dict(zip(outs, res, strict=True))


def _view_shape(f: Frame, shape: tuple) -> tuple:
  """A frame array's shape, [.., heads, dim] ([batch, rows, cols, heads, dim] for a column pass), in its
  `f.layout`."""
  hb, dim, columns = f.heads_per_block, shape[-1], len(shape) == 5
  layout = f.layout(dim, columns)
  if layout == "fold":
    return (*shape[:-3], shape[-3] * shape[-2] * dim) if columns else (*shape[:-2], shape[-2] * dim)
  if layout == "split":
    return (*shape[:-2], shape[-2] // hb, hb, dim)
  return tuple(shape)


def _view(f: Frame, x: Array) -> Array:
  """A frame array [.., heads, dim] in its `f.layout` (a reshape)."""
  return x.reshape(_view_shape(f, x.shape))


def _kernel_entry(*refs, kernel, f: Frame, names: tuple, outs: tuple, tok: tuple, heads: tuple,
                  extra: tuple) -> None:
  b = pl.program_id(0)
  each_head(f, names, refs, outs, functools.partial(kernel, b), tok, heads, extra)


def aliases_by_name(ins: list[str], outs: list[str] | tuple[str, ...], arrays: list[Array], shapes: list[Any],
                    rules: dict[str, str]) -> dict[int, int]:
  """`call_kernel`'s aliases {input index: output index} from rules {input name: output name}, for each
  input given with the shape and dtype of its output."""
  out_at = {n: i for i, n in enumerate(outs)}
  aliases = {}
  for i, n in enumerate(ins):
    j = out_at.get(rules.get(n, ""))
    if j is not None and (arrays[i].shape, arrays[i].dtype) == (shapes[j].shape, shapes[j].dtype):
      aliases[i] = j
  return aliases


def whole_spec(f: Frame, x: Array) -> pl.BlockSpec:
  """A frame array a program copies tiles out of (`TileLoader`): left in HBM on TPU, whole elsewhere."""
  if f.platform == "tpu":
    return pl.BlockSpec(memory_space=pl.ANY)
  return pl.BlockSpec(x.shape, lambda b, h, g: (0,) * x.ndim)


class TileLoader:
  """Loads row `i` of the frame (`cols` positions) of a frame array for a batch row and head: on TPU a copy
  of that row of the head's block into VMEM, then the head's part; elsewhere a direct read. `valid` gives
  its positions' validity, from a whole mask [batch, rows, 1, cols] where the plan is masked."""

  def __init__(self, f: Frame, R: dict, b: Array, head: Array, mask: str = "mask"):
    self.f, self.R, self.b, self.head, self.mask = f, R, b, head, mask

  def __call__(self, name: str, i: Array, dim: int) -> Array:
    f = self.f
    if f.reverse:
      return tiles.flip_rows(self._load(name, f.rows - 1 - i, dim))
    return self._load(name, i, dim)

  def _load(self, name: str, i: Array, dim: int) -> Array:
    f, b, head = self.f, self.b, self.head
    rows = pl.ds(pl.multiple_of(i * f.cols, f.cols), f.cols)
    if f.packed:
      return self.R[name][b, rows, pl.ds(head * dim, dim)]
    hb = f.heads_per_block
    layout = f.layout(dim)
    blk, within = lax.div(head, jnp.int32(hb)), lax.rem(head, jnp.int32(hb))
    if f.platform != "tpu":
      if layout == "fold":
        return self.R[name][b, rows, pl.ds(head * dim, dim)]
      if layout == "split":
        return self.R[name][b, rows, blk, within, :]
      return self.R[name][b, rows, head, :]
    block, cur = self.R["buf_all_" + name], self.R["buf_" + name]
    if layout == "fold":
      first = 0 if hb == f.heads else pl.multiple_of(blk * (hb * dim), hb * dim)
      pltpu.sync_copy(self.R[name].at[b, rows, pl.ds(first, hb * dim)], block)
    elif layout == "split":
      pltpu.sync_copy(self.R[name].at[b, rows, blk, :, :], block)
    else:
      # A block of all the heads starts at 0: a traced start Mosaic cannot prove a multiple of the (2, 128)
      # tile of a [1, dim] bfloat16 head block (one head per chip) fails to compile.
      first = 0 if hb == f.heads else pl.multiple_of(head - within, hb)
      pltpu.sync_copy(self.R[name].at[b, rows, pl.ds(first, hb), :], block)
    for jj in range(hb):
      @pl.when(within == jj)
      def _(jj=jj):
        cur[...] = block[:, jj * dim:(jj + 1) * dim] if layout == "fold" else block[:, jj, :]
    return cur[...]

  def valid(self, i: Array, b: Array, shape: tuple[int, int]) -> Array:
    """Validity of frame row i's positions as a row [1, cols] or a column [cols, 1]."""
    f = self.f
    axis = 1 if shape[0] == 1 else 0
    ok = f.valid(i, lax.broadcasted_iota(jnp.int32, shape, axis))
    if f.masked:
      m = self.R[self.mask][b, pl.ds(i, 1), 0, :] > 0  # [1, cols]
      ok = ok & (m if axis == 1 else tiles.column(m.astype(F32)) > 0)
    return ok
