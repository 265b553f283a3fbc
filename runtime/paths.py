"""One path layer for every plain file the entry points write: local paths and `gs://` (any epath URI).

Orbax and tfds already read and write `gs://` through etils.epath / tensorstore; config.json, metrics JSON,
TensorBoard event files and data caches go through `epath.Path` here too, so a `gs://` workdir works end to
end. Without TensorFlow installed, epath reaches GCS through fsspec + gcsfs (requirements-tpu.txt).

TensorBoard: tensorboardX writes `gs://` only through google-cloud-storage (or TensorFlow). `summary_writer`
instead registers, for the logdir's URI scheme, a record writer that goes through epath: it keeps the event
file's bytes in memory and rewrites the whole object on every flush (a GCS object cannot be appended to),
which is cheap for scalar summaries. Local logdirs keep tensorboardX's own appending file writer.
"""

from __future__ import annotations

import io
import json
import os
import sys
from typing import Any

from etils import epath

PathLike = str | os.PathLike


def is_uri(path: PathLike) -> bool:
  """True for `scheme://...` paths (gs://, s3://, ...), which never go through the local filesystem."""
  return "://" in os.fspath(path)


def path(p: PathLike) -> epath.Path:
  """`p` as an epath.Path; a local path is made absolute (orbax requires it)."""
  p = os.fspath(p)
  return epath.Path(p if is_uri(p) else os.path.abspath(os.path.expanduser(p)))


def join(base: PathLike, *parts: str) -> str:
  """String join that keeps a URI's `scheme://` intact."""
  return os.fspath(path(base).joinpath(*parts))


def makedirs(p: PathLike) -> epath.Path:
  out = path(p)
  out.mkdir(parents=True, exist_ok=True)
  return out


def exists(p: PathLike) -> bool:
  return path(p).exists()


def write_bytes(p: PathLike, data: bytes) -> None:
  """Writes the whole file; a local file is replaced atomically (a reader never sees half a file)."""
  target = path(p)
  target.parent.mkdir(parents=True, exist_ok=True)
  if is_uri(p):
    target.write_bytes(data)  # object stores replace whole objects
    return
  tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
  tmp.write_bytes(data)
  tmp.replace(target)


def write_text(p: PathLike, text: str) -> None:
  write_bytes(p, text.encode())


def rmtree(p: PathLike) -> None:
  """Removes a directory tree if it is there."""
  target = path(p)
  if target.exists():
    target.rmtree(missing_ok=True)


def read_text(p: PathLike) -> str:
  return path(p).read_text()


def write_json(p: PathLike, value: Any) -> None:
  write_text(p, json.dumps(value, indent=2))


def read_json(p: PathLike) -> Any:
  return json.loads(read_text(p))


# ------------------------------------------------------------------------------------------------------------
# TensorBoard


class _EpathRecordFile:
  """A file-like event sink for tensorboardX: buffers the bytes, rewrites the object on flush and close."""

  def __init__(self, p: str):
    self.path = epath.Path(p)
    self.buffer = io.BytesIO()
    self._dirty = True

  def write(self, data: bytes) -> None:
    self.buffer.write(data)
    self._dirty = True

  def flush(self) -> None:
    if self._dirty:
      self.path.write_bytes(self.buffer.getvalue())
      self._dirty = False

  def close(self) -> None:
    self.flush()


class _EpathRecordFactory:
  def open(self, p: str) -> _EpathRecordFile:
    return _EpathRecordFile(p)

  def directory_check(self, p: str) -> None:
    epath.Path(p).mkdir(parents=True, exist_ok=True)


def summary_writer(logdir: PathLike) -> Any:
  """A tensorboardX SummaryWriter for a local or URI logdir (see the module docstring for `gs://`).

  tensorboardX's torch import is skipped (`_import_tensorboardx`)."""
  tbx = _import_tensorboardx("tensorboardX")
  SummaryWriter, record_writer = tbx.SummaryWriter, _import_tensorboardx("tensorboardX.record_writer")
  logdir = os.fspath(path(logdir))
  if is_uri(logdir):
    record_writer.register_writer_factory(logdir.split("://", 1)[0], _EpathRecordFactory())
  return SummaryWriter(logdir)


def _import_tensorboardx(module: str) -> Any:
  """A tensorboardX module without importing torch (seconds) when it is not loaded already: tensorboardX
  imports it only to accept torch tensors, which this project never logs."""
  import importlib

  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # makes `import torch` raise ImportError inside tensorboardX
  try:
    return importlib.import_module(module)
  finally:
    if blocked:
      del sys.modules["torch"]


def read_scalars(logdir: PathLike) -> dict[str, list[tuple[int, float]]]:
  """Every scalar in a TensorBoard logdir's event files: tag -> [(step, value)], sorted by step (a resumed
  run's later file wins a step written twice). Reads the records directly (length, CRC, Event proto), so
  neither TensorFlow nor TensorBoard is needed; {} when the logdir does not exist."""
  event_pb2 = _import_tensorboardx("tensorboardX.proto.event_pb2")
  root = path(logdir)
  if not root.exists():
    return {}
  out: dict[str, dict[int, float]] = {}
  for f in sorted(root.glob("events.out.tfevents.*"), key=lambda f: f.name):
    data, i = f.read_bytes(), 0
    while i + 12 <= len(data):
      n = int.from_bytes(data[i:i + 8], "little")
      record = data[i + 12:i + 12 + n]
      i += 12 + n + 4
      if len(record) < n:  # a record cut short by a crash
        break
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        if value.HasField("simple_value"):
          out.setdefault(value.tag, {})[int(event.step)] = float(value.simple_value)
  return {tag: sorted(points.items()) for tag, points in out.items()}


# ------------------------------------------------------------------------------------------------------------
# Directories of arrays (data caches)


def publish_dir(target: PathLike, files: dict[str, bytes]) -> bool:
  """Writes `files` (name -> bytes) into a temporary sibling of `target`, then renames it to `target`.

  Local: the rename is atomic, so a reader sees all files or none. Object stores: the rename copies, and only
  after every file is complete. Returns False (and leaves `target` alone) when another process published
  `target` first; both wrote the same files.
  """
  import uuid

  final = path(target)
  final.parent.mkdir(parents=True, exist_ok=True)
  tmp = final.parent / f"{final.name}.tmp-{uuid.uuid4().hex[:12]}"
  tmp.mkdir(parents=True, exist_ok=False)
  try:
    for name, data in files.items():
      (tmp / name).write_bytes(data)
    if final.exists():
      return False
    try:
      tmp.rename(final)
    except OSError:
      if not final.exists():
        raise
      return False
    return True
  finally:
    if tmp.exists():
      tmp.rmtree()


def npy_bytes(array: Any) -> bytes:
  import numpy as np

  buf = io.BytesIO()
  np.save(buf, array)
  return buf.getvalue()


def load_npy(p: PathLike, *, mmap_over_mb: float | None = None) -> Any:
  """np.load through the path layer; a local file larger than `mmap_over_mb` is memory-mapped."""
  import numpy as np

  src = path(p)
  if not is_uri(p):
    big = mmap_over_mb is not None and os.path.getsize(os.fspath(src)) > mmap_over_mb * 2**20
    return np.load(os.fspath(src), mmap_mode="r" if big else None)
  return np.load(io.BytesIO(src.read_bytes()))
