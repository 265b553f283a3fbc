"""The argument language of every config file's `get_config(arg)`, and the variants it turns on.

`arg` is a comma-separated list of `key=value` items and flags (`smoke`), e.g.
`attention=combiner_axial_vertical,layers=6,smoke`; the keys of COMMON_KEYS work in every config file, a file
adds its own (`parse_arg(arg, extra=..., flags=...)`), and an unknown key is an error that lists the valid
ones (`train.py --list`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_collections

from attention_core import registry as op_registry
from runtime.cli import UsageError


def _set(path: str) -> Callable[[ml_collections.ConfigDict, Any], None]:
  def setter(c: ml_collections.ConfigDict, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value

  return setter


def _set_param(key: str) -> Callable[[ml_collections.ConfigDict, Any], None]:
  def setter(c: ml_collections.ConfigDict, value: Any) -> None:
    c.model.attention.params[key] = value

  return setter


def _auto_or_int(value: str) -> Any:
  return value if value == "auto" else int(value)


def _bool(value: str) -> bool:
  if value.lower() in ("1", "true", "yes"):
    return True
  if value.lower() in ("0", "false", "no"):
    return False
  raise ValueError(f"expected a boolean, got {value!r}")


# Keys every config file's arg understands: key -> (setter, converter).
COMMON_KEYS: dict[str, tuple[Callable, Callable]] = {
  "attention": (_set("model.attention.name"), str),
  "layers": (_set("model.num_layers"), int),
  "features": (_set("model.features"), int),
  "heads": (_set("model.num_heads"), int),
  "mlp_dim": (_set("model.mlp_dim"), int),
  "seq_len": (_set("data.seq_len"), int),
  "steps": (_set("train.num_steps"), int),
  "batch_size": (_set("train.batch_size"), int),
  "lr": (_set("optimizer.lr"), float),
  "dtype": (_set("model.dtype"), str),
  "remat": (_set("model.remat"), str),
  "scan_layers": (_set("model.scan_layers"), _bool),
  "block_size": (_set_param("block_size"), _auto_or_int),
  "row_length": (_set_param("row_length"), _auto_or_int),
  "pooling": (_set_param("pooling"), str),
  "normalize": (_set_param("normalize"), str),
  "deepsets": (_set("model.attention.deepsets"), _bool),
  "learned_span_key": (_set("model.attention.learned_span_key"), _bool),
  "pool": (_set("model.classifier_pool"), str.upper),
}


class UnknownConfigArgument(UsageError):
  """A config argument no key or flag of the config names; carries the valid ones (`train.py --list`)."""

  def __init__(self, message: str, keys: list[str], flags: list[str]):
    super().__init__(message)
    self.keys, self.flags = keys, flags


def parse_arg(arg: str | None, extra: tuple[str, ...] = (), flags: tuple[str, ...] = ()
              ) -> tuple[dict[str, str], set[str]]:
  """Splits `k=v,flag` into ({k: v}, {flags}); keys must be COMMON_KEYS or in `extra` and take a value, flags
  ('smoke' or in `flags`) take none. Anything else is an error naming the item."""
  values: dict[str, str] = {}
  given: set[str] = set()
  flag_names = {"smoke"} | set(flags)
  valid = sorted(set(COMMON_KEYS) | flag_names | set(extra))
  for item in (arg or "").split(","):
    item = item.strip()
    if not item:
      continue
    key, sep, value = item.partition("=")
    key = key.strip()
    if key not in valid:
      raise UnknownConfigArgument(f"unknown config argument {key!r} in {arg!r}; valid: {valid}",
                                  sorted(set(COMMON_KEYS) | set(extra)), sorted(flag_names))
    if key in flag_names:
      if sep:
        raise ValueError(f"config argument {key!r} is a flag and takes no value: write {key!r}, not {item!r}")
      given.add(key)
    elif not sep or not value.strip():
      raise ValueError(f"config argument {key!r} in {arg!r} needs a value: write {key}=VALUE")
    else:
      values[key] = value.strip()
  return values, given




def apply_common(c: ml_collections.ConfigDict, values: dict[str, str]) -> None:
  """Applies the common `key=value` arguments, then pre-fills the chosen op's automatic plan parameters."""
  for key, value in values.items():
    if key in COMMON_KEYS:
      setter, convert = COMMON_KEYS[key]
      try:
        converted = convert(value)
      except ValueError:
        kind = {int: "an int", float: "a number", _auto_or_int: "an int or 'auto'", _bool: "true or false"}
        raise UsageError(f"config argument {key}={value!r}: {key} must be "
                         f"{kind.get(convert, 'a valid value')}") from None
      setter(c, converted)
  fill_auto_params(c)


def fill_auto_params(c: ml_collections.ConfigDict) -> None:
  """Writes "auto" for every automatic plan parameter of the chosen op the config leaves out, so that each can
  be overridden from the command line (`--config.model.attention.params.block_size=64`). Only the names of
  the op's automatic parameters are read here; their values are chosen where the model is built."""
  name = c.model.attention.name
  if name not in op_registry.names():
    return
  for key in op_registry.get(name).params(max(int(c.data.seq_len), 1)):
    if key not in c.model.attention.params:
      c.model.attention.params[key] = "auto"


def route_every_head(c: ml_collections.ConfigDict) -> None:
  """`attention=routing` in the Combiner paper's comparisons: every head of every layer routes (the rows share
  one architecture, without the Routing Transformer's local heads: Section 5), unless the config chose a
  layout."""
  att = c.model.attention
  if str(att.name) == "routing" and att.get("routing_heads") is None:
    att.routing_heads = int(c.model.num_heads)


def shrink_for_smoke(c: ml_collections.ConfigDict, *, seq_len: int | None = None) -> None:
  """A model/data/step budget that trains and evaluates on a CPU in seconds (the `smoke` variant)."""
  c.model.num_layers = 1
  c.model.features = 32
  c.model.num_heads = 2
  c.model.mlp_dim = 64
  c.model.max_len = 0
  c.train.batch_size = 8
  c.train.eval_batch_size = 8
  c.train.num_steps = 4
  c.train.log_every = 2
  c.train.eval_every = 0
  c.train.eval_batches = 2
  c.train.checkpoint_every = 2
  c.optimizer.warmup_steps = 1
  c.data.stand_in = True
  if seq_len is not None:
    c.data.seq_len = seq_len
