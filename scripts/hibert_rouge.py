"""ROUGE-1/2/L of a trained HIBERT summariser's top-T sentences (training/hibert.py).

    python -m scripts.hibert_rouge --workdir W [--split test] [--top 3] [--max_documents N]

Restores the newest checkpoint of W (a `configs/hibert.py:summarise` run) with the config it was trained
with, and prints one JSON line: the model's ROUGE and, for reference, the oracle's and lead-T's, and writes
it to `W/rouge_<split>_<step>.json`.
"""

from __future__ import annotations

import argparse
import json
import sys

from runtime import cli


def _parse(argv: list[str]) -> argparse.Namespace:
  p = cli.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--split", default=None, help="default: the config's eval_split")
  p.add_argument("--top", type=int, default=3, help="sentences per summary (T; 3 for CNN/DailyMail)")
  p.add_argument("--max_documents", type=int, default=-1, help="the first N documents (-1 = all)")
  p.add_argument("--step", type=int, default=None, help="default: the newest checkpoint that restores")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
  """A bad flag, or a workdir that is not a HIBERT run's, is one line on stderr (exit 2; `--debug`: the
  traceback)."""
  return cli.run(_main, sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> dict:
  args = _parse(argv)
  from runtime import paths
  from training import config_io, evaluate, hibert

  exp, state, mgr = evaluate.restore_workdir(args.workdir, step=args.step)
  mgr.close()
  out = hibert.summarise(exp, state, args.split, top=args.top, max_documents=args.max_documents)
  print(json.dumps(out), flush=True)
  config_io.write_json(paths.join(args.workdir, f"rouge_{out['split']}_{out['step']}.json"), out)
  return out


if __name__ == "__main__":
  main()
