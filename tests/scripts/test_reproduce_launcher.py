"""scripts/reproduce.py --launcher tpu: the command it runs for a row is one scripts/tpu.py accepts, with
--allow_dirty passed through when asked."""

from scripts import reproduce, tpu
from scripts import reproduce_runner as runner
from scripts import reproduce_tables as paper


def test_tpu_command_passes_allow_dirty_through(capsys):
  table = next(iter(paper.tables()))
  argv = ["--table", table, "--run", "--dry_run", "--launcher", "tpu", "--workdir_root", "gs://b/r",
          "--tpu_args", "--zone us-central2-b --accelerator v4-8 --spot"]
  for dirty in (False, True):
    assert reproduce.main(argv + (["--allow_dirty"] if dirty else [])) == 0
    out = capsys.readouterr().out.splitlines()
    commands = [line.split(": ", 1)[1] for line in out if "scripts.tpu run" in line]
    assert commands and all(("--allow_dirty" in c) == dirty for c in commands)
  row = next(r for r in reproduce.select(table, None) if runner.implemented(r))
  cmd = runner.tpu_argv(row, "smoke", "gs://b/r/x", 0, "--zone z --accelerator v4-8", allow_dirty=True)
  assert cmd[1:4] == ["-m", "scripts.tpu", "run"]
  args = tpu.parse_args(cmd[3:])
  assert args.allow_dirty and args.workdir == "gs://b/r/x" and args.accelerator == "v4-8"
