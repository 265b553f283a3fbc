"""Cached decoding for Combiner-Mixture (`combiner.mixture`): the vertical and horizontal caches of
`combiner.axial_decode` together.

A `attention_core.decode.Decoder` (its docstring gives the protocol) whose step equals row `position` of the
plan's
causal forward pass: the same pieces and pooling laid out for one query. Each step writes the span summaries
its token completes, so every summary a query reads is complete and the per-token cost stays bounded.

Layouts (head-major, one token): q_t, k_t, pool_q, pool_k: [batch, heads, head_dim]; v_t: [batch, heads,
value_dim]; `position`: an int32 scalar shared by the batch; out_t: [batch, heads, value_dim] in v's dtype.
"""

from __future__ import annotations

from attention_core import contract
from attention_core.combine import joint_softmax, merge, partial_softmax
from attention_core.combine import normalize as normalize_partial
from attention_core.decode import finish, make_decoder, token
from combiner.axial_decode import (
  column_piece,
  grid_init,
  grid_write,
  horizontal_spans,
  row_piece,
  vertical_spans,
)
from combiner.mixture import NORMALIZE


def mixture_init(batch, heads, max_length, head_dim, value_dim, dtype, *, row_length: int,
                 pooling: str = "max", normalize: str = "mean"):
  del normalize
  return grid_init(batch, heads, max_length, head_dim, value_dim, dtype, row_length=row_length,
                    families=("vertical", "horizontal"), op="combiner.mixture")


def mixture_step(cache, q, k, v, position, *, row_length: int, pooling: str = "max", normalize: str = "mean",
                 pool_q=None, pool_k=None):
  op = "combiner.mixture"
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  contract.check_choice(normalize, name="normalize", allowed=NORMALIZE, op=op)
  g = grid_write(cache, token(q, k, v, position, pool_q, pool_k, op=op), m)
  direct = [row_piece(g), column_piece(g)]
  vertical, cache = vertical_spans(g, pooling)
  horizontal, cache = horizontal_spans(g._replace(cache=cache), pooling)
  if normalize == "mean":
    shared = partial_softmax(direct)
    out = 0.5 * sum(normalize_partial(merge([shared, partial_softmax([s])])) for s in (vertical, horizontal))
  else:
    out = joint_softmax(direct + [vertical, horizontal])
  return finish(out, g.x), cache


MIXTURE = make_decoder(mixture_init, mixture_step)
