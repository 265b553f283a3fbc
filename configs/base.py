"""The config schema every experiment shares, and the `get_config(arg)` argument parser.

Every field train.py reads exists here, so `--config.<field>=...` overrides are type-checked by ml_collections
and a misspelled field is an error. `arg` is a comma-separated list of `key=value` items and flags (`smoke`),
e.g. `attention=combiner_axial_vertical,layers=6,smoke`; an unknown key is an error that lists the valid ones.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

import ml_collections

from attention_core import registry as op_registry
from runtime.cli import UsageError

# Logical parameter axis -> mesh axis (None = replicated). FSDP splits the model width of every weight (and
# its optimizer moments) over the "fsdp" axis; model parallelism splits heads, MLP and vocabulary.
SHARDING_RULES = (("embed", "fsdp"), ("mlp", "model"), ("heads", "model"), ("kv", None), ("vocab", "model"))


def attention_config(name: str = "combiner_fixed") -> ml_collections.ConfigDict:
  """`config.model.attention`: the attention's registry name, its plan parameters and its module's options.

  params: plan parameters passed to the op ("auto" = the op's own choice for the sequence length, its
    registration's `params(L)`, resolved where the model is built); type-unsafe so that "auto" can be
    replaced by an int from the command line.
  Module options: each module declares the fields it reads (its `FIELDS`; `train.py --list` shows them). A
  config holds only those it sets, e.g. `att.deepsets = True`; `--config.model.attention.FIELD=VALUE` and gin
  set the others; absent or None = the module's default. The entry points check every field against the
  chosen module's declaration before anything is built.
  """
  att = ml_collections.ConfigDict()
  att.name = name
  att.params = ml_collections.ConfigDict(type_safe=False)
  # Dropout on the attention output per head (the ops are fused: no weights to drop).
  att.dropout_rate = ml_collections.FieldReference(None, field_type=float)
  # Ops that take `implementation` (Combiner plans): "auto" (fused Pallas kernels on GPU/TPU, XLA on CPU),
  # "xla" or the op's accelerated one ("pallas"); passed only to ops whose signature accepts it.
  att.implementation = "auto"
  return att


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.eval_seed = 0  # rng seed of every evaluation (random attention stays deterministic in eval)
  c.aux_loss_weight = 1e-4  # weight of the sum of sown `aux_loss` values (routing commitment loss)
  c.eval_split = "validation"

  c.data = ml_collections.ConfigDict()
  c.data.name = "synthetic_recall"
  c.data.data_dir = ml_collections.FieldReference(None, field_type=str)
  c.data.seq_len = 512
  # grain engine: None = "dataset" for batched pipelines, "loader" for self-batching text packing. A
  # data-iterator checkpoint resumes only on the engine that wrote it: "loader" resumes one the loader wrote.
  c.data.engine = ml_collections.FieldReference(None, field_type=str)
  c.data.cache_in_memory = 512  # MB: small splits are read into RAM once (0 = never)
  c.data.cache_dir = ml_collections.FieldReference(None, field_type=str)  # generated splits; None = data_dir
  c.data.ordered = False  # Transformer-XL order: each row continues the last batch's row (LM; data.ordered)
  # When the data is not there, train on the generated stand-in of `data.testing.mock_data` (set by `smoke`;
  # real runs stop with the "prepare it with ..." message instead).
  c.data.stand_in = False

  c.model = ml_collections.ConfigDict()
  c.model.num_layers = 2
  c.model.features = 128
  c.model.num_heads = 4
  c.model.head_dim = ml_collections.FieldReference(None, field_type=int)  # None = features // num_heads
  c.model.mlp_dim = 512
  c.model.dropout_rate = 0.0
  c.model.dtype = "float32"  # "bfloat16": activations/matmuls in bf16, softmax and parameters in float32
  # "learned" | "factorized" (images: rows + columns + channels) | "none" (attentions with relative positions)
  c.model.position_embedding = "learned"
  c.model.image_shape = ml_collections.FieldReference(None, field_type=tuple)
  c.model.max_len = 0  # position table length; 0 = the data's seq_len
  c.model.classifier_pool = "CLS"  # "CLS" (first position) | "MEAN" (padding-aware)
  c.model.remat = "none"  # "full" | "minimal": recompute each block (or its attention core) in the backward
  # One lax.scan over the blocks (parameters stacked at call time) instead of num_layers unrolled copies: the
  # compiler sees one block (the per-parameter work, the optimizer's update, still grows with depth); the same
  # parameters and results.
  c.model.scan_layers = False
  c.model.attention = attention_config()
  # Segment recurrence (Transformer-XL, lm only): each block keeps its inputs at the last mem_len positions of
  # the previous batches' rows (no gradient) as extra keys for the same rows of the next batch, so the
  # attention's module must take a `memory`, and the data should be ordered (row i of batch s + 1 continues
  # row i of batch s; a row's "reset" clears its memory). 0 = no memory (nothing carried, nothing saved).
  c.model.mem_len = 0
  # The memory length in evaluation (None = mem_len, 0 = none): the papers evaluate with a longer one.
  c.model.eval_mem_len = ml_collections.FieldReference(None, field_type=int)
  # Compressive Transformer: per layer a FIFO of this many compressions of what mem_len evicts; 0 = off.
  c.model.compressed_mem_len = 0
  # The compressed memory's length in evaluation (None = compressed_mem_len, 0 = none).
  c.model.eval_compressed_mem_len = ml_collections.FieldReference(None, field_type=int)

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adam"  # "adam" | "adamw" | "adafactor" | "adagrad"
  c.optimizer.lr = 1e-3
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.98
  c.optimizer.eps = 1e-9
  c.optimizer.weight_decay = 0.0  # adamw only
  c.optimizer.schedule = "cosine"  # "cosine" | "rsqrt" | "constant" (all with linear warmup)
  c.optimizer.warmup_steps = 1000
  c.optimizer.end_lr_ratio = 0.0  # cosine: final lr / peak lr
  c.optimizer.clip_norm = 1.0  # global-norm gradient clipping; 0 = off

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 32  # global batch (all hosts)
  c.train.eval_batch_size = 32
  c.train.num_steps = 10_000
  c.train.log_every = 100
  c.train.eval_every = 1000  # 0 = only at the end
  c.train.eval_batches = -1  # batches per evaluation; -1 = the whole split
  c.train.checkpoint_every = 1000
  c.train.keep_checkpoints = 3
  # (start, stop): a jax.profiler trace of the steps from step start to step stop in <workdir>/profile (open
  # it in TensorBoard's profile tab or Perfetto); None = off. Step 0 of a run includes the compilation.
  c.train.profile_steps = ml_collections.FieldReference(None, field_type=tuple)

  c.mesh = ml_collections.ConfigDict()
  # -1 = the devices the other axes leave (training/mesh.py: seq/model take them first, then fsdp, then data).
  # The batch is split over data x fsdp; fsdp devices also split parameters and optimizer state (FSDP), so by
  # default every data-parallel device holds 1/n of them; fsdp = 1: plain data parallelism (whole copies).
  c.mesh.data = -1
  c.mesh.fsdp = -1
  c.mesh.seq = 1  # sequence parallelism: each sequence split over this many devices (ops with that form)
  c.mesh.model = 1
  c.sharding_rules = SHARDING_RULES
  return c


# Keys every config file's arg understands: key -> (setter, converter).
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
  if m.get("eval_mem_len", None) is not None:
    at_least("config.model.eval_mem_len", m.eval_mem_len, 0,
             " or None (= config.model.mem_len; 0 = evaluate without memory)")
    if not m.get("mem_len", 0):
      raise UsageError(f"config.model.eval_mem_len={m.eval_mem_len} needs config.model.mem_len > 0 (a model "
                       "trained with segment recurrence)")
  at_least("config.model.compressed_mem_len", m.get("compressed_mem_len", 0), 0, " (0 = off)")
  if m.get("compressed_mem_len", 0) and not m.get("mem_len", 0):  # compressed memories come from the FIFO
    raise UsageError(f"config.model.compressed_mem_len={m.compressed_mem_len} needs config.model.mem_len > 0")
  if m.get("eval_compressed_mem_len", None) is not None:
    at_least("config.model.eval_compressed_mem_len", m.eval_compressed_mem_len, 0,
             " or None (= config.model.compressed_mem_len; 0 = evaluate without it)")
    if not m.get("compressed_mem_len", 0):
      raise UsageError(f"config.model.eval_compressed_mem_len={m.eval_compressed_mem_len} needs "
                       "config.model.compressed_mem_len > 0 (a model trained with a compressed memory)")
  in_range("config.model.dropout_rate", m.dropout_rate, 0, 1, "[)")
  one_of("config.model.remat", m.remat, ("none", "full", "minimal"))
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
  for key, value in att.params.items():
    if key.endswith(("_size", "_length", "_block", "_stride", "num_hashes", "num_features", "num_clusters",
                     "num_landmarks", "n_hashes", "n_buckets"))\
        and isinstance(value, int) and not isinstance(value, bool):
      at_least(f"config.model.attention.params.{key}", value, 1)

  at_least("config.data.seq_len", c.data.seq_len, 1)
  at_least("config.data.cache_in_memory", c.data.cache_in_memory, 0, " (MB; 0 = never)")

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
