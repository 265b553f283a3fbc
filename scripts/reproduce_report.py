"""The results of a table's runs (scripts/reproduce.py): collected from the workdirs into markdown and CSV
beside the papers' values, evaluation curves, and evaluation-memory sweeps."""

from __future__ import annotations

import csv
import datetime
import io
import math
import statistics
from collections.abc import Sequence
from typing import Any

from runtime import paths
from scripts.reproduce_runner import RUN_INFO, build_config, implemented, unavailable, workdir
from scripts.reproduce_tables import Row
from training import status as run_status


def metric_value(metric: str, metrics: dict[str, Any]) -> float | None:
  """The row's number in the paper's unit from train.py's metrics.json."""
  if metric == "bits_per_byte":
    return float(metrics["loss"]) / math.log(2.0) if "loss" in metrics else None
  value = metrics.get(metric)
  if value is None:
    return None
  return 100.0 * float(value) if metric == "accuracy" else float(value)


COLUMNS = ("table", "row", "metric", "paper", "ours", "std", "delta", "seeds", "steps", "scale", "date",
           "data", "status")


def collect(selected: list[Row], scale: str, root: str, *, seeds: int = 1) -> list[dict[str, Any]]:
  """One record per row: paper value, ours (mean over the seeds found), delta, steps, scale, date."""
  out = []
  for row in selected:
    rec: dict[str, Any] = dict.fromkeys(COLUMNS)
    rec.update(table=row.table, row=row.label, metric=row.metric, paper=row.paper, seeds=0, scale=scale,
               status=unavailable(row) or "not run")
    if implemented(row):
      values, steps, dates = [], [], []
      for seed in range(max(seeds, 1)):
        wd = workdir(row, scale, root, seed)
        mpath = paths.join(wd, "metrics.json")
        if not paths.exists(mpath):
          continue
        metrics = paths.read_json(mpath)
        value = metric_value(row.metric, metrics)
        if value is None:
          continue
        values.append(value)
        steps.append(int(metrics.get("step", 0)))
        dates.append(datetime.datetime.fromtimestamp(paths.path(mpath).stat().mtime).date().isoformat())
        info_path = paths.join(wd, RUN_INFO)
        if paths.exists(info_path):
          rec["data"] = paths.read_json(info_path).get("data_version") or rec["data"]
      rec["status"] = "ok" if values else _unfinished(row, workdir(row, scale, root, 0))
      if values:
        rec.update(ours=statistics.fmean(values), seeds=len(values), steps=max(steps), date=max(dates),
                   std=statistics.stdev(values) if len(values) > 1 else None)
        if row.paper is not None:
          rec["delta"] = rec["ours"] - row.paper
    out.append(rec)
  return out


Curve = list[tuple[int, float]]  # [(step, value)]


def eval_points(row: Row, wd: str) -> Curve:
  """One run's evaluations in the paper's unit, from its TensorBoard events: [(step, value)] by step."""
  config = paths.join(wd, "config.json")
  split = (paths.read_json(config) if paths.exists(config) else {}).get("eval_split", "validation")
  scalars = paths.read_scalars(paths.join(wd, "tensorboard"))
  prefix = f"eval_{split}/"
  points: dict[int, dict[str, float]] = {}
  for tag, series in scalars.items():
    if tag.startswith(prefix):
      for step, value in series:
        points.setdefault(step, {})[tag[len(prefix):]] = value
  values = ((step, metric_value(row.metric, metrics)) for step, metrics in sorted(points.items()))
  return [(step, value) for step, value in values if value is not None]


def _unfinished(row: Row, wd: str) -> str:
  """The status of a row without final metrics: "not run", or how far a stopped run got (its last
  evaluation), so that a run cut short by a time limit shows its progress; `--run` resumes it."""
  stopped = run_status.record_path(wd, "preempted")
  points = eval_points(row, wd) if paths.exists(paths.join(wd, "tensorboard")) else []
  if not (paths.exists(stopped) or points):
    return "not run"
  step = paths.read_json(stopped).get("step") if paths.exists(stopped) else None
  last = f"; last evaluation {points[-1][1]:.4g} at step {points[-1][0]}" if points else ""
  return f"unfinished (stopped at step {step}{last})" if step is not None else f"unfinished{last}"


def curves(selected: list[Row], scale: str, root: str, *, seeds: int = 1) -> dict[Row, Curve]:
  """Each run row's evaluation curve in the paper's unit, from its TensorBoard events: [(step, value)], the
  mean over the seeds that logged that step."""
  out = {}
  for row in selected:
    if not implemented(row):
      continue
    by_step: dict[int, list[float]] = {}
    for seed in range(max(seeds, 1)):
      for step, value in eval_points(row, workdir(row, scale, root, seed)):
        by_step.setdefault(step, []).append(value)
    if by_step:
      out[row] = [(step, statistics.fmean(values)) for step, values in sorted(by_step.items())]
  return out


def plot_curves(curves_: dict[Row, Curve], out: str) -> None:
  """One panel per table: every row's evaluation curve against training steps, written as a PNG to `out`."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tables_ = list(dict.fromkeys(row.table for row in curves_))
  fig, axes = plt.subplots(len(tables_), 1, figsize=(8, 4.5 * len(tables_)), squeeze=False)
  for ax, table in zip(axes[:, 0], tables_, strict=True):
    rows = [row for row in curves_ if row.table == table]
    for i, row in enumerate(rows):
      steps, values = zip(*curves_[row], strict=True)
      # Dashed after the colour cycle's 10 colours, so that no two rows share a line.
      ax.plot(steps, values, marker=".", label=row.label, linestyle="-" if i < 10 else "--")
    ax.set_title(table)
    ax.set_xlabel("training step")
    ax.set_ylabel(rows[0].metric.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=110)
  plt.close(fig)
  paths.write_bytes(out, buf.getvalue())


def memory_rows(selected: list[Row], scale: str) -> list[Row]:
  """The implemented rows whose model carries a memory of earlier segments (config.model.mem_len > 0)."""
  return [r for r in selected if implemented(r) and int(build_config(r, scale).model.get("mem_len", 0) or 0)]


EVAL_MEM_COLUMNS = ("table", "row", "eval_mem_len", "bits_per_byte", "loss", "step", "split", "batches",
                    "examples")


def eval_memory_sweep(selected: list[Row], scale: str, root: str, lengths: Sequence[int]) -> list[dict]:
  """Each memory row's latest checkpoint evaluated on its config's eval_split with every evaluation memory
  length in `lengths` (0 = none), over the batches of train.py's evaluations: one record per (row, length).
  Rows without a checkpoint are skipped with a line."""
  from training import evaluate

  out = []
  for row in memory_rows(selected, scale):
    wd = workdir(row, scale, root)
    if not paths.exists(paths.join(wd, "checkpoints")):
      print(f"{row.table} / {row.label}: no checkpoint in {wd}: not evaluated", flush=True)
      continue
    for n in lengths:
      m = evaluate.evaluate_workdir(wd, eval_mem_len=int(n))
      bpb = metric_value("bits_per_byte", m)
      out.append({"table": row.table, "row": row.label, "eval_mem_len": int(n), "bits_per_byte": bpb,
                  "loss": float(m["loss"]), "step": int(m["step"]), "split": m["split"],
                  "batches": m["num_batches"], "examples": m["num_examples"]})
      print(f"{row.table} / {row.label} step {m['step']}: eval_mem_len {n}: {m['split']} "
            f"{bpb:.4f} bits per byte ({m['num_batches']} batches)", flush=True)
  return out


def eval_memory_markdown(records: list[dict]) -> str:
  lines = ["| row | step | eval memory | validation bits per byte |", "|---|---|---|---|"]
  lines += [f"| {r['row']} | {r['step']} | {r['eval_mem_len']} | {r['bits_per_byte']:.4f} |" for r in records]
  return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
  if value is None:
    return ""
  if isinstance(value, float):
    return f"{value:.3f}" if abs(value) < 1000 else f"{value:.1f}"
  return str(value)


def to_markdown(records: list[dict[str, Any]]) -> str:
  lines = []
  for table in dict.fromkeys(r["table"] for r in records):
    rows = [r for r in records if r["table"] == table]
    lines += [f"## {table} ({rows[0]['metric']}, scale {rows[0]['scale']})", "",
              "| row | paper | ours | delta | seeds | steps | date | status |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
      ours = _fmt(r["ours"]) + (f" ± {r['std']:.3f}" if r["std"] is not None else "")
      status = r["status"] + (f" ({r['data']})" if r["data"] else "")
      lines.append(f"| {r['row']} | {_fmt(r['paper'])} | {ours} | {_fmt(r['delta'])} | {r['seeds'] or ''} | "
                   f"{_fmt(r['steps'])} | {_fmt(r['date'])} | {status} |")
    lines.append("")
  return "\n".join(lines)


def to_csv(records: list[dict[str, Any]]) -> str:
  buf = io.StringIO()
  w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
  w.writeheader()
  for r in records:
    w.writerow({k: ("" if r[k] is None else r[k]) for k in COLUMNS})
  return buf.getvalue()
