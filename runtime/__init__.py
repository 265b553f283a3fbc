"""What the entry points run on: one path layer for local and `gs://` files, and JAX multi-process setup."""
