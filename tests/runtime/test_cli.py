"""runtime/cli.py in process: a user error is one `ERROR:` line and exit 2, an internal error keeps its
traceback, `--debug` / LSA_DEBUG=1 re-raise user errors; the domain checks name the flag."""

from __future__ import annotations

import os
import sys

import pytest

from runtime import cli


def _raise(e: BaseException):
  raise e


def test_a_user_error_is_one_line_and_exit_2(capsys, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["prog"])
  monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
  with pytest.raises(SystemExit) as e:
    cli.run(_raise, cli.UsageError("--top_p must be in (0, 1],\n got 2.0"))
  assert e.value.code == 2
  assert capsys.readouterr().err == "ERROR: --top_p must be in (0, 1], got 2.0\n"


def test_internal_errors_keep_their_traceback_and_debug_shows_user_errors(monkeypatch):
  monkeypatch.setattr(sys, "argv", ["prog"])
  monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
  with pytest.raises(ZeroDivisionError):
    cli.run(_raise, ZeroDivisionError("a bug"))
  with pytest.raises(ValueError, match="a bug"):  # a plain ValueError is not a user error
    cli.run(_raise, ValueError("a bug"))
  monkeypatch.setenv(cli.DEBUG_ENV, "1")
  with pytest.raises(cli.UsageError):
    cli.run(_raise, cli.UsageError("--x must be >= 1"))
  monkeypatch.delenv(cli.DEBUG_ENV)
  monkeypatch.setattr(sys, "argv", ["prog", "--debug"])
  with pytest.raises(cli.UsageError):
    cli.run(_raise, cli.UsageError("--x must be >= 1"))


def test_the_innermost_usage_error_wins():
  """ml_collections re-raises a config file's error as the same type with a traceback in the text."""
  try:
    try:
      raise cli.UsageError("config argument layers='x': layers must be an int")
    except cli.UsageError as inner:
      raise cli.UsageError("Error whilst parsing config file:\n\nTraceback ...") from inner
  except cli.UsageError as e:
    assert cli.user_error(e) == "config argument layers='x': layers must be an int"


@pytest.mark.parametrize("check,args,match", [
    (cli.at_least, ("--num_samples", -1, 1), "--num_samples must be >= 1, got -1"),
    (cli.positive, ("--poll_s", -5.0), "--poll_s must be > 0, got -5.0"),
    (cli.probability, ("--top_p", 2.0), r"--top_p must be in \(0, 1\], got 2.0"),
    (cli.probability, ("--top_p", 0.0), r"--top_p must be in \(0, 1\]"),
    (cli.one_of, ("--mode", "opz", ["ops", "train"]), "did you mean 'ops'"),
])
def test_domain_checks_name_the_flag(check, args, match):
  with pytest.raises(cli.UsageError, match=match):
    check(*args)
  if check is not cli.one_of:
    check(args[0], None, *args[2:])  # an unset optional flag passes


def test_argument_parser_errors_are_one_line(capsys, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["prog"])
  p = cli.ArgumentParser(prog="prog")
  p.add_argument("--n", type=int)
  with pytest.raises(SystemExit) as e:
    p.parse_args(["--n", "x"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("ERROR: argument --n: invalid int value")


def test_a_workdir_to_write_is_checked_with_the_os_and_nothing_is_left(tmp_path):
  """Missing directories are made and a file written to find what the OS refuses, then removed again."""
  new = tmp_path / "a" / "b" / "run"
  cli.workdir_dir("--workdir", str(new), must_exist=False)
  assert sorted(p.name for p in tmp_path.iterdir()) == []
  (tmp_path / "run").mkdir()
  cli.workdir_dir("--workdir", str(tmp_path / "run"), must_exist=False)
  assert list((tmp_path / "run").iterdir()) == []
  (tmp_path / "file").write_text("x")
  with pytest.raises(cli.UsageError, match=r"--workdir .*/file/run: .*/file is a file, so no directory"):
    cli.workdir_dir("--workdir", str(tmp_path / "file" / "run"), must_exist=False)
  with pytest.raises(cli.UsageError, match=r"the OS refuses it .*: File name too long"):
    cli.workdir_dir("--workdir", str(tmp_path / ("x" * 300) / "run"), must_exist=False)
  (tmp_path / "link").symlink_to(tmp_path / "gone")
  with pytest.raises(cli.UsageError, match=r"--workdir .*/link/run: .*/link is a link to nothing$"):
    cli.workdir_dir("--workdir", str(tmp_path / "link" / "run"), must_exist=False)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "link", "run"]
  if os.path.isdir("/proc/self"):  # Linux: /proc answers a mkdir "no such file", with its directory there
    with pytest.raises(cli.UsageError, match=r"^--workdir /proc/self/x/run: the OS refuses it "
                       r"\(/proc/self/x\): [^\n]+$"):
      cli.workdir_dir("--workdir", "/proc/self/x/run", must_exist=False)


_RACE = """
import sys
from multiprocessing.connection import Client
from runtime import cli
base, port, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with Client(("localhost", port)) as go:
  for i in range(rounds):
    go.recv()  # every process starts round i together
    cli.workdir_dir("--workdir", f"{base}/{i}/a/run", must_exist=False)
    go.send(i)
"""


def test_processes_checking_one_new_workdir_at_once_all_pass(tmp_path):
  """The processes of a multi-host run on one machine check the same new workdir at the same moment: a
  directory another one just made (or removed) is no refusal, and no probe file is left. Real processes,
  released together each round."""
  import subprocess
  import time
  from multiprocessing.connection import Listener

  from tests.training.localhost import ROOT

  rounds, count = 60, 4
  with Listener(("localhost", 0)) as listener:
    args = [sys.executable, "-c", _RACE, str(tmp_path), str(listener.address[1]), str(rounds)]
    procs = [subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, text=True) for _ in range(count)]
    conns = [listener.accept() for _ in procs]
    for i in range(rounds):
      for c in conns:
        c.send(i)
      for c in conns:
        try:
          assert c.recv() == i
        except EOFError:  # a process ended: the others wait for a round that will not come
          time.sleep(1)
          for p in procs:
            if p.poll() is None:
              p.kill()
          raise AssertionError(f"round {i}: {[p.communicate()[1] for p in procs if p.returncode]}") from None
  assert [p.wait(timeout=60) for p in procs] == [0] * count
  # No probe file is left; at most the workdir's own directories, made by one process while another's check
  # was in them (the run makes them next anyway).
  left = {"/".join(p.relative_to(tmp_path).parts[1:]) for p in tmp_path.rglob("*")}  # below each round's dir
  assert left <= {"", "a", "a/run"}, left
