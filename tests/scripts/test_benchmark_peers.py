"""scripts/benchmark_peers.py without torch: the `nsa_pytorch` peer is registered against our `nsa` and hands
the package our op's automatic parameters (stand-in torch and package, so the core's venv runs it)."""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import types

import numpy as np
import pytest

from attention_baselines.nsa import auto_params
from attention_core import registry as ops_registry
from scripts import benchmark_peers


class _Positions:
  """A stand-in parameter: remembers what `copy_` wrote."""

  def __init__(self, shape):
    self.shape = shape
    self.value = None

  def copy_(self, value):
    self.value = value


class _Array(np.ndarray):
  """numpy with torch's `new_full`."""

  def new_full(self, shape, value):
    return np.full(shape, value, self.dtype)


def _fake_torch_and_package(monkeypatch) -> tuple[list[dict], list[str]]:
  """Installs stand-ins for `torch` and `native_sparse_attention_pytorch`; returns the list that collects each
  SparseAttention's constructor arguments and the log of calls."""
  built, log = [], []

  class SparseAttention:
    def __init__(self, **kwargs):
      self.kwargs = kwargs
      built.append(self)
      self.k_intrablock_positions = _Positions((kwargs["heads"], kwargs["compress_block_size"], 4))
      self.v_intrablock_positions = _Positions((kwargs["heads"], kwargs["compress_block_size"], 4))

    def to(self, dtype):
      log.append(("to", dtype))
      return self

    def eval(self):
      return self

    def __call__(self, x):  # x: [batch, length, 3 * inner] -> [batch, length, inner]
      log.append("attn")
      return x[..., : x.shape[-1] // 3]

  def randn(*shape, generator=None, dtype=None, requires_grad=False):
    return np.random.default_rng(len(log)).normal(size=shape[0] if len(shape) == 1 else shape)

  nn = types.SimpleNamespace(Module=object, Identity=lambda: "identity")
  fake_torch = types.SimpleNamespace(
      float32="float32", nn=nn, no_grad=contextlib.nullcontext, randn=randn,
      Generator=lambda: types.SimpleNamespace(manual_seed=lambda seed: None),
      autograd=types.SimpleNamespace(grad=lambda out, inputs: log.append(("grad", float(out)))))
  monkeypatch.setitem(sys.modules, "torch", fake_torch)
  monkeypatch.setitem(sys.modules, "native_sparse_attention_pytorch",
                      types.SimpleNamespace(SparseAttention=SparseAttention))
  return built, log


def test_nsa_pytorch_is_registered_against_nsa():
  factory = benchmark_peers.PEERS["nsa_pytorch"]
  assert benchmark_peers.COUNTERPARTS["nsa_pytorch"] == ("nsa",)
  assert "nsa" in ops_registry.names() and ops_registry.OPS["nsa"].params is auto_params  # the peer's params
  assert list(inspect.signature(factory).parameters) == ["length", "batch", "heads", "head_dim", "causal",
                                                          "dtype"]
  assert "torch" not in benchmark_peers.__dict__  # torch is imported inside the factories only


def test_nsa_pytorch_refuses_bidirectional_before_importing_torch(monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)  # an import of torch would raise ImportError
  with pytest.raises(ValueError, match="causal only"):
    benchmark_peers.PEERS["nsa_pytorch"](256, 1, 2, 16, False, "float32")


@pytest.mark.parametrize("length", [256, 1024, 8192])
def test_nsa_pytorch_takes_our_automatic_parameters(monkeypatch, length):
  built, log = _fake_torch_and_package(monkeypatch)
  fwd, fwdbwd = benchmark_peers.PEERS["nsa_pytorch"](length, 1, 2, 4, True, "float32")
  p = auto_params(length)
  (attn,) = built
  kw = attn.kwargs
  assert kw["compress_block_size"] == p["compress_block"]
  assert kw["compress_block_sliding_stride"] == p["compress_stride"]
  assert kw["selection_block_size"] == p["select_block"]
  assert kw["num_selected_blocks"] + 1 == p["num_selected"]  # + the own block, which the package adds
  assert kw["sliding_window_size"] == p["window"]
  assert kw["causal"] is True and kw["norm"] is False and kw["num_compressed_mem_kv"] == 1
  assert kw["dim"] == 3 * 2 * 4 and kw["dim_head"] == 4 and kw["heads"] == 2
  assert int(kw["compress_mlp_expand_factor"] * p["compress_block"] * 4) == 4  # hidden = head_dim
  gates = kw["strategy_combine_mlp"].forward(np.zeros((1, 3, 24)).view(_Array))  # [batch, length, 3 * heads]
  assert gates.shape == (1, 3, 6) and np.allclose(1 / (1 + np.exp(-gates)), 1 / 3)
  # Only the attention is timed: no q/k/v or output projection, no rotation.
  assert attn.to_qkv == attn.combine_heads == "identity"
  assert attn.rotary_emb.rotate_queries_with_cached_keys("q", "k") == ("q", "k")
  assert attn.k_intrablock_positions.value is not None and attn.v_intrablock_positions.value is not None
  fwd()
  fwdbwd()
  assert log[:3] == [("to", "float32"), "attn", "attn"] and len(log) == 4
  assert log[3][0] == "grad" and math.isfinite(log[3][1])
