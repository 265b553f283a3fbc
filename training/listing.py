"""`train.py --list`: what a command line can choose, read from the registry and the config files."""

from __future__ import annotations

import glob
import importlib
import os

from configs import arguments
from training.config_io import ROOT


def listing() -> str:
  """What a command line can choose: attention names, config files with their first docstring line, and each
  config's arguments (`--config FILE:key=value,flag`)."""
  from attention_core import registry as ops_registry
  from models import registry

  lines = ["attention (--config FILE:attention=NAME; its fields as --config.model.attention.FIELD=VALUE):"]
  for name in registry.names():
    spec = ops_registry.OPS.get(name)
    lines.append(f"  {name:<28} {spec.description if spec else ''}".rstrip())
    fields = registry.module_fields(registry.get_module(name))
    if fields:
      lines.append(f"  {'':<28} fields: {', '.join(fields)}")
  lines.append("configs (--config FILE[:ARGS]; any field also as --config.FIELD=VALUE):")
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
    module = importlib.import_module(f"configs.{os.path.splitext(os.path.basename(path))[0]}")
    if "get_config" not in vars(module):
      continue  # shared settings (base, images, text, routing_paper), not an experiment
    try:
      module.get_config("__list__")
    except arguments.UnknownConfigArgument as e:
      keys, flags = e.keys, e.flags
    paper = getattr(module, "routing_paper", None)  # the Routing paper's variant, read before the parser
    if paper is not None:
      keys, flags = keys + [f"{k}= (with {paper.FLAG})" for k in paper.KEYS], flags + [paper.FLAG]
    rel = os.path.relpath(path, ROOT)
    lines.append(f"  {rel:<22} {_summary(module.__doc__)}")
    lines.append(f"  {'':<22} keys: {', '.join(k if '=' in k else k + '=' for k in keys)}")
    lines.append(f"  {'':<22} flags: {', '.join(flags)}")
  return "\n".join(lines)


def _summary(doc: str | None) -> str:
  """A docstring's first paragraph as one line (its summary may wrap)."""
  return " ".join((doc or "").strip().split("\n\n")[0].split())
