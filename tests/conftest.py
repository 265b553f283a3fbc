"""Test-session setup: 8 simulated CPU devices (docs/design.md section 6) before JAX initialises its
backend."""

import os
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
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


# The fast suite (under 10 minutes on 2 cores) runs a sample of the long parametrized sweeps; `-m slow` runs
# the rest. Sweeps over every registered op keep the listed cases fast (one or more of each family, the
# cheapest); other tests send the listed cases (their most expensive: logsparse, the joint mixture, the
# widest definitions) to the slow run. Ids match by prefix.
FAST_CASES = {
    "test_every_attention_forward_backward": (
        "dense-", "combiner_fixed-", "combiner_axial_rowmajor-", "sparse_fixed-", "linear-", "local-",
        "none-", "linformer-", "yoso-"),
    "test_nonfinite_behind_masks_never_reaches_visible_outputs": (
        "dense", "combiner_fixed", "combiner_axial_rowmajor", "sparse_fixed", "sparse_axial", "linear",
        "linformer", "local", "none", "nystromformer", "synthesizer", "yoso_c", "yoso_e", "bigbird",
        "longformer"),
}
SLOW_CASES = {
    "test_op_step_equals_forward": ("combiner_logsparse-", "combiner_mixture_joint-", "combiner_fixed-"),
    "test_op_step_equals_forward_with_pooled_inputs": ("combiner_mixture-",),
    "test_op_equals_reference": ("logsparse", "mixture_joint", "mixture_mean", "axial_vertical"),
    "test_gradients_match_finite_differences": ("logsparse", "mixture_joint"),
    "test_no_nan_fully_masked_spans_and_huge_logits": ("logsparse", "mixture_joint", "mixture_mean"),
    "test_jacobian_causality_through_a_layer": ("logsparse", "mixture_joint", "mixture_mean"),
    "test_bfloat16_close_to_float32": ("logsparse", "mixture_joint"),
    "test_sparse_gradients_bf16_and_huge_logits": ("logsparse",),
    "test_sparse_op_equals_reference_and_support": ("logsparse",),
    "test_pallas_equals_xla": ("logsparse-", "axial_vertical-", "mixture_mean-"),
    "test_lowers_for_accelerators": ("mixture-cuda", "logsparse-cuda", "sparse_logsparse-tpu"),
    "test_matches_reference": ("10-4-False", "13-3-False"),
    "test_longformer_matches_definition": ("10-4-glob3-True", "13-3-glob1-True"),
    "test_bigbird_matches_definition": ("22-2-glob0-2-", "16-2-glob2-3-True"),
    "test_linear_equals_its_quadratic_formula": ("12-3-True", "11-4-True"),
    "test_causal_outputs_do_not_depend_on_the_future": ("linear", "performer", "local"),
    "test_registered_ops_run_at_their_automatic_parameters": ("bigbird", "performer"),
    "test_model_decode_equals_forward": ("combiner_logsparse", "dense", "combiner_fixed"),
    "test_masked_keys_holding_nan_change_nothing": ("linear-", "performer-True"),
    "test_formulations_agree_on_the_same_draws": ("onehot-", "pallas-None"),
    "test_dense_backward_matches_surrogate_exactly": ("False",),
    "test_linear_bidirectional_keeps_input_dtypes": ("bfloat16",),
    "test_routing_step_equals_nearest_forward": ("False-True",),
}


def _case_is_slow(name: str, case: str) -> bool:
  if name in FAST_CASES:
    return not any(case == p or (p.endswith("-") and case.startswith(p)) for p in FAST_CASES[name])
  return any(case.startswith(p) for p in SLOW_CASES.get(name, ()))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
  for item in items:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and _case_is_slow(item.originalname, callspec.id):
      item.add_marker(pytest.mark.slow)



@pytest.fixture(autouse=True)
def _traced_for_cpu(request):
  """Ops traced in a test make their choices for CPU only (`core.contract.traced_for`), as train.py's steps
  do for their mesh: one trace instead of one per platform. Tests that lower for another platform (export
  for TPU or CUDA, the per-platform staging itself) are marked `all_platforms`."""
  if request.node.get_closest_marker("all_platforms"):
    yield
    return
  from core import contract

  with contract.traced_for("cpu"):
    yield
