"""Test-session setup: 8 simulated CPU devices (docs/design.md section 6) before JAX initialises its
backend."""

import os
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "")
# 8 simulated devices; and the CPU backend's code generation at its cheapest. The tests' programs are tiny,
# so generating machine code is most of their compile time and little of their run time: LLVM's
# optimisation passes off, the elemental emitters instead of the MLIR fusion emitters, one codegen thread.
# XLA's HLO passes, which decide the program, its fusions and its buffers, still run, and TPU compiles are
# unchanged. The suites take about half the time.
for flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
             "--xla_llvm_disable_expensive_passes=true", "--xla_cpu_use_fusion_emitters=false",
             "--xla_cpu_parallel_codegen_split_count=1"):
  if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keep the repository root importable however pytest is invoked (the root is the import root, as in
# big_vision).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def decoding_matches_forward():
  """check(model, length, prompt=5): prefill `prompt` tokens, decode the rest one at a time, and assert that
  every position's logits equal the model's forward pass on the same tokens (float32, 1e-5)."""

  def check(model, length: int, prompt: int = 5) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.generate import Decoder

    tokens = jax.random.randint(jax.random.key(2), (2, length), 0, 11)
    full = model({"inputs": tokens}, deterministic=True)  # [batch, length, vocab]
    dec = Decoder(model)
    cache = dec.init_cache(2, length)
    logits, cache = dec.prefill(cache, tokens[:, :prompt])
    stepped = [logits]
    for t in range(prompt + 1, length):
      out, cache = dec.decode(cache, tokens[:, t - 1], t)
      stepped.append(out[:, None])
    np.testing.assert_allclose(jnp.concatenate(stepped, axis=1), full, rtol=1e-5, atol=1e-5)

  return check


@pytest.fixture(autouse=True)
def _traced_for_cpu(request):
  """Ops traced in a test make their choices for CPU only (`attention_core.contract.traced_for`), as
     train.py's steps
  do for their mesh: one trace instead of one per platform. Tests that lower for another platform (export
  for TPU or CUDA, the per-platform staging itself) are marked `all_platforms`."""
  if request.node.get_closest_marker("all_platforms"):
    yield
    return
  from attention_core import contract

  with contract.traced_for("cpu"):
    yield


@pytest.fixture(autouse=True)
def _fresh_eager_programs():
  """Ops called eagerly run as programs cached by their arguments (`attention_core.partition._whole`);
  tests patch what ops trace to (tile sizes, the backend), so each test starts and ends with none cached."""
  from attention_core import partition

  partition.clear_compiled()
  yield
  partition.clear_compiled()
