"""Registers the Combiner plans and their sparse counterparts: op, module, decoder, sequence-parallel form."""

from __future__ import annotations

import functools

from attention_core.decode import bind
from attention_core.registry import OpSpec, register, sqrt_pow2
from combiner import axial, fixed, logsparse, mixture, seq_parallel, sparse
from combiner import seq_parallel_axial as sp_axial
from combiner import seq_parallel_logsparse as sp_logsparse
from combiner.axial_decode import AXIAL, SPARSE_AXIAL
from combiner.fixed import SELECT, fixed_select
from combiner.fixed_decode import FIXED, SPARSE_FIXED
from combiner.logsparse_decode import LOGSPARSE, SPARSE_LOGSPARSE
from combiner.mixture_decode import MIXTURE
from combiner.selected_decode import SELECTED


def _block(length: int) -> dict:
  return {"block_size": sqrt_pow2(length)}


def _block_select(length: int) -> dict:
  return {"block_size": sqrt_pow2(length), "select": SELECT}


def _row(length: int) -> dict:
  return {"row_length": sqrt_pow2(length)}


COMBINER = "models.attention:CombinerAttention"  # the module with DeepSets pooling and the learned span key

register(OpSpec("combiner_fixed", fixed, params=_block, description="Combiner-Fixed, O(L sqrt L)",
                decode=FIXED, module=COMBINER, seq_parallel=seq_parallel.fixed))
register(OpSpec("combiner_fixed_select", fixed_select, params=_block_select, module=COMBINER, decode=SELECTED,
                description=f"Combiner-Fixed, each query's top-{SELECT} spans exact (NSA-style selection)"))
register(OpSpec("combiner_logsparse", logsparse, description="Combiner-Logsparse, O(L log L)",
                decode=LOGSPARSE, module=COMBINER, seq_parallel=sp_logsparse.logsparse))
for _direction in ("rowmajor", "vertical", "horizontal"):
  register(OpSpec(f"combiner_axial_{_direction}", functools.partial(axial, direction=_direction), params=_row,
                  description=f"Combiner-Axial ({_direction}), O(L sqrt L)",
                  decode=bind(AXIAL, direction=_direction), module=COMBINER,
                  seq_parallel=functools.partial(sp_axial.axial, direction=_direction)))
register(OpSpec("combiner_mixture", mixture, params=_row,
                description="Combiner-Mixture (mean of vertical and horizontal), O(L sqrt L)",
                decode=MIXTURE, module=COMBINER, seq_parallel=sp_axial.mixture))
register(OpSpec("combiner_mixture_joint", functools.partial(mixture, normalize="joint"), params=_row,
                description="Combiner-Mixture, one joint softmax (released code), O(L sqrt L)",
                decode=bind(MIXTURE, normalize="joint"), module=COMBINER,
                seq_parallel=functools.partial(sp_axial.mixture, normalize="joint")))
register(OpSpec("sparse_fixed", sparse.fixed, params=_block, description="Sparse Transformer fixed pattern",
                decode=SPARSE_FIXED, seq_parallel=seq_parallel.sparse_fixed))
register(OpSpec("sparse_logsparse", sparse.logsparse, description="LogSparse pattern",
                decode=SPARSE_LOGSPARSE, seq_parallel=sp_logsparse.sparse_logsparse))
register(OpSpec("sparse_axial", sparse.axial, params=_row, description="Axial attention (row + column)",
                decode=SPARSE_AXIAL, seq_parallel=sp_axial.sparse_axial))
