"""Every registered attention op, read by the models and the scripts.

Importing this module imports each op package's `registry` module, which registers its ops in `core.registry`;
the names below are that registry's. A new op package adds one import line here.
"""

from __future__ import annotations

import baselines.registry  # noqa: F401  (registers dense, dense_xla)
import combiner.registry  # noqa: F401  (registers the Combiner plans and their sparse counterparts)
import routing.registry  # noqa: F401  (registers routing, combiner_routed)
import yoso.registry  # noqa: F401  (registers yoso, yoso_sketch, yoso_e, yoso_c)
from core.registry import OPS, OpSpec, get, names, register, sqrt_pow2, takes_implementation

__all__ = ["OPS", "OpSpec", "get", "names", "register", "sqrt_pow2", "takes_implementation"]
