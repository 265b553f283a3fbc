r"""Evaluates a train.py checkpoint on a split, prints the metrics and writes them as JSON to the workdir.

    python eval.py --workdir workdirs/default-20261122-050000  # latest checkpoint, config.eval_split
    python eval.py --workdir DIR --split test --step 4000 --max_batches 100
    python eval.py --workdir DIR --eval_mem_len 2048  # a Transformer-XL memory other than the config's
    python eval.py --workdir DIR --eval_compressed_mem_len 1536  # a longer compressed memory (Compressive)

The config is the resolved one train.py saved (`<workdir>/config.json`, with the changes it recorded in
`config_history.json` up to the checkpoint's step); `--config.*`-style overrides are not needed because
everything that shapes the model is in it. By default it evaluates as many batches as train.py's evaluations
(`config.train.eval_batches`), so the two agree; both print how many batches and examples a figure covers. The
result goes to `<workdir>/eval_<split>_<step>.json` for the whole split, `eval_<split>_<step>_<n>batches.json`
for the first n batches. A latest checkpoint that does not restore is reported and the newest one that does is
evaluated (training/evaluate.py).
"""

from __future__ import annotations

import math
import os
import sys

from runtime import cli, distributed


def check_flags(f) -> None:
  """The flags' domains and the workdir, before anything is restored (UsageError naming the flag)."""
  cli.workdir_dir("--workdir", f.workdir, must_exist=True)
  if "://" not in f.workdir:
    cli.check(os.path.isfile(os.path.join(f.workdir, "config.json")),
              f"--workdir {f.workdir} has no config.json: not a train.py workdir")
  if f.max_batches is not None and (f.max_batches == 0 or f.max_batches < -1):
    raise cli.UsageError(f"--max_batches must be >= 1 or -1 (the whole split), got {f.max_batches}")
  cli.at_least("--step", f.step, 0)
  cli.at_least("--eval_mem_len", f.eval_mem_len, 0, " (0 = no memory)")
  cli.at_least("--eval_compressed_mem_len", f.eval_compressed_mem_len, 0, " (0 = none)")
  if f.split is not None:
    cli.check(bool(f.split.strip()), "--split must name a split (e.g. validation, test), got ''")


def main(argv: list[str]) -> None:
  del argv
  from absl import flags, logging

  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  check_flags(f)
  from training import evaluate, loop

  distributed.initialize_from_flags(f)
  m = evaluate.evaluate_workdir(f.workdir, split=f.split, step=f.step, max_batches=f.max_batches,
                                eval_mem_len=f.eval_mem_len,
                                eval_compressed_mem_len=f.eval_compressed_mem_len)
  print(loop.format_metrics(m), flush=True)
  bad = sorted(k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v))
  if bad:
    print(f"ERROR: the evaluation is not finite ({', '.join(bad)})", file=sys.stderr, flush=True)
    sys.exit(1)


def _flags() -> None:
  from absl import flags

  flags.DEFINE_string("workdir", None, "a train.py workdir", required=True)
  flags.DEFINE_string("split", None, "split to evaluate (default: the config's eval_split)")
  flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
  flags.DEFINE_integer("max_batches", None, "evaluate at most this many batches (-1 = the whole split; "
                       "default: config.train.eval_batches, as train.py's evaluations)")
  flags.DEFINE_integer("eval_mem_len", None, "a model trained with segment recurrence (config.model.mem_len "
                       "> 0): evaluate with a memory of this many positions (0 = none; default: the config's "
                       "eval_mem_len)")
  flags.DEFINE_integer("eval_compressed_mem_len", None, "a Compressive Transformer (config.model."
                       "compressed_mem_len > 0): evaluate with a compressed memory of this many slots "
                       "(0 = none; default: the config's eval_compressed_mem_len)")
  distributed.define_flags()  # --multihost, --coordinator_address, --num_processes, --process_id


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  cli.run_absl(main, _flags)
