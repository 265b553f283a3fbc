"""The config schema every experiment shares: every field the code reads exists here, so that
`--config.<field>=...` overrides are type-checked by ml_collections and a misspelled field is an error.

Its neighbours: configs/arguments.py (the `get_config(arg)` argument language and the `smoke` variant) and
configs/validation.py (the domain of every field, checked before anything is built).
"""

from __future__ import annotations

import ml_collections

# Logical parameter axis -> mesh axis, or a tuple of them (None = replicated). FSDP splits the model width of
# every weight (and its optimizer moments) over the "fsdp" and "seq" axes (the devices that split a sequence
# need the same weights); model parallelism splits heads, MLP and vocabulary.
# "layers": the leading axis of stacked blocks (`model.scan_layers`, models/stacked.py), replicated: every
# device holds every layer's share of the other axes.
SHARDING_RULES = (("embed", ("fsdp", "seq")), ("mlp", "model"), ("heads", "model"), ("kv", None),
                  ("vocab", "model"), ("layers", None))


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


def scanned_and_recomputed(c: ml_collections.ConfigDict) -> None:
  """A deep paper-scale model's blocks stacked and scanned (one block to compile, models/stacked.py), each
  recomputed in the backward pass from its input (`model.remat = "full"`): the step keeps one block's
  intermediates instead of every layer's, which sets the TPU slice such a model needs (docs/tpu.md). A
  scanned step without recompute keeps more than the unrolled one: every value its backward pass reads
  crosses the loop as a stacked array, where an unrolled program's compiler may fuse cheap ones into the
  backward pass instead."""
  c.model.scan_layers = True
  c.model.remat = "full"


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
  c.data.cache_in_memory = 512  # MB: small splits are read into RAM once (0 = never)
  c.data.cache_dir = ml_collections.FieldReference(None, field_type=str)  # generated splits; None = data_dir
  c.data.ordered = False  # Transformer-XL order: each row continues the last batch's row (LM; data.ordered)
  # When the data is not there, train on the generated stand-in of `data.testing.mock_data` (set by `smoke`;
  # real runs stop with the "prepare it with ..." message instead).
  c.data.stand_in = False
  # The input pipeline (data/pipeline.py; None = its default): record-reading threads, records read ahead,
  # grain worker processes, and for benchmarks a split presented as this many records (record i = record i
  # mod its size).
  for name in ("read_threads", "prefetch", "worker_count", "virtual_records"):
    c.data[name] = ml_collections.FieldReference(None, field_type=int)

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
  # The blocks' parameters stacked on a leading layer axis, run by one lax.scan (models/stacked.py): the same
  # values and results as num_layers unrolled blocks, in a train step that does not grow with depth.
  c.model.scan_layers = False
  # With scan_layers: layers per iteration of the scanned loop (jax.lax.scan's unroll). More compiles a larger
  # loop body for fewer trips; scripts/compile_tpu.py compiles 2 to count a layer's cost, which XLA's cost
  # analysis counts once however many trips the loop makes.
  c.model.scan_unroll = 1
  c.model.attention = attention_config()
  # Segment recurrence (lm, an attention declaring a memory, ordered data): each block keeps its last mem_len
  # inputs as extra keys for the same rows of the next batch (docs/design.md section 6). 0 = no memory.
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
  # seq devices split them as well (SHARDING_RULES), beside fsdp.
  c.mesh.data = -1
  c.mesh.fsdp = -1
  c.mesh.seq = 1  # sequence parallelism: each sequence split over this many devices (ops with that form)
  c.mesh.model = 1
  c.sharding_rules = SHARDING_RULES
  return c
