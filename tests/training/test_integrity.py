"""Per-array checksums (training/integrity.py): every single-bit flip of any dtype is detected."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from training import integrity


def _flip(x: np.ndarray, index: int, bit: int) -> np.ndarray:
  raw = np.frombuffer(x.tobytes(), np.uint8).copy()
  raw[index] ^= np.uint8(1 << bit)
  return np.frombuffer(raw.tobytes(), x.dtype).reshape(x.shape)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.float16, jnp.int8, jnp.uint32])
def test_every_single_bit_flip_changes_the_checksum(dtype):
  key = jax.random.key(0)
  x = np.asarray(jax.random.normal(key, (3, 5)).astype(dtype) if jnp.issubdtype(dtype, jnp.floating)
                 else jax.random.randint(key, (3, 5), -100, 100).astype(dtype))
  tree = {"a": jnp.asarray(x)}
  saved = integrity.checksums(tree)
  integrity.verify(tree, saved)
  rng = np.random.default_rng(0)
  for index in rng.choice(x.nbytes, size=min(24, x.nbytes), replace=False):
    for bit in (0, 7, int(rng.integers(8))):
      with pytest.raises(ValueError, match=r"checksum mismatch in \['a'\]"):
        integrity.verify({"a": jnp.asarray(_flip(x, int(index), bit))}, saved)


def test_keys_bools_and_float64_and_sharded_arrays():
  mesh = jax.make_mesh((len(jax.devices()),), ("d",))
  sharded = jax.device_put(jnp.arange(8 * len(jax.devices()), dtype=jnp.float32),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
  with jax.enable_x64(True):
    tree = {"key": jax.random.key(3), "mask": jnp.array([True, False]), "x64": jnp.arange(3.0),
            "sharded": sharded}
    saved = integrity.checksums(tree)
    assert set(saved) == {"['key']", "['mask']", "['x64']", "['sharded']"}
    assert integrity.checksums({**tree, "sharded": jnp.asarray(np.asarray(sharded))}) == saved  # layout-free
    with pytest.raises(ValueError, match="x64"):
      integrity.verify({**tree, "x64": tree["x64"].at[1].set(np.nextafter(1.0, 2.0))}, saved)
    with pytest.raises(ValueError, match="key"):
      integrity.verify({**tree, "key": jax.random.key(4)}, saved)
  integrity.verify(tree, None)  # a checkpoint written before checksums: not checked
