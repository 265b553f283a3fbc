r"""The papers' result tables as data: list, run and collect their rows from the configs.

    python -m scripts.reproduce --table combiner-1 --list                  # the rows and their commands
    python -m scripts.reproduce --table combiner-1 --run --scale smoke     # run them one after another
    python -m scripts.reproduce --table all --scale smoke --run --collect  # every table, then the results
    python -m scripts.reproduce --table pystdlib --run --scale cpu --seeds 3 --collect --plot
    python -m scripts.reproduce --table combiner-2 --run --scale paper --launcher tpu \
        --workdir_root gs://B/r --tpu_args "--zone us-central2-b --accelerator v4-32 --spot"  # scripts/tpu.py

Tables: Combiner (Wang et al. 2021) Tables 1-6, Routing Transformer (Roy et al. 2021) Tables 1 and 4, YOSO
(Zeng et al. 2021) Table 3, `pystdlib` (byte-level LM on the Python standard library,
configs/pystdlib.py) and `listops-bidirectional` (ListOps of the offline generator at length 1024, every
registered bidirectional attention in one small model: configs/lra.py `listops_1024`).
A row is (table, label, paper value, metric, config string, overrides, attention); rows whose attention is not
in `models.registry.names()` (or that has no form for the row's direction, e.g. a bidirectional-only op in a
decoder) are listed as "not implemented" and skipped, so a table grows as modules land.

Scales: `paper` runs the config as it is; `cpu` a small model at reduced length that trains in minutes on a
CPU (per data family: `CPU_ARGS`); `smoke` the config's `smoke` variant (a few steps; generated stand-in data
when the real data is missing), with the row's architecture and length arguments dropped.

Each run has its workdir `<workdir_root>/<table>/<row>/<scale>[-seed<k>]`; a row whose workdir holds
train.py's final `metrics.json` is skipped (delete the workdir to rerun it). `--collect` reads every row's
metrics and writes `<workdir_root>/results-<scale>.md` and `.csv`: paper value, ours (mean over seeds), delta,
steps, scale, date (and the data version where the data varies by machine, e.g. the Python of pystdlib).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import importlib
import io
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python scripts/reproduce.py` as well as `python -m scripts.reproduce`
  sys.path.insert(0, ROOT)

from runtime import cli, paths  # noqa: E402
from training import status as run_status  # noqa: E402

SCALES = ("smoke", "cpu", "paper")
RUN_INFO = "reproduce.json"  # written into each row's workdir after its run: what ran, where, with what
# Arguments dropped from a row's config string at smoke scale: the smoke variant's own model and length win.
SMOKE_DROPS = ("layers", "features", "heads", "mlp_dim", "seq_len", "steps", "batch_size", "main",
               "routing_heads", "routing_layers", "window", "clusters")
SMOKE_OVERRIDE_DROPS = ("train.eval_batch_size", "train.eval_batches")  # row overrides smoke drops
# cpu scale: config arguments appended to the row's (they win), by config file; minutes on 2 CPU cores.
_CPU_MODEL = "layers=2,features=128,heads=4,mlp_dim=512,batch_size=8,steps=600"
CPU_ARGS = {
  "configs/cifar10.py": _CPU_MODEL + ",image_size=16",
  "configs/imagenet64.py": _CPU_MODEL + ",image_size=16",
  "configs/wiki40b.py": _CPU_MODEL + ",seq_len=512",
  "configs/c4.py": _CPU_MODEL + ",seq_len=512",
  "configs/lra.py": "layers=2,features=64,heads=2,mlp_dim=128,batch_size=16,steps=600",
  "configs/pystdlib.py": "",  # the config is CPU-sized already
}
_CPU_ROUTING = "layers=2,features=128,heads=8,mlp_dim=512,batch_size=8,steps=600,image_size=16"


@dataclasses.dataclass(frozen=True)
class Row:
  """One result of a paper table and the config that reproduces it.

  paper: the published value (None where the paper gives none); metric: "bits_per_dim" | "perplexity" |
  "accuracy" (percent, as the papers print it) | "bits_per_byte"; config: `path[:arg]` for train.py --config;
  overrides: extra `--config.<field>=<value>` flags (`{workdir_root}` in them: --workdir_root); attention: the
  registry name the row needs; cpu_args: the config arguments of the cpu scale when not CPU_ARGS' (a setting
  that is CPU-sized already: "").
  """

  table: str
  label: str
  paper: float | None
  metric: str
  config: str
  attention: str
  overrides: tuple[str, ...] = ()
  note: str = ""
  cpu_args: str | None = None  # cpu scale: appended instead of CPU_ARGS[config file] ("": none)

  @property
  def id(self) -> str:
    return re.sub(r"[^a-z0-9]+", "-", self.label.lower().replace("*", "star-")).strip("-")


def _rows(table: str, metric: str, config: str, items: Sequence[tuple], arg_prefix: str = "") -> list[Row]:
  """items: (label, paper value, attention, extra config arg[, overrides[, note]])."""
  out = []
  for item in items:
    label, value, attention, extra = item[:4]
    overrides = tuple(item[4]) if len(item) > 4 else ()
    note = item[5] if len(item) > 5 else ""
    arg = ",".join(a for a in (arg_prefix, f"attention={attention}", extra) if a)
    out.append(Row(table, label, value, metric, f"{config}:{arg}", attention, overrides, note))
  return out


SAME_ARCHITECTURE = "every head of every layer routes (the same architecture as the other rows)"


def _combiner_tables() -> dict[str, list[Row]]:
  t: dict[str, list[Row]] = {}
  # Table 1: 6-layer ablation (and 12 layers) on CIFAR-10 and ImageNet-64, bits/dim.
  six = [("Reformer", None, None, "reformer"), ("Performer", 3.335, 3.719, "performer"),
         ("Logsparse", 4.253, 4.351, "sparse_logsparse"),
         ("Combiner-Logsparse", 3.366, 3.795, "combiner_logsparse"),
         ("Fixed", 3.408, 3.696, "sparse_fixed"), ("Combiner-Fixed", 3.321, 3.654, "combiner_fixed"),
         ("Axial", 3.666, 4.032, "sparse_axial"), ("Combiner-Axial", 3.050, 3.585, "combiner_axial_vertical"),
         ("Combiner-Mixture", 3.040, 3.585, "combiner_mixture")]
  twelve = [("Reformer", None, 3.710, "reformer"), ("Performer", 3.310, 3.636, "performer"),
            ("Routing Transformer", 2.950, None, "routing"),
            ("Combiner-Mixture", 2.885, 3.504, "combiner_mixture")]
  rows = []
  for dataset, col in (("cifar10", 1), ("imagenet64", 2)):
    for layers, models in ((6, six), (12, twelve)):
      for m in models:
        value = m[col]
        if m[0] == "Reformer" and dataset == "cifar10":
          continue  # no CIFAR-10 number in the paper
        if m[0] == "Routing Transformer" and dataset == "imagenet64":
          continue
        if m[0] == "Reformer":
          value = 3.740 if layers == 6 else 3.710
        note = ("same architecture as every row: routing in every head of every layer"
                if m[3] == "routing" else "")
        rows += _rows("combiner-1", "bits_per_dim", f"configs/{dataset}.py",
                      [(f"{dataset} {m[0]} {layers}L", value, m[3], f"layers={layers}", (), note)])
  t["combiner-1"] = rows
  # Table 2: Wiki-40B LM perplexity (12 layers, width 768).
  t["combiner-2"] = _rows("combiner-2", "perplexity", "configs/wiki40b.py", [
    ("Transformer-2k", 17.26, "dense", ""), ("Performer-2k", 19.66, "performer", ""),
    ("Routing-2k", 20.85, "routing", "", (), SAME_ARCHITECTURE),
    ("Fixed-2k", 18.04, "sparse_fixed", ""), ("Combiner-Fixed-2k", 17.70, "combiner_fixed", ""),
    ("Axial-2k", 20.82, "sparse_axial", ""), ("Combiner-Axial-2k", 17.56, "combiner_axial_vertical", ""),
    ("Combiner-Fixed-8k", 16.60, "combiner_fixed", "seq_len=8192"),
    ("Combiner-Axial-8k", 16.49, "combiner_axial_vertical", "seq_len=8192")])
  # Table 3: Wiki-40B 8k ablation of the span summaries (DeepSets), perplexity.
  t["combiner-3"] = _rows("combiner-3", "perplexity", "configs/wiki40b.py", [
    ("Transformer-2k", 17.26, "dense", ""),
    ("Combiner-DeepSets-Max-8k", 16.29, "combiner_fixed", "seq_len=8192,deepsets=true,pooling=max"),
    ("Combiner-DeepSets-Mean-8k", 16.48, "combiner_fixed", "seq_len=8192,deepsets=true,pooling=mean"),
    ("Combiner-Max-8k", 16.60, "combiner_fixed", "seq_len=8192,pooling=max"),
    ("Combiner-Mean-8k", 16.54, "combiner_fixed", "seq_len=8192,pooling=mean")])
  # Table 4: the main image results (Child et al.'s 128 layers on CIFAR-10; 30 layers on ImageNet-64).
  t["combiner-4"] = _rows("combiner-4", "bits_per_dim", "configs/cifar10.py", [
    ("CIFAR-10 Combiner-Axial", 2.77, "combiner_axial_vertical", "main")]) + _rows(
    "combiner-4", "bits_per_dim", "configs/imagenet64.py", [
    ("ImageNet-64 Combiner-Axial", 3.42, "combiner_axial_vertical", "main")])
  # Table 5: Long Range Arena test accuracy (pathfinder-32 "inter").
  lra_models = [("Transformer", "dense", (36.38, 64.27, 57.46, 42.44, 88.81)),
                ("Local Attention", "local", (15.95, 52.98, 53.39, 41.46, 84.64)),
                ("Sparse Trans.", "sparse_fixed", (35.78, 63.58, 59.59, 44.24, 83.90)),
                ("Longformer", "longformer", (36.03, 62.85, 56.89, 42.22, 86.68)),
                ("Linformer", "linformer", (35.49, 53.94, 52.27, 38.56, 86.17)),
                ("Reformer", "reformer", (36.30, 56.10, 53.40, 38.07, 79.18)),
                ("Sinkhorn Trans.", "sinkhorn", (34.20, 61.20, 53.83, 41.23, 73.36)),
                ("Synthesizer", "synthesizer", (36.50, 61.68, 54.67, 41.61, 81.61)),
                ("BigBird", "bigbird", (37.08, 64.02, 59.29, 40.83, 86.75)),
                ("Linear Trans.", "linear", (17.15, 65.90, 53.09, 42.34, 88.13)),
                ("Performer", "performer", (36.00, 65.40, 53.82, 42.77, 88.76)),
                ("Combiner-Fixed", "combiner_fixed", (36.65, 64.99, 59.81, 41.67, 88.59)),
                ("Combiner-Axial", "combiner_axial_vertical", (36.15, 64.36, 56.10, 41.33, 88.43))]
  t["combiner-5"] = _lra_rows("combiner-5", lra_models, "")
  # Table 6: C4 MLM perplexity (the Wiki-40B architecture, bidirectional).
  t["combiner-6"] = _rows("combiner-6", "perplexity", "configs/c4.py", [
    ("Transformer-2k", 4.552, "dense", ""), ("BigBird-2k", 4.696, "bigbird", ""),
    ("Performer-2k", 10.940, "performer", ""), ("Fixed-2k", 5.279, "sparse_fixed", ""),
    ("Combiner-Fixed-2k", 5.170, "combiner_fixed", ""), ("Axial-2k", 5.370, "sparse_axial", ""),
    ("Combiner-Axial-2k", 4.809, "combiner_axial_vertical", ""),
    ("Routing-2k", 6.703, "routing", "", (), SAME_ARCHITECTURE),
    ("Combiner-Routing-2k", 6.539, "combiner_routed", ""), ("BigBird-8k", 4.542, "bigbird", "seq_len=8192"),
    ("Combiner-Axial-8k", 4.190, "combiner_axial_vertical", "seq_len=8192"),
    ("Combiner-Fixed-8k", 4.139, "combiner_fixed", "seq_len=8192")])
  return t


def _lra_rows(table: str, models: Sequence[tuple], flag: str) -> list[Row]:
  rows = []
  for label, attention, values in models:
    for task, value in zip(("listops", "text", "retrieval", "image", "pathfinder"), values, strict=True):
      arg = ",".join(a for a in (f"task={task}", flag, f"attention={attention}") if a)
      rows.append(Row(table, f"{task} {label}", value, "accuracy", f"configs/lra.py:{arg}", attention))
  return rows


def _routing_tables() -> dict[str, list[Row]]:
  # Routing Transformer Table 1 (CIFAR-10, 12 layers, 8 heads, k = 6, 200k steps); values as quoted in
  # section 6.1.
  flag = "routing_paper"
  t1 = [("Transformer (full attention)", 2.983, "dense", ""),
        ("Local Transformer", 3.009, "routing", "routing_heads=0,window=512"),
        ("Routing 2 layers 4 heads window 512", 2.986, "routing",
         "routing_heads=4,routing_layers=2,window=512"),
        ("Routing 4 layers 4 heads window 512", 2.975, "routing",
         "routing_heads=4,routing_layers=4,window=512"),
        ("Routing 4 layers 4 heads window 1024", None, "routing",
         "routing_heads=4,routing_layers=4,window=1024",
         (), "the paper's best CIFAR-10 model; its value is in the table only"),
        ("Routing only window 512", 3.400, "routing", "routing_heads=8,routing_layers=all,window=512"),
        ("Routing only window 1024", 3.291, "routing", "routing_heads=8,routing_layers=all,window=1024")]
  t4 = [("Routing Transformer", 3.425, "routing", ""),
        ("Local Transformer (24 layers, 16 heads)", 3.48, "routing", "routing_heads=0", (), "section 5.4")]
  return {"routing-1": _rows("routing-1", "bits_per_dim", "configs/cifar10.py", t1, arg_prefix=flag),
          "routing-4": _rows("routing-4", "bits_per_dim", "configs/imagenet64.py", t4, arg_prefix=flag)}


def _yoso_tables() -> dict[str, list[Row]]:
  models = [("None", "none", (19.20, 61.11, 74.78, 33.86, 66.51)),
            ("Softmax", "dense", (37.10, 65.02, 79.35, 38.20, 74.16)),
            ("YOSO-E", "yoso_e", (37.30, 64.71, 81.16, 39.78, 72.90)),
            ("Nystromformer", "nystromformer", (37.15, 65.52, 79.56, 41.58, 70.94)),
            ("Longformer", "longformer", (37.20, 64.60, 80.97, 39.06, 73.01)),
            ("Linformer", "linformer", (37.25, 55.91, 79.37, 37.84, 67.60)),
            ("Reformer", "reformer", (19.05, 64.88, 78.64, 43.29, 69.36)),
            ("Performer", "performer", (18.80, 63.81, 78.62, 37.07, 69.87)),
            ("YOSO-32", "yoso", (37.25, 63.12, 78.69, 40.21, 72.33)),
            ("YOSO-C-16", "yoso_c", (37.40, 64.28, 77.61, 44.67, 71.86)),
            ("*YOSO-16", "yoso_sketch", (37.20, 62.97, 79.02, 40.50, 72.05)),
            ("*YOSO-C-16", "yoso_sketch_c", (37.35, 65.89, 78.80, 45.93, 71.39))]
  rows = _lra_rows("yoso-3", models, "yoso_paper")
  # *YOSO-16: the sketched estimator with 16 hashes (the config gives the sampled ones 32).
  rows = [dataclasses.replace(r, overrides=("--config.model.attention.params.num_hashes=16",))
          if r.attention == "yoso_sketch" else r for r in rows]
  return {"yoso-3": rows}


PYSTDLIB_ROWS = ("dense", "sparse_fixed", "combiner_fixed", "sparse_axial", "combiner_axial_vertical",
                 "combiner_axial_horizontal", "combiner_axial_rowmajor", "combiner_mixture",
                 "sparse_logsparse", "combiner_logsparse", "routing", "yoso", "nsa", "moba",
                 "combiner_fixed_select")


# Transformer-XL in the pystdlib table: the same model, optimizer, steps and bytes per step as the other rows,
# in its own order with a memory. Segments of 512 bytes on 16 streams (16 x 512 = the 4 x 2048 bytes of a step
# of the other rows), a memory of 1536 so that a query sees up to 2048 bytes as in the other rows, relative
# positions only. Its validation reads the split as one stream of 256 segments of 512: the same first 131,072
# bytes of the split that the other rows' 16 x 4 windows of 2048 predict, each segment with the memory of the
# ones before it (so a byte sees up to 2048 earlier bytes, where a window's byte at p sees p of them).
PYSTDLIB_XL = ("transformer_xl", None, "transformer_xl", "seq_len=512,batch_size=16",
               ("--config.data.ordered=true", "--config.model.mem_len=1536",
                "--config.model.position_embedding=none", "--config.train.eval_batch_size=1",
                "--config.train.eval_batches=256"),
               "ordered streams, segments of 512 bytes with a memory of 1536")


# The Compressive Transformer and Adaptive Span rows: Transformer-XL's order, segments, optimizer and
# validation, each with the memory that gives a byte the same context of up to 2048 bytes. Compressive: the
# paper's n_m = n_cm with rate c = 2 (its PG-19 setting), a FIFO of 512 and 512 compressed slots of 2 bytes
# each (512 + 1024 bytes behind the segment), conv compression with its reconstruction loss. Adaptive Span:
# a cache of 1536 with max_span = 2048 (a head may learn to read all of it), the paper's relative position
# embeddings, its span penalty.
_PYSTDLIB_STREAM = ("--config.data.ordered=true", "--config.model.position_embedding=none",
                    "--config.train.eval_batch_size=1", "--config.train.eval_batches=256")
PYSTDLIB_COMPRESSIVE = ("compressive", None, "compressive", "seq_len=512,batch_size=16",
                        _PYSTDLIB_STREAM + ("--config.model.mem_len=512",
                                            "--config.model.compressed_mem_len=512",
                                            "--config.model.attention.compression_rate=2"),
                        "ordered streams, segments of 512 bytes, a memory of 512 and 512 compressed slots "
                        "(rate 2, 1024 bytes)")
PYSTDLIB_ADAPTIVE_SPAN = ("adaptive_span", None, "adaptive_span", "seq_len=512,batch_size=16",
                          _PYSTDLIB_STREAM + ("--config.model.mem_len=1536",
                                              "--config.model.attention.params.max_span=2048",
                                              "--config.model.attention.relative_positions=true"),
                          "ordered streams, segments of 512 bytes with a cache of 1536, spans up to 2048")


def _pystdlib_table() -> dict[str, list[Row]]:
  return {"pystdlib": _rows("pystdlib", "bits_per_byte", "configs/pystdlib.py",
                            [(name, None, name, "") for name in PYSTDLIB_ROWS]
                            + [PYSTDLIB_XL, PYSTDLIB_COMPRESSIVE, PYSTDLIB_ADAPTIVE_SPAN])}


# The bidirectional ListOps table: every registered attention with a bidirectional form in the encoder
# classifier, in one setting (configs/lra.py `listops_1024`: ListOps of the offline generator at length 1024,
# a small model; the paper scale trains with YOSO's LRA ListOps budget, which needs an accelerator, the cpu
# scale with a budget of minutes per row, which runs every row but does not rank them). Its rows come from
# the registry, so a new attention gets a row without an edit here. Left out: comparison-only duplicates of
# another row's op and the decoder-only memory systems (also marked causal-only in the registry). HIBERT is
# a model (built of dense attention), not an attention, so it has no row. `none` (no attention, feed-forward
# only) is the reference, as in YOSO's LRA table.
LISTOPS_TABLE = "listops-bidirectional"
LISTOPS_EXCLUDED = {"dense_xla": "dense's op without the fused kernels (for comparisons)",
                    "transformer_xl": "decoder-only memory", "compressive": "decoder-only memory",
                    "nsa": "decoder-only"}
# Row order: dense, then each sparse pattern with its Combiner plans beside it (as in the pystdlib table),
# then the rest alphabetically. A Combiner plan not named here joins the pattern its name starts with
# (combiner_<x>... -> sparse_<x>), else the rest.
LISTOPS_GROUPS = (("dense",), ("sparse_fixed", "combiner_fixed", "combiner_fixed_select"),
                  ("sparse_axial", "combiner_axial_vertical", "combiner_axial_horizontal",
                   "combiner_axial_rowmajor", "combiner_mixture", "combiner_mixture_joint"),
                  ("sparse_logsparse", "combiner_logsparse"), ("routing", "combiner_routed"))
# Rows that need more than the setting at length 1024: attention -> (overrides, note).
LISTOPS_ROW_FIXES: dict[str, tuple[tuple[str, ...], str]] = {}
# One cache of the generated splits for every row (generated once, before the rows run: run_rows).
LISTOPS_DATA = ("--config.data.cache_dir={workdir_root}/data",)  # {workdir_root}: see `overrides`
LISTOPS_CPU_BUDGET = "cpu_budget"  # configs/lra.py LISTOPS_1024_CPU


def bidirectional_attentions() -> list[str]:
  """The registered attentions the encoder classifier can use (a bidirectional form), in the table's order."""
  from attention_core import registry as ops_registry
  from models import registry

  ops = set(ops_registry.names())
  names = [n for n in registry.names()
           if n not in LISTOPS_EXCLUDED and (n not in ops or ops_registry.get(n).bidirectional)]
  groups = [[n for n in group if n in names] for group in LISTOPS_GROUPS]
  placed = {n for g in groups for n in g}
  rest = []
  for n in sorted(set(names) - placed):
    group = next((g for g in groups[1:] if n.startswith("combiner_")
                  and g and g[0] == "sparse_" + n.split("_")[1]), None)
    (group if group is not None else rest).append(n)
  return [n for g in groups for n in g] + rest


def _listops_table() -> dict[str, list[Row]]:
  rows = []
  for name in bidirectional_attentions():
    fix, note = LISTOPS_ROW_FIXES.get(name, ((), ""))
    config = f"configs/lra.py:listops_1024,attention={name}"
    rows.append(Row(LISTOPS_TABLE, name, None, "accuracy", config, name, LISTOPS_DATA + fix, note,
                    cpu_args=LISTOPS_CPU_BUDGET))
  return {LISTOPS_TABLE: rows}


def tables() -> dict[str, list[Row]]:
  """Every table id -> its rows, in the papers' order."""
  out: dict[str, list[Row]] = {}
  for part in (_combiner_tables(), _routing_tables(), _yoso_tables(), _pystdlib_table(), _listops_table()):
    out.update(part)
  return out


CAUSAL_TASKS = ("lm", "image")  # decoders; the other tasks run bidirectional attention


@functools.cache
def unavailable(row: Row) -> str | None:
  """Why the row cannot run yet (its attention is not registered, or has no form for the row's direction), or
  None when it can."""
  from attention_core import registry as ops_registry
  from models import registry

  if row.attention not in registry.names():
    return f"not implemented: attention {row.attention!r}"
  if row.attention in ops_registry.names():
    import data

    spec = ops_registry.get(row.attention)
    causal = data.dataset_info(build_config(row, "paper")).task in CAUSAL_TASKS
    if not (spec.causal if causal else spec.bidirectional):
      direction = "causal" if causal else "bidirectional"
      return f"not implemented: attention {row.attention!r} has no {direction} form"
  return None


def implemented(row: Row) -> bool:
  return unavailable(row) is None


# ------------------------------------------------------------------------------------------------------------
# Commands


def _split_config(config: str) -> tuple[str, list[str]]:
  path, _, arg = config.partition(":")
  return path, [a for a in arg.split(",") if a]


def config_string(row: Row, scale: str) -> str:
  """The row's `--config` value at `scale`."""
  if scale not in SCALES:
    raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
  path, items = _split_config(row.config)
  if scale == "smoke":
    items = [a for a in items if a.partition("=")[0] not in SMOKE_DROPS] + ["smoke"]
  elif scale == "cpu":
    extra = (row.cpu_args if row.cpu_args is not None
             else _CPU_ROUTING if "routing_paper" in items else CPU_ARGS.get(path, ""))
    keys = {a.partition("=")[0] for a in extra.split(",") if a}
    items = [a for a in items if a.partition("=")[0] not in keys] + [a for a in extra.split(",") if a]
  return f"{path}:{','.join(items)}" if items else path


WORKDIR_ROOT = "{workdir_root}"  # in a row's overrides: the --workdir_root of the run


def overrides(row: Row, scale: str, root: str | None = None) -> list[str]:
  """The row's `--config.*` flags at `scale`: smoke drops those of SMOKE_OVERRIDE_DROPS (the smoke variant's
  evaluation batches win, e.g. over the Transformer-XL row's single stream, which a multi-device mesh cannot
  split). `{workdir_root}` becomes `root` (absolute when local); without a root, flags naming it are left
  out (the config's default)."""
  out = []
  for o in row.overrides:
    if scale == "smoke" and o.removeprefix("--config.").partition("=")[0] in SMOKE_OVERRIDE_DROPS:
      continue
    if WORKDIR_ROOT in o:
      if root is None:
        continue
      o = o.replace(WORKDIR_ROOT, root if paths.is_uri(root) else os.path.abspath(root))
    out.append(o)
  return out


def workdir(row: Row, scale: str, root: str, seed: int = 0) -> str:
  return paths.join(root, row.table, row.id, scale if seed == 0 else f"{scale}-seed{seed}")


def train_argv(row: Row, scale: str, wd: str, seed: int = 0, root: str | None = None) -> list[str]:
  """train.py's arguments for the row (without the interpreter); root: the --workdir_root."""
  argv = ["train.py", "--config", config_string(row, scale), "--workdir", wd, *overrides(row, scale, root)]
  if seed:
    argv.append(f"--config.seed={seed}")
  return argv


def tpu_argv(row: Row, scale: str, wd: str, seed: int, tpu_args: str, allow_dirty: bool = False,
             root: str | None = None) -> list[str]:
  """`python -m scripts.tpu run` for the row (train.py's own flags after `--`); allow_dirty: ship the git
  HEAD although the tree has uncommitted changes (scripts.tpu refuses it otherwise)."""
  name = re.sub(r"[^a-z0-9-]+", "-", f"{row.table}-{row.id}-{seed}")[:60].strip("-")
  argv = [sys.executable, "-m", "scripts.tpu", "run", "--name", name, *shlex.split(tpu_args),
          *(["--allow_dirty"] if allow_dirty else []), "--config", config_string(row, scale), "--workdir", wd]
  extra = [*overrides(row, scale, root)] + ([f"--config.seed={seed}"] if seed else [])
  return argv + (["--", *extra] if extra else [])


def build_config(row: Row, scale: str, root: str | None = None) -> Any:
  """The row's resolved config (get_config + overrides), checked against the attention registry; root: the
  --workdir_root (see `overrides`)."""
  from models import registry

  path, _, arg = config_string(row, scale).partition(":")
  module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
  c = module.get_config(arg or None)
  for flag in overrides(row, scale, root):
    key, _, value = flag.removeprefix("--config.").partition("=")
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    current = node.get(leaf, None)
    if isinstance(current, bool):
      if value.lower() not in ("true", "false"):
        raise cli.UsageError(f"{flag}: {key} takes true or false")
      node[leaf] = value.lower() == "true"
    elif isinstance(current, (int, float)):
      node[leaf] = type(current)(value)
    elif value.lower() in ("true", "false"):  # a new field (a module's own): read as train.py's flags read it
      node[leaf] = value.lower() == "true"
    else:
      node[leaf] = int(value) if value.lstrip("-").isdigit() else value
  registry.check_fields(c.model.attention)
  registry.get_module(str(c.model.attention.name))
  return c


# ------------------------------------------------------------------------------------------------------------
# Running


def finished(wd: str) -> bool:
  return paths.exists(paths.join(wd, "metrics.json"))


def _run_info(row: Row, scale: str, seed: int, argv: list[str]) -> dict[str, Any]:
  import platform

  info = {"table": row.table, "row": row.label, "scale": scale, "seed": seed, "command": shlex.join(argv),
          "python": platform.python_version(),
          "started": datetime.datetime.now().isoformat(timespec="seconds")}
  try:
    import data

    version = data.dataset_info(build_config(row, scale)).version
    if version:
      info["data_version"] = version
  except Exception:  # the run itself reports what is wrong with the data
    pass
  return info


def _train_in_process(row: Row, scale: str, wd: str, seed: int, progress: bool, root: str | None = None
                      ) -> None:
  """train.py's training and final evaluation in this process (no interpreter and JAX start per row)."""
  from training import loop

  config = build_config(row, scale, root)
  if seed:
    config.seed = seed
  loop.train_and_evaluate(config, wd, progress=progress)


@dataclasses.dataclass
class _Job:
  row: Row
  scale: str
  seed: int
  wd: str
  argv: list[str]
  head: str
  root: str | None = None


def _run_one(job: _Job, launcher: str, in_process: bool, progress: bool) -> tuple[bool, float]:
  """Runs one job; (finished, seconds). Exceptions of in-process runs are reported, not raised."""
  start = time.time()
  if in_process and launcher == "local":
    try:
      _train_in_process(job.row, job.scale, job.wd, job.seed, progress, job.root)
      rc = 0
    except Exception as e:  # report and go on with the next row
      print(f"{job.head}: {type(e).__name__}: {e}", flush=True)
      rc = 1
  else:
    rc = subprocess.call(job.argv, cwd=ROOT)
  took = time.time() - start
  ok = rc == 0 and (launcher != "local" or finished(job.wd))
  if ok:  # after the run: train.py refuses a workdir that holds files of anything but its own run
    paths.write_json(paths.join(job.wd, RUN_INFO), _run_info(job.row, job.scale, job.seed, job.argv))
  print(f"{job.head}: {_outcome(job, launcher, ok, rc)} after {took:.0f}s", flush=True)
  return ok, took


def _outcome(job: _Job, launcher: str, ok: bool, rc: int) -> str:
  """How a run ended, in words: done, stopped before its last step with a checkpoint to resume from (train.py
  exits 0 after SIGTERM or a planned stop, with a `preempted` status record), or failed."""
  if ok:
    return "done"
  stopped = run_status.record_path(job.wd, "preempted")
  if rc == 0 and launcher == "local" and paths.exists(stopped):
    r = paths.read_json(stopped)
    return (f"stopped at step {r.get('step')} ({r.get('reason')}); run it again to resume from its "
            f"checkpoint")
  return f"FAILED (exit status {rc})"


def _generate_shared_data(jobs: Sequence[_Job]) -> None:
  """Generates the cached ListOps splits (data/listops.py) that the jobs read, once, before any runs: rows
  training side by side would otherwise generate the same split at once, and the first to finish removes the
  shards that the other may still be reading. Every CPU generates (the rows start after)."""
  from data import listops

  done = set()
  for job in jobs:
    try:
      c = build_config(job.row, job.scale, job.root)
    except Exception:  # the row's own run reports what is wrong with its config
      continue
    if c.data.name != "listops_synthetic":
      continue
    for split in ("train", str(c.eval_split)):
      path = listops.cache_path(c, split)
      if path is None or path in done:
        continue
      done.add(path)
      listops.build_cache(c, split, workers=1 if job.scale == "smoke" else os.cpu_count(),
                          progress=job.scale != "smoke")


def _worker(job: _Job, progress: bool) -> bool:  # a process of the --jobs pool
  return _run_one(job, "local", True, progress)[0]


def run_rows(selected: list[Row], scale: str, root: str, *, seeds: int = 1, launcher: str = "local",
             tpu_args: str = "", dry_run: bool = False, progress: bool = True, in_process: bool = False,
             jobs: int = 1, allow_dirty: bool = False) -> list[str]:
  """Runs the implemented rows; returns the labels of the failed ones.

  Rows whose command is the same as another row's at this scale (e.g. the 6- and 12-layer rows of one
  attention, once `smoke` drops the layer count) train once; the others get a copy of its metrics.
  in_process: train in this process (`launcher="local"` only), the fast way for many small runs; jobs > 1:
  that many worker processes train rows side by side (in-process runs each; no progress bars).
  """
  missing: dict[str, int] = {}
  for r in selected:
    if not implemented(r):
      why = unavailable(r).removeprefix("not implemented: attention ")
      missing[why] = missing.get(why, 0) + 1
  if missing:
    print(f"[skip] {sum(missing.values())} rows not implemented yet: "
          + ", ".join(f"{why} ({n})" for why, n in sorted(missing.items())), flush=True)
  todo = [(r, s) for r in selected if implemented(r) for s in range(seeds)]
  source: dict[tuple[str, ...], str] = {}  # command without the workdir -> the workdir that runs it
  pending: list[_Job] = []
  copies: list[tuple[_Job, str]] = []
  for i, (row, seed) in enumerate(todo, 1):
    wd = workdir(row, scale, root, seed)
    head = f"[{i}/{len(todo)}] {row.table} / {row.label} ({scale}{f', seed {seed}' if seed else ''})"
    key = tuple(a for a in train_argv(row, scale, "", seed, root) if a)
    if not dry_run and finished(wd):  # (a dry run touches no storage)
      print(f"{head}: finished already ({paths.join(wd, 'metrics.json')})", flush=True)
      source.setdefault(key, wd)
      continue
    if launcher == "tpu":
      argv = tpu_argv(row, scale, wd, seed, tpu_args, allow_dirty, root)
    else:
      argv = [sys.executable, *train_argv(row, scale, wd, seed, root)]
      argv += [] if progress else ["--noprogress"]
    job = _Job(row, scale, seed, wd, argv, head, root)
    if key in source and launcher == "local":
      copies.append((job, source[key]))
      continue
    source[key] = wd
    print(f"{head}: {shlex.join(argv)}", flush=True)
    pending.append(job)
  if dry_run:
    for job, same in copies:
      print(f"{job.head}: the same command as {same}", flush=True)
    return []
  failed = []
  if launcher == "local":
    _generate_shared_data(pending)
  if jobs > 1 and launcher == "local" and len(pending) > 1:
    import concurrent.futures
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")  # JAX in forked children is unsafe
    # Rows side by side on one accelerator: each process takes its share of the device's memory instead of
    # JAX's default 75% for the first (the workers inherit this environment; CPUs ignore it).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / jobs:.3f}")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=spawn) as pool:
      results = list(pool.map(_worker, pending, [False] * len(pending)))
  else:
    results = [_run_one(job, launcher, in_process, progress)[0] for job in pending]
  failed += [f"{job.row.table} / {job.row.label}" for job, ok in zip(pending, results, strict=True) if not ok]
  for job, same in copies:
    if not finished(same):
      failed.append(f"{job.row.table} / {job.row.label}")
      continue
    print(f"{job.head}: the same command as {same}: its metrics are this row's", flush=True)
    paths.makedirs(job.wd)
    info = paths.read_json(paths.join(same, RUN_INFO)) if paths.exists(paths.join(same, RUN_INFO)) else {}
    paths.write_json(paths.join(job.wd, RUN_INFO), {**info, "row": job.row.label, "same_as": same})
    paths.write_json(paths.join(job.wd, "metrics.json"), paths.read_json(paths.join(same, "metrics.json")))
  return failed


# ------------------------------------------------------------------------------------------------------------
# Collecting


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


# ------------------------------------------------------------------------------------------------------------
# Command line


def select(table: str, rows: Sequence[str] | None) -> list[Row]:
  all_tables = tables()
  if table != "all" and table not in all_tables:
    raise cli.UsageError(f"--table must be 'all' or one of {list(all_tables)}, got {table!r}")
  chosen = chosen_all = [r for t, rs in all_tables.items() if table in ("all", t) for r in rs]
  if rows:
    want = set(rows)
    chosen = [r for r in chosen if r.id in want or r.label in want]
    if not chosen:
      raise cli.UsageError(f"no row of {table!r} matches --rows {sorted(want)}; rows: "
                           f"{sorted(r.id for r in chosen_all)}")
  return chosen


def main(argv: Sequence[str] | None = None) -> int:
  """Bad flags: one `ERROR:` line on stderr, exit 2 (runtime/cli.py)."""
  return cli.run(_main, argv)


def _main(argv: Sequence[str] | None = None) -> int:
  p = cli.ArgumentParser(prog="python -m scripts.reproduce", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--table", required=True, help=f"'all' or one of {list(tables())}")
  p.add_argument("--rows", nargs="*", default=None, help="row ids or labels (default: all of the table)")
  p.add_argument("--list", action="store_true", help="print the rows and their train.py commands")
  p.add_argument("--run", action="store_true", help="run the implemented rows one after another")
  p.add_argument("--collect", action="store_true", help="write the markdown and CSV result tables")
  p.add_argument("--plot", action="store_true", help="plot the rows' evaluation curves (one panel per table)")
  p.add_argument("--eval_mem_lens", type=int, nargs="+", default=None, metavar="N",
                 help="rows whose model carries a memory (config.model.mem_len > 0): evaluate the latest "
                      "checkpoint with each of these evaluation memory lengths (0 = none) and write "
                      "eval-memory-<table>-<scale>.{md,csv}")
  p.add_argument("--scale", choices=SCALES, default="smoke")
  p.add_argument("--seeds", type=int, default=1, help="runs per row, seeds 0..N-1 (mean and std collected)")
  p.add_argument("--launcher", choices=("local", "tpu"), default="local")
  p.add_argument("--tpu_args", default="", help="scripts.tpu arguments for --launcher tpu (--zone, ...)")
  p.add_argument("--allow_dirty", action="store_true",
                 help="--launcher tpu: ship the git HEAD although the tree has uncommitted changes (they are "
                      "not shipped; scripts.tpu refuses such a tree otherwise)")
  p.add_argument("--workdir_root", default=os.path.join("workdirs", "reproduce"))
  p.add_argument("--dry_run", action="store_true", help="print the commands --run would run")
  p.add_argument("--noprogress", action="store_true", help="no progress bar in train.py")
  p.add_argument("--jobs", type=int, default=0,
                 help="local in-process runs: train this many rows side by side (0: 2 at smoke scale "
                      "when the machine has 2 or more CPUs, else 1)")
  p.add_argument("--in_process", choices=("auto", "yes", "no"), default="auto",
                 help="local runs: train in this process (auto: yes at smoke scale, where starting an "
                      "interpreter and JAX per row would cost more than the run)")
  args = p.parse_args(argv)
  cli.at_least("--seeds", args.seeds, 1)
  cli.at_least("--jobs", args.jobs, 0, " (0: automatic)")
  if args.launcher == "tpu" and not paths.is_uri(args.workdir_root) and not args.dry_run:
    raise cli.UsageError("--launcher tpu needs a gs:// --workdir_root (every TPU worker writes there)")
  chosen = select(args.table, args.rows)
  for n in args.eval_mem_lens or ():
    cli.at_least("--eval_mem_lens", n, 0, " (0 = no memory)")
  if not (args.list or args.run or args.collect or args.plot or args.eval_mem_lens):
    args.list = True
  if args.list:
    for r in chosen:
      value = "" if r.paper is None else f" paper {r.paper}"
      if not implemented(r):
        print(f"{r.table} / {r.label}:{value} [{unavailable(r)}]")
        continue
      argv_ = train_argv(r, args.scale, workdir(r, args.scale, args.workdir_root), root=args.workdir_root)
      print(f"{r.table} / {r.label}:{value} {r.metric}{f' ({r.note})' if r.note else ''}\n  python "
            f"{shlex.join(argv_)}")
  status = 0
  smoke = args.scale == "smoke"
  if args.run:
    failed = run_rows(chosen, args.scale, args.workdir_root, seeds=args.seeds, launcher=args.launcher,
                      tpu_args=args.tpu_args, dry_run=args.dry_run, progress=not args.noprogress,
                      in_process=args.in_process == "yes" or (args.in_process == "auto" and smoke),
                      jobs=args.jobs or (min(2, os.cpu_count() or 1) if smoke else 1),
                      allow_dirty=args.allow_dirty)
    if failed:
      print(f"{len(failed)} row(s) failed: " + "; ".join(failed), flush=True)
      status = 1
  if args.collect:
    records = collect(chosen, args.scale, args.workdir_root, seeds=args.seeds)
    md = paths.join(args.workdir_root, f"results-{args.table}-{args.scale}.md")
    cs = paths.join(args.workdir_root, f"results-{args.table}-{args.scale}.csv")
    paths.makedirs(args.workdir_root)
    paths.write_text(md, to_markdown(records))
    paths.write_text(cs, to_csv(records))
    done = sum(r["status"] == "ok" for r in records)
    print(f"collected {done} of {len(records)} rows -> {md}, {cs}", flush=True)
  if args.plot:
    found = curves(chosen, args.scale, args.workdir_root, seeds=args.seeds)
    png = paths.join(args.workdir_root, f"curves-{args.table}-{args.scale}.png")
    if found:
      plot_curves(found, png)
    print(f"plotted {len(found)} rows' evaluation curves" + (f" -> {png}" if found else ""), flush=True)
  if args.eval_mem_lens:
    records = eval_memory_sweep(chosen, args.scale, args.workdir_root, args.eval_mem_lens)
    md = paths.join(args.workdir_root, f"eval-memory-{args.table}-{args.scale}.md")
    cs = paths.join(args.workdir_root, f"eval-memory-{args.table}-{args.scale}.csv")
    if records:
      paths.makedirs(args.workdir_root)
      paths.write_text(md, eval_memory_markdown(records))
      buf = io.StringIO()
      w = csv.DictWriter(buf, fieldnames=EVAL_MEM_COLUMNS, lineterminator="\n")
      w.writeheader()
      w.writerows({k: ("" if r[k] is None else r[k]) for k in EVAL_MEM_COLUMNS} for r in records)
      paths.write_text(cs, buf.getvalue())
    where = f" -> {md}, {cs}" if records else ""
    print(f"evaluated {len(records)} (row, memory) pairs{where}", flush=True)
  return status


if __name__ == "__main__":
  sys.exit(main())
