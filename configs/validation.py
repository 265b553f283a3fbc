"""The domain of every config field, checked before anything is built or written (`validate`).

A value outside it would otherwise fail after compiling or silently train something else; the error names
the field and what it may be (`runtime.cli.UsageError`: one line, exit 2). The attention's own fields and
plan parameters are checked against what its module and op declare (models.registry.check_fields).
"""

from __future__ import annotations

import difflib
from typing import Any

import ml_collections

from runtime.cli import UsageError


def _number(path: str, value: Any, kind: type = int) -> None:
  ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
  if not ok:
    raise UsageError(f"{path} must be {'a number' if kind is float else 'an int'}, got {value!r}")


def validate(c: ml_collections.ConfigDict, attention_names: Any = None) -> None:
  """Refuses, naming the field and its domain, config values that would otherwise fail after compiling or
  silently train something else (UsageError). `attention_names`: the names `model.attention.name` may take
  (models/registry.py knows them; the entry points pass them)."""
  def at_least(path: str, value: Any, low: int, note: str = "") -> None:
    _number(path, value)
    if value < low:
      raise UsageError(f"{path} must be >= {low}{note}, got {value}")

  def in_range(path: str, value: Any, low: float, high: float, closed: str) -> None:
    _number(path, value, float)
    ok = (low <= value if closed[0] == "[" else low < value) and (value <= high if closed[1] == "]"
                                                                     else value < high)
    if not ok:
      raise UsageError(f"{path} must be in {closed[0]}{low}, {high}{closed[1]}, got {value}")

  def one_of(path: str, value: Any, allowed: Any) -> None:
    if value not in allowed:
      raise UsageError(f"{path} must be one of {sorted(allowed)}, got {value!r}")

  t = c.train
  for name in ("num_steps", "log_every", "eval_every", "checkpoint_every", "batch_size", "eval_batch_size",
               "keep_checkpoints", "eval_batches"):
    _number(f"config.train.{name}", t[name])
  for name in ("log_every", "checkpoint_every", "batch_size", "eval_batch_size", "keep_checkpoints"):
    at_least(f"config.train.{name}", t[name], 1)
  at_least("config.train.num_steps", t.num_steps, 0, " (0 = evaluate the initial or restored state)")
  at_least("config.train.eval_every", t.eval_every, 0, " (0 = only at the end)")
  if t.eval_batches == 0 or t.eval_batches < -1:
    raise UsageError(f"config.train.eval_batches must be >= 1 or -1 (the whole split), got {t.eval_batches}")
  profile = t.get("profile_steps", None)
  if profile is not None and not (
      isinstance(profile, (tuple, list)) and len(profile) == 2
      and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in profile)
      and profile[0] < profile[1]):
    raise UsageError(f"config.train.profile_steps must be None (off) or (start, stop), ints with "
                     f"0 <= start < stop, got {profile!r}")

  m = c.model
  for name in ("num_layers", "features", "num_heads", "mlp_dim"):
    at_least(f"config.model.{name}", m[name], 1)
  if m.head_dim is not None:
    at_least("config.model.head_dim", m.head_dim, 1)
  elif m.features // m.num_heads < 1:
    raise UsageError(f"config.model.features ({m.features}) must be >= config.model.num_heads "
                     f"({m.num_heads}) when config.model.head_dim is None (head_dim = features // num_heads)")
  at_least("config.model.max_len", m.max_len, 0, " (0 = the data's seq_len)")
  at_least("config.model.mem_len", m.get("mem_len", 0), 0, " (0 = no memory)")
  at_least("config.model.compressed_mem_len", m.get("compressed_mem_len", 0), 0, " (0 = off)")
  if m.get("compressed_mem_len", 0) and not m.get("mem_len", 0):  # compressed memories come from the FIFO
    raise UsageError(f"config.model.compressed_mem_len={m.compressed_mem_len} needs config.model.mem_len > 0")
  for train, what in (("mem_len", "memory"), ("compressed_mem_len", "compressed memory")):
    evaluate = f"eval_{train}"  # the papers evaluate with other lengths than they train with
    if m.get(evaluate, None) is not None:
      at_least(f"config.model.{evaluate}", m[evaluate], 0,
               f" or None (= config.model.{train}; 0 = evaluate without the {what})")
      if not m.get(train, 0):
        raise UsageError(f"config.model.{evaluate}={m[evaluate]} needs config.model.{train} > 0 (a model "
                         f"trained with a {what})")
  in_range("config.model.dropout_rate", m.dropout_rate, 0, 1, "[)")
  one_of("config.model.remat", m.remat, ("none", "full", "minimal"))
  at_least("config.model.scan_unroll", m.get("scan_unroll", 1), 1, " (layers per scanned loop iteration)")
  one_of("config.model.dtype", m.dtype, ("float32", "bfloat16", "float16", "float64"))
  att = m.attention
  if attention_names is not None:
    names = sorted(attention_names)
    if att.name not in names:
      close = difflib.get_close_matches(str(att.name), names, n=1)
      raise UsageError(f"config.model.attention.name {att.name!r} is not an attention"
                       + (f" (did you mean {close[0]!r}?)" if close else "") + f"; valid: {names}")
  if att.dropout_rate is not None:
    in_range("config.model.attention.dropout_rate", att.dropout_rate, 0, 1, "[)")

  d = c.data
  at_least("config.data.seq_len", d.seq_len, 1)
  at_least("config.data.cache_in_memory", d.cache_in_memory, 0, " (MB; 0 = never)")
  for name, low in (("read_threads", 1), ("prefetch", 0), ("worker_count", 0), ("virtual_records", 1)):
    if d.get(name, None) is not None:
      at_least(f"config.data.{name}", d[name], low, " or None (the pipeline's default)")

  o = c.optimizer
  one_of("config.optimizer.name", o.name, ("adam", "adamw", "adafactor", "adagrad"))
  one_of("config.optimizer.schedule", o.schedule, ("cosine", "rsqrt", "constant"))
  _number("config.optimizer.lr", o.lr, float)
  if not o.lr > 0:
    raise UsageError(f"config.optimizer.lr must be > 0, got {o.lr}")
  in_range("config.optimizer.b1", o.b1, 0, 1, "[)")
  in_range("config.optimizer.b2", o.b2, 0, 1, "[)")
  _number("config.optimizer.eps", o.eps, float)
  if not o.eps > 0:
    raise UsageError(f"config.optimizer.eps must be > 0, got {o.eps}")
  for name in ("weight_decay", "clip_norm"):
    _number(f"config.optimizer.{name}", o[name], float)
    if o[name] < 0:
      raise UsageError(f"config.optimizer.{name} must be >= 0, got {o[name]}")
  at_least("config.optimizer.warmup_steps", o.warmup_steps, 0)
  in_range("config.optimizer.end_lr_ratio", o.end_lr_ratio, 0, 1, "[]")
  in_range("config.aux_loss_weight", c.aux_loss_weight, 0, float("inf"), "[)")

  for name in ("seq", "model"):
    at_least(f"config.mesh.{name}", c.mesh[name], 1)
  for name in ("data", "fsdp"):
    if c.mesh[name] != -1:
      at_least(f"config.mesh.{name}", c.mesh[name], 1, " or -1 (the devices the other axes leave)")
