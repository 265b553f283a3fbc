"""The attention op registry under its former name, for callers not yet reading `core.registry` directly.

Everything here is `core.registry`'s (which loads every op package's registrations on first lookup); new code
imports `core.registry`.
"""

from __future__ import annotations

from core.registry import (
           OPS,
           OpSpec,
           bench_params,
           get,
           load,
           names,
           register,
           sqrt_pow2,
           takes_implementation,
)

load()  # `OPS` is read directly by some callers

__all__ = ["OPS", "OpSpec", "bench_params", "get", "load", "names", "register", "sqrt_pow2",
           "takes_implementation"]
