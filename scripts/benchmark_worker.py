"""One measurement of the benchmark (scripts/benchmark.py) in a process of its own: an op or a peer at one
length, compiled from shapes, its memory read from XLA and the process, its forward and forward+backward
timed; and the launching of such workers, one JSON line back each."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from attention_core import (
  registry as ops_registry,  # imports no op package until a lookup (attention_core.registry.load)
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MB = float(2**20)
GB = float(2**30)
PEER_PREFIX = "peer:"
FLASH = "flash"  # the backend's fused attention kernel, the baseline on accelerators
SKIP_MEMORY = "skipped: > budget"

SKIP_NO_FLASH = "skipped: no fused attention kernel"


def op_direction(supports_causal: bool, supports_bidirectional: bool, causal: bool) -> tuple[bool, str]:
  """The direction an op runs in when `causal` is requested, and the table's `mode` cell.

  An op that supports only one direction runs in that one; the cell says so ("bidirectional*" under a causal
  run).
  """
  if causal and not supports_causal:
    return False, "bidirectional*"
  if not causal and not supports_bidirectional:
    return True, "causal*"
  return causal, "causal" if causal else "bidirectional"


def memory_skip_reason(need_bytes: float | None, budget_bytes: float) -> str | None:
  """"skipped: > budget (...)" when XLA's compiled footprint exceeds the budget, else None."""
  if need_bytes is None or need_bytes <= budget_bytes:
    return None
  return f"{SKIP_MEMORY} (XLA needs {need_bytes / GB:.1f} GiB > {budget_bytes / GB:.1f} GiB)"


def _read_status_kb(field: str) -> float | None:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return float(line.split()[1])
  except OSError:
    pass
  return None


class PeakRSS:
  """Peak resident-set increase of this process over a baseline (Linux VmHWM; falls back to ru_maxrss)."""

  def __init__(self) -> None:
    self.resettable = False
    try:
      with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
      self.resettable = _read_status_kb("VmHWM") is not None
    except OSError:
      pass
    self.baseline_kb = self._peak_kb() if not self.resettable else _read_status_kb("VmRSS")

  def _peak_kb(self) -> float:
    if self.resettable:
      return _read_status_kb("VmHWM") or 0.0
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # kB on Linux

  def increase_mb(self) -> float:
    return max(0.0, self._peak_kb() - (self.baseline_kb or 0.0)) / 1024.0


def median_time(fn: Callable[[], Any], repeats: int, budget_s: float,
                block: Callable[[Any], Any] = lambda x: x) -> tuple[float, int]:
  """(median seconds, calls timed) of `block(fn())` after one untimed warm-up call.

  Runs fewer than `repeats` timed calls (at least one) when the warm-up says they would exceed `budget_s`.
  """
  start = time.perf_counter()
  block(fn())
  warm = time.perf_counter() - start
  n = max(1, min(repeats, int(budget_s // warm) if warm > 0 else repeats))
  times = []
  for _ in range(n):
    start = time.perf_counter()
    block(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times), n


def op_params(spec: Any, length: int, **shape: Any) -> dict[str, Any]:
  """The op's automatic plan parameters and benchmark inputs (`attention_core.registry.bench_params`), also
     passing the
  keywords among batch/heads/head_dim/dtype their signatures name."""
  return ops_registry.bench_params(spec, length, **shape)


def _xla_memory(compiled: Any) -> dict[str, int] | None:
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # some backends do not implement it
    return None
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  if analysis is None:
    return None
  return {name: int(getattr(analysis, f"{name}_size_in_bytes", 0) or 0)
          for name in ("argument", "output", "temp", "alias", "generated_code")}


def _device_peak_mb() -> float | None:
  import jax

  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:
    return None
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return stats["peak_bytes_in_use"] / MB


def _start_worker(args: argparse.Namespace, result: dict[str, Any]) -> Any:
  """Starts JAX for one measurement (float64 enabled when asked) and records the device; returns jax."""
  import jax

  if args.dtype == "float64":
    jax.config.update("jax_enable_x64", True)
  device = jax.local_devices()[0]
  result["device"] = f"{device.platform} ({device.device_kind})"
  return jax


def flash_attention_fn(platform: str, *, causal: bool, dtype: str, length: int, head_dim: int
                       ) -> tuple[Callable[..., Any] | None, str]:
  """(forward, "") for the backend's raw fused attention kernel, or (None, skip reason).

  GPU: `jax.nn.dot_product_attention(..., implementation="cudnn")` (bfloat16/float16); TPU: Splash attention
  with a causal or full mask (`attention_baselines.splash.kernel`, the tiles `dense` uses; lengths a multiple
  of 128). q, k, v: [batch, length, heads, head_dim]; no key mask, as for the ops.
  """
  import jax
  import jax.numpy as jnp

  if platform == "gpu":
    if dtype not in ("bfloat16", "float16"):
      return None, f"{SKIP_NO_FLASH} for {dtype} (cuDNN flash attention takes bfloat16/float16)"
    def cudnn(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    return cudnn, ""
  if platform == "tpu":
    if dtype not in ("bfloat16", "float32") or length % 128:
      return None, f"{SKIP_NO_FLASH} for {dtype}, L={length} (Splash: bfloat16/float32, L % 128 == 0)"
    from attention_baselines import splash

    def forward(q, k, v):
      heads = q.shape[2]
      run = splash.kernel(splash.Pattern(causal=causal), length, heads)
      q = q * jnp.asarray(head_dim**-0.5, q.dtype)  # Splash has no logit scale of its own
      qh, kh, vh = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # [batch, heads, length, head_dim]
      return jnp.swapaxes(jax.vmap(run)(qh, kh, vh), 1, 2)  # [batch, length, heads, head_dim]
    return forward, ""
  return None, f"{SKIP_NO_FLASH} on {platform}"


def _worker_flash(args: argparse.Namespace, result: dict[str, Any]) -> None:
  jax = _start_worker(args, result)
  result["mode"] = "causal" if args.causal else "bidirectional"
  forward, reason = flash_attention_fn(jax.default_backend(), causal=args.causal, dtype=args.dtype,
                                       length=args.lengths[0], head_dim=args.head_dim)
  if forward is None:
    result["status"] = reason
    return
  _measure(forward, args, result)


def _worker_op(args: argparse.Namespace, result: dict[str, Any]) -> None:
  _start_worker(args, result)
  forward, result["mode"], params = op_forward(
      ops_registry.get(args._name), args.lengths[0], causal=args.causal, batch=args.batch, heads=args.heads,
      head_dim=args.head_dim, dtype=args.dtype, implementation=args.implementation)
  result["params"] = {k: v for k, v in params.items() if isinstance(v, (int, float, str, bool))}
  _measure(forward, args, result)


def op_forward(spec: Any, length: int, *, causal: bool, batch: int, heads: int, head_dim: int, dtype: str,
               implementation: str | None = None) -> tuple[Callable[..., Any], str, dict[str, Any]]:
  """(forward(q, k, v), mode, params): a registered op at its automatic parameters for this shape, run in
  the direction it supports (see `op_direction`), with `implementation` where the op takes one."""
  causal, mode = op_direction(spec.causal, spec.bidirectional, causal)
  params = op_params(spec, length, batch=batch, heads=heads, head_dim=head_dim, dtype=dtype)
  if implementation is not None and ops_registry.takes_implementation(spec):
    params["implementation"] = implementation

  def forward(q, k, v):  # [batch, length, heads, head_dim] each
    out = spec.fn(q, k, v, causal=causal, **params)
    return out[0] if isinstance(out, tuple) else out  # [batch, length, heads, head_dim]

  return forward, mode, params


def _measure(forward: Callable[..., Any], args: argparse.Namespace, result: dict[str, Any]) -> None:
  """Compiles, checks the memory budget, then times forward and forward+backward of `forward(q, k, v)`."""
  import jax
  import jax.numpy as jnp

  length = args.lengths[0]
  dtype = jnp.dtype(args.dtype)

  def loss(q, k, v, cotangent):
    return jnp.sum((forward(q, k, v) * cotangent).astype(jnp.float32))

  fwdbwd = jax.grad(loss, argnums=(0, 1, 2))
  shape = jax.ShapeDtypeStruct((args.batch, length, args.heads, args.head_dim), dtype)
  start = time.perf_counter()
  fwd_c = jax.jit(forward).lower(shape, shape, shape).compile()
  fwdbwd_c = jax.jit(fwdbwd).lower(shape, shape, shape, shape).compile()
  result["compile_s"] = time.perf_counter() - start
  memories = [_xla_memory(fwd_c), _xla_memory(fwdbwd_c)]
  if all(m is not None for m in memories):
    result["xla_fwd_mb"] = (memories[0]["temp"] + memories[0]["output"]) / MB
    result["xla_fwdbwd_mb"] = (memories[1]["temp"] + memories[1]["output"]) / MB
    result["xla_mb"] = max(result["xla_fwd_mb"], result["xla_fwdbwd_mb"])
    need = max(m["argument"] + m["temp"] + m["output"] for m in memories)
    reason = memory_skip_reason(need, memory_budget_bytes(args))
    if reason:
      result["status"] = reason
      return

  keys = jax.random.split(jax.random.key(args.seed), 4)
  q, k, v, cotangent = (jax.random.normal(key, shape.shape, dtype) for key in keys)
  jax.block_until_ready((q, k, v, cotangent))
  rss = PeakRSS()
  result["rss_resettable"] = rss.resettable
  result["fwd_s"], result["fwd_repeats"] = median_time(
    lambda: fwd_c(q, k, v), args.repeats, args.time_budget_s, jax.block_until_ready)
  result["fwd_peak_mb"] = rss.increase_mb()
  result["fwdbwd_s"], result["fwdbwd_repeats"] = median_time(
    lambda: fwdbwd_c(q, k, v, cotangent), args.repeats, args.time_budget_s, jax.block_until_ready)
  result["peak_mb"] = rss.increase_mb()
  result["device_peak_mb"] = _device_peak_mb()
  result["status"] = "ok"


def _worker_peer(args: argparse.Namespace, result: dict[str, Any]) -> None:
  from scripts.benchmark_peers import PEERS

  if args._name not in PEERS:
    raise ValueError(f"unknown peer {args._name!r}; registered: {sorted(PEERS)}")
  result["mode"] = "causal" if args.causal else "bidirectional"
  fwd, fwdbwd = PEERS[args._name](args.lengths[0], args.batch, args.heads, args.head_dim, args.causal,
                                  args.dtype)
  rss = PeakRSS()
  result["rss_resettable"] = rss.resettable
  result["fwd_s"], result["fwd_repeats"] = median_time(fwd, args.repeats, args.time_budget_s)
  result["fwd_peak_mb"] = rss.increase_mb()
  result["fwdbwd_s"], result["fwdbwd_repeats"] = median_time(fwdbwd, args.repeats, args.time_budget_s)
  result["peak_mb"] = rss.increase_mb()
  result["status"] = "ok"


def worker_main(args: argparse.Namespace) -> int:
  """Measures one (op or peer, length) and prints one JSON line; exit status 1 on error (also reported)."""
  result: dict[str, Any] = {"op": row_name(args._kind, args._name),
                            "length": args.lengths[0], "status": "error"}
  code = 0
  try:
    {"op": _worker_op, "peer": _worker_peer, FLASH: _worker_flash}[args._kind](args, result)
  except Exception as e:  # reported in the table instead of aborting the whole run
    result["status"] = f"error: {type(e).__name__}: {e}"[:300]
    code = 1
  for field in ("fwd_s", "fwdbwd_s"):
    if field in result:
      result[field.replace("_s", "_ms")] = result[field] * 1000.0
  print(json.dumps(result, default=str), flush=True)
  return code


def parse_worker_output(stdout: str) -> dict[str, Any] | None:
  """The last JSON object line of a worker's stdout (libraries may print before it), or None."""
  for line in reversed(stdout.strip().splitlines()):
    line = line.strip()
    if line.startswith("{"):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        return None
  return None


def row_name(kind: str, name: str) -> str:
  return PEER_PREFIX + name if kind == "peer" else name


def worker_command(args: argparse.Namespace, kind: str, name: str, length: int) -> list[str]:
  command = [sys.executable, "-m", "scripts.benchmark", "--_worker", "--_kind", kind, "--_name", name,
             "--lengths", str(length), "--batch", str(args.batch), "--heads", str(args.heads),
             "--head_dim", str(args.head_dim), "--dtype", args.dtype, "--causal", str(args.causal).lower(),
             "--repeats", str(args.repeats), "--time_budget_s", str(args.time_budget_s),
             "--seed", str(args.seed)]
  if args.memory_budget_gb is not None:
    command += ["--memory_budget_gb", str(args.memory_budget_gb)]
  if getattr(args, "implementation", None) is not None:
    command += ["--implementation", args.implementation]
  return command


def run_worker(command: Sequence[str], *, timeout_s: float) -> tuple[dict[str, Any] | None, str]:
  """Runs a worker command from the repository root; (parsed JSON line or None, failure description)."""
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # so an accelerator's peak is the op's own
  env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
  try:
    proc = subprocess.run(list(command), cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return None, f"failed: worker timed out after {timeout_s:.0f} s"
  parsed = parse_worker_output(proc.stdout)
  if parsed is not None:
    return parsed, ""
  if proc.returncode in (-9, 137):
    return None, "failed: killed (out of memory?)"
  tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
  return None, f"failed: rc={proc.returncode}: {tail}"[:300]


def memory_budget_bytes(args: argparse.Namespace) -> float:
  """--memory_budget_gb, or 85% of the device's memory (an accelerator's limit, else this machine's RAM)."""
  import jax

  if args.memory_budget_gb is not None:
    return args.memory_budget_gb * GB
  stats = jax.devices()[0].memory_stats() or {}
  total = stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return 0.85 * float(total)
