"""Test-session setup: 8 simulated CPU devices (docs/design.md section 6) before JAX initialises its
backend."""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keep the repository root importable however pytest is invoked (the root is the import root, as in
# big_vision).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
