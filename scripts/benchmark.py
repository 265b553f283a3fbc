"""Speed and memory of every registered attention op, side by side in one run (docs/design.md section 7).

    python -m scripts.benchmark                           # all ops, L = 1024 .. 65536, causal
    python -m scripts.benchmark --ops dense,combiner_fixed --lengths 256,512,1024 --repeats 3
    python -m scripts.benchmark --causal false --dtype bfloat16 --out_dir bench_bidir
    python -m scripts.benchmark --peers                   # + third-party rows (scripts/benchmark_peers.py)
    python -m scripts.benchmark --mode train ...          # scripts/benchmark_train.py (models/)
    python -m scripts.benchmark --mode input ...          # scripts/benchmark_input.py (data/)

What is measured (`--mode ops`, the default). For every op in `attention_core.registry` (or `--ops`) and every
length, a fresh worker process (`python -m scripts.benchmark --_worker ...`, printing one JSON line) does:
  1. AOT-compiles `jax.jit(op)` (forward) and `jax.jit(grad of sum(op(q, k, v) * cotangent) w.r.t. q, k, v)`
     (forward+backward) from shapes only, and reads XLA's `memory_analysis()`. If arguments + temporaries +
     outputs exceed `--memory_budget_gb`, it stops there: "skipped: > budget". Compile time is never timed.
  2. Draws random q, k, v, cotangent ([batch, length, heads, head_dim]), resets the process's peak-RSS counter
     (Linux: "5" > /proc/self/clear_refs resets VmHWM) and takes the current RSS as the baseline.
  3. Runs each function once (warm-up) and then `--repeats` times with `block_until_ready`; reports the
     median. When one call takes so long that the repeats would exceed `--time_budget_s`, fewer repeats are
     run (>= 1).
  4. Reports the peak-RSS increase over the baseline (VmHWM - baseline), after the forward calls and after all
     calls, XLA's compiled temp + output bytes, and on accelerators the device allocator's peak.
Lengths run in increasing order. An op is not run at a length where its forward+backward, extrapolated from
its last measured length (as L^2 for dense; at the op's own measured growth, clamped to [L, L^2], for the
others), would exceed `--time_budget_s` ("skipped: time > budget"), nor at lengths above one where it was over
the memory budget or killed. Ops that only support `causal=False` run bidirectional under `--causal true`
(column `mode`).

Output (`--out_dir`, default `bench_out/`): `benchmark_ops.md` (table of absolute figures, ratios to dense
from the same run: speedup = dense_time / op_time, mem/dense = op_peak / dense_peak, "n/a" where dense has no
figure at that length; growth = fwd+bwd time(L) / time(L/2)), `benchmark_ops.json` (header + every field of
every row) and `benchmark_ops.png` (time and memory against L, log-log, one line per op). The header gives the
JAX version, device kind, CPU count, date and flags.

Extension points (for the other packages' helpers):
  * Ops: register a pure op with `attention_core.registry.register(OpSpec(...))` in `<pkg>/registry.py`; it
    appears here by name. It runs at its automatic plan parameters (`OpSpec.params(length)`); arguments a
    model owns (weights, keys, state) come from `OpSpec.bench_inputs`: the benchmark calls
    `bench_inputs(length)` and additionally passes whichever of the keywords `batch`, `heads`, `head_dim`,
    `dtype` the callable's signature names (e.g. `bench_inputs=lambda L, *, heads, head_dim:
    {"centroids": ...}`). Array-valued inputs are closed over (compile-time constants). An op may return
    `(out, aux)`: only `out` is timed/diffed.
  * `--mode train` / `--mode input`: imported lazily from `scripts/benchmark_train.py` /
    `scripts/benchmark_input.py`, which define `main(args)`; `args` is this parser's `argparse.Namespace`
    (shared flags: lengths, batch, heads, head_dim, dtype, causal, repeats, out_dir, ops, memory_budget_gb,
    time_budget_s, seed) plus `args.extra`, the list of command-line flags this parser did not know (parse
    them with your own parser). Report through `write_report(rows, columns, out_dir, name,
    header=header_info(args))` (and `plot_scaling` if useful) so every mode writes the same markdown + JSON;
    `add_ratios` computes ratios to a baseline row. `run_worker` and `median_time` are reusable for
    per-process measurements.
  * `--peers [a,b]`: rows from `scripts/benchmark_peers.py` (`PEERS: name -> factory(length, batch, heads,
    head_dim, causal, dtype) -> (fwd, fwdbwd)`), each measured in its own worker like the ops, as rows
    `peer:<name>`; `COUNTERPARTS` there names our ops each peer is compared with in `benchmark_peers.md`
    (ratio = peer time / our time).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from attention_core import (
  registry as ops_registry,  # imports no op package until a lookup (attention_core.registry.load)
)
from runtime import cli

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_LENGTHS = tuple(1024 * 2**i for i in range(7))  # 1024 .. 65536
BASELINE = "dense"
MB = float(2**20)
GB = float(2**30)
PEER_PREFIX = "peer:"
FLASH = "flash"  # the backend's fused attention kernel, the baseline on accelerators
SKIP_MEMORY = "skipped: > budget"
SKIP_TIME = "skipped: time > budget"
SKIP_NO_FLASH = "skipped: no fused attention kernel"

# (row key, table heading) of the ops table; every other row field is still written to the JSON file.
OP_COLUMNS: tuple[tuple[str, str], ...] = (
  ("op", "op"),
  ("mode", "mode"),
  ("length", "L"),
  ("fwd_ms", "fwd ms"),
  ("fwdbwd_ms", "fwd+bwd ms"),
  ("peak_mb", "peak MB"),
  ("device_peak_mb", "device peak MB"),
  ("xla_mb", "XLA MB"),
  ("speedup_fwd", "fwd speedup"),
  ("speedup_fwdbwd", "fwd+bwd speedup"),
  ("mem_ratio", "mem/dense"),
  ("growth", "growth t(L)/t(L/2)"),
  ("status", "status"),
)



def op_columns(baseline: str) -> tuple[tuple[str, str], ...]:
  """OP_COLUMNS with the memory ratio named after the run's baseline (dense on CPU, flash on accelerators)."""
  return tuple((key, heading.replace("/dense", f"/{baseline}")) for key, heading in OP_COLUMNS)


_MODE_MODULES = {
  "train": ("scripts.benchmark_train", "scripts/benchmark_train.py", "training throughput (models/ helper)"),
  "input": ("scripts.benchmark_input", "scripts/benchmark_input.py", "input pipelines (data/ helper)"),
}


# ------------------------------------------------------------------------------------------------------------
# Pure logic (unit-tested in tests/scripts/test_benchmark.py).


def parse_bool(text: str | bool) -> bool:
  if isinstance(text, bool):
    return text
  lowered = text.strip().lower()
  if lowered in ("1", "true", "yes", "y", "on"):
    return True
  if lowered in ("0", "false", "no", "n", "off"):
    return False
  raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_lengths(text: str) -> list[int]:
  """"256,512" -> [256, 512] (sorted, unique); every length must be a positive integer."""
  try:
    lengths = sorted({int(t) for t in text.split(",") if t.strip()})
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"--lengths must be comma-separated integers, got {text!r}") from e
  if not lengths or lengths[0] < 1:
    raise argparse.ArgumentTypeError(f"--lengths must be positive integers, got {text!r}")
  return lengths


def parse_names(text: str | None, available: Sequence[str], *, flag: str) -> list[str]:
  """Comma list of names (None or "all" = every available one, in `available`'s order)."""
  if text is None or text.strip() in ("", "all"):
    return list(available)
  names = [t.strip() for t in text.split(",") if t.strip()]
  unknown = [n for n in names if n not in available]
  if unknown:
    raise ValueError(f"{flag}: unknown {unknown}; available: {list(available)}")
  return list(dict.fromkeys(names))


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


def extrapolation_exponent(name: str, history: Sequence[tuple[int, float]]) -> float:
  """Exponent p in time ~ L^p used to predict the next length: 2 for dense (and when only one point is known),
  otherwise the op's measured growth between its last two lengths, clamped to [1, 2]."""
  if name == BASELINE or len(history) < 2:
    return 2.0
  (l0, t0), (l1, t1) = history[-2], history[-1]
  if l1 <= l0 or t0 <= 0 or t1 <= 0:
    return 2.0
  return min(2.0, max(1.0, math.log(t1 / t0) / math.log(l1 / l0)))


def predict_time(length: int, history: Sequence[tuple[int, float]], exponent: float) -> float | None:
  """Predicted fwd+bwd seconds at `length` from the last (length, seconds) measurement, or None."""
  if not history:
    return None
  last_length, last_time = history[-1]
  return last_time * (length / last_length) ** exponent


def time_skip_reason(name: str, length: int, history: Sequence[tuple[int, float]],
                     budget_s: float) -> str | None:
  """"skipped: time > budget (...)" when the predicted fwd+bwd time at `length` exceeds `budget_s`."""
  predicted = predict_time(length, history, extrapolation_exponent(name, history))
  if predicted is None or predicted <= budget_s:
    return None
  return f"{SKIP_TIME} (~{predicted:.0f} s predicted from L={history[-1][0]})"


def memory_skip_reason(need_bytes: float | None, budget_bytes: float) -> str | None:
  """"skipped: > budget (...)" when XLA's compiled footprint exceeds the budget, else None."""
  if need_bytes is None or need_bytes <= budget_bytes:
    return None
  return f"{SKIP_MEMORY} (XLA needs {need_bytes / GB:.1f} GiB > {budget_bytes / GB:.1f} GiB)"


def _ratio(numer: Any, denom: Any) -> float | None:
  if not isinstance(numer, (int, float)) or not isinstance(denom, (int, float)) or numer <= 0 or denom <= 0:
    return None
  return float(numer) / float(denom)


def add_ratios(rows: Sequence[dict[str, Any]], *, baseline: str = BASELINE, key: str = "op",
               time_fields: Sequence[tuple[str, str]] = (("fwd_ms", "speedup_fwd"),
                                                         ("fwdbwd_ms", "speedup_fwdbwd")),
               memory_fields: Sequence[tuple[str, str]] = (("peak_mb", "mem_ratio"),
                                                           ("xla_mb", "xla_mem_ratio")),
               growth_field: str | None = "fwdbwd_ms") -> list[dict[str, Any]]:
  """Adds ratios to the `baseline` row of the same length (from the same run) and the growth per doubling.

  speedup = baseline_time / row_time; memory ratio = row_mem / baseline_mem; None ("n/a") when either figure
  is missing (e.g. the baseline was skipped at that length). growth = (t(L) / t(L'))^(1 / log2(L / L'))
  against the row's previous measured length L' < L, i.e. t(L) / t(L/2) for consecutive powers of two.
  """
  time_fields, memory_fields = dict(time_fields), dict(memory_fields)
  base = {r["length"]: r for r in rows if r.get(key) == baseline}
  out = []
  for row in rows:
    row = dict(row)
    ref = base.get(row["length"], {})
    for field, name in time_fields.items():
      row[name] = _ratio(ref.get(field), row.get(field))
    for field, name in memory_fields.items():
      row[name] = _ratio(row.get(field), ref.get(field))
    out.append(row)
  if growth_field is not None:
    last: dict[str, tuple[int, float]] = {}
    for row in sorted(out, key=lambda r: r["length"]):
      value = row.get(growth_field)
      row["growth"] = None
      if isinstance(value, (int, float)) and value > 0:
        prev = last.get(row[key])
        if prev is not None and row["length"] > prev[0]:
          row["growth"] = (value / prev[1]) ** (1.0 / math.log2(row["length"] / prev[0]))
        last[row[key]] = (row["length"], float(value))
  return out


PEER_COLUMNS: tuple[tuple[str, str], ...] = (
  ("peer", "peer"),
  ("op", "ours"),
  ("length", "L"),
  ("peer_fwd_ms", "peer fwd ms"),
  ("op_fwd_ms", "ours fwd ms"),
  ("fwd_ratio", "fwd peer/ours"),
  ("peer_fwdbwd_ms", "peer fwd+bwd ms"),
  ("op_fwdbwd_ms", "ours fwd+bwd ms"),
  ("fwdbwd_ratio", "fwd+bwd peer/ours"),
  ("peer_peak_mb", "peer peak MB"),
  ("op_peak_mb", "ours peak MB"),
  ("status", "status"),
)


def peer_comparisons(rows: Sequence[Mapping[str, Any]], counterparts: Mapping[str, Sequence[str]]
                     ) -> list[dict[str, Any]]:
  """One row per (peer, our counterpart op, length) present in `rows`: ratio = peer time / our time
  (>= 1: ours is at least as fast), "n/a" where either has no figure."""
  by_key = {(r["op"], r["length"]): r for r in rows}
  out = []
  for peer, ours in counterparts.items():
    for length in sorted({r["length"] for r in rows}):
      p = by_key.get((PEER_PREFIX + peer, length))
      if p is None:
        continue
      for op in ours:
        o = by_key.get((op, length), {"status": "not in this run"})
        statuses = {f"peer {p.get('status')}", f"ours {o.get('status')}"}
        out.append({
          "peer": PEER_PREFIX + peer, "op": op, "length": length,
          "peer_fwd_ms": p.get("fwd_ms"), "op_fwd_ms": o.get("fwd_ms"),
          "fwd_ratio": _ratio(p.get("fwd_ms"), o.get("fwd_ms")),
          "peer_fwdbwd_ms": p.get("fwdbwd_ms"), "op_fwdbwd_ms": o.get("fwdbwd_ms"),
          "fwdbwd_ratio": _ratio(p.get("fwdbwd_ms"), o.get("fwdbwd_ms")),
          "peer_peak_mb": p.get("peak_mb"), "op_peak_mb": o.get("peak_mb"),
          "status": "ok" if statuses == {"peer ok", "ours ok"} else ", ".join(sorted(statuses)),
        })
  return out


def format_value(value: Any) -> str:
  """Table cell: None -> "n/a"; floats with about three significant digits, no exponent notation."""
  if value is None or (isinstance(value, float) and not math.isfinite(value)):
    return "n/a"
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, int):
    return str(value)
  if isinstance(value, float):
    magnitude = abs(value)
    if magnitude >= 100:
      return f"{value:.0f}"
    if magnitude >= 10:
      return f"{value:.1f}"
    if magnitude >= 1 or magnitude == 0:
      return f"{value:.2f}"
    return f"{value:.3g}"
  return str(value).replace("|", "/").replace("\n", " ")


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
  lines = ["| " + " | ".join(h for _, h in columns) + " |",
           "|" + "|".join("---" for _ in columns) + "|"]
  for row in rows:
    lines.append("| " + " | ".join(format_value(row.get(k)) for k, _ in columns) + " |")
  return "\n".join(lines) + "\n"


def write_report(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]], out_dir: str,
                 name: str, *, header: Mapping[str, Any] | None = None, title: str | None = None,
                 notes: Sequence[str] = ()) -> dict[str, str]:
  """Writes `<out_dir>/<name>.md` (header list + table of `columns`) and `<name>.json` (header + all row
  fields).

  Shared by every benchmark mode so their outputs look alike. Returns {"markdown": path, "json": path}.
  """
  os.makedirs(out_dir, exist_ok=True)
  header = dict(header or {})
  md_path, json_path = os.path.join(out_dir, f"{name}.md"), os.path.join(out_dir, f"{name}.json")
  lines = [f"# {title or name}", ""]
  lines += [f"- {k}: {v}" for k, v in header.items()]
  lines += [f"- {n}" for n in notes]
  lines += ["", markdown_table(rows, columns)]
  with open(md_path, "w") as f:
    f.write("\n".join(lines))
  with open(json_path, "w") as f:
    json.dump({"header": header, "columns": [list(c) for c in columns], "rows": list(rows)}, f, indent=1,
              default=str)
  return {"markdown": md_path, "json": json_path}


def _length_label(length: int) -> str:
  return f"{length // 1024}K" if length >= 1024 and length % 1024 == 0 else str(length)


def plot_scaling(rows: Sequence[Mapping[str, Any]], path: str, *, key: str = "op", title: str = "",
                 panels: Sequence[tuple[str, str]] = (("fwdbwd_ms", "forward+backward time (ms)"),
                                                      ("fwd_ms", "forward time (ms)"),
                                                      ("peak_mb", "peak RSS increase (MB)"))) -> str:
  """PNG of each panel's field against L on log-log axes, one line per `key` value (Agg backend)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  names = list(dict.fromkeys(r[key] for r in rows))
  fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), squeeze=False)
  styles = ["-o", "-s", "-^", "-v", "-D", "-P", "-X", "--o", "--s", "--^", "--v", "--D", "--P", "--X"]
  for ax, (field, label) in zip(axes[0], panels, strict=True):
    for i, name in enumerate(names):
      points = sorted((r["length"], r[field]) for r in rows if r[key] == name
                      and isinstance(r.get(field), (int, float)) and r[field] > 0)
      if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, styles[i % len(styles)], label=name, markersize=4, linewidth=1.2,
                color="black" if name == BASELINE else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    lengths = sorted({r["length"] for r in rows})
    ax.set_xticks(lengths, [_length_label(n) for n in lengths], fontsize=8)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("sequence length L")
    ax.set_title(label, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
  handles, labels = axes[0][0].get_legend_handles_labels()
  for ax in axes[0][1:]:
    for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
      if lab not in labels:
        handles.append(h)
        labels.append(lab)
  fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))), fontsize=8, frameon=False)
  if title:
    fig.suptitle(title, fontsize=10)
  rows_of_legend = math.ceil(len(labels) / 4) if labels else 0
  fig.tight_layout(rect=(0, 0.05 + 0.045 * rows_of_legend, 1, 0.95 if title else 1))
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def header_info(args: argparse.Namespace, *, device: str | None = None) -> dict[str, Any]:
  """JAX version, device, CPU count, date and flags for a report header (does not start a JAX backend)."""
  import jax

  try:
    cpus_usable = len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    cpus_usable = os.cpu_count()
  flags = {k: v for k, v in sorted(vars(args).items()) if not k.startswith("_") and k != "extra"}
  return {
    "jax": jax.__version__,
    "device": device or "unknown",
    "cpus": f"{cpus_usable} usable of {os.cpu_count()}",
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    "python": sys.version.split()[0],
    "command": "python -m scripts.benchmark " + " ".join(getattr(args, "_argv", []) or []),
    "flags": json.dumps(flags, default=str),
  }


# ------------------------------------------------------------------------------------------------------------
# Worker: one (op or peer, length) per process, one JSON line on stdout.


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


# ------------------------------------------------------------------------------------------------------------
# Orchestration.


def _progress(row: Mapping[str, Any]) -> None:
  print(f"[benchmark] {row['op']:<28} L={row['length']:<6} {row.get('mode') or '':<15} "
        f"fwd {format_value(row.get('fwd_ms')):>8} ms  fwd+bwd {format_value(row.get('fwdbwd_ms')):>8} ms  "
        f"peak {format_value(row.get('peak_mb')):>7} MB  xla {format_value(row.get('xla_mb')):>7} MB  "
        f"{row.get('status')}", flush=True)


def measure_all(args: argparse.Namespace, entries: Sequence[tuple[str, str]],
                notes: list[str] | None = None) -> list[dict[str, Any]]:
  """Rows for every (kind, name) entry at every length, in increasing length, applying the skip rules.

  A flash entry whose worker finds no fused kernel on the device gives no row (its reason goes to `notes`)
  and is not run again.
  """
  rows = []
  history: dict[str, list[tuple[int, float]]] = {}
  stopped: dict[str, str] = {}
  for length in args.lengths:
    for kind, name in entries:
      key = row_name(kind, name)
      row: dict[str, Any] = {"op": key, "length": length}
      # A time skip repeats by itself at larger L (the prediction only grows); memory skips and kills are
      # remembered.
      reason = stopped.get(key) or time_skip_reason(key, length, history.get(key, []), args.time_budget_s)
      if reason and reason.startswith(SKIP_NO_FLASH):
        continue
      if reason:
        row["status"] = reason
      else:
        parsed, failure = run_worker(worker_command(args, kind, name, length),
                                     timeout_s=args.worker_timeout_s)
        row.update(parsed or {"status": failure})
        status = row.get("status", "")
        if status.startswith(SKIP_NO_FLASH):
          if notes is not None:
            notes.append(f"{FLASH} (the backend's fused attention kernel): {status}")
          stopped[key] = status
          continue
        if status.startswith(SKIP_MEMORY):
          stopped[key] = f"{SKIP_MEMORY} (at L={length} already)"
        elif "killed" in status:
          stopped[key] = f"skipped: killed at L={length}"
        elif status == "ok":
          history.setdefault(key, []).append((length, row["fwdbwd_s"]))
      rows.append(row)
      _progress(row)
  return rows


def run_ops_mode(args: argparse.Namespace) -> dict[str, str]:
  available = ops_registry.names()
  names = parse_names(args.ops, [BASELINE] + [n for n in available if n != BASELINE], flag="--ops")
  entries = ([(FLASH, FLASH)] if args.flash else []) + [("op", n) for n in names]
  if args.peers is not None:
    from scripts.benchmark_peers import PEERS

    entries += [("peer", n) for n in parse_names(args.peers, list(PEERS), flag="--peers")]
  print(f"[benchmark] {len(entries)} rows x {len(args.lengths)} lengths: {[n for _, n in entries]}",
        flush=True)
  flash_notes: list[str] = []
  measured = measure_all(args, entries, flash_notes)
  device = next((r["device"] for r in measured if r.get("device")), None)
  accelerator = device is not None and not device.startswith("cpu")
  baseline = FLASH if any(r["op"] == FLASH and r.get("status") == "ok" for r in measured) else BASELINE
  peak = "device_peak_mb" if accelerator else "peak_mb"
  rows = add_ratios(measured, baseline=baseline,
                    memory_fields=((peak, "mem_ratio"), ("xla_mb", "xla_mem_ratio")))
  header = header_info(args, device=device)
  notes = [
    f"shapes: q, k, v [batch={args.batch}, L, heads={args.heads}, head_dim={args.head_dim}], {args.dtype}",
    "fwd / fwd+bwd ms: median of repeats after a warm-up, compile excluded; fwd+bwd = grad of "
    "sum(out * random cotangent) w.r.t. q, k, v",
    "peak MB: the worker process's peak-RSS increase over its baseline after inputs were created "
    "(host memory); device peak MB: the accelerator allocator's peak_bytes_in_use in the op's own process "
    "(inputs included; n/a on CPU); XLA MB: compiled temp + output bytes (max of fwd and fwd+bwd)",
    f"speedup = {baseline} time / op time, mem/{baseline} = op {peak} / {baseline} {peak}, both against "
    f"{baseline} in this run at the same L (n/a: no {baseline} figure there); growth = fwd+bwd time(L) / "
    "time(L/2)",
    "mode with *: the op supports only that direction",
    *flash_notes,
  ]
  paths = write_report(rows, op_columns(baseline), args.out_dir, "benchmark_ops", header=header, notes=notes,
                       title="Attention ops: time and memory")
  paths["png"] = plot_scaling(rows, os.path.join(args.out_dir, "benchmark_ops.png"),
                              title=f"{header['device']}, jax {header['jax']}, batch {args.batch}, heads "
                                    f"{args.heads}, head_dim {args.head_dim}, {args.dtype}, "
                                    f"{'causal' if args.causal else 'bidirectional'}")
  with open(paths["markdown"]) as f:
    print(f.read())
  if args.peers is not None:
    from scripts.benchmark_peers import COUNTERPARTS

    comparisons = peer_comparisons(rows, COUNTERPARTS)
    peer_paths = write_report(comparisons, PEER_COLUMNS, args.out_dir, "benchmark_peers", header=header,
                              title="Peers against our counterpart ops",
                              notes=["ratio = peer time / our time: >= 1 means ours is at least as fast"])
    paths.update(peers_markdown=peer_paths["markdown"], peers_json=peer_paths["json"])
    with open(peer_paths["markdown"]) as f:
      print(f.read())
  print(f"[benchmark] wrote {', '.join(paths.values())}", flush=True)
  return paths


def run_delegated_mode(args: argparse.Namespace) -> Any:
  module_name, path, what = _MODE_MODULES[args.mode]
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name != module_name:
      raise
    raise SystemExit(f"--mode {args.mode} ({what}) needs {path}, which is missing") from None
  return module.main(args)


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(prog="python -m scripts.benchmark", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
  parser.add_argument("-h", "--help", action="store_true",
                      help="show this help (with --mode M: also M's flags)")
  parser.add_argument("--mode", choices=("ops", *_MODE_MODULES), default="ops")
  parser.add_argument("--ops", default=None, help="comma list of registered ops (default: all)")
  parser.add_argument("--lengths", type=parse_lengths, default=list(DEFAULT_LENGTHS),
                      help="comma list (default 1024..65536, powers of 2)")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"))
  parser.add_argument("--causal", type=parse_bool, default=True, help="true|false (default true)")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed calls after one warm-up (median; default 3, --mode input: 10 train steps)")
  parser.add_argument("--out_dir", default="bench_out")
  parser.add_argument("--memory_budget_gb", type=float, default=None,
                      help="GiB; skip an (op, L) whose XLA footprint exceeds it (default: 85%% of this "
                           "machine's memory, or of the accelerator's)")
  parser.add_argument("--time_budget_s", type=float, default=300.0,
                      help="skip an op at L when its predicted fwd+bwd time exceeds this")
  parser.add_argument("--worker_timeout_s", type=float, default=3600.0,
                      help="wall limit of one worker process")
  parser.add_argument("--peers", nargs="?", const="all", default=None,
                      help="also time scripts/benchmark_peers.py PEERS (all, or a comma list)")
  parser.add_argument("--flash", type=parse_bool, default=True,
                      help="also time the backend's fused attention kernel (cuDNN on GPU, the Pallas TPU "
                           "kernel on TPU; none on CPU) and take it as the ratios' baseline (default true)")
  parser.add_argument("--implementation", default=None,
                      help="passed as implementation= to every op whose signature takes it (default: the "
                           "op's own default, 'auto')")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--_kind", choices=("op", "peer", FLASH), default="op", help=argparse.SUPPRESS)
  parser.add_argument("--_name", default=None, help=argparse.SUPPRESS)
  return parser


def print_mode_help(parser: argparse.ArgumentParser, mode: str) -> None:
  """`--mode M --help`: the shared flags, then the flags of mode M's own module."""
  module_name, _, what = _MODE_MODULES[mode]
  parser.print_help()
  print(f"\n--mode {mode} ({what}) also takes:\n")
  importlib.import_module(module_name).build_parser().print_help()


def memory_budget_bytes(args: argparse.Namespace) -> float:
  """--memory_budget_gb, or 85% of the device's memory (an accelerator's limit, else this machine's RAM)."""
  import jax

  if args.memory_budget_gb is not None:
    return args.memory_budget_gb * GB
  stats = jax.devices()[0].memory_stats() or {}
  total = stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return 0.85 * float(total)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = build_parser()
  argv = list(sys.argv[1:] if argv is None else argv)
  args, extra = parser.parse_known_args(argv)
  if extra and args.mode == "ops":
    parser.error(f"unrecognized arguments: {' '.join(extra)}")
  for flag in ("batch", "heads", "head_dim", "repeats"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
  for flag in ("memory_budget_gb", "time_budget_s", "worker_timeout_s"):
    if getattr(args, flag) is not None and not getattr(args, flag) > 0:
      parser.error(f"--{flag} must be > 0, got {getattr(args, flag)}")
  if args.mode != "input" and args.repeats is None:
    args.repeats = 3
  if args.help:
    if args.mode == "ops":
      parser.print_help()
    else:
      print_mode_help(parser, args.mode)
    parser.exit()
  args.extra = extra
  args._argv = argv
  return args


def main(argv: Iterable[str] | None = None) -> Any:
  args = parse_args(None if argv is None else list(argv))
  if args._worker:
    return worker_main(args)
  if args.mode == "ops":
    run_ops_mode(args)
    return 0
  return run_delegated_mode(args)


if __name__ == "__main__":
  sys.exit(main())
