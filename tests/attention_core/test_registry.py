"""Every registration declares what its function does: the keywords it takes (plan parameters, model inputs,
the fused path's argument), the plan parameters `params(L)` chooses, whether keys may run longer than the
queries (a memory), and the values of its fused path. Nothing else in the code reads an op's signature, so
these tests are where a declaration and its function are held against each other."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import pytest

from attention_core import registry as ops_registry

NAMES = ops_registry.names()


def keywords(fn) -> set[str]:
  """The keyword-only parameters of an op a registration may set (those a partial binds are its own)."""
  bound = set(fn.keywords) if isinstance(fn, functools.partial) else set()
  return {n for n, p in inspect.signature(fn).parameters.items()
          if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in bound} - {"causal", "mask"}


def mismatch(spec: ops_registry.OpSpec) -> list[str]:
  """What a registration declares that its function does not take, and the reverse."""
  chooser = {"implementation"} if ops_registry.takes_implementation(spec) else set()
  declared = set(spec.plan) | set(spec.inputs) | chooser
  taken = keywords(spec.fn)
  out = [f"declared, not taken: {sorted(declared - taken)}"] if declared - taken else []
  out += [f"taken, not declared: {sorted(taken - declared)}"] if taken - declared else []
  if set(spec.plan) & set(spec.inputs):
    out.append(f"both a plan parameter and a model input: {sorted(set(spec.plan) & set(spec.inputs))}")
  for length in (1, 7, 64, 4096):
    if not set(spec.params(length)) <= set(spec.plan):
      out.append(f"params({length}) chooses undeclared {sorted(set(spec.params(length)) - set(spec.plan))}")
  if spec.fused is not None and spec.fused.argument not in taken:
    out.append(f"fused path chosen by {spec.fused.argument!r}, which the function does not take")
  return out


@pytest.mark.parametrize("name", NAMES)
def test_registration_declares_what_its_function_takes(name):
  spec = ops_registry.get(name)
  assert mismatch(spec) == []
  inputs = ops_registry.bench_params(spec, 16, heads=2, head_dim=8)
  assert set(inputs) - set(spec.params(16)) <= set(spec.inputs)  # stand-ins only for model inputs


def test_a_declaration_that_differs_from_its_function_is_found():
  def op(q, k, v, *, causal, mask=None, block_size, pool_q=None):
    return v

  assert mismatch(ops_registry.OpSpec("ok", op, plan={"block_size": ops_registry.POSITIVE},
                                      inputs=("pool_q",))) == []
  assert mismatch(ops_registry.OpSpec("extra", op, plan={"block_size": ops_registry.POSITIVE, "width": 1},
                                      inputs=("pool_q",))) == ["declared, not taken: ['width']"]
  assert mismatch(ops_registry.OpSpec("missing", op, plan={"block_size": ops_registry.POSITIVE})) == [
      "taken, not declared: ['pool_q']"]
  assert mismatch(ops_registry.OpSpec("fused", op, plan={"block_size": ops_registry.POSITIVE},
                                      inputs=("pool_q",), fused=ops_registry.PALLAS)) == [
      "declared, not taken: ['implementation']", "fused path chosen by 'implementation', which the function "
      "does not take"]


@pytest.mark.parametrize("name", NAMES)
def test_memory_is_declared_where_keys_may_run_longer(name):
  """A memory op takes M keys more than queries (the first queries then see the memory); any other op refuses
  them."""
  spec = ops_registry.get(name)
  if not spec.causal:
    pytest.skip("memory is segment recurrence: causal ops only")
  length, memory = 8, 4
  kq, kk = jax.random.split(jax.random.key(0))
  q = jax.random.normal(kq, (1, length, 2, 8))
  kv = jax.random.normal(kk, (1, memory + length, 2, 8))
  params = ops_registry.bench_params(spec, memory + length, heads=2, head_dim=8)
  call = functools.partial(spec.fn, q, kv, kv, causal=True, mask=jnp.ones((1, memory + length), bool),
                           **params)
  if spec.memory:
    out = call()
    assert out.shape == q.shape
  else:
    with pytest.raises((ValueError, TypeError)):
      call()


@pytest.mark.parametrize("name", sorted(ops_registry.fused_ops()))
def test_fused_path_values_are_the_ones_the_op_accepts(name):
  """An unknown value of the fused path's argument is refused, naming every declared value."""
  spec = ops_registry.get(name)
  path = spec.fused
  x = jnp.ones((1, 16, 2, 8))
  params = ops_registry.bench_params(spec, 16, heads=2, head_dim=8)
  params[path.argument] = "no_such_kernel"
  with pytest.raises(ValueError) as e:
    spec.fn(x, x, x, causal=spec.causal and path.causal, **params)
  for value in path.allowed:
    assert repr(value) in str(e.value)
  assert set(path.kernels) <= set(path.values) and path.reference not in path.values


def test_plan_parameter_kinds():
  ops_registry.POSITIVE.check(3, name="block_size")
  ops_registry.CHUNKS.check(None, name="row_chunks")
  with pytest.raises(ValueError, match="block_size must be >= 1"):
    ops_registry.POSITIVE.check(0, name="block_size")
  with pytest.raises(ValueError, match="block_size must be an int, got 2.5"):
    ops_registry.POSITIVE.check(2.5, name="block_size")
  with pytest.raises(ValueError, match="flag must be a bool"):
    ops_registry.FLAG.check(1, name="flag")
  ops_registry.TUPLE.check([0, -1], name="global_blocks")  # a list (JSON) passes for a tuple


@pytest.mark.parametrize("name", [n for n in NAMES if ops_registry.get(n).seq_parallel is not None])
def test_sequence_parallel_form_takes_what_the_registration_declares(name):
  """attention_core.partition hands a sequence-split call to the op's sequence-parallel form when the call's
  keywords are among the registration's plan and inputs: the form must take them all."""
  spec = ops_registry.get(name)
  form = spec.seq_parallel
  bound = set(form.keywords) if isinstance(form, functools.partial) else set()
  taken = set(inspect.signature(form).parameters) - bound
  assert {"causal", "mask", *spec.plan, *spec.inputs} <= taken, sorted(
      {"causal", "mask", *spec.plan, *spec.inputs} - taken)
