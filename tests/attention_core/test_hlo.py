"""attention_core.hlo.device_ops on HLO text as XLA's TPU backend prints it: what counts as a device op, and
(device_op_breakdown) where each comes from."""

from __future__ import annotations

from attention_core import hlo

# An entry computation with bookkeeping, an async copy, a kernel, a fusion and a loop of 4 iterations whose
# body runs a fusion and a custom call; the loop's condition is `i < 4` (no known trip count printed); a
# computation header whose parameter types carry "/*index=5*/" comments.
PROGRAM = """HloModule jit_f, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%fused_computation (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %negate.1 = f32[8]{0} negate(%param_0)
}

%body (arg: (s32[], f32[8], f32[8], f32[8], f32[8], /*index=5*/f32[8])) -> (s32[], f32[8]) {
  %arg = (s32[], f32[8]) parameter(0)
  %gte.0 = s32[] get-tuple-element(%arg), index=0
  %gte.1 = f32[8]{0} get-tuple-element(%arg), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%gte.0, %one)
  %fusion.2 = f32[8]{0} fusion(%gte.1), kind=kLoop, calls=%fused_computation
  %kernel.2 = f32[8]{0} custom-call(%fusion.2), custom_call_target="tpu_custom_call"
  ROOT %tuple.2 = (s32[], f32[8]) tuple(%next, %kernel.2)
}

%cond (arg.1: (s32[], f32[8])) -> pred[] {
  %arg.1 = (s32[], f32[8]) parameter(0)
  %gte.2 = s32[] get-tuple-element(%arg.1), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%gte.2, %four), direction=LT
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %copy-start = (f32[8]{0}, f32[8]{0}, u32[]) copy-start(%x)
  %copy-done = f32[8]{0} copy-done(%copy-start)
  %bitcast.1 = f32[8]{0} bitcast(%copy-done)
  %kernel.1 = f32[8]{0} custom-call(%bitcast.1), custom_call_target="tpu_custom_call"
  %fusion.1 = f32[8]{0} fusion(%kernel.1), kind=kLoop, calls=%fused_computation
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]) tuple(%zero, %fusion.1)
  %loop = (s32[], f32[8]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8]{0} get-tuple-element(%loop), index=1
}
"""


def test_device_ops_count_work_not_bookkeeping():
  """Entry: copy-start (its done half not counted), custom call, fusion = 3; the loop's body (add, fusion,
  custom call) 4 times = 12; parameters, constants, tuples, their elements and bitcasts are free."""
  got = hlo.device_ops(PROGRAM)
  assert got == hlo.DeviceOps(ops=15, custom_calls=5, fusions=5)


def test_known_trip_count_wins_over_the_condition():
  text = PROGRAM.replace("condition=%cond, body=%body",
                         'condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"2"}}')
  assert hlo.device_ops(text).ops == 3 + 2 * 3


def test_breakdown_groups_the_same_count_by_where_each_op_comes_from():
  """Each op's origin is read from its JAX metadata: the primitive after the innermost named scope (a
  kernel's name), "(backward)" inside a transpose, "XLA" where the compiler added it (the copy-start); the
  counts sum to device_ops'."""
  text = PROGRAM.replace(
      'custom-call(%bitcast.1), custom_call_target="tpu_custom_call"',
      'custom-call(%bitcast.1), custom_call_target="tpu_custom_call", '
      'metadata={op_name="jit(f)/jvp(my_kernel)/pallas_call" source_file="x.py"}').replace(
      'custom-call(%fusion.2), custom_call_target="tpu_custom_call"',
      'custom-call(%fusion.2), custom_call_target="tpu_custom_call", '
      'metadata={op_name="jit(f)/transpose(jvp(my_kernel_bwd))/pallas_call"}').replace(
      "%fusion.1 = f32[8]{0} fusion(%kernel.1), kind=kLoop, calls=%fused_computation",
      '%fusion.1 = f32[8]{0} fusion(%kernel.1), kind=kLoop, calls=%fused_computation, '
      'metadata={op_name="jit(f)/transpose(jvp())/gather;jit(f)/jvp()/add"}')
  got = hlo.device_op_breakdown(text)
  assert got == [(4, "add", "XLA"), (4, "custom-call", "my_kernel_bwd/pallas_call (backward)"),
                 (4, "fusion", "XLA"), (1, "copy-start", "XLA"), (1, "custom-call", "my_kernel/pallas_call"),
                 (1, "fusion", "gather (backward)")]
  assert sum(n for n, _, _ in got) == hlo.device_ops(text).ops == 15


def test_a_kernel_without_metadata_is_named_by_its_instruction():
  """XLA names a custom call after its kernel (`%splash_mha_fwd.1`); what it added itself is "XLA"."""
  got = hlo.device_op_breakdown(PROGRAM)
  assert got == [(5, "custom-call", "kernel"), (5, "fusion", "XLA"), (4, "add", "XLA"),
                 (1, "copy-start", "XLA")]
