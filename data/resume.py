"""A checkpoint's data-iterator state (grain's orbax handler writes one JSON file per host into `data/`):
whether it can continue this run (`check_iterator_checkpoint`), and restoring it on any host count
(`restore_iterator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from data.pipeline import ORDERED_KEY, resolve_shards
from runtime import cli


def check_iterator_checkpoint(step_dir: str, data_iter: Any, config: Any) -> None:
  """Raises ValueError naming the checkpoint when its saved data-iterator state cannot continue this run: a
  state of grain.DataLoader (the engine packed text, and before that every dataset, ran on; its states hold
  `last_seen_indices`), which nothing reads any more, or an ordered stream's state in a shuffled run.
  `step_dir` is the checkpoint step directory holding `data/process_*.json` (grain's orbax handler); nothing
  is checked when it has none.
  """
  import json

  from etils import epath  # the checkpoint may live on gs://

  data_dir = epath.Path(step_dir) / "data"
  files = sorted(data_dir.glob("process_*.json")) if data_dir.exists() else []
  if not files:
    return
  try:
    saved = json.loads(files[0].read_text())
  except ValueError:
    return  # not a grain state we know; grain itself reports it
  if isinstance(saved, dict) and "last_seen_indices" in saved:
    raise cli.mark_usage(ValueError(
      f"checkpoint {step_dir} holds a data-iterator state of grain.DataLoader ({files[0].name}), an input "
      f"engine this version no longer has; start a fresh workdir, or finish the run with the version that "
      f"wrote it"))
  check = getattr(data_iter, "check_saved_state", None)  # an ordered stream's state fits only its own layout
  if check is not None:
    check(saved, step_dir)
  elif isinstance(saved, dict) and ORDERED_KEY in saved:
    raise cli.mark_usage(ValueError(f"checkpoint {step_dir} holds an ordered stream's position "
                                    f"({saved[ORDERED_KEY]}); resume it with config.data.ordered=True, or "
                                    f"start a fresh workdir"))


def _agree(files: Sequence[Any]) -> bool:
  """Whether the saved hosts' iterator states (grain JSON files `state_file`) are every host's and one state:
  a global stream's position."""
  import json

  counts = {f.name.rpartition("-of-")[2].removesuffix(".json") for f in files}
  if len(counts) != 1 or len(files) != int(counts.pop() or 0):
    return False
  states = [json.loads(f.read_text()) for f in files]
  return all(other == states[0] for other in states[1:])


def state_file(process_index: int, process_count: int) -> str:
  """The name grain's orbax handler gives a host's data-iterator state in a checkpoint's `data/` item."""
  return f"process_{process_index}-of-{process_count}.json"


def restore_iterator(step_dir: str, data_iter: Any) -> None:
  """Sets `data_iter` to the state saved in `<step_dir>/data` (after `check_iterator_checkpoint`).

  grain's orbax handler saves one file per host (`state_file`) and restores only the same host's file of the
  same host count. A training stream's state is its global position (a batched stream's global batch index,
  a packed one's stream position: `make_loader`), the same on every host, so it is read from this host's
  file when the host count is unchanged, else from the saved hosts' files, which must agree: a run resumes
  on any host count, continuing the same global stream. Raises (FileNotFoundError, ValueError) when the
  files are missing, unreadable or disagree.
  """
  import json

  from etils import epath  # the checkpoint may live on gs://

  data_dir = epath.Path(step_dir) / "data"
  own = data_dir / state_file(*resolve_shards(None, None))
  if own.exists():
    text = own.read_text()
  else:
    files = sorted(data_dir.glob("process_*-of-*.json")) if data_dir.exists() else []
    if not files:
      raise FileNotFoundError(f"no data-iterator state for this host in {data_dir} (found: none)")
    if not _agree(files):
      raise ValueError(f"the hosts' data-iterator states in {data_dir} differ ({files[0].name}: "
                       f"{files[0].read_text()[:200]}), so they are not one global stream's position")
    text = files[0].read_text()
  data_iter.set_state(json.loads(text))
  data_iter.start_prefetch()  # reading resumes while the model's state is restored
