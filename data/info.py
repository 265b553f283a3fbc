"""`DatasetInfo`: the static facts a model needs about its dataset (sizes, special ids, task)."""

from __future__ import annotations

import dataclasses

TASKS = ("lm", "mlm", "image", "classify", "retrieval", "hibert_pretrain", "hibert_summarise")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What the model and the metrics need to know about a dataset.

  vocab_size: ids in `inputs`/`targets` lie in [0, vocab_size); also the output size of lm/image/mlm heads
    (bits/dim and perplexity are computed over exactly these classes).
  input_vocab_size: embedding rows the model needs: > every id it feeds in, including a dedicated `bos_id` or
    `cls_id` beyond the data's vocabulary (images: bos_id = 256, input_vocab_size = 257).
  bos_id: id the model right-shifts `inputs` with (lm/image). cls_id: an id no data token uses, for models
    that prepend a [CLS] token (classify/retrieval). mask_id: the [MASK] id used by the mlm corruption.
  """

  name: str
  task: str
  vocab_size: int
  seq_len: int
  input_vocab_size: int
  num_classes: int | None = None
  pad_id: int = 0
  bos_id: int | None = None
  eos_id: int | None = None
  mask_id: int | None = None
  cls_id: int | None = None
  image_shape: tuple[int, int, int] | None = None  # (height, width, channels) for image tasks
  metric: str = "accuracy"  # "bits_per_dim" | "perplexity" | "accuracy" | "bits_per_byte" (a token a byte)
  max_segments: int | None = None  # packed text: most documents per row (None = unlimited)
  split_sizes: dict[str, int] = dataclasses.field(default_factory=dict)  # known full-dataset record counts
  version: str | None = None  # what the data was read from, where it varies by machine (pystdlib: the Python)

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")


# config.data.name -> module providing create_dataset(...) and dataset_info(config).
DATASETS: dict[str, str] = {
  "cifar10": "data.images",
  "imagenet64": "data.images",
  "wiki40b": "data.text",
  "c4": "data.text",
  "pg19": "data.text",
  "imdb": "data.text",
  "sst5": "data.text",
  "lra_listops": "data.lra",
  "lra_text": "data.lra",
  "lra_retrieval": "data.lra",
  "lra_image": "data.lra",
  "lra_pathfinder": "data.lra",
  "listops_synthetic": "data.listops",
  "synthetic_recall": "data.synthetic",
  "synthetic_local": "data.synthetic_local",
  "pystdlib": "data.pystdlib",
  "enwik8": "data.characters",
  "text8": "data.characters",
  "cnn_dailymail": "data.cnn_dailymail",
}
