"""Registers the Combiner plans and their sparse counterparts in the single op registry."""

from __future__ import annotations

import functools

from combiner import axial, fixed, logsparse, mixture, sparse
from core.registry import OpSpec, register, sqrt_pow2


def _block(length: int) -> dict:
  return {"block_size": sqrt_pow2(length)}


def _row(length: int) -> dict:
  return {"row_length": sqrt_pow2(length)}


register(OpSpec("combiner_fixed", fixed, params=_block, description="Combiner-Fixed, O(L sqrt L)"))
register(OpSpec("combiner_logsparse", logsparse, description="Combiner-Logsparse, O(L log L)"))
for _direction in ("rowmajor", "vertical", "horizontal"):
  register(OpSpec(f"combiner_axial_{_direction}", functools.partial(axial, direction=_direction), params=_row,
                  description=f"Combiner-Axial ({_direction}), O(L sqrt L)"))
register(OpSpec("combiner_mixture", mixture, params=_row, description="Combiner-Mixture (mean of vertical and "
                "horizontal), O(L sqrt L)"))
register(OpSpec("combiner_mixture_joint", functools.partial(mixture, normalize="joint"), params=_row,
                description="Combiner-Mixture, one joint softmax (released code), O(L sqrt L)"))
register(OpSpec("sparse_fixed", sparse.fixed, params=_block, description="Sparse Transformer fixed pattern"))
register(OpSpec("sparse_logsparse", sparse.logsparse, description="LogSparse pattern"))
register(OpSpec("sparse_axial", sparse.axial, params=_row, description="Axial attention (row + column)"))
