"""What the entry points run on: one path layer for local and `gs://` files, JAX multi-process setup, and
the one-line report of command-line errors (cli.py)."""
