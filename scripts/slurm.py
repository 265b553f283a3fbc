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

Before anything is written, the config is loaded the way train.py loads it (training/command_line.py:
`--config` with the `--config.*` overrides and gin flags after `--`, then validated), from this checkout
(a relative `--config` path is the repository's); a bad flag or config is one `ERROR:` line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Sequence

from runtime import cli

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
  """Bad values name their flag (UsageError)."""
  for name in ("nodes", "gpus_per_node", "cpus_per_task", "signal_s"):
    cli.at_least(f"--{name}", getattr(args, name), 1)
  # #SBATCH lines are read by sbatch, not by a shell: no quoting there.
  for name in ("job_name", "log_dir", "time", "partition", "account", "qos", "mem"):
    value = getattr(args, name)
    if value is not None and (not value or re.search(r"\s", value)):
      raise cli.UsageError(f"--{name} must be a non-empty value without spaces, got {value!r}")
  if not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", args.time):
    raise cli.UsageError(f"--time must be SLURM's [days-]hours[:minutes[:seconds]], got {args.time!r}")
  if args.out is not None:
    out_dir = os.path.dirname(os.path.abspath(args.out))
    cli.check(os.path.isdir(out_dir), f"--out {args.out}: no such directory {out_dir}")
    cli.check(not os.path.isdir(args.out), f"--out {args.out} is a directory, not a file")
    cli.workdir_dir("--log_dir", args.log_dir, must_exist=False)
  check_config(args.config, args.train_args)


def check_config(config: str, train_args: Sequence[str]) -> None:
  """Loads `--config` with the `--config.*` overrides and gin flags among `train_args` through train.py's
  own helper (training/command_line.py) and validates it, so that a typo fails here and not on the cluster
  (UsageError). A relative config path is read from this checkout; train.py's other flags are left alone."""
  from absl import flags

  from training import command_line, config_io

  path = config.split(":", 1)[0]
  local = path if os.path.isabs(path) else os.path.join(ROOT, path)
  cli.check(os.path.isfile(local), f"--config: no config file {path} (the configs: configs/*.py; "
                                   "`python train.py --list`)")
  argv = ["train.py", "--config", local + config[len(path):], *train_args]
  fv = flags.FlagValues()
  command_line.define_config_flag(config_io.DEFAULT_CONFIG, flag_values=fv, sys_argv=argv)
  flags.DEFINE_multi_string("gin_file", [], "gin files", flag_values=fv)
  flags.DEFINE_multi_string("gin_bindings", [], "gin bindings", flag_values=fv)
  try:
    fv(argv, known_only=True)
    command_line.checked_config(fv)
  except flags.Error as e:
    raise cli.UsageError(cli.user_error(e) or cli.one_line(str(e).split("\n")[0])) from e


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = cli.ArgumentParser(prog="python -m scripts.slurm", description=__doc__,
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
  """Bad flags or config: one `ERROR:` line on stderr, exit 2 (runtime/cli.py), and nothing written."""
  return cli.run(_main, argv)


def _main(argv: Sequence[str] | None) -> int:
  args = parse_args(argv)
  check(args)
  text = render(args)
  if args.out is None:
    sys.stdout.write(text)
    return 0
  try:
    with open(args.out, "w") as f:
      f.write(text)
  except OSError as e:
    raise cli.UsageError(f"--out {args.out}: {e.strerror or e}") from e
  os.makedirs(args.log_dir, exist_ok=True)  # sbatch does not make the output file's directory
  print(f"wrote {args.out} ({args.nodes} x {args.gpus_per_node} GPUs, log in {args.log_dir}); submit it "
        f"with: sbatch {shlex.quote(args.out)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
