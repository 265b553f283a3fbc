"""Command-line tools run from the repository root: `python -m scripts.<name> ...` (benchmarks, pictures)."""
