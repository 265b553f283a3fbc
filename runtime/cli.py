"""How every entry point reports what the user got wrong: one line on stderr, exit code 2, no traceback.

A user error is a bad flag or config value, a missing or unreadable input file, a gin fault: something the
person at the command line fixes by changing the command. It is raised as `UsageError` (a ValueError) with a
message that names the flag or field and what it may be; `run` / `run_absl` print it as

    ERROR: --top_p must be in (0, 1], got 2.0

and exit with 2. Anything else is an internal error and keeps its traceback (exit 1). `--debug` on the command
line or `LSA_DEBUG=1` in the environment shows the traceback of a user error too.

Flag-parsing faults of absl (unknown flag, bad value) and of ml_collections' config flags (a config file that
is not there, `--config.train.num_stepz=...`, a config argument get_config refuses) count as user errors;
`ArgumentParser` is argparse's parser with the same one-line report. Nothing here imports jax.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

DEBUG_ENV = "LSA_DEBUG"
EXIT_USAGE = 2


class UsageError(ValueError):
  """A bad command line: the message names the flag or config field and the allowed values."""


def mark_usage(e: BaseException) -> BaseException:
  """Marks an error of another type (a FileNotFoundError for data that is not there) as the user's to fix:
  reported as one line like a UsageError, while callers still catch it by its own type."""
  e.usage_error = True
  return e


def debug() -> bool:
  """True when `--debug` is on the command line or LSA_DEBUG is set (not "0"): show user tracebacks."""
  args = sys.argv[1:sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:]
  return os.environ.get(DEBUG_ENV, "0") not in ("", "0") or "--debug" in args


def strip_debug(argv: list[str]) -> list[str]:
  """argv without `--debug` (argument parsers that do not define it)."""
  return [a for a in argv if a != "--debug"]


def one_line(message: str) -> str:
  return " ".join(str(message).split())


def fail(message: str) -> NoReturn:
  """Prints `ERROR: message` as one line on stderr and exits with 2."""
  print(f"ERROR: {one_line(message)}", file=sys.stderr, flush=True)
  sys.exit(EXIT_USAGE)


# ------------------------------------------------------------------------------------------------------------
# Checks the entry points share


def check(ok: bool, message: str) -> None:
  if not ok:
    raise UsageError(message)


def at_least(name: str, value: Any, low: float, note: str = "") -> None:
  """`name` (a flag, `--x`, or config field) must be >= low."""
  if value is not None and value < low:
    raise UsageError(f"{name} must be >= {low}{note}, got {value}")


def positive(name: str, value: Any) -> None:
  if value is not None and not value > 0:
    raise UsageError(f"{name} must be > 0, got {value}")


def probability(name: str, value: Any) -> None:
  """A probability that may be 1 and not 0: (0, 1]."""
  if value is not None and not 0 < value <= 1:
    raise UsageError(f"{name} must be in (0, 1], got {value}")


def one_of(name: str, value: Any, allowed: Iterable[Any]) -> None:
  allowed = list(allowed)
  if value not in allowed:
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UsageError(f"{name} {value!r} is not one of {allowed}{hint}")


def workdir_dir(flag: str, workdir: str | None, *, must_exist: bool) -> None:
  """A local workdir flag must name a directory (not a file); gs:// paths are not checked here. A workdir to
  be written (`must_exist=False`) must also be one the OS lets this process create and write: a path under a
  file, too long a name, a read-only or forbidden place is refused here, before anything starts."""
  if not workdir or "://" in workdir:
    return
  if _not_a_directory(workdir):
    raise UsageError(f"{flag} {workdir} is a file, not a directory")
  if must_exist and not os.path.isdir(workdir):
    raise UsageError(f"{flag} {workdir}: no such directory (a train.py workdir)")
  if not must_exist:
    _check_writable_dir(flag, workdir)


def _not_a_directory(path: str) -> bool:
  """Whether `path` exists and is not a directory, in one look (another process may make or remove it)."""
  try:
    return not stat.S_ISDIR(os.stat(path).st_mode)
  except OSError:
    return False


def _check_writable_dir(flag: str, workdir: str, *, tries: int = 20) -> None:
  """Makes the missing directories of `workdir` and a file in it, then removes what it made: whatever the OS
  refuses on the way is a UsageError naming the path and the OS's reason. Nothing is left behind. The
  processes of a multi-host run check the same local path at once: a directory another one just made is
  used as it is (and may stay, empty, when the other's check was still in it), and one removed under this
  check is made again (`tries` times)."""
  path = os.path.abspath(os.path.expanduser(workdir))
  refused = None  # the last "no such file" whose directory was there: a refusal (/proc), not a race
  for _ in range(tries):
    parent = path
    while not os.path.lexists(parent):  # the nearest part of the path that exists
      parent = os.path.dirname(parent)
    try:  # one look: what another process makes and removes between two looks is no file
      is_dir = stat.S_ISDIR(os.stat(parent).st_mode)
    except FileNotFoundError:
      if os.path.islink(parent):
        raise UsageError(f"{flag} {workdir}: {parent} is a link to nothing") from None
      refused = None
      continue  # removed by another process since
    if not is_dir:
      raise UsageError(f"{flag} {workdir}: {parent} is a file, so no directory can be made under it")
    made = []
    try:
      for part in _missing_parts(path, parent):
        try:
          os.mkdir(part)
          made.append(part)
        except FileExistsError:
          if not stat.S_ISDIR(os.stat(part).st_mode):  # gone since (FileNotFoundError: again) or a file
            raise
      probe = os.path.join(path, f".write-check-{os.getpid()}")
      with open(probe, "w") as f:
        f.write("x")
      os.remove(probe)
      return
    except FileNotFoundError as e:  # another process removed a directory of the path under this check
      refused = e if e.filename and os.path.isdir(os.path.dirname(os.fspath(e.filename))) else None
    except OSError as e:
      raise _refusal(flag, workdir, path, e) from e
    finally:
      for part in reversed(made):
        try:
          os.rmdir(part)
        except OSError:  # another process's check is still in it, or the OS refuses: it stays
          pass
  if refused is not None:
    raise _refusal(flag, workdir, path, refused)
  raise UsageError(f"{flag} {workdir}: its directories keep disappearing while it is checked")


def _refusal(flag: str, workdir: str, path: str, e: OSError) -> UsageError:
  """The OS's refusal of a part of the workdir, in one line naming that part when it is not the workdir."""
  where = f" ({e.filename})" if e.filename and os.fspath(e.filename) != path else ""
  return UsageError(f"{flag} {workdir}: the OS refuses it{where}: {e.strerror or e}")


def _missing_parts(path: str, existing: str) -> list[str]:
  """The directories from just below `existing` down to `path`, top first."""
  parts = []
  while path != existing:
    parts.append(path)
    path = os.path.dirname(path)
  return parts[::-1]


# ------------------------------------------------------------------------------------------------------------
# Classifying an exception


def _chain(e: BaseException | None) -> Iterable[BaseException]:
  seen: set[int] = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


def _config_override_message(e: BaseException) -> str | None:
  """`--config.a.b=...` naming no field: ml_collections raises KeyError/AttributeError in its config flag's
  parser, whose frame holds the config and the field path."""
  tb = e.__traceback__
  frames = []
  while tb is not None:
    frames.append(tb.tb_frame)
    tb = tb.tb_next
  for frame in reversed(frames):
    local = frame.f_locals
    if "field_path" in local and "config" in local and hasattr(local.get("self"), "name"):
      flag, path, config = local["self"].name, local["field_path"], local["config"]
      node, parts = config, path.split(".")
      for i, part in enumerate(parts):
        keys = list(node.keys()) if hasattr(node, "keys") else None
        if keys is None or part not in keys:
          where = ".".join([flag, *parts[:i]])
          if keys is None:
            return f"--{flag}.{path}: {where} is a value, not a section with fields"
          close = difflib.get_close_matches(part, keys, n=1)
          hint = f"did you mean {close[0]!r}? " if close else ""
          return f"--{flag}.{path}: {where} has no field {part!r}; {hint}fields: {sorted(keys)}"
        node = node[part]
  return None


CONFIG_FILE_ERROR = "Error whilst parsing config file:"  # how ml_collections re-raises a config file's error


def _config_argument_message(chain: list[BaseException]) -> str | None:
  """A ValueError that a config file's get_config raised (it refuses the config argument, e.g. `task=nope` or
  `mem_len=x`), as `flag --config=VALUE: its message`; ml_collections re-raises it with the traceback in the
  text, the original being the next exception of the chain."""
  for outer, inner in zip(chain, chain[1:], strict=False):
    if str(outer).startswith(CONFIG_FILE_ERROR) and isinstance(inner, ValueError):
      flag = next((str(x).split(f": {CONFIG_FILE_ERROR}")[0] for x in chain
                   if f": {CONFIG_FILE_ERROR}" in str(x)), "--config")
      return f"{flag}: {one_line(str(inner))}"
  return None


def _config_file_message(e: BaseException) -> str | None:
  text = str(e)
  m = re.search(r"Failed loading config file (\w+)", text)
  if not m:
    return None
  flag = m.group(1).removesuffix("_config")
  given = None
  for i, arg in enumerate(sys.argv):
    if arg == f"--{flag}" and i + 1 < len(sys.argv):
      given = sys.argv[i + 1]
    elif arg.startswith(f"--{flag}="):
      given = arg.split("=", 1)[1]
  path = (given or "").split(":", 1)[0]
  if path and not os.path.exists(path):
    return f"--{flag}: no config file {path} (the configs: configs/*.py; `python train.py --list`)"
  return f"--{flag} {given}: the config file cannot be loaded: {one_line(text.split(chr(10))[-1])}"


def user_error(e: BaseException) -> str | None:
  """The one-line message when `e` is a user error, else None."""
  chain = list(_chain(e))
  usage = [x for x in chain if isinstance(x, UsageError) or getattr(x, "usage_error", False)]
  if usage:  # the innermost: ml_collections re-raises a config file's error with its traceback in the text
    return str(usage[-1])
  msg = _config_argument_message(chain)
  if msg:
    return msg
  for x in chain:
    msg = _config_file_message(x) if isinstance(x, OSError) else None
    if msg:
      return msg
  for x in chain:
    if isinstance(x, (KeyError, AttributeError)):
      msg = _config_override_message(x)
      if msg:
        return msg
  flags = sys.modules.get("absl.flags")
  if flags is not None and isinstance(e, flags.Error):
    return str(e).split("\n")[0]
  if isinstance(e, argparse.ArgumentError):
    return str(e)
  return None


# ------------------------------------------------------------------------------------------------------------
# Running an entry point


def run(main: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """Calls main(*args, **kwargs); a user error (UsageError, flag faults) becomes one line and exit 2."""
  try:
    return main(*args, **kwargs)
  except (SystemExit, KeyboardInterrupt):
    raise
  except BaseException as e:
    message = user_error(e)
    if message is None or debug():
      raise
    fail(message)


def _absl_parse(argv: list[str]) -> list[str]:
  from absl import flags

  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    raise UsageError(user_error(e) or one_line(str(e).split("\n")[0])) from e


def run_absl(main: Callable[[list[str]], Any], define: Callable[[], Any] | None = None) -> None:
  """absl's app.run(main) after `define()` (the flag definitions: config flags read the command line there)
  with the one-line report of user errors, also for flag-parsing faults; adds `--debug`."""
  from absl import app, flags

  def go() -> None:
    if define is not None:
      define()
    if "debug" not in flags.FLAGS:
      flags.DEFINE_bool("debug", False, f"show the traceback of a user error (also {DEBUG_ENV}=1)")
    _show_in_help(flags.FLAGS)
    try:
      app.run(main, flags_parser=_absl_parse)
    except SystemExit as e:  # absl exits 1 after printing the help it was asked for: that is a success
      help_flags = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")
      if e.code == 1 and any(a in help_flags for a in sys.argv[1:]):
        raise SystemExit(0) from None
      raise

  run(go)


def _show_in_help(flag_values: Any) -> None:
  """The entry point's flags defined in the project's other modules (`--config`, `--debug`, the processes'
  flags) listed by `--help` with its own: absl lists only the main module's and its key flags."""
  main = sys.argv[0]
  for module, defined in list(flag_values.flags_by_module_dict().items()):
    if module == main or module.startswith("absl") or "site-packages" in module:
      continue
    for flag in defined:
      flag_values.register_key_flag_for_module(main, flag)


class ArgumentParser(argparse.ArgumentParser):
  """argparse with one-line errors (exit 2, no usage block) and a `--debug` flag (debug=False: none, for the
  flags of a mode whose shared parser has it)."""

  def __init__(self, *args: Any, debug: bool = True, **kwargs: Any):
    super().__init__(*args, **kwargs)
    if debug:
      self.add_argument("--debug", action="store_true",
                        help=f"show the traceback of a user error (also {DEBUG_ENV}=1)")

  def error(self, message: str) -> NoReturn:
    fail(message)
