"""Peer implementations timed next to ours by `python -m scripts.benchmark --peers` (docs/design.md §7).

A peer is a third-party attention (PyTorch packages from `requirements-bench.txt`: lucidrains'
`routing-transformer`, HuggingFace `transformers`' YOSO) run on the same shapes as our ops. Each entry of
`PEERS` maps a row name to a factory

    factory(length, batch, heads, head_dim, causal, dtype) -> (fwd, fwdbwd)

that builds its module and inputs (random, never zeros) and returns two zero-argument callables: `fwd()` runs
the forward pass, `fwdbwd()` runs forward + backward (gradient of sum(out * random cotangent) with respect to
the inputs, like ours); both must block until the work is done (PyTorch on CPU is synchronous). The benchmark
calls the factory inside a fresh worker process, measures the process's peak-RSS increase over the baseline
taken *after* the factory returned, times one warm-up and `--repeats` calls of each, and reports the row as
`peer:<name>`. `dtype` is the benchmark's `--dtype` string ("float32", "bfloat16", ...). Raise `ValueError`
for shapes or modes the peer cannot run (e.g. `causal=False` for a causal-only module): the row then reports
the message.

Rules: import torch (and the peer package) only *inside* the factory, so the core never depends on it; set
`torch.set_num_threads(...)` only if you also say so in the row name, so the comparison stays fair.

Example (a PyTorch dense-attention peer; not registered, keep `PEERS` for real peers):

    def _torch_dense(length, batch, heads, head_dim, causal, dtype):
      import torch
      torch_dtype = getattr(torch, dtype)
      gen = torch.Generator().manual_seed(0)
      q, k, v = (torch.randn(batch, heads, length, head_dim, generator=gen, dtype=torch_dtype,
                             requires_grad=True) for _ in range(3))
      cot = torch.randn(batch, heads, length, head_dim, generator=gen, dtype=torch_dtype)
      attn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

      def fwd():
        with torch.no_grad():
          attn()

      def fwdbwd():
        torch.autograd.grad((attn() * cot).sum(), (q, k, v))

      return fwd, fwdbwd

    PEERS["torch_dense"] = _torch_dense   # or decorate the factory with @register_peer("torch_dense")
    COUNTERPARTS["torch_dense"] = ("dense",)  # -> benchmark_peers.md: peer time / dense time per L
"""

from __future__ import annotations

from collections.abc import Callable

PeerFactory = Callable[[int, int, int, int, bool, str], tuple[Callable[[], object], Callable[[], object]]]

# name -> factory. Filled by the routing (routing-transformer) and YOSO (transformers YOSO) helpers.
PEERS: dict[str, PeerFactory] = {}


# peer name -> our registered ops it is compared with in `benchmark_peers.md` (ratio = peer time / our time,
# so >= 1 means ours is at least as fast), e.g. {"routing_transformer": ("routing",),
# "hf_yoso": ("yoso_e", "yoso", "yoso_sketch")}.
COUNTERPARTS: dict[str, tuple[str, ...]] = {}


def register_peer(name: str, *, counterparts: tuple[str, ...] = ()) -> Callable[[PeerFactory], PeerFactory]:
  """Decorator: `@register_peer("routing_transformer", counterparts=("routing",))` adds the factory to `PEERS`
  under `name` and compares it with our `counterparts` ops (when they are in the same run)."""

  def wrap(factory: PeerFactory) -> PeerFactory:
    if name in PEERS:
      raise ValueError(f"benchmark peer {name!r} is already registered")
    PEERS[name] = factory
    if counterparts:
      COUNTERPARTS[name] = tuple(counterparts)
    return factory

  return wrap


@register_peer("routing_transformer", counterparts=("routing",))
def _routing_transformer(length, batch, heads, head_dim, causal, dtype):
  """lucidrains' `routing-transformer` KmeansAttention, set up like our `routing` op: clusters = window =
  sqrt(L) rounded up to a power of two, shared QK. Its one-time k-means initialisation (10 Lloyd iterations)
  runs here, untimed; the timed calls are in eval mode, so like ours they do not update the centroids."""
  import torch
  from routing_transformer.routing_transformer import KmeansAttention

  from attention_core.registry import sqrt_pow2

  torch_dtype = getattr(torch, dtype)
  size = sqrt_pow2(length)
  attn = KmeansAttention(size, size, heads, head_dim, causal=causal, shared_qk=True).to(torch_dtype)
  gen = torch.Generator().manual_seed(0)
  q, v = (torch.randn(batch, heads, length, head_dim, generator=gen, dtype=torch_dtype, requires_grad=True)
          for _ in range(2))
  cot = torch.randn(batch, heads, length, head_dim, generator=gen, dtype=torch_dtype)
  with torch.no_grad():
    attn.train()
    attn(q, q, v)  # k-means init
  attn.eval()

  def fwd():
    with torch.no_grad():
      attn(q, q, v)

  def fwdbwd():
    out, _ = attn(q, q, v)
    torch.autograd.grad((out * cot).sum(), (q, v))

  return fwd, fwdbwd


@register_peer("hf_yoso", counterparts=("yoso_e", "yoso", "yoso_sketch"))
def _hf_yoso(length, batch, heads, head_dim, causal, dtype):
  """HuggingFace `transformers`' `YosoSelfAttention` with tau = hash_code_len = 8, as our `yoso_e` and `yoso`.
  Without CUDA its LSH kernels do not exist, so only the expectation path (`use_expectation=True`, dense
  O(L^2), YOSO-E) runs here. The q/k/v linear projections are replaced by identities so that, like our ops,
  only the attention is timed (the module then attends over q = k = v = its input, which costs the same as
  distinct inputs). Padding mask: all real tokens; no convolution (conv_window=None)."""
  if causal:
    raise ValueError("hf_yoso: YOSO attention is bidirectional only (causal=True unsupported)")
  import torch
  from transformers import YosoConfig
  from transformers.models.yoso.modeling_yoso import YosoSelfAttention

  torch_dtype = getattr(torch, dtype)
  config = YosoConfig(hidden_size=heads * head_dim, num_attention_heads=heads, use_expectation=True,
                      hash_code_len=8, num_hash=32, conv_window=None, attention_probs_dropout_prob=0.0)
  attn = YosoSelfAttention(config).to(torch_dtype).eval()
  attn.query = attn.key = attn.value = torch.nn.Identity()
  gen = torch.Generator().manual_seed(0)
  x = torch.randn(batch, length, heads * head_dim, generator=gen, dtype=torch_dtype, requires_grad=True)
  cot = torch.randn(batch, length, heads * head_dim, generator=gen, dtype=torch_dtype)
  mask = torch.zeros(batch, length, dtype=torch_dtype)  # the extended mask: 0 = real token

  def fwd():
    with torch.no_grad():
      attn(x, mask)

  def fwdbwd():
    out = attn(x, mask)[0]
    torch.autograd.grad((out * cot).sum(), (x,))

  return fwd, fwdbwd


def _torch_qkv(length, batch, heads, head_dim, dtype):
  """Random q, k, v [batch, heads, length, head_dim] (requiring grad) and a cotangent, in torch."""
  import torch

  torch_dtype = getattr(torch, dtype)
  gen = torch.Generator().manual_seed(0)
  q, k, v = (torch.randn(batch, heads, length, head_dim, generator=gen, dtype=torch_dtype, requires_grad=True)
             for _ in range(3))
  cot = torch.randn(batch, heads, length, head_dim, generator=gen, dtype=torch_dtype)
  return q, k, v, cot


def _torch_pair(attn, q, k, v, cot):
  """(fwd, fwdbwd) for `attn(q, k, v) -> out`."""
  import torch

  def fwd():
    with torch.no_grad():
      attn(q, k, v)

  def fwdbwd():
    torch.autograd.grad((attn(q, k, v) * cot).sum(), (q, k, v))

  return fwd, fwdbwd


@register_peer("reformer_pytorch", counterparts=("reformer",))
def _reformer_pytorch(length, batch, heads, head_dim, causal, dtype):
  """lucidrains' `reformer-pytorch` LSHAttention set up like our `reformer` row: bucket_size = chunk = 64
  (as many buckets as chunks), 2 hash rounds, shared QK (it normalises the keys itself); heads folded into the
  batch, as its LSHSelfAttention does. Its length must be a multiple of 128."""
  import torch
  from reformer_pytorch.reformer_pytorch import LSHAttention

  torch_dtype = getattr(torch, dtype)
  attn = LSHAttention(bucket_size=64, n_hashes=2, causal=causal).eval()
  gen = torch.Generator().manual_seed(0)
  qk, v = (torch.randn(batch * heads, length, head_dim, generator=gen, dtype=torch_dtype, requires_grad=True)
           for _ in range(2))
  cot = torch.randn(batch * heads, length, head_dim, generator=gen, dtype=torch_dtype)

  def fwd():
    with torch.no_grad():
      attn(qk, v)

  def fwdbwd():
    out = attn(qk, v)[0]
    torch.autograd.grad((out * cot).sum(), (qk, v))

  return fwd, fwdbwd


@register_peer("performer_pytorch", counterparts=("performer",))
def _performer_pytorch(length, batch, heads, head_dim, causal, dtype):
  """lucidrains' `performer-pytorch` FastAttention (FAVOR+), 256 features as our `performer`; causal through
  its CPU prefix-sum path (chunks of 128)."""
  import torch
  from performer_pytorch import FastAttention

  attn = FastAttention(dim_heads=head_dim, nb_features=256, causal=causal).to(getattr(torch, dtype))
  return _torch_pair(attn, *_torch_qkv(length, batch, heads, head_dim, dtype))


@register_peer("linear_attention_transformer", counterparts=("linear",))
def _linear_attention_transformer(length, batch, heads, head_dim, causal, dtype):
  """lucidrains' `linear-attention-transformer` attention functions: `linear_attn` (bidirectional) and
  `causal_linear_attn` (prefix sums over buckets of 64, as our chunks). Its feature map is the softmax of
  "efficient attention" (Shen et al.) rather than elu + 1; the cost has the same O(L d^2) shape."""
  if causal and length % 64:
    raise ValueError("linear_attention_transformer: causal needs a length divisible by 64")
  from linear_attention_transformer.linear_attention_transformer import causal_linear_attn, linear_attn

  attn = (lambda q, k, v: causal_linear_attn(q, k, v, bucket_size=64)) if causal else linear_attn
  return _torch_pair(attn, *_torch_qkv(length, batch, heads, head_dim, dtype))


def _local_attention(length, batch, heads, head_dim, causal, dtype, *, sliding):
  import torch
  from local_attention import LocalAttention

  from attention_core.registry import sqrt_pow2

  size = sqrt_pow2(length)
  if sliding:  # +-window exactly, like our longformer without global tokens
    attn = LocalAttention(window_size=size, causal=causal, look_backward=1, look_forward=0 if causal else 1,
                          exact_windowsize=True, autopad=True)
  else:  # own block only, like our local
    attn = LocalAttention(window_size=size, causal=causal, look_backward=0, look_forward=0, autopad=True)
  return _torch_pair(attn.to(getattr(torch, dtype)), *_torch_qkv(length, batch, heads, head_dim, dtype))


@register_peer("local_attention", counterparts=("local",))
def _local_attention_block(length, batch, heads, head_dim, causal, dtype):
  """lucidrains' `local-attention` LocalAttention with the window sqrt(L) rounded up to a power of two and no
  look backward/forward: each query attends within its own block, as our `local` at its automatic block
  size."""
  return _local_attention(length, batch, heads, head_dim, causal, dtype, sliding=False)


@register_peer("local_attention_window", counterparts=("longformer",))
def _local_attention_window(length, batch, heads, head_dim, causal, dtype):
  """`local-attention` LocalAttention as an exact sliding window of sqrt(L) rounded up to a power of two on
  each side (causal: behind), one block back and forward: our `longformer`'s band without global tokens."""
  return _local_attention(length, batch, heads, head_dim, causal, dtype, sliding=True)


@register_peer("nystrom_attention", counterparts=("nystromformer",))
def _nystrom_attention(length, batch, heads, head_dim, causal, dtype):
  """lucidrains' `nystrom-attention` NystromAttention set up like our `nystromformer` row: 64 landmarks, 6
  pseudo-inverse iterations, no residual convolution. Its q/k/v and output projections are replaced by
  identities (the input carries q, k, v side by side), so only the attention is timed. Bidirectional only."""
  if causal:
    raise ValueError("nystrom_attention: Nystromformer is bidirectional only (causal=True unsupported)")
  import torch
  from nystrom_attention import NystromAttention

  torch_dtype = getattr(torch, dtype)
  attn = NystromAttention(dim=heads * head_dim, dim_head=head_dim, heads=heads, num_landmarks=64,
                          pinv_iterations=6, residual=False).to(torch_dtype).eval()
  attn.to_qkv = attn.to_out = torch.nn.Identity()
  gen = torch.Generator().manual_seed(0)
  x = torch.randn(batch, length, 3 * heads * head_dim, generator=gen, dtype=torch_dtype, requires_grad=True)
  cot = torch.randn(batch, length, heads * head_dim, generator=gen, dtype=torch_dtype)

  def fwd():
    with torch.no_grad():
      attn(x)

  def fwdbwd():
    torch.autograd.grad((attn(x) * cot).sum(), (x,))

  return fwd, fwdbwd


@register_peer("nsa_pytorch", counterparts=("nsa",))
def _nsa_pytorch(length, batch, heads, head_dim, causal, dtype):
  """lucidrains' `native-sparse-attention-pytorch` SparseAttention (its CPU path: einsums and gathers), at our
  `nsa` op's automatic parameters for this length (`attention_baselines.nsa.auto_params`: compression block l,
  stride s, selection block l', top n, window w). The package has no attention-only entry point, so the module
  is timed with its own projections, pre-norm, rotary embedding and gate network replaced: the input carries
  q, k, v side by side (identity `to_qkv`, no output projection, no RMSNorm, no rotation) and the three gates
  are constants sigmoid(-ln 2) = 1/3, as our op without gates. What the package cannot express exactly, and
  the closest setting taken: its selection adds each query's own block to the top blocks, so it selects
  n - 1 blocks (n in all, as ours, whose n include the own, previous and first blocks); its sliding window is
  `local-attention`'s exact window of w (keys i - w <= j <= i: w + 1 keys against our w); it has one learned
  compressed memory key-value (its minimum) before the L/s compressed blocks; its compression MLP is ours
  (flatten(x + pos) -> l*d x d -> relu -> d x d, shared by the heads; expand factor 1/l) but its block
  scores are the mean of the compressed scores over each selection block, not eq. 9's overlap counts. Causal
  only, like our `nsa`."""
  if not causal:
    raise ValueError("nsa_pytorch: our `nsa` is causal only (causal=False has no counterpart)")
  import math

  import torch
  from native_sparse_attention_pytorch import SparseAttention

  from attention_baselines.nsa import auto_params

  p = auto_params(length)
  torch_dtype = getattr(torch, dtype)
  inner = heads * head_dim

  class ThirdGates(torch.nn.Module):
    """Gate logits -ln 2 for every (token, head, branch): sigmoid gives 1/3."""

    def forward(self, x):  # x: [batch, length, 3 * inner] -> [batch, length, 3 * heads]
      return x.new_full((*x.shape[:-1], 3 * heads), -math.log(2.0))

  class NoRotary(torch.nn.Module):
    """Our op has no position rotation: q and k pass unchanged."""

    def rotate_queries_with_cached_keys(self, q, k):
      return q, k

  attn = SparseAttention(
      dim=3 * inner, dim_head=head_dim, heads=heads, sliding_window_size=p["window"],
      compress_block_size=p["compress_block"], compress_block_sliding_stride=p["compress_stride"],
      selection_block_size=p["select_block"], num_selected_blocks=max(p["num_selected"] - 1, 0), causal=True,
      norm=False, num_compressed_mem_kv=1, compress_mlp_expand_factor=1.0 / p["compress_block"],
      strategy_combine_mlp=ThirdGates())
  attn.to_qkv = attn.combine_heads = torch.nn.Identity()
  attn.rotary_emb = NoRotary()
  attn = attn.to(torch_dtype).eval()
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():  # random intra-block positions, as our benchmark's compression inputs (package's: 0)
    for pos in (attn.k_intrablock_positions, attn.v_intrablock_positions):
      pos.copy_(torch.randn(pos.shape, generator=gen, dtype=torch_dtype) / math.sqrt(head_dim))
  x = torch.randn(batch, length, 3 * inner, generator=gen, dtype=torch_dtype, requires_grad=True)
  cot = torch.randn(batch, length, inner, generator=gen, dtype=torch_dtype)

  def fwd():
    with torch.no_grad():
      attn(x)

  def fwdbwd():
    torch.autograd.grad((attn(x) * cot).sum(), (x,))

  return fwd, fwdbwd
