"""Registers the Combiner plans and their sparse counterparts: op, plan parameters, model inputs, fused path,
module, decoder, sequence-parallel form."""

from __future__ import annotations

import functools

from attention_core.decode import bind
from attention_core.registry import CHUNKS, PALLAS, POSITIVE, TEXT, OpSpec, Param, register, sqrt_pow2
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
POOLS = ("pool_q", "pool_k")  # DeepSets: the model's vectors to pool into span abstractions
SELECT_COUNT = Param(int, 0)  # spans attended exactly (0 = Combiner-Fixed)
FIXED_PLAN = {"block_size": POSITIVE, "pooling": TEXT, "select": SELECT_COUNT, "query_chunks": CHUNKS}
ROW_PLAN = {"row_length": POSITIVE, "pooling": TEXT, "query_chunks": CHUNKS}

register(OpSpec("combiner_fixed", fixed, params=_block, description="Combiner-Fixed, O(L sqrt L)",
                decode=FIXED, module=COMBINER, seq_parallel=seq_parallel.fixed, plan=FIXED_PLAN, inputs=POOLS,
                fused=PALLAS))
register(OpSpec("combiner_fixed_select", fixed_select, params=_block_select, module=COMBINER, decode=SELECTED,
                description=f"Combiner-Fixed, each query's top-{SELECT} spans exact (NSA-style selection)",
                plan=FIXED_PLAN, inputs=POOLS, fused=PALLAS))
register(OpSpec("combiner_logsparse", logsparse, description="Combiner-Logsparse, O(L log L)",
                decode=LOGSPARSE, module=COMBINER, seq_parallel=sp_logsparse.logsparse,
                plan={"pooling": TEXT}, inputs=POOLS, fused=PALLAS))
for _direction in ("rowmajor", "vertical", "horizontal"):
  register(OpSpec(f"combiner_axial_{_direction}", functools.partial(axial, direction=_direction), params=_row,
                  description=f"Combiner-Axial ({_direction}), O(L sqrt L)",
                  decode=bind(AXIAL, direction=_direction), module=COMBINER,
                  seq_parallel=functools.partial(sp_axial.axial, direction=_direction), plan=ROW_PLAN,
                  inputs=(*POOLS, "span_key_fn"), fused=PALLAS))
register(OpSpec("combiner_mixture", mixture, params=_row,
                description="Combiner-Mixture (mean of vertical and horizontal), O(L sqrt L)",
                decode=MIXTURE, module=COMBINER, seq_parallel=sp_axial.mixture,
                plan={**ROW_PLAN, "normalize": TEXT}, inputs=POOLS, fused=PALLAS))
register(OpSpec("combiner_mixture_joint", functools.partial(mixture, normalize="joint"), params=_row,
                description="Combiner-Mixture, one joint softmax (released code), O(L sqrt L)",
                decode=bind(MIXTURE, normalize="joint"), module=COMBINER,
                seq_parallel=functools.partial(sp_axial.mixture, normalize="joint"), plan=ROW_PLAN,
                inputs=POOLS, fused=PALLAS))
register(OpSpec("sparse_fixed", sparse.fixed, params=_block, description="Sparse Transformer fixed pattern",
                decode=SPARSE_FIXED, seq_parallel=seq_parallel.sparse_fixed, plan={"block_size": POSITIVE},
                fused=PALLAS))
register(OpSpec("sparse_logsparse", sparse.logsparse, description="LogSparse pattern",
                decode=SPARSE_LOGSPARSE, seq_parallel=sp_logsparse.sparse_logsparse, fused=PALLAS))
register(OpSpec("sparse_axial", sparse.axial, params=_row, description="Axial attention (row + column)",
                decode=SPARSE_AXIAL, seq_parallel=sp_axial.sparse_axial,
                plan={"row_length": POSITIVE, "query_chunks": CHUNKS}, fused=PALLAS))
