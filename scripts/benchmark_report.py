"""The benchmark's report (scripts/benchmark.py, and its train and input modes): ratios to a baseline row, the
markdown and JSON tables, the scaling plot and the header that says what ran where."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from scripts.benchmark_worker import PEER_PREFIX

BASELINE = "dense"

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
