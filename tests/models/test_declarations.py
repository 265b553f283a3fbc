"""Every attention module declares what it takes and does (`CONTEXT`, `MEMORY`, `COMPRESSES`, `GRAPH_NODES`,
`PLAN`, docs/design.md section 5): the model reads the declarations, never the module's code, so these tests
hold each declaration against the class."""

from __future__ import annotations

import inspect

import pytest

from attention_core import registry as ops_registry
from models import attention, registry
from models.learned_baselines_attention import _OwnArgumentsAttention

CONTRACT = {"self", "config", "features", "num_heads", "head_dim", "causal", "dtype", "rngs", "kwargs"}
CLASSES = sorted({registry.get_module(n) for n in registry.names()}, key=lambda c: c.__name__)


def _parameters(fn) -> set[str]:
  return set(inspect.signature(fn).parameters)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_module_declares_the_model_facts_its_constructor_takes(cls):
  assert _parameters(cls.__init__) - CONTRACT == set(cls.CONTEXT)
  assert set(cls.CONTEXT) <= set(registry.CONTEXT)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_memory_compression_and_graph_nodes_are_declared(cls):
  takes = {"memory", "memory_mask"} <= _parameters(cls.__call__)
  if issubclass(cls, attention.OpAttention):
    assert takes  # the one attention path: whether an op has a memory is its registration's `memory`
  else:
    assert takes == cls.MEMORY
  assert cls.COMPRESSES == callable(getattr(cls, "compress", None))
  assert cls.GRAPH_NODES is None or callable(getattr(cls.GRAPH_NODES, "tokens", None))


@pytest.mark.parametrize("name", [n for n in registry.names() if n in ops_registry.names()])
def test_module_supplies_what_its_op_declares_as_model_inputs(name):
  cls, spec = registry.get_module(name), ops_registry.get(name)
  if issubclass(cls, _OwnArgumentsAttention):
    assert set(cls.OWN) == set(spec.inputs)
  if cls.PLAN is not None:  # a module that runs its heads itself declares its plan parameters
    assert not issubclass(cls, attention.OpAttention)
  if spec.inputs and cls is attention.OpAttention:
    pytest.fail(f"{name}: OpAttention supplies no model inputs, the op declares {spec.inputs}")
  if spec.memory:
    assert issubclass(cls, attention.OpAttention)
