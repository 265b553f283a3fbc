"""Self-checks of the from-definition reference (combiner/reference.py) against docs/design.md §4 and the
paper.

The reference is what the fast ops are tested against, so it is checked here on its own: the sets partition
Omega_i for every plan, length, block/row size and mask; hand-written cases from the paper's figures; and the
attention matrix against formulas written out by hand for tiny cases.
"""

import math

import numpy as np
import pytest

from combiner import reference as ref

LENGTHS = (1, 2, 3, 5, 9, 10, 11, 17)
SIZES = (1, 2, 3, 4, "L")


def _size(size, length):
  return length if size == "L" else size


def _sized_plans(length, extra):
  """(plan, params): logsparse, then fixed and the axial plans at every block/row size s, plus extra(s)."""
  out = [("logsparse", {})]
  for size in SIZES:
    s = _size(size, length)
    out.append(("fixed", {"block_size": s}))
    for direction in ("rowmajor", "vertical", "horizontal"):
      out.append((f"axial_{direction}", {"row_length": s}))
    out += extra(s)
  return out


def _set_plans(length, rng):
  """Every set plan at every block/row size, including 'routed' with random clusters."""
  return _sized_plans(length, lambda s: [("routed", {"cluster_ids": rng.integers(0, s, length),
                                                     "num_clusters": s})])

def _masks(length, rng):
  mask = rng.random(length) < 0.6
  mask[rng.integers(length)] = True  # at least one real token
  return [None, mask]


@pytest.mark.parametrize("causal", [True, False])
def test_sets_partition_omega(causal):
  rng = np.random.default_rng(0)
  checked = 0
  for length in LENGTHS:
    for mask in _masks(length, rng):
      real = np.ones(length, bool) if mask is None else mask
      for plan, params in _set_plans(length, rng):
        for i in range(length):
          direct, spans = ref.plan_sets(plan, length, i, causal=causal, mask=mask, **params)
          omega = ref.omega(length, i, causal=causal, mask=mask)
          members = direct + [j for span in spans for j in span]
          assert len(members) == len(set(members)), (plan, params, length, i, "sets overlap")
          assert sorted(members) == omega, (plan, params, length, i, "sets do not cover Omega_i")
          assert all(spans), (plan, length, i, "empty span kept")
          assert (i in direct) == bool(real[i]), (plan, length, i)
          if causal:
            assert max(members, default=-1) <= i
          checked += 1
  assert checked > 1000


def test_logsparse_hand_cases():
  spans = lambda length, i, causal: ref.plan_sets("logsparse", length, i, causal=causal)[1]  # noqa: E731
  rng = lambda a, b: list(range(a, b))  # noqa: E731
  # i = 13 = 0b1101: [0, 8), [8, 12), [12, 13).
  assert spans(16, 13, True) == [rng(0, 8), rng(8, 12), rng(12, 13)]
  assert ref.plan_sets("logsparse", 16, 13, causal=True)[0] == [13]
  # L = 2^k + 1 keeps the top span (the released code loses it).
  assert spans(17, 16, True) == [rng(0, 16)]
  assert spans(17, 0, False) == [rng(1, 17)]
  assert spans(17, 15, False) == [rng(0, 8), rng(8, 12), rng(12, 14), rng(14, 15), rng(16, 17)]
  # Bidirectional i = 2 of 16: causal [0, 2); reversed i' = 13 gives (i, L) as [15, 16)... mirrored.
  assert spans(16, 2, False) == [rng(0, 2), rng(8, 16), rng(4, 8), rng(3, 4)]
  # The number of summaries a query uses is the popcount of i (causal): O(log L).
  for i in range(64):
    assert len(spans(64, i, True)) == bin(i).count("1")


def test_fixed_and_axial_hand_cases():
  # fixed, L=10, s=4, causal i=9: own block [8, 9]; spans are the earlier blocks.
  assert ref.plan_sets("fixed", 10, 9, causal=True, block_size=4) == ([8, 9], [[0, 1, 2, 3], [4, 5, 6, 7]])
  # Bidirectional i=1: the ragged last block is a span.
  assert ref.plan_sets("fixed", 10, 1, causal=False, block_size=4) == ([0, 1, 2, 3], [[4, 5, 6, 7], [8, 9]])
  # Paper Figure 2, a 3x4 image (m = 4). Vertical, causal i=6 (row 1, col 2): D = own row so far + own column.
  assert ref.plan_sets("axial_vertical", 12, 6, causal=True, row_length=4) == ([2, 4, 5, 6], [[0], [1], [3]])
  # Horizontal, causal i=10 (row 2, col 2): spans are the earlier rows without column 2.
  assert ref.plan_sets("axial_horizontal", 12, 10, causal=True, row_length=4) == (
      [2, 6, 8, 9, 10], [[0, 1, 3], [4, 5, 7]])
  # Vertical, bidirectional i=5 (row 1, col 1) of 10 (ragged last row [8, 9]).
  assert ref.plan_sets("axial_vertical", 10, 5, causal=False, row_length=4) == (
      [1, 4, 5, 6, 7, 9], [[0, 8], [2], [3]])
  # Row-major, bidirectional i=3 (row 0, col 3) of 10: rows 1 and 2 are spans.
  assert ref.plan_sets("axial_rowmajor", 10, 3, causal=False, row_length=4) == (
      [0, 1, 2, 3], [[4, 5, 6, 7], [8, 9]])
  # Span queries: the column-aligned token 7; position 11 is beyond the ragged last row, so pooled (None).
  assert ref.span_query_rows("axial_rowmajor", 10, 3, causal=False, row_length=4) == [7, None]
  mask = np.ones(10, bool)
  mask[7] = False
  assert ref.span_query_rows("axial_rowmajor", 10, 3, causal=False, mask=mask, row_length=4) == [None, None]
  assert ref.span_query_rows("axial_rowmajor", 10, 9, causal=True, row_length=4) == [1, 5]
  assert ref.span_query_rows("fixed", 10, 9, causal=True, block_size=4) == [None, None]


def test_masking_drops_emptied_spans():
  mask = np.ones(12, bool)
  mask[4:8] = False  # the whole middle block / row
  assert ref.plan_sets("fixed", 12, 10, causal=True, mask=mask, block_size=4) == ([8, 9, 10], [[0, 1, 2, 3]])
  direct, spans = ref.plan_sets("axial_horizontal", 12, 10, causal=True, mask=mask, row_length=4)
  assert direct == [2, 8, 9, 10] and spans == [[0, 1, 3]]


def test_routed_chunks_are_balanced():
  ids = np.array([2, 0, 1, 0, 2, 2, 1, 0, 0, 1])  # cluster sizes 4, 3, 3
  # Sorted by (id, position): 1 3 7 8 | 2 6 9 0 | 4 5 (chunks of ceil(10/3) = 4).
  chunks = [[1, 3, 7, 8], [0, 2, 6, 9], [4, 5]]
  for i in range(10):
    own = next(c for c in chunks if i in c)
    assert ref.plan_sets("routed", 10, i, causal=False, cluster_ids=ids, num_clusters=3) == (
        own, [c for c in chunks if c is not own])
    direct, spans = ref.plan_sets("routed", 10, i, causal=True, cluster_ids=ids, num_clusters=3)
    assert direct == [j for j in own if j <= i]
    assert spans == [s for s in ([j for j in c if j <= i] for c in chunks if c is not own) if s]
  # Unbalanced assignment (everyone in cluster 0) still gives equal chunks.
  sizes = {len(ref.plan_sets("routed", 9, i, causal=False, cluster_ids=np.zeros(9, int), num_clusters=3)[0])
           for i in range(9)}
  assert sizes == {3}


def _softmax(x):
  e = np.exp(np.asarray(x) - np.max(x))
  return e / e.sum()


def test_attention_matrix_matches_hand_formulas():
  rng = np.random.default_rng(1)
  d = 3
  q, k = rng.normal(size=(4, d)), rng.normal(size=(4, d))
  s = lambda a, b: a @ b / math.sqrt(d)  # noqa: E731
  # fixed, L=4, block 2, causal, i=3: D = {2, 3}, span {0, 1} with max-pooled q and k.
  qb, kb = np.maximum(q[0], q[1]), np.maximum(k[0], k[1])
  w = _softmax([s(q[3], k[2]), s(q[3], k[3]), s(q[3], kb)])
  inner = _softmax([s(qb, k[0]), s(qb, k[1])])
  expect = np.array([w[2] * inner[0], w[2] * inner[1], w[0], w[1]])
  a = ref.attention_matrix("fixed", q, k, causal=True, block_size=2)
  np.testing.assert_allclose(a[3], expect, rtol=1e-13)
  # Same with mean pooling.
  qb, kb = (q[0] + q[1]) / 2, (k[0] + k[1]) / 2
  w = _softmax([s(q[3], k[2]), s(q[3], k[3]), s(q[3], kb)])
  inner = _softmax([s(qb, k[0]), s(qb, k[1])])
  expect = np.array([w[2] * inner[0], w[2] * inner[1], w[0], w[1]])
  a = ref.attention_matrix("fixed", q, k, causal=True, block_size=2, pooling="mean")
  np.testing.assert_allclose(a[3], expect, rtol=1e-13)
  # Row-major, causal, i=3 (row 1, col 1): row 0's span query is q[1], its key is pooled (pool_k if given).
  pk = rng.normal(size=(4, d))
  kb = np.maximum(pk[0], pk[1])
  w = _softmax([s(q[3], k[2]), s(q[3], k[3]), s(q[3], kb)])
  inner = _softmax([s(q[1], k[0]), s(q[1], k[1])])
  expect = np.array([w[2] * inner[0], w[2] * inner[1], w[0], w[1]])
  a = ref.attention_matrix("axial_rowmajor", q, k, causal=True, row_length=2, pool_k=pk)
  np.testing.assert_allclose(a[3], expect, rtol=1e-13)
  # Row-major with a masked aligned token: pooled span query over the real members only ({0}).
  mask = np.array([True, False, True, True])
  w = _softmax([s(q[3], k[2]), s(q[3], k[3]), s(q[3], k[0])])
  expect = np.array([w[2], 0.0, w[0], w[1]])
  a = ref.attention_matrix("axial_rowmajor", q, k, causal=True, row_length=2, mask=mask)
  np.testing.assert_allclose(a[3], expect, rtol=1e-13)


def test_mixture_and_joint_hand_formula():
  rng = np.random.default_rng(2)
  d = 2
  q, k = rng.normal(size=(4, d)), rng.normal(size=(4, d))
  av = ref.attention_matrix("axial_vertical", q, k, causal=False, row_length=2)
  ah = ref.attention_matrix("axial_horizontal", q, k, causal=False, row_length=2)
  np.testing.assert_allclose(ref.attention_matrix("mixture", q, k, causal=False, row_length=2), (av + ah) / 2)
  # 2x2 grid, i=0: D = {0, 1, 2}; vertical span = column 1 minus row 0 = {3};
  # horizontal span = row 1 minus col 0 = {3}.
  s = lambda a, b: a @ b / math.sqrt(d)  # noqa: E731
  w = _softmax([s(q[0], k[0]), s(q[0], k[1]), s(q[0], k[2]), s(q[0], k[3]), s(q[0], k[3])])
  expect = np.array([w[0], w[1], w[2], w[3] + w[4]])
  a = ref.attention_matrix("mixture", q, k, causal=False, row_length=2, normalize="joint")
  np.testing.assert_allclose(a[0], expect, rtol=1e-13)


def _matrix_plans(length):
  return _sized_plans(length, lambda s: [("mixture", {"row_length": s, "normalize": n})
                                         for n in ("mean", "joint")])


@pytest.mark.parametrize("causal", [True, False])
def test_attention_matrix_full_support_rows_sum_to_one(causal):
  rng = np.random.default_rng(3)
  for length in (1, 2, 5, 9, 11):
    q, k = rng.normal(size=(length, 4)), rng.normal(size=(length, 4))
    for mask in _masks(length, rng):
      real = np.ones(length, bool) if mask is None else mask
      allowed = np.broadcast_to(real[None, :], (length, length))
      if causal:
        allowed = allowed & np.tril(np.ones((length, length), bool))
      routed = ("routed", {"cluster_ids": rng.integers(0, 3, length), "num_clusters": 3})
      plans = _matrix_plans(length) + [routed]
      for plan, params in plans:
        for pooling in ("max", "mean"):
          a = ref.attention_matrix(plan, q, k, causal=causal, mask=mask, pooling=pooling, **params)
          rows = a[real]
          np.testing.assert_allclose(rows.sum(-1), 1.0, rtol=1e-12, err_msg=f"{plan} {params}")
          assert np.all(rows[allowed[real]] > 0), (plan, params, length)
          assert np.all(rows[~allowed[real]] == 0), (plan, params, length)


def test_degenerate_sizes_equal_dense():
  rng = np.random.default_rng(4)
  for length in (1, 3, 7):
    q, k = rng.normal(size=(length, 5)), rng.normal(size=(length, 5))
    for causal in (True, False):
      logits = q @ k.T / math.sqrt(5)
      if causal:
        logits = np.where(np.tril(np.ones((length, length), bool)), logits, -np.inf)
      dense = np.exp(logits - logits.max(-1, keepdims=True))
      dense /= dense.sum(-1, keepdims=True)
      for plan, params in [("fixed", {"block_size": length}), ("axial_rowmajor", {"row_length": length}),
                           ("routed", {"cluster_ids": rng.integers(0, 4, length), "num_clusters": 1})]:
        a = ref.attention_matrix(plan, q, k, causal=causal, **params)
        np.testing.assert_allclose(a, dense, rtol=1e-12)
      for name in ("fixed", "axial"):
        p = {"block_size" if name == "fixed" else "row_length": length}
        a = ref.sparse_attention_matrix(name, q, k, causal=causal, **p)
        np.testing.assert_allclose(a, dense, rtol=1e-12)
      if length == 1:
        np.testing.assert_allclose(ref.attention_matrix("logsparse", q, k, causal=causal), dense)


def test_sparse_support_hand_cases():
  assert ref.sparse_support("fixed", 10, 9, causal=True, block_size=4) == [3, 7, 8, 9]
  assert ref.sparse_support("fixed", 10, 1, causal=False, block_size=4) == [0, 1, 2, 3, 7]
  assert ref.sparse_support("logsparse", 16, 13, causal=True) == [7, 11, 12, 13]
  # Bidirectional i=2 of 16: causal [0, 2) -> 1; reversed i'=13 -> spans (reversed) ending at 7, 11, 12.
  assert ref.sparse_support("logsparse", 16, 2, causal=False) == [1, 2, 3, 4, 8]
  assert ref.sparse_support("axial", 10, 9, causal=True, row_length=4) == [1, 5, 8, 9]
  assert ref.sparse_support("axial", 10, 1, causal=False, row_length=4) == [0, 1, 2, 3, 5, 9]
  mask = np.ones(16, bool)
  mask[11] = False  # a masked summary position is simply absent
  assert ref.sparse_support("logsparse", 16, 13, causal=True, mask=mask) == [7, 12, 13]
  # The sparse support is a subset of Omega_i that contains i, for every plan and size.
  for length in LENGTHS:
    for i in range(length):
      for causal in (True, False):
        omega = set(ref.omega(length, i, causal=causal))
        for plan, p in [("logsparse", {}), ("fixed", {"block_size": 3}), ("axial", {"row_length": 3})]:
          support = ref.sparse_support(plan, length, i, causal=causal, **p)
          assert i in support and set(support) <= omega


def test_reference_op_layout():
  rng = np.random.default_rng(5)
  q, k = rng.normal(size=(2, 6, 3, 4)), rng.normal(size=(2, 6, 3, 4))
  v = rng.normal(size=(2, 6, 3, 5))
  mask = rng.random((2, 6)) < 0.7
  mask[:, 0] = True
  out = ref.reference_op("fixed", q, k, v, causal=True, mask=mask, block_size=2)
  assert out.shape == v.shape
  a = ref.attention_matrix("fixed", q[1, :, 2], k[1, :, 2], causal=True, mask=mask[1], block_size=2)
  np.testing.assert_allclose(out[1, :, 2], a @ v[1, :, 2])
  ids = rng.integers(0, 2, (2, 6, 3))
  out = ref.reference_op("routed", q, k, v, causal=False, cluster_ids=ids, num_clusters=2)
  a = ref.attention_matrix("routed", q[0, :, 1], k[0, :, 1], causal=False, cluster_ids=ids[0, :, 1],
                           num_clusters=2)
  np.testing.assert_allclose(out[0, :, 1], a @ v[0, :, 1])
  out = ref.sparse_reference_op("axial", q, k, v, causal=False, mask=mask, row_length=3)
  a = ref.sparse_attention_matrix("axial", q[0, :, 0], k[0, :, 0], causal=False, mask=mask[0], row_length=3)
  np.testing.assert_allclose(out[0, :, 0], a @ v[0, :, 0])


def test_reference_rejects_bad_arguments():
  q = np.ones((4, 2))
  with pytest.raises(ValueError, match="'plan'"):
    ref.attention_matrix("nope", q, q, causal=True)
  for bad in (0, -1, 2.5):
    with pytest.raises(ValueError, match="'block_size'"):
      ref.plan_sets("fixed", 4, 0, causal=True, block_size=bad)
  with pytest.raises(ValueError, match="'pooling'"):
    ref.attention_matrix("fixed", q, q, causal=True, block_size=2, pooling="min")
  with pytest.raises(ValueError, match="'normalize'"):
    ref.attention_matrix("mixture", q, q, causal=True, row_length=2, normalize="sum")
  with pytest.raises(ValueError, match="'row_length'"):
    ref.sparse_support("axial", 4, 0, causal=True)
