"""Combiner attention (Ren et al., NeurIPS 2021): full attention at sparse cost, as pure JAX functions.

Every op follows the contract of DESIGN.md §3; `combiner.reference` builds the same attention from the set
definitions with explicit loops, and `combiner.sparse` holds the sparse baselines each plan is derived from.
"""

from combiner.axial import axial
from combiner.fixed import fixed

__all__ = ["axial", "fixed"]
