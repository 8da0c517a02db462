"""Paged KV storage and ragged attention that reads only the pages in use.

The KV cache of one layer is a pool of `num_pages` fixed-size pages. A slot (a request) owns one
row of a page table `page_table_sp` [num_slots, pages_per_slot]: logical page p of slot s lives
in physical page `page_table_sp[s, p]`. Attention runs over a packed (ragged) token axis: query
token t belongs to one sequence, and each sequence is one slot's contiguous run of new query
tokens, whose keys and values `write_kv` has already stored.

Implementations (`PagedLayout.impl`; `default_impl` picks one per backend, or the one named by
the environment variable DSPARK_JAX_ATTENTION):

- "dense": the reference. Every query gathers all `pages_per_slot` pages of its slot and calls
  `layers.attention` with a mask, so it is exact against the contiguous-cache code and its cost
  follows the page table width, not the keys in use. Tests only.
- "jax" (CPU default, and TPU's path for the engine's cached part): pure JAX, an online
  softmax (running max and sum) over chunks of `kv_chunk_pages` pages. Query tokens are folded
  `queries_per_fold` at a time per sequence (as extra heads); the work is the list of (fold,
  chunk) pairs each fold needs up to its own visible length, and a `lax.fori_loop` takes F of
  them a step (F: the static number of folds; a traced trip count), gathering each item's own
  slot's pages and merging partial softmaxes per fold. So the cost follows the keys in use
  (the sum over sequences, not folds x the longest one) and not the pool size or
  `pages_per_slot`. On CPU it is the fastest path here (benchmarks/attention_paths.py: flat
  over an 8x larger pool, about 2x per doubling of the keys in use, and one long sequence among
  seven short ones costs what its own keys add); on an accelerator the gathered copies cost a
  second trip through memory, which is why the kernels below exist.
- "pallas_tpu": `jax.experimental.pallas.ops.tpu.ragged_paged_attention`, the kernel built for
  mixed prefill/decode over packed tokens and pages (what vLLM's TPU backend uses). Causal
  attention maps one to one onto it; each sequence's pages are DMA'd once per block of query
  tokens. Non-causal attention (the drafter's block) folds `queries_per_fold` query tokens of a
  sequence into the head axis and presents each fold as a one-token sequence that sees all its
  keys. The kernel wants K and V interleaved along the head axis of one array and a head dim
  that is a multiple of 128, so this layout pads head_dim (a no-op for Qwen3's 128).
  Not verified on this machine: JAX's TPU interpreter (0.10.2, and at JAX main as of 2026-08)
  cannot interpret this kernel (it reshapes a VMEM ref, and the interpreter only understands
  indexing transforms), so the tests check everything we feed the kernel by substituting the
  kernel's own shipped pure-JAX reference, `ref_ragged_paged_attention`, for it. Expected to be
  fast on TPU v4+ (the shipped tuned block sizes cover v5e/v6e); never measured here.
- "pallas_gpu": the shipped Triton kernels. The public `ops.gpu.paged_attention` returns only the
  normalised output, but its kernel body (`paged_attention_kernel`) writes the softmax residuals
  (running max m and sum l) per split, so this module runs that same kernel body under its own
  `pallas_call` to keep them. A verification step of up to `queries_per_fold` tokens per
  sequence is split into (a) all of the sequence's queries against the keys before its new
  tokens, folded into the kernel's head axis so those pages are read once per fold, not once per
  query, and (b) causal attention among the new tokens themselves, done by the shipped flash
  attention `ops.gpu.attention.mha` over the packed token axis with one segment id per sequence
  (it returns the log-sum-exp); the two are merged by log-sum-exp. Non-causal attention is part
  (a) over all keys. Part (b) costs (tokens)^2 / 2 per step, small for verification and decode;
  a long prefill chunk is one segment and needs that work anyway. The kernel has no softmax
  scale argument, so queries are scaled before it (one extra rounding in bfloat16). Both
  modules are deprecated from JAX 0.11.1 on (their import warns; tokamax is the announced
  successor); the warning is silenced at import. Verified on CPU in Pallas interpret mode
  against the dense reference; speed on a GPU was not measured in this work (none was at
  hand): expected memory-bound decode/verification reading each slot's pages about once per
  step. Triton needs head_dim and page_size to be powers of two (the layout refuses others)
  and dots at least 16 wide: pages of fewer than 16 tokens are read several to a key block,
  the page table padded to whole blocks (keys past a sequence's length are masked). A key block
  holds at most 32 KiB (128 keys at Qwen3's head_dim 128 in bfloat16), and a table of any
  length is walked in such blocks by up to 16 parallel splits (`_gpu_paged_blocking`).

Every path computes scores and softmax in float32 and returns q's dtype. A query token with no
visible key (padding past `cu_q_lens[num_seqs]`, or a sequence whose kv length is 0) gets zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp

from dspark_jax.models.layers import MASK_VALUE, attention, target_backend

IMPLS = ("dense", "jax", "pallas_tpu", "pallas_gpu")
ATTENTION_ENV = "DSPARK_JAX_ATTENTION"

# Triton's dot wants every operand dimension >= 16.
_MIN_DOT = 16

# Bytes of one block of keys (and one of values) that the Triton paged kernel loads per step:
# Triton stages `num_stages` (2) of each in shared memory. 32 KiB is the largest block JAX's own
# GPU tests of the kernel run (256 keys x head_dim 64 in float16) and what Qwen3's shapes give
# at 128 keys (head_dim 128, bfloat16); a float32 cache or larger pages take fewer keys a step
# rather than asking for more shared memory than an A100 (164 KiB) has.
_GPU_KV_BLOCK_BYTES = 32 * 1024

# Lane width of TPU vector registers: the ragged kernel broadcasts its softmax statistics over
# 128 lanes onto the head dim, so the head dim it sees must be a multiple of it.
_TPU_LANES = 128


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """Static description of one layer's page pool (hashable, so it can be a jit static arg).

    `kv_chunk_pages` is the "jax" path's loop step (0: about 128 keys per step);
    `queries_per_fold` is how many query tokens of one sequence the "jax", "pallas_gpu" and
    (non-causal) "pallas_tpu" paths fold into the head axis so that they share one read of the
    sequence's pages.

    `value_dtype` (a 16-bit float dtype's name, or None) makes the pool store float32 arrays
    holding values rounded to that dtype: written keys/values are rounded to it first and what
    attention gathers is cast back to it, so every result is bit for bit that of a pool of that
    dtype. XLA:CPU gathers and scatters 16-bit arrays through a float32 copy of the whole
    array, hoisted out of the attention loop: a pass over every layer's pool per step, so a step
    cost grew with the pool, not the context (`pool_value_dtype` sets it for the CPU paths).
    Only the "jax" and "dense" paths support it.
    """

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    impl: str
    interpret: bool = False
    kv_chunk_pages: int = 0
    queries_per_fold: int = 8
    value_dtype: str | None = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"unknown attention impl {self.impl!r}; expected one of {IMPLS}")
        if self.value_dtype is not None and self.impl not in _WIDE_POOL_IMPLS:
            raise ValueError(f"the {self.impl} attention reads pools in their own dtype")
        for name in ("num_pages", "page_size", "num_kv_heads", "head_dim", "queries_per_fold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_chunk_pages < 0:
            raise ValueError(f"kv_chunk_pages must be >= 0, got {self.kv_chunk_pages}")
        if self.impl == "pallas_gpu":
            # Triton's block shapes are powers of two and its dots at least 16 wide.
            for name in ("page_size", "head_dim"):
                value = getattr(self, name)
                if value & (value - 1):
                    raise ValueError(
                        f"the pallas_gpu attention needs a power-of-two {name}, got {value}"
                    )
            if self.head_dim < _MIN_DOT:
                raise ValueError(
                    f"the pallas_gpu attention needs head_dim >= {_MIN_DOT}, got {self.head_dim}"
                )

    @property
    def chunk_pages(self) -> int:
        return self.kv_chunk_pages or max(1, 128 // self.page_size)

    @property
    def physical_head_dim(self) -> int:
        if self.impl == "pallas_tpu":
            return -(-self.head_dim // _TPU_LANES) * _TPU_LANES
        return self.head_dim

    def pool_dtype(self, dtype):
        """The dtype a pool of keys/values in `dtype` is stored in (see `value_dtype`)."""
        return jnp.float32 if self.value_dtype is not None else dtype

    @property
    def stacked_kv(self) -> bool:
        """True when K and V are stacked on a leading axis of length 2 (the GPU kernel's
        layout) rather than interleaved along the heads."""
        return self.impl == "pallas_gpu"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
    """One layer's K/V pages (`kv`, one array) in the physical layout of its
    `PagedLayout.impl`:

    - "dense", "jax", "pallas_tpu": [num_pages, page_size, 2 * num_kv_heads, hd], the
      key of KV head h at head index 2h and its value at 2h + 1 (the ragged TPU kernel's
      layout; hd is head_dim, padded to a multiple of 128 for "pallas_tpu").
    - "pallas_gpu": [2, num_kv_heads, num_pages, page_size, head_dim], K at index 0
      of the leading axis and V at 1: the Triton kernel reads each half as its own operand (two
      block specs over the one buffer), and a step writes both with one scatter, not two.
    """

    kv: jax.Array

    @property
    def nbytes(self) -> int:
        return self.kv.size * self.kv.dtype.itemsize


def default_impl(backend: str | None = None) -> str:
    """The attention path for a JAX backend name (when None: the default backend, and on a GPU
    older than Ampere the pure-JAX path, see `_pre_ampere_gpu`).

    The environment variable DSPARK_JAX_ATTENTION (one of IMPLS) overrides the choice for every
    engine that does not name its own: the way out when a backend's kernel does not build or
    misbehaves on some machine ("jax" runs everywhere)."""
    chosen = os.environ.get(ATTENTION_ENV, "").strip()
    if chosen:
        if chosen not in IMPLS:
            raise ValueError(
                f"{ATTENTION_ENV}={chosen!r} is not an attention path; expected one of {IMPLS}"
            )
        return chosen
    if backend is None:
        backend = jax.default_backend()
        old_gpu = _pre_ampere_gpu() if backend == "gpu" else None
        if old_gpu is not None:
            warnings.warn(
                f"{old_gpu}: the Triton attention kernels need compute capability 8.0 (Ampere) "
                f"or newer, so attention runs as pure JAX ({ATTENTION_ENV}=pallas_gpu to try "
                "the kernels anyway)",
                RuntimeWarning,
                stacklevel=2,
            )
            return "jax"
    backend = backend.lower()
    if backend == "tpu":
        return "pallas_tpu"
    if backend in ("gpu", "cuda", "rocm"):
        try:
            _gpu_modules()
        except ImportError as e:  # a JAX that no longer ships the Triton kernels
            warnings.warn(
                f"this JAX ({jax.__version__}) has no Pallas Triton attention kernels ({e}), so "
                "attention runs as pure JAX",
                RuntimeWarning,
                stacklevel=2,
            )
            return "jax"
        return "pallas_gpu"
    return "jax"


# Triton builds its kernels for Ampere (compute capability 8.0) and newer: Turing and Volta (a
# Colab T4, a V100) lack the bfloat16 tensor-core instructions the attention kernels use.
_TRITON_MIN_CAPABILITY = 8.0


def _pre_ampere_gpu() -> str | None:
    """'<device kind> (compute capability X)' when the first device is an NVIDIA GPU older than
    Ampere, else None (also when the device does not say: the kernels stay the GPU default)."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    try:
        if capability is None or float(capability) >= _TRITON_MIN_CAPABILITY:
            return None
    except (TypeError, ValueError):
        return None
    return f"{device.device_kind} (compute capability {capability})"


# The paths whose reads go through `_values` (gathers in plain JAX).
_WIDE_POOL_IMPLS = ("jax", "dense")


def pool_value_dtype(impl: str, dtype, platform: str) -> str | None:
    """`PagedLayout.value_dtype` for keys/values computed in `dtype` on `platform`: the 16-bit
    float dtype's name on XLA:CPU's plain-JAX paths when this XLA:CPU gathers and scatters that
    dtype through a float32 copy (see `PagedLayout`), else None (GPU and TPU keep 16-bit pools;
    their gathers and scatters are native)."""
    dtype = jnp.dtype(dtype)
    wide = platform == "cpu" and impl in _WIDE_POOL_IMPLS
    if wide and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return dtype.name if cpu_gathers_through_float32(dtype.name) else None
    return None


@functools.cache
def cpu_gathers_through_float32(dtype_name: str) -> bool:
    """Whether XLA:CPU gathers and scatters arrays of `dtype_name` through a float32 copy of the
    whole array: it does for bfloat16 with jax 0.10's XLA, not for float16 nor with jax 0.11's.
    Compiles a tiny gather and scatter (once per process) and looks for a float32 array of the
    operand's shape; False where the default backend is not the CPU."""
    if jax.default_backend() != "cpu":
        return False
    shape = (97, 3, 5)  # a shape nothing else in the program has

    def gather_scatter(x, idx, rows):
        return x.at[idx].set(rows), x[idx]

    args = (
        jax.ShapeDtypeStruct(shape, dtype_name),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((2, *shape[1:]), dtype_name),
    )
    hlo = jax.jit(gather_scatter).lower(*args).compile().as_text()
    return "f32[97,3,5]" in hlo


def init_pages(layout: PagedLayout, dtype) -> Pages:
    """A zeroed page pool for one layer (stored in `layout.pool_dtype(dtype)`)."""
    dtype = layout.pool_dtype(dtype)
    if layout.stacked_kv:
        shape = (2, layout.num_kv_heads, layout.num_pages, layout.page_size, layout.head_dim)
        return Pages(jnp.zeros(shape, dtype))
    shape = (layout.num_pages, layout.page_size, 2 * layout.num_kv_heads, layout.physical_head_dim)
    return Pages(jnp.zeros(shape, dtype))


def _stored(x, layout: PagedLayout, pool_dtype):
    """Keys/values as written to a pool: rounded to `value_dtype` first when it is set."""
    if layout.value_dtype is not None:
        x = x.astype(layout.value_dtype)
    return x.astype(pool_dtype)


def _values(x, layout: PagedLayout):
    """Keys/values gathered from a pool, in the dtype attention sees (exact: they were rounded
    to it when written)."""
    return x if layout.value_dtype is None else x.astype(layout.value_dtype)


def _interleave_kv(k_thd, v_thd, head_dim_out: int):
    """[T, KV, D] x2 -> [T, 2KV, D'] with K of head h at 2h and V at 2h+1, zero padded to D'."""
    t, kv, d = k_thd.shape
    kv_thd = jnp.stack([k_thd, v_thd], axis=2).reshape(t, 2 * kv, d)
    return jnp.pad(kv_thd, ((0, 0), (0, 0), (0, head_dim_out - d)))


def stack_kv(k_thd: jax.Array, v_thd: jax.Array) -> jax.Array:
    """Keys and values [T, KV, D] as one array [2, T, KV, D] (K at 0, V at 1).

    A select over the leading axis, not a concatenate: XLA fuses the select into the kernels
    around it (both halves computed by one kernel, or the stacking inside the pool's update),
    while it kept each concatenate as a kernel of its own in every layer. One array is also
    one buffer a forward's token-bucket branch hands out per layer, where two were a kernel
    each."""
    half = jnp.arange(2).reshape(2, 1, 1, 1)
    return jnp.where(half == 0, k_thd[None], v_thd[None])


def write_kv(pages: Pages, layout: PagedLayout, kv_2thd, page_table_sp, slot_t, pos_t,
             valid_t) -> Pages:
    """Stores token t's key and value (`kv_2thd` [2, T, KV, D], `stack_kv`) at position pos_t
    of slot slot_t.

    Invalid tokens, and positions outside the slot's page table, are scattered to the
    out-of-range page `num_pages` with mode="drop": they write nothing, never a real page.
    """
    pages_per_slot = page_table_sp.shape[1]
    page_size = layout.page_size
    ok_t = valid_t & (pos_t >= 0) & (pos_t < pages_per_slot * page_size)
    logical_t = jnp.clip(pos_t // page_size, 0, pages_per_slot - 1)
    slot_t = jnp.clip(slot_t, 0, page_table_sp.shape[0] - 1)
    page_t = jnp.where(ok_t, page_table_sp[slot_t, logical_t], layout.num_pages)
    offset_t = pos_t % page_size
    kv_pages = pages.kv
    if layout.stacked_kv:
        kv_2ktd = _stored(jnp.swapaxes(kv_2thd, 1, 2), layout, kv_pages.dtype)
        return Pages(kv_pages.at[:, :, page_t, offset_t].set(kv_2ktd, mode="drop"))
    kv_thd = _interleave_kv(kv_2thd[0], kv_2thd[1], layout.physical_head_dim)
    kv_thd = _stored(kv_thd, layout, kv_pages.dtype)
    return Pages(kv_pages.at[page_t, offset_t].set(kv_thd, mode="drop"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Ragged:
    """Per-sequence and per-token bookkeeping of a packed batch (all traced, static shapes)."""

    cu_q_n1: jax.Array  # cu_q_lens with entries past num_seqs pinned to the total
    q_len_n: jax.Array
    kv_len_n: jax.Array  # 0 for sequences >= num_seqs
    num_seqs: jax.Array
    seq_t: jax.Array  # owning sequence, clipped into range (meaningless where not valid)
    valid_t: jax.Array  # t < cu_q_lens[num_seqs]
    offset_t: jax.Array  # index of the token inside its sequence
    pos_t: jax.Array  # absolute position of the token: kv_len - q_len + offset
    limit_t: jax.Array  # the token sees keys at positions < limit_t (0: none)


def searchsorted_steps(sorted_n: jax.Array, values_t: jax.Array, *,
                       unrolled: bool | None = None) -> jax.Array:
    """int32 [T]: for each value, how many entries of the ascending `sorted_n` are <= it
    (`jnp.searchsorted(..., side="right")`), by a binary search of log2(N) steps.

    `unrolled` (None: for a GPU target, `layers.target_backend()`) writes the steps out. As a
    while loop, on a GPU each trip is a few kernels and a predicate the host reads back (3
    loops of 7 trips in a speculative round at 64 slots); written out, XLA fuses the steps into
    the kernels that use the result. Elsewhere the loop stays: XLA:CPU fuses written-out steps
    into every consumer and runs them again for each of its elements -- the search of a token's
    sequence once per key of the local attention's [blocks, heads, window, 3 window] scores:
    two fifths of a CPU prefill packing 512 prompts (the fixture models). The loop's result is
    an array the consumers read."""
    if sorted_n.shape[0] == 1:
        # jnp.searchsorted's "scan_unrolled" over one entry still emits a loop (of one trip):
        # a drafter bucket of one slot, or any program of a 1-slot engine, held it on a GPU.
        return (sorted_n[0] <= values_t).astype(jnp.int32)
    if unrolled is None:
        unrolled = target_backend() == "gpu"
    method = "scan_unrolled" if unrolled else "scan"
    return jnp.searchsorted(sorted_n, values_t, side="right", method=method).astype(jnp.int32)


def _ragged(num_tokens, seq_slot_n, cu_q_lens_n1, kv_lens_n, num_seqs, causal) -> _Ragged:
    n = seq_slot_n.shape[0]
    num_seqs = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, n)
    cu = cu_q_lens_n1.astype(jnp.int32)
    cu = jnp.where(jnp.arange(n + 1) <= num_seqs, cu, cu[num_seqs])
    live_n = jnp.arange(n) < num_seqs
    q_len_n = cu[1:] - cu[:-1]
    kv_len_n = jnp.where(live_n, kv_lens_n.astype(jnp.int32), 0)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # A binary search, not a [T, N] comparison: with constant offsets (the drafter's block) XLA
    # would fold that comparison at compile time, minutes for 4096 slots. Its steps written out
    # for a GPU, a loop elsewhere (`searchsorted_steps`).
    seq_t = searchsorted_steps(cu[1:], t)
    valid_t = t < cu[num_seqs]
    seq_t = jnp.minimum(seq_t, n - 1)
    offset_t = t - cu[seq_t]
    kv_len_t = kv_len_n[seq_t]
    pos_t = kv_len_t - q_len_n[seq_t] + offset_t
    limit_t = jnp.clip(pos_t + 1, 0, kv_len_t) if causal else kv_len_t
    limit_t = jnp.where(valid_t, limit_t, 0)
    return _Ragged(cu, q_len_n, kv_len_n, num_seqs, seq_t, valid_t, offset_t, pos_t, limit_t)


def ragged_paged_attention(q_thd, pages: Pages, layout: PagedLayout, page_table_sp, seq_slot_n,
                           cu_q_lens_n1, kv_lens_n, num_seqs, *, scale: float, causal: bool,
                           new_kv=None, max_q_len: int | None = None):
    """Attention of packed query tokens over their slots' paged keys.

    Sequence i < num_seqs (a traced scalar; n = len(seq_slot_n) is the static maximum) owns
    query tokens cu_q_lens[i]:cu_q_lens[i+1] and the first kv_lens[i] keys of slot
    seq_slot[i]; its last q_len_i keys are its own new tokens (kv_lens[i] >= q_len_i).
    causal: query j of sequence i sits at position kv_lens[i] - q_len_i + j and sees the keys
    at positions <= its own (prefill chunks, verification). Otherwise every query of sequence
    i sees all kv_lens[i] keys (the drafter's block). q_thd [T, H, D] with H a multiple of
    num_kv_heads; returns [T, H, D] in q's dtype, zeros for tokens that see no key.

    new_kv: None when the new tokens' keys and values are already in the pages (`write_kv`
    first). Otherwise (k_thd, v_thd) [T, KV, D], the new tokens' own keys and values in the
    packed order of the queries: the pages are then read only before each sequence's new tokens
    (positions < kv_lens - q_len) and the new tokens' part is computed from `new_kv`, the two
    merged by log-sum-exp. The caller writes `new_kv` afterwards. This is what the engine uses:
    a program that writes the pool inside a conditional (its token-bucket `lax.switch`) makes
    XLA copy the whole pool per step, while one that only reads it there does not.

    max_q_len: a static bound on any sequence's query tokens (None: T). With `new_kv` it bounds
    the new tokens' attention among themselves to a window of that many tokens around each
    query, so its cost is T x max_q_len rather than T x T (a step of 4096 slots verifying 8
    tokens each packs T = 32768).
    """
    num_tokens, num_heads, head_dim = q_thd.shape
    if head_dim != layout.head_dim or num_heads % layout.num_kv_heads:
        raise ValueError(
            f"q heads/head_dim {num_heads}/{head_dim} do not fit the layout's "
            f"{layout.num_kv_heads} KV heads of dim {layout.head_dim}"
        )
    rag = _ragged(num_tokens, seq_slot_n, cu_q_lens_n1, kv_lens_n, num_seqs, causal)
    if new_kv is not None:
        out_thd = _prefix_and_new(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale,
                                  causal, new_kv, max_q_len)
    elif layout.impl == "dense":
        out_thd = _dense(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale)
    elif layout.impl == "jax":
        out_thd = _chunked(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale)[0]
    elif layout.impl == "pallas_tpu":
        out_thd = _pallas_tpu(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale, causal)
    else:
        out_thd = _pallas_gpu(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale, causal)
    sees_keys_t = rag.limit_t > 0
    return jnp.where(sees_keys_t[:, None, None], out_thd, 0).astype(q_thd.dtype)


def _prefix_and_new(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale, causal, new_kv,
                    max_q_len=None):
    """Attention over (paged prefix) + (new tokens from `new_kv`), merged by log-sum-exp."""
    k_thd, v_thd = new_kv
    prefix_n = jnp.maximum(rag.kv_len_n - rag.q_len_n, 0)
    # Every query sees the whole prefix: it lies before all of its sequence's new tokens.
    pre = dataclasses.replace(
        rag,
        kv_len_n=prefix_n,
        limit_t=jnp.where(rag.valid_t, prefix_n[rag.seq_t], 0),
    )
    if layout.impl == "dense":
        o_pre, lse_pre = _dense_lse(q_thd, pages, layout, page_table_sp, seq_slot_n, pre, scale)
    elif layout.impl == "pallas_gpu":
        o_pre, lse_pre = _pallas_gpu_prefix(q_thd, pages, layout, page_table_sp, seq_slot_n, pre,
                                            scale)
    else:
        # The ragged TPU kernel returns no softmax residuals, so it cannot be merged: TPU uses
        # the pure-JAX path here.
        o_pre, lse_pre = _chunked(q_thd, pages, layout, page_table_sp, seq_slot_n, pre, scale)
    num_tokens = q_thd.shape[0]
    windowed = max_q_len is not None and 3 * max_q_len < num_tokens
    if max_q_len == 1:
        o_new, lse_new = _own_token_attention(q_thd, k_thd, v_thd, rag, scale)
    elif layout.impl == "pallas_gpu" and not windowed:
        o_new, lse_new = _new_token_attention(q_thd, k_thd, v_thd, rag, scale, causal,
                                              interpret=layout.interpret)
    else:
        window = max_q_len if windowed else num_tokens
        o_new, lse_new = _local_attention(q_thd, k_thd, v_thd, rag, scale, causal, window)
    return _merge(o_pre, lse_pre, o_new, lse_new)


def _merge(o_a, lse_a, o_b, lse_b):
    """softmax-weighted union of two normalised attention outputs [T, H, D] by their [T, H]
    log-sum-exps (-inf where a part saw no key)."""
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w_a = jnp.exp(lse_a - top)
    w_b = jnp.exp(lse_b - top)
    total = w_a + w_b
    out = w_a[..., None] * o_a + w_b[..., None] * o_b
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def _masked_softmax(s_xs, mask_xs):
    """Scores -> unnormalised softmax over the last axis where `mask_xs` (broadcast) holds:
    (p, max m, sum l) in float32; p is 0 at masked keys, so l is 0 where none is visible."""
    s_xs = jnp.where(mask_xs, s_xs, MASK_VALUE)
    m_x = jnp.max(s_xs, axis=-1)
    p_xs = jnp.where(mask_xs, jnp.exp(s_xs - m_x[..., None]), 0.0)
    return p_xs, m_x, jnp.sum(p_xs, axis=-1)


def _normalised(acc_xd, m_x, l_x):
    """An unnormalised output and its softmax max and sum -> (out, log-sum-exp); a query whose
    sum is 0 (no visible key) keeps its accumulator (zeros) and gets lse -inf."""
    seen = l_x > 0
    l_safe = jnp.where(seen, l_x, 1.0)
    return acc_xd / l_safe[..., None], jnp.where(seen, m_x + jnp.log(l_safe), -jnp.inf)


def _own_token_attention(q_thd, k_thd, v_thd, rag, scale):
    """The new tokens' part where no sequence has more than one (plain decoding): a token's
    only new key is its own, causal or not, so its softmax over them is that one key's -- the
    output is its value, the log-sum-exp its score (out float32, lse; zeros and -inf for
    padding). What `_local_attention` and the GPU's flash kernel compute for such tokens,
    without their blocks and padding: a few kernels less in every layer of a decode step."""
    num_tokens, num_heads, head_dim = q_thd.shape
    kv_heads = k_thd.shape[1]
    groups = num_heads // kv_heads
    q_tkgd = q_thd.reshape(num_tokens, kv_heads, groups, head_dim)
    s_tkg = jnp.einsum("tkgd,tkd->tkg", q_tkgd, k_thd, preferred_element_type=jnp.float32)
    valid_t = rag.valid_t
    lse_th = jnp.where(valid_t[:, None], (s_tkg * scale).reshape(num_tokens, num_heads), -jnp.inf)
    # Query head h reads KV head h // groups (the grouping of the reshape above).
    out_thd = jnp.repeat(v_thd.astype(jnp.float32), groups, axis=1)
    return jnp.where(valid_t[:, None, None], out_thd, 0.0), lse_th


def _local_attention(q_thd, k_thd, v_thd, rag, scale, causal, window: int):
    """Each token against its own sequence's new tokens (causally, or all of them), which this
    step's packed axis holds. Returns (out, lse) in float32.

    No sequence may have more than `window` tokens: a sequence is a contiguous run of the
    packed axis, so the tokens a query may see lie in its own block of `window` tokens or the
    blocks either side, and scores are [T, 3 * window], not [T, T]. A window of T or more is
    one block whose neighbours would be all padding: scores over that block alone, [T, T].
    """
    num_tokens, num_heads, head_dim = q_thd.shape
    kv_heads = k_thd.shape[1]
    groups = num_heads // kv_heads
    blocks = -(-num_tokens // window)
    pad = blocks * window - num_tokens

    def padded(x, value):
        return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1), constant_values=value)

    def neighbours(x, value):
        """[T, ...] -> [blocks, S, ...]: each block's previous, own and next block (S = 3
        window), or with a single block that block alone (S = window)."""
        if blocks == 1:
            return padded(x, value)[None]
        x = jnp.pad(padded(x, value), ((window, window),) + ((0, 0),) * (x.ndim - 1),
                    constant_values=value)
        views = [x[i * window: (i + blocks) * window].reshape(blocks, window, *x.shape[1:])
                 for i in range(3)]
        return jnp.concatenate(views, axis=1)

    seq_t = jnp.where(rag.valid_t, rag.seq_t, -1)
    q_nwkgd = padded(q_thd, 0).reshape(blocks, window, kv_heads, groups, head_dim)
    k_nskd = neighbours(k_thd, 0)
    v_nskd = neighbours(v_thd.astype(jnp.float32), 0)
    seq_q_nw = padded(seq_t, -1).reshape(blocks, window)
    off_q_nw = padded(rag.offset_t, 0).reshape(blocks, window)
    seq_k_ns = neighbours(seq_t, -1)
    off_k_ns = neighbours(rag.offset_t, 0)
    same_nws = (seq_q_nw[:, :, None] == seq_k_ns[:, None, :]) & (seq_q_nw[:, :, None] >= 0)
    if causal:
        same_nws &= off_k_ns[:, None, :] <= off_q_nw[:, :, None]
    s_nkgws = jnp.einsum("nwkgd,nskd->nkgws", q_nwkgd, k_nskd,
                         preferred_element_type=jnp.float32) * scale
    p_nkgws, m_nkgw, l_nkgw = _masked_softmax(s_nkgws, same_nws[:, None, None])
    o_nwkgd = jnp.einsum("nkgws,nskd->nwkgd", p_nkgws, v_nskd)
    o_nwkgd, lse_nwkg = _normalised(o_nwkgd, jnp.transpose(m_nkgw, (0, 3, 1, 2)),
                                    jnp.transpose(l_nkgw, (0, 3, 1, 2)))
    out_thd = o_nwkgd.reshape(blocks * window, num_heads, head_dim)[:num_tokens]
    lse_th = lse_nwkg.reshape(blocks * window, num_heads)[:num_tokens]
    return out_thd, lse_th


def _split_combined(kv_x2hd, num_kv_heads: int, head_dim: int):
    """[..., 2KV, hd] interleaved -> K, V [..., KV, head_dim]."""
    kv = kv_x2hd.reshape(*kv_x2hd.shape[:-2], num_kv_heads, 2, kv_x2hd.shape[-1])
    return kv[..., 0, :head_dim], kv[..., 1, :head_dim]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Folds:
    """Query tokens grouped `queries_per_fold` at a time within each sequence.

    Sequence i owns folds cu_f[i]:cu_f[i+1]; fold f holds tokens tok_fr (tok_valid_fr marks
    the real ones). Token t sits in fold fold_t at place place_t.
    """

    cu_f_n1: jax.Array
    seq_f: jax.Array
    valid_f: jax.Array
    num_folds: jax.Array
    tok_fr: jax.Array
    tok_valid_fr: jax.Array
    fold_t: jax.Array
    place_t: jax.Array


def _folds(rag: _Ragged, num_tokens: int, per_fold: int) -> _Folds:
    n = rag.q_len_n.shape[0]
    # sum_i ceil(q_i / R) <= (sum_i q_i + m (R - 1)) / R bounds the folds statically, m the
    # sequences with tokens: at most min(n, T) of them (an empty one has no fold), so the folds
    # follow the tokens, not the slots (one token of 16 slots: 1 fold, not 14).
    busy = min(n, num_tokens)
    max_folds = (num_tokens + busy * (per_fold - 1)) // per_fold
    folds_n = (rag.q_len_n + per_fold - 1) // per_fold
    cu_f = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(folds_n, dtype=jnp.int32)])
    f = jnp.arange(max_folds, dtype=jnp.int32)
    num_folds = cu_f[rag.num_seqs]
    seq_f = jnp.minimum(jnp.sum(cu_f[1:][None, :] <= f[:, None], axis=1, dtype=jnp.int32), n - 1)
    valid_f = f < num_folds
    start_f = rag.cu_q_n1[seq_f] + (f - cu_f[seq_f]) * per_fold
    tok_fr = start_f[:, None] + jnp.arange(per_fold)[None, :]
    tok_valid_fr = valid_f[:, None] & (tok_fr < rag.cu_q_n1[seq_f + 1][:, None])
    tok_fr = jnp.clip(tok_fr, 0, num_tokens - 1)
    fold_t = jnp.clip(cu_f[rag.seq_t] + rag.offset_t // per_fold, 0, max_folds - 1)
    place_t = rag.offset_t % per_fold
    return _Folds(cu_f, seq_f, valid_f, num_folds, tok_fr, tok_valid_fr, fold_t, place_t)


def _fold_queries(q_thd, folds: _Folds, kv_heads: int):
    """[T, H, D] -> [F, KV, R * G, D]: a fold's queries as extra heads of each KV head."""
    num_tokens, num_heads, head_dim = q_thd.shape
    q_frhd = jnp.where(folds.tok_valid_fr[..., None, None], q_thd[folds.tok_fr], 0)
    f, r = q_frhd.shape[:2]
    q_frkgd = q_frhd.reshape(f, r, kv_heads, num_heads // kv_heads, head_dim)
    return jnp.transpose(q_frkgd, (0, 2, 1, 3, 4)).reshape(f, kv_heads, -1, head_dim)


def _unfold(x_fkrg, folds: _Folds, num_groups: int):
    """[F, KV, R * G, ...] -> [T, KV * G, ...], the inverse of `_fold_queries` per token."""
    f, kv_heads, rg = x_fkrg.shape[:3]
    x_fkrgx = x_fkrg.reshape(f, kv_heads, rg // num_groups, num_groups, *x_fkrg.shape[3:])
    x_tkgx = x_fkrgx[folds.fold_t, :, folds.place_t]
    return x_tkgx.reshape(x_tkgx.shape[0], kv_heads * num_groups, *x_tkgx.shape[3:])


def _dense_keys(pages, layout, page_table_sp, seq_slot_n, rag):
    """Every token's slot's whole page table gathered: K, V [T, S, KV, D] and the mask [T, S]
    of the keys the token sees (S = pages_per_slot * page_size)."""
    kv_pages = pages.kv
    kv_tpsxd = _values(kv_pages[page_table_sp[seq_slot_n[rag.seq_t]]], layout)
    t, pps, page_size = kv_tpsxd.shape[:3]
    kv_tsxd = kv_tpsxd.reshape(t, pps * page_size, *kv_tpsxd.shape[3:])
    k_tskd, v_tskd = _split_combined(kv_tsxd, layout.num_kv_heads, layout.head_dim)
    mask_ts = jnp.arange(pps * page_size)[None, :] < rag.limit_t[:, None]
    return k_tskd, v_tskd, mask_ts


def _dense(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale):
    """The reference: `layers.attention` itself over the gathered keys."""
    k_tskd, v_tskd, mask_ts = _dense_keys(pages, layout, page_table_sp, seq_slot_n, rag)
    return attention(q_thd[:, None], k_tskd, v_tskd, mask_ts[:, None, :], scale)[:, 0]


def _dense_lse(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale):
    """`_dense` with its log-sum-exp: (out [T, H, D] float32, lse [T, H], -inf: no key).
    `layers.attention` returns no log-sum-exp, hence the softmax spelled out here."""
    k_tskd, v_tskd, mask_ts = _dense_keys(pages, layout, page_table_sp, seq_slot_n, rag)
    t, num_heads, head_dim = q_thd.shape
    q = q_thd.reshape(t, layout.num_kv_heads, num_heads // layout.num_kv_heads, head_dim)
    s_tkgs = jnp.einsum("tkgd,tskd->tkgs", q, k_tskd, preferred_element_type=jnp.float32) * scale
    p_tkgs, m_tkg, l_tkg = _masked_softmax(s_tkgs, mask_ts[:, None, None])
    o_tkgd = jnp.einsum("tkgs,tskd->tkgd", p_tkgs, v_tskd.astype(jnp.float32))
    o_tkgd, lse_tkg = _normalised(o_tkgd, m_tkg, l_tkg)
    return o_tkgd.reshape(q_thd.shape), lse_tkg.reshape(t, num_heads)


def _chunk_schedule(limit_fr, chunk_keys: int):
    """The work list of `_chunked` from each fold's visible lengths [F, R]: fold f owns items
    cu_w[f]:cu_w[f+1], one per chunk of `chunk_keys` keys up to its longest length; returns
    (cu_w [F + 1], the number of items, the loop steps of F items each that cover them)."""
    num_folds = limit_fr.shape[0]
    chunks_f = (jnp.max(limit_fr, axis=1) + chunk_keys - 1) // chunk_keys
    cu_w = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks_f, dtype=jnp.int32)])
    num_items = cu_w[-1]
    return cu_w, num_items, (num_items + num_folds - 1) // num_folds


def _chunked(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale):
    """Online softmax over chunks of pages, as a list of (fold, chunk) work items.
    Returns (out [T, H, D] float32, log-sum-exp [T, H]; -inf where no key is visible).

    Queries are folded (`queries_per_fold` tokens of a sequence as extra heads), so each chunk
    of a sequence's pages is gathered once per fold rather than once per query token. Fold f
    needs the chunks holding its longest visible length, and the work items are those chunks of
    every fold, fold after fold: each loop step takes the next F items (F: the static number of
    folds), so the trip count is ceil(sum_f chunks_f / F) -- the keys the batch sees, not its
    folds times the longest context (one long sequence among short ones no longer makes every
    fold walk its length), and never more steps than that longest context needs.
    """
    kv_pages = pages.kv
    num_tokens, num_heads, head_dim = q_thd.shape
    kv_heads = layout.num_kv_heads
    groups = num_heads // kv_heads
    pages_per_slot = page_table_sp.shape[1]
    chunk_pages = min(layout.chunk_pages, pages_per_slot)
    chunk_keys = chunk_pages * layout.page_size
    folds = _folds(rag, num_tokens, layout.queries_per_fold)
    q_fkqd = _fold_queries(q_thd, folds, kv_heads)
    num_folds = q_fkqd.shape[0]
    limit_fr = jnp.where(folds.tok_valid_fr, rag.limit_t[folds.tok_fr], 0)
    limit_fq = jnp.repeat(limit_fr, groups, axis=1)  # fold order is (token, group)
    slot_f = seq_slot_n[folds.seq_f]
    cu_w, num_items, num_steps = _chunk_schedule(limit_fr, chunk_keys)

    def step(i, carry):
        m_fkq, l_fkq, acc_fkqd = carry
        w = i * num_folds + jnp.arange(num_folds, dtype=jnp.int32)
        valid_w = w < num_items
        fold_w = jnp.minimum(searchsorted_steps(cu_w[1:], w), num_folds - 1)
        chunk_w = jnp.where(valid_w, w - cu_w[fold_w], 0)
        logical_wc = jnp.minimum(
            chunk_w[:, None] * chunk_pages + jnp.arange(chunk_pages)[None, :], pages_per_slot - 1
        )
        kv_wcpxd = _values(kv_pages[page_table_sp[slot_f[fold_w][:, None], logical_wc]], layout)
        kv_wsxd = kv_wcpxd.reshape(num_folds, chunk_keys, *kv_wcpxd.shape[3:])
        k_wskd, v_wskd = _split_combined(kv_wsxd, kv_heads, head_dim)
        s_wkqs = jnp.einsum("wkqd,wskd->wkqs", q_fkqd[fold_w], k_wskd,
                            preferred_element_type=jnp.float32) * scale
        key_pos_ws = chunk_w[:, None] * chunk_keys + jnp.arange(chunk_keys)[None, :]
        mask_wqs = (key_pos_ws[:, None, :] < limit_fq[fold_w][:, :, None]) & valid_w[:, None, None]
        p_wkqs, m_wkq, l_wkq = _masked_softmax(s_wkqs, mask_wqs[:, None])
        pv_wkqd = jnp.einsum("wkqs,wskd->wkqd", p_wkqs, v_wskd.astype(jnp.float32))
        # Items of one fold sit side by side and may share a step: each is rescaled to the
        # fold's new maximum and the sums are added per fold (items past the list: dropped).
        into_w = jnp.where(valid_w, fold_w, num_folds)
        m_new = m_fkq.at[into_w].max(m_wkq, mode="drop")
        weight_wkq = jnp.exp(m_wkq - m_new[fold_w])
        alpha_fkq = jnp.exp(m_fkq - m_new)
        l_new = (alpha_fkq * l_fkq).at[into_w].add(weight_wkq * l_wkq, mode="drop")
        acc_new = (alpha_fkq[..., None] * acc_fkqd).at[into_w].add(
            weight_wkq[..., None] * pv_wkqd, mode="drop"
        )
        return m_new, l_new, acc_new

    shape_fkq = q_fkqd.shape[:-1]
    init = (
        jnp.full(shape_fkq, MASK_VALUE, jnp.float32),
        jnp.zeros(shape_fkq, jnp.float32),
        jnp.zeros(q_fkqd.shape, jnp.float32),
    )
    m_fkq, l_fkq, acc_fkqd = jax.lax.fori_loop(0, num_steps, step, init)
    out_fkqd, lse_fkq = _normalised(acc_fkqd, m_fkq, l_fkq)
    return _unfold(out_fkqd, folds, groups), _unfold(lse_fkq, folds, groups)


def _tpu_kernel(layout: PagedLayout, num_tokens: int, pages_per_slot: int):
    """The shipped ragged kernel, with explicit block sizes when interpreting (its tuned-size
    lookup queries the TPU generation, which does not exist off a TPU)."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    if not layout.interpret:
        return rpa.ragged_paged_attention
    kernel = functools.partial(
        rpa.ragged_paged_attention,
        num_kv_pages_per_block=min(pages_per_slot, 4),
        num_queries_per_block=min(num_tokens, 8),
    )

    def interpreted(*args, **kwargs):
        from jax.experimental.pallas import tpu as pltpu

        with pltpu.force_tpu_interpret_mode():
            return kernel(*args, **kwargs)

    return interpreted


def _pallas_tpu(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale, causal,
                kernel=None):
    """`kernel` defaults to the shipped ragged kernel; tests pass its shipped reference."""
    kv_pages = pages.kv
    num_tokens, num_heads, head_dim = q_thd.shape
    pages_per_slot = page_table_sp.shape[1]
    capacity = pages_per_slot * layout.page_size
    pad = ((0, 0), (0, 0), (0, layout.physical_head_dim - head_dim))
    q_thd = jnp.pad(q_thd, pad).astype(kv_pages.dtype)
    if kernel is None:
        kernel = _tpu_kernel(layout, num_tokens, pages_per_slot)
    if causal:
        # The kernel's DMA chain prefetches the next sequence's first block before that
        # sequence's own loop starts; a sequence with no key block would leave that copy
        # unconsumed and hand its data to the following sequence. At least one block per live
        # sequence keeps the chain aligned; such tokens are zeroed by the caller.
        live_n = jnp.arange(seq_slot_n.shape[0]) < rag.num_seqs
        kv_lens_n = jnp.where(live_n, jnp.clip(rag.kv_len_n, jnp.maximum(rag.q_len_n, 1),
                                               capacity), 0)
        out_thd = kernel(q_thd, kv_pages, kv_lens_n, page_table_sp[seq_slot_n], rag.cu_q_n1,
                         rag.num_seqs.reshape(1), sm_scale=scale)
        return out_thd[..., :head_dim]
    folds = _folds(rag, num_tokens, layout.queries_per_fold)
    q_fkqd = _fold_queries(q_thd, folds, layout.num_kv_heads)
    num_folds_total = q_fkqd.shape[0]
    q_fhd = q_fkqd.reshape(num_folds_total, -1, q_fkqd.shape[-1])
    kv_lens_f = jnp.where(folds.valid_f, jnp.clip(rag.kv_len_n[folds.seq_f], 1, capacity), 0)
    cu_f = jnp.minimum(jnp.arange(num_folds_total + 1, dtype=jnp.int32), folds.num_folds)
    out_fhd = kernel(q_fhd, kv_pages, kv_lens_f, page_table_sp[seq_slot_n[folds.seq_f]], cu_f,
                     folds.num_folds.reshape(1), sm_scale=scale)
    out_fkqd = out_fhd.reshape(q_fkqd.shape)
    return _unfold(out_fkqd, folds, num_heads // layout.num_kv_heads)[..., :head_dim]


def _gpu_modules():
    """The shipped Triton kernels; JAX >= 0.11.1 warns on import that they are deprecated (the
    default path falls back to pure JAX on a JAX that no longer has them: `default_impl`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas import triton as plgpu
        from jax.experimental.pallas.ops.gpu import attention as gpu_attention
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged
    return plgpu, gpu_attention, gpu_paged


def _largest_divisor(n: int, at_most: int, power_of_two: bool = False) -> int:
    for d in range(min(n, at_most), 0, -1):
        if n % d == 0 and (not power_of_two or d & (d - 1) == 0):
            return d
    return 1


def _gpu_paged_blocking(
    table_pages: int, page_size: int, head_dim: int, itemsize: int
) -> tuple[int, int, int]:
    """How the Triton paged kernel walks a page table of `table_pages` entries: (k_splits,
    pages_per_split, pages_per_block), the table padded with page 0 to k_splits *
    pages_per_split entries.

    A block of keys is `pages_per_block` whole pages, a power of two times `unit`: it must hold
    at least Triton's smallest dot operand (16 rows), so pages smaller than that are taken
    `unit` at a time, and it stays within _GPU_KV_BLOCK_BYTES unless one unit is larger. The
    blocks are shared among up to 16 splits that run in parallel (flash-decoding), their
    partial softmaxes merged after. The padding costs nothing past a sequence's length: the
    kernel stops at its last page and masks keys past its length within the last block. The
    block size does not depend on how `table_pages` factors (a prime table length would
    otherwise be walked one page at a time)."""
    unit = max(1, _MIN_DOT // page_size)
    block_keys = max(_MIN_DOT, _GPU_KV_BLOCK_BYTES // (head_dim * itemsize))
    units_per_block = max(1, block_keys // (unit * page_size))
    pages_per_block = unit << (units_per_block.bit_length() - 1)  # a power of two of units
    # No block much larger than the table itself (a short table would read mostly padding).
    while pages_per_block > unit and pages_per_block // 2 >= table_pages:
        pages_per_block //= 2
    blocks = -(-table_pages // pages_per_block)
    blocks_per_split = -(-blocks // min(16, blocks))
    k_splits = -(-blocks // blocks_per_split)
    return k_splits, blocks_per_split * pages_per_block, pages_per_block


def _gpu_paged_partials(q_kqd, kv_pages, table_p, length, *, interpret: bool):
    """One fold against its slot's pages (`kv_pages` [2, KV, pages, page_size, D], K then V):
    unnormalised output and softmax residuals.

    Runs the kernel body of `ops.gpu.paged_attention` under our own pallas_call: the same grid
    (KV heads, head blocks, splits of the page table) and block specs as the shipped wrapper,
    but returning each split's running max m and sum l, combined here in float32. The kernel's
    K and V operands are the one pool passed twice, each block spec picking its half.
    """
    plgpu, _, gpu_paged = _gpu_modules()
    from jax.experimental import pallas as pl

    kv_heads, queries, head_dim = q_kqd.shape
    _, _, num_pages, page_size, _ = kv_pages.shape
    block_h = min(64, max(16, pl.next_power_of_2(queries)))
    padded = -(-queries // block_h) * block_h
    q_kqd = jnp.pad(q_kqd, ((0, 0), (0, padded - queries), (0, 0)))
    k_splits, pages_per_split, pages_per_block = _gpu_paged_blocking(
        table_p.shape[0], page_size, head_dim, kv_pages.dtype.itemsize
    )
    table_p = jnp.pad(table_p, (0, k_splits * pages_per_split - table_p.shape[0]))
    kernel = functools.partial(
        gpu_paged.paged_attention_kernel,
        num_heads=queries,
        pages_per_compute_block=pages_per_block,
        mask_value=MASK_VALUE,
        attn_logits_soft_cap=None,
    )

    def pages_spec(half: int):
        return pl.BlockSpec((None, None, num_pages, page_size, head_dim),
                            lambda h, i, k: (half, h, 0, 0, 0))

    o_skqd, l_skq, m_skq = pl.pallas_call(
        kernel,
        grid=(kv_heads, padded // block_h, k_splits),
        in_specs=[
            pl.BlockSpec((None, block_h, head_dim), lambda h, i, k: (h, i, 0)),
            pages_spec(0),
            None,
            pages_spec(1),
            None,
            pl.BlockSpec((None, pages_per_split), lambda h, i, k: (k, 0)),
            pl.BlockSpec((1,), lambda h, i, k: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_h, head_dim), lambda h, i, k: (k, h, i, 0)),
            pl.BlockSpec((None, None, block_h), lambda h, i, k: (k, h, i)),
            pl.BlockSpec((None, None, block_h), lambda h, i, k: (k, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((k_splits, kv_heads, padded, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, kv_heads, padded), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, kv_heads, padded), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=8 if head_dim > 64 else 4, num_stages=2),
        name="dspark_paged_attention_partials",
    )(q_kqd, kv_pages, None, kv_pages, None, table_p.reshape(k_splits, pages_per_split),
      length.reshape(1))
    m_kq = jnp.max(m_skq, axis=0)
    correction_skq = jnp.exp(m_skq - m_kq[None])
    l_kq = jnp.sum(l_skq * correction_skq, axis=0)
    o_kqd = jnp.sum(o_skqd * correction_skq[..., None], axis=0)
    return o_kqd[:, :queries], l_kq[:, :queries], m_kq[:, :queries]


def _gpu_mha_block(padded_tokens: int, head_dim: int, itemsize: int) -> int:
    """The flash kernel's query and key block for `padded_tokens` (a multiple of 16) new
    tokens: a power of two dividing them, at most 128, and within _GPU_KV_BLOCK_BYTES per block
    as the paged kernel's key blocks are (a float32 block of 128 x 128 would ask Triton for
    about 256 KiB of shared memory: the query block and two stages of keys and values)."""
    most = max(_MIN_DOT, min(128, _GPU_KV_BLOCK_BYTES // (head_dim * itemsize)))
    return _largest_divisor(padded_tokens, most, power_of_two=True)


def _new_token_attention(q_thd, k_thd, v_thd, rag, scale, causal, *, interpret: bool):
    """Attention among the packed new tokens of each sequence (causal or not), with its
    log-sum-exp, by the shipped flash attention: one segment id per sequence keeps sequences
    apart, and packed order is position order inside a sequence, so the kernel's causal mask
    over the packed axis is the positional one."""
    _, gpu_attention, _ = _gpu_modules()
    num_tokens, num_heads, head_dim = q_thd.shape
    groups = num_heads // k_thd.shape[1]
    k_thd = jnp.repeat(k_thd, groups, axis=1)
    v_thd = jnp.repeat(v_thd, groups, axis=1)
    padded = -(-num_tokens // _MIN_DOT) * _MIN_DOT
    block = _gpu_mha_block(padded, head_dim, jnp.dtype(q_thd.dtype).itemsize)
    pad = ((0, padded - num_tokens), (0, 0), (0, 0))
    segment_t = jnp.pad(jnp.where(rag.valid_t, rag.seq_t, -1), (0, padded - num_tokens),
                        constant_values=-1)
    out_bthd, lse2_bht = gpu_attention.mha(
        jnp.pad(q_thd, pad)[None],
        jnp.pad(k_thd.astype(q_thd.dtype), pad)[None],
        jnp.pad(v_thd.astype(q_thd.dtype), pad)[None],
        segment_t[None],
        sm_scale=scale,
        causal=causal,
        block_sizes=gpu_attention.BlockSizes(block_q=block, block_k=block),
        interpret=interpret,
        return_residuals=True,
    )
    # mha works in base 2 (scores scaled by log2 e): its residual is log2 of the softmax sum.
    lse_th = jnp.swapaxes(lse2_bht[0], 0, 1)[:num_tokens] * math.log(2.0)
    lse_th = jnp.where(rag.valid_t[:, None], lse_th, -jnp.inf)
    return out_bthd[0, :num_tokens].astype(jnp.float32), lse_th


def _pallas_gpu_prefix(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale):
    """Every query against all rag.kv_len keys of its sequence by the paged kernel (queries
    folded so a sequence's pages are read once per fold): (out float32, lse)."""
    kv_pages = pages.kv
    num_tokens, num_heads, _ = q_thd.shape
    kv_heads = layout.num_kv_heads
    folds = _folds(rag, num_tokens, layout.queries_per_fold)
    q_scaled = (q_thd.astype(jnp.float32) * scale).astype(kv_pages.dtype)
    q_fkqd = _fold_queries(q_scaled, folds, kv_heads)
    capacity = page_table_sp.shape[1] * layout.page_size
    length_f = jnp.where(folds.valid_f, jnp.clip(rag.kv_len_n[folds.seq_f], 0, capacity), 0)
    table_fp = page_table_sp[seq_slot_n[folds.seq_f]]
    partials = functools.partial(_gpu_paged_partials, interpret=layout.interpret)
    o_fkqd, l_fkq, m_fkq = jax.vmap(partials, in_axes=(0, None, 0, 0))(
        q_fkqd, kv_pages, table_fp, length_f
    )
    groups = num_heads // kv_heads
    o_thd = _unfold(o_fkqd, folds, groups)
    l_th = _unfold(l_fkq, folds, groups)
    m_th = _unfold(m_fkq, folds, groups)
    out_thd, lse_th = _normalised(o_thd, m_th, l_th)
    return out_thd, jnp.where(rag.valid_t[:, None], lse_th, -jnp.inf)


def _new_kv_from_pages(pages, layout, page_table_sp, seq_slot_n, rag):
    """The new tokens' keys and values read back from their pages (for callers that wrote
    them first): one gather of both halves of the pool."""
    kv_pages = pages.kv
    page_size = layout.page_size
    pages_per_slot = page_table_sp.shape[1]
    slot_t = seq_slot_n[rag.seq_t]
    pos_t = jnp.clip(rag.pos_t, 0, pages_per_slot * page_size - 1)
    page_t = page_table_sp[slot_t, pos_t // page_size]
    offset_t = pos_t % page_size
    kv_tk2d = jnp.transpose(kv_pages[:, :, page_t, offset_t], (2, 1, 0, 3))
    return kv_tk2d[:, :, 0], kv_tk2d[:, :, 1]


def _pallas_gpu(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale, causal):
    if not causal:
        return _pallas_gpu_prefix(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale)[0]
    # Part (a): the keys before each sequence's new tokens, from the pages by the paged kernel;
    # part (b): the new tokens among themselves; merged by log-sum-exp.
    new_kv = _new_kv_from_pages(pages, layout, page_table_sp, seq_slot_n, rag)
    return _prefix_and_new(q_thd, pages, layout, page_table_sp, seq_slot_n, rag, scale, causal,
                           new_kv)


def gather_slot_kv(pages: Pages, layout: PagedLayout, page_table_sp):
    """Every slot's keys and values as contiguous [slots, pages_per_slot * page_size, KV, D]
    arrays (for tests and debugging: its cost follows the page table, not the keys in use)."""
    kv_pages = pages.kv
    if layout.stacked_kv:

        def contiguous(x_knpd):
            x_skppd = x_knpd[:, page_table_sp]
            kv, s, p, ps, d = x_skppd.shape
            return jnp.transpose(x_skppd, (1, 2, 3, 0, 4)).reshape(s, p * ps, kv, d)

        return contiguous(kv_pages[0]), contiguous(kv_pages[1])
    x_sppxd = _values(kv_pages[page_table_sp], layout)
    s, p, ps = x_sppxd.shape[:3]
    x_ssxd = x_sppxd.reshape(s, p * ps, *x_sppxd.shape[3:])
    return _split_combined(x_ssxd, layout.num_kv_heads, layout.head_dim)

