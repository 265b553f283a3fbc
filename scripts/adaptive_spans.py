"""Adaptive span's learned spans: short where only local context matters, long where the task reads far back.

    python -m scripts.adaptive_spans --workdir_root workdirs/adaptive_spans            # the measured setting
    python -m scripts.adaptive_spans --workdir_root /tmp/spans --setting smoke         # seconds, for tests

Trains the same small causal `adaptive_span` model (models/adaptive_span_attention.py) with train.py's loop
(`training.loop.train_and_evaluate`, one workdir per task under --workdir_root; a finished workdir is only
re-evaluated) on
  local   `synthetic_local` (data/synthetic_local.py): an order-2 Markov chain over 16 symbols, each token
          (x_{t-1} + 3 x_{t-2}) mod 16 except 10% uniform noise, so the best prediction needs the last two
          tokens only;
  recall  `synthetic_recall` (data/synthetic.py, the default task): answers found up to L - 1 tokens back;
then reads every layer's per-head spans z_h = max_span * clamp(span_ratio_h, 0, 1) (the module's `spans()`)
from the final parameters and prints a markdown table: task, layer, the spans in tokens, the task's
validation accuracy (with chance and, for local, the best possible accuracy).

The `default` setting: length 256, max_span = 256 (the whole sequence), the paper's ramp R = 32; 2 layers,
width 64, 4 heads, MLP 128, the paper's learned relative position embeddings and no absolute positions;
spans start at max_span (`span_init = 1`), so every head first sees the whole sequence and the L1 penalty
has to pull each span in against the task's use of it; `span_loss = 1e-3` per token of mean span per layer
(the paper's 2e-6 is for runs a thousand times longer: with Adam a span moves by at most about lr * max_span
tokens a step whatever the coefficient, and 1e-3 makes the penalty's gradient win wherever the task's is
small); Adam 4e-3 constant after 50 warm-up steps, batch 16, 400 steps, no dropout, seed 0. About 10
minutes per task on one CPU core (`XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1"`, 0.8 to 1.6 s a step on a loaded 2-core machine).
Measured (docs/results.md, "Adaptive span: learned spans"): on local every span ends at 0 to 1.5 tokens (each
head reads little more than the ramp's last R = 32 tokens) at 90.2% accuracy (best possible 90.6%); on recall
the first layer's spans stay near 200 tokens at 99.1% accuracy while the second layer's, which the recall does
not need, go to 0 to 4 tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np

from runtime import cli

TASKS = ("local", "recall")
DATA = {"local": "synthetic_local", "recall": "synthetic_recall"}
SETTINGS: dict[str, dict[str, Any]] = {
  "default": dict(seq_len=256, layers=2, features=64, heads=4, mlp_dim=128, batch_size=16, steps=400, lr=4e-3,
                  warmup=50, span_loss=1e-3, eval_examples=128, eval_every=100, log_every=50),
  "smoke": dict(seq_len=64, layers=2, features=32, heads=2, mlp_dim=64, batch_size=8, steps=3, lr=5e-3,
                warmup=1, span_loss=1e-3, eval_examples=8, eval_every=0, log_every=3),
}


def task_config(task: str, setting: str = "default", steps: int | None = None) -> ml_collections.ConfigDict:
  """The experiment config of `task` ("local" | "recall") in `setting`; `steps` overrides its step count."""
  from configs import default

  s = dict(SETTINGS[setting])
  if steps is not None:
    s["steps"] = int(steps)
  c = default.get_config(f"attention=adaptive_span,seq_len={s['seq_len']},layers={s['layers']},"
                         f"features={s['features']},heads={s['heads']},mlp_dim={s['mlp_dim']},"
                         f"batch_size={s['batch_size']},steps={s['steps']},lr={s['lr']}")
  c.data.name = DATA[task]
  if task == "local":
    for key in ("num_keys", "num_values", "num_pairs", "num_filler"):  # the recall task's fields
      del c.data[key]
    c.data.num_symbols = 16
    c.data.order = 2
    c.data.noise = 0.1
  c.data.eval_examples = s["eval_examples"]
  c.model.position_embedding = "none"
  c.model.attention.relative_positions = True
  c.model.attention.span_init = 1.0
  c.model.attention.span_loss = s["span_loss"]
  c.model.attention.dropout_rate = 0.0
  c.optimizer.warmup_steps = s["warmup"]
  c.train.eval_batch_size = min(64, s["eval_examples"])
  c.train.eval_batches = -1
  c.train.eval_every = s["eval_every"]
  c.train.log_every = s["log_every"]
  c.train.checkpoint_every = s["steps"]
  return c


def learned_spans(result: dict[str, Any]) -> np.ndarray:
  """[layers, heads]: the spans in tokens of every adaptive-span layer of a finished run's final parameters
  (`training.loop.train_and_evaluate`'s result), in the order of the model's blocks."""
  from flax import nnx

  from models.adaptive_span_attention import AdaptiveSpanAttention

  exp, state = result["experiment"], result["state"]
  model = nnx.merge(exp.graphdef, state.params, exp.rng_state, state.rest)
  modules = [m for _, m in nnx.iter_graph(model) if isinstance(m, AdaptiveSpanAttention)]
  return np.stack([np.asarray(m.spans()) for m in modules])  # [layers, heads]


def chance_and_best(config: ml_collections.ConfigDict) -> tuple[float, float | None]:
  """(chance accuracy, best achievable accuracy or None where it is not known in closed form)."""
  from data import synthetic, synthetic_local

  if config.data.name == synthetic_local.NAME:
    return synthetic_local.chance(config), synthetic_local.optimal_accuracy(config)
  return synthetic.chance(config), None


def run(root: str, setting: str = "default", tasks: Sequence[str] = TASKS, steps: int | None = None,
        progress: bool = True) -> list[dict[str, Any]]:
  """Trains (or resumes) each task under `root`/<task>; one record per task with its spans and accuracy."""
  from training import loop

  records = []
  for task in tasks:
    config = task_config(task, setting, steps)
    workdir = os.path.join(root, f"{task}-{setting}")
    result = loop.train_and_evaluate(config, workdir, progress=progress)
    chance, best = chance_and_best(config)
    records.append({"task": task, "data": str(config.data.name), "spans": learned_spans(result),
                    "accuracy": float(result["metrics"]["accuracy"]), "chance": chance, "best": best,
                    "seq_len": int(config.data.seq_len), "step": int(result["step"])})
  return records


def to_markdown(records: Sequence[dict[str, Any]]) -> str:
  """One row per (task, layer): the spans per head in tokens, their mean, the task's validation accuracy."""
  heads = max(r["spans"].shape[1] for r in records)
  lines = ["| task | layer | " + " | ".join(f"head {h}" for h in range(heads)) + " | mean span | accuracy |",
           "|---|---|" + "---|" * heads + "---|---|"]
  for r in records:
    best = f", best {100 * r['best']:.1f}%" if r["best"] is not None else ""
    accuracy = f"{100 * r['accuracy']:.1f}% (chance {100 * r['chance']:.1f}%{best})"
    for layer, z in enumerate(r["spans"]):
      cells = " | ".join(f"{v:.0f}" for v in z)
      lines.append(f"| {r['task']} ({r['data']}, L={r['seq_len']}) | {layer} | {cells} | {z.mean():.0f} | "
                   f"{accuracy} |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir_root", required=True, help="one workdir per task under it")
  parser.add_argument("--setting", choices=sorted(SETTINGS), default="default")
  parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
  parser.add_argument("--steps", type=int, default=None, help="override the setting's step count")
  parser.add_argument("--no_progress", action="store_true", help="no progress bar")
  parser.add_argument("--output", default=None, help="also write the table to this markdown file")
  args = parser.parse_args(argv)
  if args.steps is not None and args.steps < 1:
    parser.error("--steps must be >= 1")
  records = run(args.workdir_root, args.setting, args.tasks, args.steps, progress=not args.no_progress)
  table = to_markdown(records)
  print(table, flush=True)
  if args.output:
    with open(args.output, "w") as f:
      f.write(table + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
