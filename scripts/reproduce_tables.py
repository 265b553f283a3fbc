"""The papers' result tables as data: every row, its published value and the config that reproduces it
(scripts/reproduce.py lists, runs and collects them)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence


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
