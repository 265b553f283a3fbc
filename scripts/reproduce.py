r"""The papers' result tables as data: list, run and collect their rows from the configs.

    python -m scripts.reproduce --table combiner-1 --list                  # the rows and their commands
    python -m scripts.reproduce --table combiner-1 --run --scale smoke     # run them one after another
    python -m scripts.reproduce --table all --scale smoke --run --collect  # every table, then the results
    python -m scripts.reproduce --table pystdlib --run --scale cpu --seeds 3 --collect --plot
    python -m scripts.reproduce --table combiner-2 --run --scale paper --launcher tpu \
        --workdir_root gs://B/r --tpu_args "--zone us-central2-b --accelerator v4-32 --spot"  # scripts/tpu.py

Tables (scripts/reproduce_tables.py): Combiner (Ren et al. 2021) Tables 1-6, Routing Transformer (Roy et al.
2021) Tables 1 and 4, YOSO (Zeng et al. 2021) Table 3, `pystdlib` (byte-level LM on the Python standard
library, configs/pystdlib.py) and `listops-bidirectional` (ListOps of the offline generator at length 1024,
every registered bidirectional attention in one small model: configs/lra.py `listops_1024`). A row is (table,
label, paper value, metric, config string, overrides, attention); rows whose attention is not in
`models.registry.names()` (or that has no form for the row's direction, e.g. a bidirectional-only op in a
decoder) are listed as "not implemented" and skipped, so a table grows as modules land.

Scales (scripts/reproduce_runner.py): `paper` runs the config as it is; `cpu` a small model at reduced length
that trains in minutes on a CPU (per data family: `CPU_ARGS`); `smoke` the config's `smoke` variant (a few
steps; generated stand-in data when the real data is missing), with the row's architecture and length
arguments dropped.

Each run has its workdir `<workdir_root>/<table>/<row>/<scale>[-seed<k>]`; a row whose workdir holds
train.py's final `metrics.json` is skipped (delete the workdir to rerun it). `--collect`
(scripts/reproduce_report.py) reads every row's metrics and writes
`<workdir_root>/results-<table>-<scale>.md` and `.csv`: paper value, ours (mean over seeds), delta, steps,
scale, date (and the data version where the data varies by machine, e.g. the Python of pystdlib).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shlex
import sys
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python scripts/reproduce.py` as well as `python -m scripts.reproduce`
  sys.path.insert(0, ROOT)

from runtime import cli, paths  # noqa: E402
from scripts.reproduce_report import (  # noqa: E402
  EVAL_MEM_COLUMNS,
  collect,
  curves,
  eval_memory_markdown,
  eval_memory_sweep,
  plot_curves,
  to_csv,
  to_markdown,
)
from scripts.reproduce_runner import (  # noqa: E402
  SCALES,
  implemented,
  run_rows,
  train_argv,
  unavailable,
  workdir,
)
from scripts.reproduce_tables import Row, tables  # noqa: E402


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
  p.add_argument("--collect", action="store_true", help="write the markdown and CSV result tables "
                 "(<workdir_root>/results-<table>-<scale>.{md,csv})")
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
