"""Combiner attention (Ren et al., NeurIPS 2021): full attention at sparse cost, as pure JAX functions.

Every op follows the contract of docs/design.md §3; `combiner.reference` builds the same attention from the
set definitions with explicit loops, and `combiner.sparse` holds the sparse baselines each plan is derived
from.
"""

from combiner import sparse
from combiner.axial import axial
from combiner.fixed import fixed
from combiner.logsparse import logsparse
from combiner.mixture import mixture
from combiner.routed import routed

__all__ = ["axial", "fixed", "logsparse", "mixture", "routed", "sparse"]
