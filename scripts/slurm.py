r"""An sbatch script for multi-node GPU training under SLURM, from the template scripts/slurm_train.sbatch.

    python -m scripts.slurm --nodes 2 --gpus_per_node 8 --partition gpu --time 24:00:00 \
        --config configs/c4.py:attention=combiner_fixed --workdir /shared/runs/c4-comb \
        --out c4-comb.sbatch -- --config.model.dtype=bfloat16
    sbatch c4-comb.sbatch

It writes the script (to `--out`, else stdout) and submits nothing. The job runs one train.py process per GPU
(`srun`, `--ntasks-per-node` = GPUs per node) with `--multihost`: JAX finds the coordinator, the process count
and index and each process's GPU in SLURM's variables (runtime/distributed.py). `--repo` is this
repository and `--python` its venv's interpreter as the nodes see them (a shared filesystem; default: here),
with jax installed for CUDA (README: GPU clusters). The workdir must be one every node sees: a shared
filesystem path or `gs://`. SIGTERM comes `--signal_s` seconds before the time limit (and on preemption);
train.py saves a checkpoint, and the requeued job resumes from it. Everything after `--` goes to train.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(ROOT, "scripts", "slurm_train.sbatch")


def render(args: argparse.Namespace) -> str:
  """The sbatch script: the template with every {{field}} filled in, shell values quoted."""
  extra = [f"#SBATCH --{name}={value}" for name, value in (("partition", args.partition),
                                                           ("account", args.account), ("qos", args.qos),
                                                           ("mem", args.mem)) if value]
  q = shlex.quote
  fields = {
      "job_name": args.job_name, "nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
      "cpus_per_task": args.cpus_per_task, "time": args.time, "signal_s": args.signal_s,
      "log_dir": args.log_dir, "sbatch_extra": "\n".join(extra), "repo": q(args.repo),
      "python": q(args.python), "config": q(args.config), "workdir": q(args.workdir),
      "train_args": "".join(" " + q(a) for a in args.train_args),
  }
  with open(TEMPLATE) as f:
    text = f.read()
  text = re.sub(r"\{\{(\w+)\}\}", lambda m: str(fields[m.group(1)]), text)
  return text.replace("\n\nset -euo", "\nset -euo")  # no blank line where no extra #SBATCH line went


def check(args: argparse.Namespace) -> None:
  """Bad values name their flag (ValueError)."""
  for name in ("nodes", "gpus_per_node", "cpus_per_task", "signal_s"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
  # #SBATCH lines are read by sbatch, not by a shell: no quoting there.
  for name in ("job_name", "log_dir", "time", "partition", "account", "qos", "mem"):
    value = getattr(args, name)
    if value is not None and (not value or re.search(r"\s", value)):
      raise ValueError(f"--{name} must be a non-empty value without spaces, got {value!r}")
  if not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", args.time):
    raise ValueError(f"--time must be SLURM's [days-]hours[:minutes[:seconds]], got {args.time!r}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m scripts.slurm", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="train.py --config value, e.g. configs/c4.py")
  p.add_argument("--workdir", required=True, help="train.py --workdir: a path every node sees, or gs://")
  p.add_argument("--nodes", type=int, required=True, help="nodes (hosts) of the job")
  p.add_argument("--gpus_per_node", type=int, default=8, help="GPUs per node: one train.py process each")
  p.add_argument("--cpus_per_task", type=int, default=8, help="CPU cores per process (input pipeline)")
  p.add_argument("--time", default="24:00:00", help="the job's time limit")
  p.add_argument("--job_name", default="train")
  p.add_argument("--partition", default=None)
  p.add_argument("--account", default=None)
  p.add_argument("--qos", default=None)
  p.add_argument("--mem", default=None, help="memory per node, e.g. 400G (default: the partition's)")
  p.add_argument("--signal_s", type=int, default=120,
                 help="seconds before the time limit that SIGTERM comes (train.py saves a checkpoint)")
  p.add_argument("--repo", default=ROOT, help="this repository on the nodes (default: here)")
  p.add_argument("--python", default=None, help="the nodes' interpreter (default: <repo>/.venv/bin/python)")
  p.add_argument("--log_dir", default=None, help="the job's output file goes here (default: <repo>/workdirs/"
                                                 "slurm; made when --out is written)")
  p.add_argument("--out", default=None, help="write the script here (default: stdout)")
  p.epilog = "Everything after `--` goes to train.py, e.g. -- --config.seed=1"
  argv = list(sys.argv[1:] if argv is None else argv)
  cut = argv.index("--") if "--" in argv else len(argv)
  args = p.parse_args(argv[:cut])
  args.train_args = argv[cut + 1:]
  args.python = args.python or os.path.join(args.repo, ".venv", "bin", "python")
  args.log_dir = args.log_dir or os.path.join(args.repo, "workdirs", "slurm")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    check(args)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  text = render(args)
  if args.out is None:
    sys.stdout.write(text)
    return 0
  os.makedirs(args.log_dir, exist_ok=True)  # sbatch does not make the output file's directory
  with open(args.out, "w") as f:
    f.write(text)
  print(f"wrote {args.out} ({args.nodes} x {args.gpus_per_node} GPUs, log in {args.log_dir}); submit it "
        f"with: sbatch {shlex.quote(args.out)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
