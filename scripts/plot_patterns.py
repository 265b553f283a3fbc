"""Pictures of each Combiner plan's attention pattern and the sparse baselines' supports (paper Figs. 1-2).

    python -m scripts.plot_patterns --out_dir docs/patterns            # L=16, block/row 4
    python -m scripts.plot_patterns --out_dir /tmp/p --length 32 --block 8

For every query row i (vertical axis) and key j (horizontal axis) a cell is coloured by the role key j plays
for query i, read from the from-definition reference (`combiner.reference.plan_sets` / `sparse_support`,
docs/design.md section 4): dark blue = direct set D_i (attended individually), warm shades = spans S_i^r
(attended through the span's pooled abstraction; neighbouring spans of a row get different shades so the
partition is visible), white = not attended (the future under causal masking). A Combiner row is fully
coloured over Omega_i (full attention); a sparse baseline's row shows only the keys it attends to
(dark green).

Writes one PNG per plan and direction (`combiner_<plan>_<causal|bidirectional>.png`,
`sparse_<plan>_<causal|bidirectional>.png`) and `overview.png` (all panels, causal top row, bidirectional
below).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from runtime import cli

EMPTY, DIRECT = 0, 1  # codes; span r (sorted by first position) has code 2 + r
COLOURS = {"empty": "#ffffff", "direct": "#1f4e9c", "sparse": "#1a7f4b"}
SPAN_SHADES = ("#f28e2b", "#ffd166", "#e15759", "#f9c49a")  # cycled over a row's spans
GRID = "#9a9a9a"

SetsFn = Callable[..., tuple[list[int], list[list[int]]]]
SupportFn = Callable[..., list[int]]


def plan_panels(block: int) -> list[tuple[str, str, str, dict[str, Any]]]:
  """(file stem, title, reference plan, params) per panel: Combiner plans first, then sparse baselines."""
  return [
    ("combiner_fixed", f"Combiner-Fixed (block {block})", "fixed", {"block_size": block}),
    ("combiner_logsparse", "Combiner-Logsparse", "logsparse", {}),
    ("combiner_axial_rowmajor", f"Combiner-Axial rowmajor (row {block})", "axial_rowmajor",
     {"row_length": block}),
    ("combiner_axial_vertical", f"Combiner-Axial vertical (row {block})", "axial_vertical",
     {"row_length": block}),
    ("combiner_axial_horizontal", f"Combiner-Axial horizontal (row {block})", "axial_horizontal",
     {"row_length": block}),
    ("sparse_fixed", f"Fixed sparse (block {block})", "fixed", {"block_size": block}),
    ("sparse_logsparse", "Logsparse sparse", "logsparse", {}),
    ("sparse_axial", f"Axial sparse (row {block})", "axial", {"row_length": block}),
  ]


def pattern_codes(plan: str, length: int, *, causal: bool, sets_fn: SetsFn | None = None,
                  **params: Any) -> np.ndarray:
  """[length, length] int codes of a Combiner plan: 0 empty, 1 direct, 2 + r for the r-th span of row i
  (spans ordered by their first position). Raises if a row's sets overlap (they must partition Omega_i)."""
  if sets_fn is None:
    from combiner.reference import plan_sets as sets_fn
  codes = np.zeros((length, length), dtype=np.int32)
  for i in range(length):
    direct, spans = sets_fn(plan, length, i, causal=causal, **params)
    for code, members in [(DIRECT, direct)] + [(2 + r, s) for r, s in enumerate(sorted(spans, key=min))]:
      for j in members:
        if codes[i, j] != EMPTY:
          raise ValueError(f"plan {plan!r}: key {j} appears twice in the sets of query {i}")
        codes[i, j] = code
  return codes


def sparse_codes(plan: str, length: int, *, causal: bool, support_fn: SupportFn | None = None,
                 **params: Any) -> np.ndarray:
  """[length, length] int codes of a sparse baseline: 1 where query i attends to key j, else 0."""
  if support_fn is None:
    from combiner.reference import sparse_support as support_fn
  codes = np.zeros((length, length), dtype=np.int32)
  for i in range(length):
    codes[i, support_fn(plan, length, i, causal=causal, **params)] = DIRECT
  return codes


def codes_to_rgb(codes: np.ndarray, *, sparse: bool = False) -> np.ndarray:
  """[L, L, 3] float colours of a code matrix (see the module docstring)."""
  from matplotlib.colors import to_rgb

  palette = [to_rgb(COLOURS["empty"]), to_rgb(COLOURS["sparse" if sparse else "direct"])]
  palette += [to_rgb(SPAN_SHADES[r % len(SPAN_SHADES)]) for r in range(max(0, int(codes.max()) - 1))]
  return np.asarray(palette)[codes]


def draw_panel(ax: Any, codes: np.ndarray, title: str, *, sparse: bool = False) -> None:
  length = codes.shape[0]
  extent = (-0.5, length - 0.5, length - 0.5, -0.5)  # cell (i, j) centred on integer coordinates
  ax.imshow(codes_to_rgb(codes, sparse=sparse), interpolation="nearest", extent=extent)
  edges = np.arange(-0.5, length, 1.0)  # one LineCollection per direction: far cheaper than tick gridlines
  ax.vlines(edges, -0.5, length - 0.5, colors=GRID, linewidth=0.4)
  ax.hlines(edges, -0.5, length - 0.5, colors=GRID, linewidth=0.4)
  ticks = [t for t in range(0, length, max(1, length // 4))]
  ax.set_xticks(ticks)
  ax.set_yticks(ticks)
  ax.tick_params(which="both", length=0, labelsize=6)
  ax.set_title(title, fontsize=7.5)


def _legend(fig: Any) -> None:
  from matplotlib.patches import Patch

  handles = [Patch(facecolor=COLOURS["direct"], label="direct $D_i$ (Combiner)"),
             *[Patch(facecolor=c, label=f"span {r + 1}" if r < 3 else "span ...") for r, c in
               enumerate(SPAN_SHADES)],
             Patch(facecolor=COLOURS["sparse"], label="attended (sparse baseline)"),
             Patch(facecolor=COLOURS["empty"], edgecolor=GRID, label="not attended")]
  fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)


def all_codes(length: int, block: int, sets_fn: SetsFn | None = None, support_fn: SupportFn | None = None
              ) -> dict[tuple[str, bool], np.ndarray]:
  """{(file stem, causal): codes} for every panel."""
  out = {}
  for stem, _, plan, params in plan_panels(block):
    for causal in (True, False):
      if stem.startswith("sparse_"):
        out[stem, causal] = sparse_codes(plan, length, causal=causal, support_fn=support_fn, **params)
      else:
        out[stem, causal] = pattern_codes(plan, length, causal=causal, sets_fn=sets_fn, **params)
  return out


def write_pictures(out_dir: str, *, length: int = 16, block: int = 4, sets_fn: SetsFn | None = None,
                   support_fn: SupportFn | None = None) -> list[str]:
  """Writes every per-panel PNG and overview.png into `out_dir`; returns their paths."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(out_dir, exist_ok=True)
  panels = plan_panels(block)
  codes = all_codes(length, block, sets_fn, support_fn)
  paths = []
  for stem, title, _, _ in panels:
    for causal in (True, False):
      direction = "causal" if causal else "bidirectional"
      fig, ax = plt.subplots(figsize=(3.0, 3.2))
      draw_panel(ax, codes[stem, causal], f"{title}, {direction}\nL={length}",
                 sparse=stem.startswith("sparse_"))
      ax.set_xlabel("key j", fontsize=7)
      ax.set_ylabel("query i", fontsize=7)
      caption = ("green: attended, white: not attended" if stem.startswith("sparse_")
                 else "blue: direct $D_i$, warm shades: spans, white: none")
      fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=6.5)
      fig.subplots_adjust(left=0.15, right=0.97, top=0.86, bottom=0.17)  # fixed: tight_layout is slow
      path = os.path.join(out_dir, f"{stem}_{direction}.png")
      fig.savefig(path, dpi=100)
      plt.close(fig)
      paths.append(path)
  fig, axes = plt.subplots(2, len(panels), figsize=(2.1 * len(panels), 4.9))
  for col, (stem, title, _, _) in enumerate(panels):
    for row, causal in enumerate((True, False)):
      draw_panel(axes[row, col], codes[stem, causal], title.replace(" (", "\n("),
                 sparse=stem.startswith("sparse_"))
    axes[0, col].set_xlabel("")
  axes[0, 0].set_ylabel(f"causal\nquery i (L={length})", fontsize=8)
  axes[1, 0].set_ylabel(f"bidirectional\nquery i (L={length})", fontsize=8)
  _legend(fig)
  fig.subplots_adjust(left=0.045, right=0.995, top=0.9, bottom=0.12, wspace=0.22, hspace=0.38)
  path = os.path.join(out_dir, "overview.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  paths.append(path)
  return paths


def main(argv: Sequence[str] | None = None) -> list[str]:
  parser = cli.ArgumentParser(prog="python -m scripts.plot_patterns",
                              description=__doc__.split("\n\n")[0])
  parser.add_argument("--out_dir", default="docs/patterns")
  parser.add_argument("--length", type=int, default=16, help="sequence length of the pictures")
  parser.add_argument("--block", type=int, default=4, help="block size (fixed) and row length (axial)")
  args = parser.parse_args(argv)
  if args.length < 1 or args.block < 1:
    parser.error("--length and --block must be >= 1")
  paths = write_pictures(args.out_dir, length=args.length, block=args.block)
  for path in paths:
    print(path)
  return paths


if __name__ == "__main__":
  main(sys.argv[1:])
