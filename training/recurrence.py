"""Segment recurrence in training (Transformer-XL memories, `config.model.mem_len` > 0, task lm).

The train state carries the model's memory (`models.transformer.Transformer.init_memory`: per block the last
mem_len of its inputs [batch, mem_len, features] and their validity [batch, mem_len], plus the previous
segment's last token), empty at init and sharded like activations: rows over the data-parallel axes
(`BATCH_AXES`), everything else replicated. Row i of the memory belongs to row i of every training batch, so
the data should be ordered (`config.data.ordered`); rows whose batch["reset"] is True (a stream starts there)
are emptied before the step. The step returns the memory after its batch, which is saved in checkpoints with
the state, so a resumed run continues bit for bit. Evaluation starts every pass with an empty memory of
`eval_mem_len` (default mem_len) and carries it over the evaluation batches in order; a Compressive
Transformer's compressed memory has `eval_compressed_mem_len` slots there (default compressed_mem_len; 0 =
none). With mem_len = 0 none of this exists: the state, the steps and the checkpoints are those of a model
without memory.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import transformer
from training.mesh import BATCH_AXES


def lengths(model_cfg: ml_collections.ConfigDict) -> tuple[int, int]:
  """(training, evaluation) memory lengths; (0, 0) without recurrence."""
  mem_len = int(model_cfg.get("mem_len", 0) or 0)
  if not mem_len:
    return 0, 0
  eval_mem_len = model_cfg.get("eval_mem_len", None)
  return mem_len, mem_len if eval_mem_len is None else int(eval_mem_len)


def eval_compressed_len(model_cfg: ml_collections.ConfigDict) -> int | None:
  """The compressed memory's length in evaluation: None (the model's own) unless
  config.model.eval_compressed_mem_len is set."""
  n = model_cfg.get("eval_compressed_mem_len", None)
  return None if n is None else int(n)


def sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Every memory array's sharding: rows over the data-parallel axes, as the batch (a prefix for the tree)."""
  return NamedSharding(mesh, P(BATCH_AXES))


def empty(abstract_model: Any, mesh: jax.sharding.Mesh, batch: int, mem_len: int,
          compressed_mem_len: int | None = None) -> dict[str, Any]:
  """An empty memory for `batch` global rows, created with its sharding (compressed_mem_len: the compressed
  memory's length, None = the model's)."""
  return jax.jit(lambda: abstract_model.init_memory(batch, mem_len, compressed_mem_len),
                 out_shardings=sharding(mesh))()


def abstract(abstract_model: Any, mesh: jax.sharding.Mesh, batch: int, mem_len: int) -> dict[str, Any]:
  """Shapes, dtypes and shardings of `empty`'s memory (the checkpoint target), nothing allocated."""
  shapes = jax.eval_shape(lambda: abstract_model.init_memory(batch, mem_len))
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding(mesh)), shapes)


def before_step(memory: dict[str, Any], batch: dict[str, Any]) -> dict[str, Any]:
  """The memory a step reads: the rows where batch["reset"] [batch] is True emptied (their stream starts)."""
  if "reset" not in batch:
    return memory
  return transformer.reset_memory(memory, batch["reset"])


def check_batch(memory: dict[str, Any], batch: dict[str, Any]) -> None:
  """The memory's rows are the (global) batch's: a clear error when the sizes differ."""
  rows = memory["token"].shape[0]
  got = next(iter(batch.values())).shape[0]
  if rows != got:
    raise ValueError(f"the memory has {rows} rows and the batch {got}: with config.model.mem_len > 0 every "
                     f"training batch must have config.train.batch_size rows")
