"""Paged KV storage and ragged paged attention (dspark_jax.models.attention).

The chain of trust: the "dense" reference is held to `layers.attention` (today's contiguous-cache
code) on the same keys; every other path is held to the dense reference. Kernel paths run in
Pallas interpret mode on CPU (the Triton kernels natively on a GPU), except the ragged TPU
kernel, which JAX cannot interpret (see the module docstring): everything we feed it is checked
through its shipped pure-JAX reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import attention as attn
from dspark_jax.models import paged
from dspark_jax.models.layers import attention as contiguous_attention

SCALE = 0.3
# The Triton kernels run natively on a GPU and in Pallas interpret mode everywhere else.
GPU_INTERPRET = jax.default_backend() != "gpu"


@dataclasses.dataclass
class Case:
    """A packed batch over a paged pool, plus the same keys as contiguous per-slot caches."""

    k_sckd: np.ndarray  # [slots, capacity, KV, D]: position p of slot s (garbage past kv_len)
    v_sckd: np.ndarray
    q_thd: np.ndarray
    page_table_sp: np.ndarray
    seq_slot_n: np.ndarray
    cu_q_lens_n1: np.ndarray
    kv_lens_n: np.ndarray
    num_seqs: int
    num_pages: int
    page_size: int

    @property
    def kv_heads(self) -> int:
        return self.k_sckd.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_sckd.shape[3]

    def layout(self, impl: str, **kw) -> attn.PagedLayout:
        return attn.PagedLayout(self.num_pages, self.page_size, self.kv_heads, self.head_dim,
                                impl, **kw)

    def args(self):
        return (
            jnp.asarray(self.page_table_sp),
            jnp.asarray(self.seq_slot_n),
            jnp.asarray(self.cu_q_lens_n1),
            jnp.asarray(self.kv_lens_n),
            jnp.int32(self.num_seqs),
        )


def make_case(seed, *, groups, kv_heads=2, head_dim=16, page_size=4, seqs=None, pad_tokens=3):
    """`seqs`: (kv_len, q_len) per live sequence. Includes, by default, an empty slot, a
    sequence without keys, a one-token decode, a verification run and a prefill-like chunk."""
    rng = np.random.default_rng(seed)
    seqs = seqs or [(9, 3), (0, 0), (1, 1), (17, 8), (0, 2), (6, 6)]
    num_seqs = len(seqs)
    n = num_seqs + 2  # static maximum above num_seqs: trailing entries must be ignored
    num_slots = num_seqs + 1
    capacity_pages = max(-(-kv // page_size) for kv, _ in seqs) + 1
    capacity = capacity_pages * page_size
    owned = [-(-kv // page_size) for kv, _ in seqs]
    num_pages = sum(owned) + 3
    physical = rng.permutation(num_pages)
    # Unowned entries point at page 0, which belongs to someone: reading one would show.
    page_table = np.zeros((num_slots, capacity_pages), np.int32)
    slots = rng.permutation(num_slots)[:num_seqs]
    used = 0
    for slot, count in zip(slots, owned, strict=True):
        page_table[slot, :count] = physical[used:used + count]
        used += count
    q_lens = [q for _, q in seqs]
    total = sum(q_lens)
    cu = np.zeros(n + 1, np.int32)
    cu[1:num_seqs + 1] = np.cumsum(q_lens)
    cu[num_seqs + 1:] = [1, 0][: n - num_seqs]  # garbage past num_seqs
    kv_lens = np.full(n, 5, np.int32)  # garbage past num_seqs
    kv_lens[:num_seqs] = [kv for kv, _ in seqs]
    seq_slot = np.full(n, slots[0], np.int32)
    seq_slot[:num_seqs] = slots
    heads = kv_heads * groups
    return Case(
        k_sckd=rng.standard_normal((num_slots, capacity, kv_heads, head_dim)).astype(np.float32),
        v_sckd=rng.standard_normal((num_slots, capacity, kv_heads, head_dim)).astype(np.float32),
        q_thd=rng.standard_normal((total + pad_tokens, heads, head_dim)).astype(np.float32),
        page_table_sp=page_table,
        seq_slot_n=seq_slot,
        cu_q_lens_n1=cu,
        kv_lens_n=kv_lens,
        num_seqs=num_seqs,
        num_pages=num_pages,
        page_size=page_size,
    )


def fill(case: Case, layout: attn.PagedLayout, dtype=jnp.float32) -> attn.Pages:
    """Writes every slot's keys below its kv length, packed, with invalid tokens mixed in."""
    slot_t, pos_t = [], []
    for i in range(case.num_seqs):
        slot = case.seq_slot_n[i]
        for p in range(case.kv_lens_n[i]):
            slot_t.append(slot)
            pos_t.append(p)
    valid_t = [True] * len(slot_t) + [False] * 3
    slot_t += [0, 1, 0]
    pos_t += [0, 2, 1]
    k_thd = case.k_sckd[slot_t, pos_t]
    v_thd = case.v_sckd[slot_t, pos_t]
    # Invalid tokens carry huge values: if one landed anywhere, outputs would show it.
    k_thd[-3:] = 1e4
    v_thd[-3:] = 1e4
    pages = attn.init_pages(layout, dtype)
    write = jax.jit(attn.write_kv, static_argnames="layout")
    kv_2thd = attn.stack_kv(jnp.asarray(k_thd), jnp.asarray(v_thd))
    return write(pages, layout=layout, kv_2thd=kv_2thd,
                 page_table_sp=jnp.asarray(case.page_table_sp), slot_t=jnp.asarray(slot_t),
                 pos_t=jnp.asarray(pos_t), valid_t=jnp.asarray(valid_t))


def contiguous_reference(case: Case, causal: bool, dtype=jnp.float32) -> np.ndarray:
    """`layers.attention` over each sequence's contiguous slot cache row, masked the way the
    current engine masks a [max_len] cache (one batched call, a row per sequence); zeros for
    tokens that see no key."""
    q_lens = np.diff(case.cu_q_lens_n1[: case.num_seqs + 1])
    q_max, capacity = max(int(q_lens.max()), 1), case.k_sckd.shape[1]
    kv_lens = case.kv_lens_n[: case.num_seqs]
    slots = case.seq_slot_n[: case.num_seqs]
    q_bqhd = np.zeros((case.num_seqs, q_max, *case.q_thd.shape[1:]), np.float32)
    for i, (start, q_len) in enumerate(zip(case.cu_q_lens_n1, q_lens, strict=False)):
        q_bqhd[i, :q_len] = case.q_thd[start:start + q_len]
    key_s = np.arange(capacity)
    if causal:
        pos_bq = (kv_lens - q_lens)[:, None] + np.arange(q_max)[None, :]
        mask_bqs = key_s[None, None, :] <= pos_bq[:, :, None]
    else:
        mask_bqs = np.ones((case.num_seqs, q_max, capacity), bool)
    mask_bqs &= key_s[None, None, :] < kv_lens[:, None, None]
    o_bqhd = contiguous_attention(
        jnp.asarray(q_bqhd, dtype), jnp.asarray(case.k_sckd[slots], dtype),
        jnp.asarray(case.v_sckd[slots], dtype), jnp.asarray(mask_bqs), SCALE)
    out = np.zeros(case.q_thd.shape, np.float32)
    for i, (start, q_len) in enumerate(zip(case.cu_q_lens_n1, q_lens, strict=False)):
        if kv_lens[i] > 0:
            out[start:start + q_len] = np.asarray(o_bqhd[i, :q_len], np.float32)
    return out


_attend = jax.jit(attn.ragged_paged_attention,
                  static_argnames=("layout", "scale", "causal", "max_q_len"))


def run(case: Case, layout: attn.PagedLayout, causal: bool, dtype=jnp.float32) -> np.ndarray:
    pages = fill(case, layout, dtype)
    out = _attend(jnp.asarray(case.q_thd, dtype), pages, layout, *case.args(), scale=SCALE,
                  causal=causal)
    assert out.dtype == dtype
    return np.asarray(out, np.float32)


def f32_tolerance(case: Case) -> float:
    # Same keys, different summation order and an online softmax: a few float32 ulps of the
    # output's scale, which is bounded by max |v|.
    return 32 * float(np.finfo(np.float32).eps) * float(np.abs(case.v_sckd).max())


def assert_padding_zero(case: Case, out: np.ndarray):
    assert np.isfinite(out).all()
    total = case.cu_q_lens_n1[case.num_seqs]
    np.testing.assert_array_equal(out[total:], 0.0)


RATIOS = [1, 3, 4]
PAGE_SIZES = {1: 8, 3: 4, 4: 1}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", RATIOS)
def test_dense_reference_matches_layers_attention(groups, causal):
    case = make_case(groups, groups=groups, page_size=PAGE_SIZES[groups])
    out = run(case, case.layout("dense"), causal)
    np.testing.assert_allclose(out, contiguous_reference(case, causal), rtol=0,
                               atol=f32_tolerance(case))
    assert_padding_zero(case, out)


@pytest.mark.parametrize("chunk_pages", [0, 1, 3])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", RATIOS)
def test_jax_path_matches_dense(groups, causal, chunk_pages):
    case = make_case(10 + groups, groups=groups, page_size=PAGE_SIZES[groups])
    ref = run(case, case.layout("dense"), causal)
    out = run(case, case.layout("jax", kv_chunk_pages=chunk_pages), causal)
    np.testing.assert_allclose(out, ref, rtol=0, atol=f32_tolerance(case))
    assert_padding_zero(case, out)


# One long sequence among short ones (page size 2, one page per chunk: the long one is 23
# chunks, several loop steps of its chunks alone), a verification run next to it and prefill
# chunks that see nothing before them.
SKEWED_SEQS = [(1, 1), (45, 8), (3, 2), (0, 0), (2, 1), (5, 5), (4, 1)]


@pytest.mark.parametrize("new_kv", [False, True], ids=["in_pages", "new_kv"])
@pytest.mark.parametrize("causal", [True, False])
def test_jax_path_with_one_long_sequence_matches_the_reference(causal, new_kv):
    """The "jax" path's work list: chunks of one fold spread over several loop steps and
    shared with other folds' chunks in one step merge into the same softmax."""
    case = make_case(50, groups=2, page_size=2, seqs=SKEWED_SEQS)
    layout = case.layout("jax", kv_chunk_pages=1, queries_per_fold=4)
    pages = fill(case, layout)
    out = _attend(jnp.asarray(case.q_thd), pages, layout, *case.args(), scale=SCALE,
                  causal=causal, new_kv=_new_kv(case) if new_kv else None)
    out = np.asarray(out, np.float32)
    np.testing.assert_allclose(out, contiguous_reference(case, causal), rtol=0,
                               atol=f32_tolerance(case))
    assert_padding_zero(case, out)


def test_jax_path_steps_follow_the_keys_in_use():
    """The loop covers the chunks each fold needs, F per step: one fold of 40 chunks among 7
    folds of 1 takes ceil(47 / 8) = 6 steps, where walking every fold to the longest length
    took 40; a batch of equal lengths takes as many steps as that length has chunks."""
    chunk_keys = 16
    limit_fr = np.zeros((8, 4), np.int32)
    limit_fr[:, 0] = 16
    limit_fr[3, :] = [640, 639, 638, 0]
    cu_w, items, steps = attn._chunk_schedule(jnp.asarray(limit_fr), chunk_keys)
    assert cu_w.tolist() == [0, 1, 2, 3, 43, 44, 45, 46, 47]
    assert (int(items), int(steps)) == (47, 6)
    equal_fr = np.full((8, 4), 640, np.int32)
    assert int(attn._chunk_schedule(jnp.asarray(equal_fr), chunk_keys)[2]) == 40
    idle_fr = np.zeros((8, 4), np.int32)
    assert [int(x) for x in attn._chunk_schedule(jnp.asarray(idle_fr), chunk_keys)[1:]] == [0, 0]


def _gpu_cases():
    fast = [(3, True, 8), (4, False, 8), (1, True, 2)]
    slow = [(g, c, r) for g in RATIOS for c in (True, False) for r in (1, 3, 8)]
    return [*fast, *(pytest.param(*p, marks=pytest.mark.slow) for p in slow if p not in fast)]


@pytest.mark.parametrize(("groups", "causal", "per_fold"), _gpu_cases())
def test_pallas_gpu_matches_dense(groups, causal, per_fold):
    case = make_case(20 + groups, groups=groups, page_size=PAGE_SIZES[groups])
    ref = run(case, case.layout("dense"), causal)
    layout = case.layout("pallas_gpu", interpret=GPU_INTERPRET, queries_per_fold=per_fold)
    out = run(case, layout, causal)
    np.testing.assert_allclose(out, ref, rtol=0, atol=f32_tolerance(case))
    assert_padding_zero(case, out)


def _shipped_tpu_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale):
    """The ragged kernel's own reference, padded back to the packed token count. It loops over
    sequences in Python, slicing with the lengths, so those are host constants here and the
    rest is compiled as one program."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention,
    )

    lens, cu, count = np.asarray(kv_lens), np.asarray(cu_q_lens), np.asarray(num_seqs)

    def reference(q, kv_pages, page_indices):
        out = ref_ragged_paged_attention(q, kv_pages, lens, page_indices, cu, count,
                                         sm_scale=sm_scale)
        return jnp.pad(out, ((0, q.shape[0] - out.shape[0]), (0, 0), (0, 0)))

    return jax.jit(reference)(q, kv_pages, page_indices)


def run_tpu_inputs(case: Case, causal: bool, dtype=jnp.float32, **layout_kw) -> np.ndarray:
    """The pallas_tpu path with the kernel replaced by its shipped reference: a first pass
    captures what the path hands the kernel, the reference runs on it, and a second pass feeds
    the reference's output back through the path's unpacking."""
    layout = case.layout("pallas_tpu", **layout_kw)
    pages = fill(case, layout, dtype)
    q = jnp.asarray(case.q_thd, dtype)

    def path(q, pages, table, seq_slot, cu, kv_lens, num_seqs, kernel):
        rag = attn._ragged(q.shape[0], seq_slot, cu, kv_lens, num_seqs, causal)
        out = attn._pallas_tpu(q, pages, layout, table, seq_slot, rag, SCALE, causal,
                               kernel=kernel)
        return jnp.where(rag.limit_t[:, None, None] > 0, out, 0)

    @jax.jit
    def kernel_inputs(*args):
        captured = []

        def capture(*kernel_args, sm_scale):
            assert sm_scale == SCALE
            captured.append(kernel_args)
            return jnp.zeros(kernel_args[0].shape, kernel_args[0].dtype)

        path(*args, kernel=capture)
        return captured[0]

    @jax.jit
    def unpack(kernel_out, *args):
        return path(*args, kernel=lambda *_, sm_scale: kernel_out)

    args = (q, pages, *case.args())
    kernel_out = _shipped_tpu_reference(*kernel_inputs(*args), sm_scale=SCALE)
    return np.asarray(unpack(kernel_out, *args), np.float32)


def _tpu_cases():
    fast = [(3, True, 8), (4, False, 3)]
    slow = [(g, c, r) for g in RATIOS for c in (True, False) for r in (1, 8)]
    return [*fast, *(pytest.param(*p, marks=pytest.mark.slow) for p in slow if p not in fast)]


@pytest.mark.parametrize(("groups", "causal", "per_fold"), _tpu_cases())
def test_pallas_tpu_kernel_inputs_match_dense(groups, causal, per_fold):
    case = make_case(30 + groups, groups=groups, page_size=PAGE_SIZES[groups])
    ref = run(case, case.layout("dense"), causal)
    out = run_tpu_inputs(case, causal, queries_per_fold=per_fold)
    np.testing.assert_allclose(out, ref, rtol=0, atol=f32_tolerance(case))


@pytest.mark.parametrize(
    ("page_size", "head_dim", "refused"),
    [(12, 16, "power-of-two page_size, got 12"), (16, 24, "power-of-two head_dim, got 24"),
     (16, 8, "head_dim >= 16, got 8")],
)
def test_pallas_gpu_layout_refuses_shapes_triton_cannot_take(page_size, head_dim, refused):
    with pytest.raises(ValueError, match=refused):
        attn.PagedLayout(8, page_size, 2, head_dim, "pallas_gpu")
    attn.PagedLayout(8, page_size, 2, head_dim, "jax")  # the pure-JAX path takes any shape


@pytest.mark.parametrize("table_pages", [1, 3, 8, 41, 256, 257, 1000])
@pytest.mark.parametrize(("page_size", "head_dim", "itemsize"),
                         [(1, 16, 4), (4, 32, 4), (16, 128, 2), (16, 128, 4), (64, 128, 2),
                          (256, 128, 2)])
def test_pallas_gpu_blocking_fits_triton(table_pages, page_size, head_dim, itemsize):
    """Key blocks are whole pages, at least 16 keys (Triton's smallest dot), at most 32 KiB
    unless one page is larger, a power of two of pages or of 16-key units; the splits cover the
    table, at most 16 of them, none empty; and a long table of any length is walked in full
    blocks, not page by page."""
    k_splits, per_split, per_block = attn._gpu_paged_blocking(
        table_pages, page_size, head_dim, itemsize
    )
    unit = max(1, 16 // page_size)
    keys = per_block * page_size
    units = per_block // unit
    assert keys >= 16 and per_block % unit == 0 and units & (units - 1) == 0
    assert keys * head_dim * itemsize <= 32 * 1024 or per_block == unit
    assert per_split % per_block == 0 and 1 <= k_splits <= 16
    assert k_splits * per_split >= table_pages > (k_splits - 1) * per_split
    full_block = max(unit, 32 * 1024 // (head_dim * itemsize * page_size))
    if table_pages >= full_block:
        assert per_block * 2 > full_block


@pytest.mark.parametrize("tokens", [16, 48, 64, 128, 256, 272, 512, 4096])
@pytest.mark.parametrize(("head_dim", "itemsize"), [(32, 4), (64, 2), (128, 2), (128, 4),
                                                    (256, 4)])  # fmt: skip
def test_pallas_gpu_new_token_blocks_fit_triton(tokens, head_dim, itemsize):
    """The flash kernel's blocks over the new tokens divide them, are powers of two of at least
    16 rows, at most 128, within 32 KiB unless 16 rows are larger, and as large as that allows
    when the token count does (Qwen3's bf16 head_dim 128: 128; float32: 64)."""
    block = attn._gpu_mha_block(tokens, head_dim, itemsize)
    assert tokens % block == 0 and block >= 16 and block & (block - 1) == 0
    assert block <= 128 and (block * head_dim * itemsize <= 32 * 1024 or block == 16)
    fits = max(16, min(128, 32 * 1024 // (head_dim * itemsize)))
    if tokens % fits == 0:
        assert block == fits


def test_pallas_gpu_partials_merge_splits_and_blocks():
    """One fold against a long page table, walked in several splits of several blocks each
    (float32 and head_dim 128: 4 pages of 16 keys a block; 200 pages: 13 splits of 4 blocks),
    the last used block partial and the last splits past the length: the merged partial
    softmax is exact attention over the first `length` keys."""
    rng = np.random.default_rng(7)
    kv_heads, queries, head_dim, page_size, num_pages, table_pages = 2, 3, 128, 16, 240, 200
    assert attn._gpu_paged_blocking(table_pages, page_size, head_dim, 4) == (13, 16, 4)
    length = 1877  # 118 pages in use: split 7 partial, splits 8-12 past the length
    k_pages = rng.standard_normal((kv_heads, num_pages, page_size, head_dim), np.float32)
    v_pages = rng.standard_normal((kv_heads, num_pages, page_size, head_dim), np.float32)
    q = rng.standard_normal((kv_heads, queries, head_dim), np.float32) / np.sqrt(head_dim)
    table = rng.permutation(num_pages)[:table_pages].astype(np.int32)
    acc, total, peak = jax.jit(
        functools.partial(attn._gpu_paged_partials, interpret=GPU_INTERPRET)
    )(q, np.stack([k_pages, v_pages]), table, np.int32(length))
    out, lse = attn._normalised(acc, peak, total)
    keys = k_pages[:, table].reshape(kv_heads, -1, head_dim)[:, :length]
    values = v_pages[:, table].reshape(kv_heads, -1, head_dim)[:, :length]
    scores = np.einsum("kqd,ksd->kqs", q.astype(np.float64), keys)
    ref_lse = np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1)) + scores.max(-1)
    ref = np.einsum("kqs,ksd->kqd", np.exp(scores - ref_lse[..., None]), values)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=0, atol=2e-5)


def test_pallas_tpu_pages_pad_head_dim_to_lanes():
    layout = attn.PagedLayout(8, 4, 2, 64, "pallas_tpu")
    kv_pages = attn.init_pages(layout, jnp.bfloat16).kv
    assert kv_pages.shape == (8, 4, 4, 128)
    assert attn.PagedLayout(8, 4, 2, 128, "pallas_tpu").physical_head_dim == 128


def test_pallas_tpu_interpret_mode_runs_or_hits_known_interpreter_gap():
    """JAX's TPU interpreter cannot run the ragged kernel (it reshapes a VMEM ref; the
    interpreter only handles indexing transforms). Pin that: the day it runs, it must match."""
    from jax.experimental.pallas import tpu as pltpu

    case = make_case(40, groups=2, head_dim=128, seqs=[(5, 2), (3, 3)], pad_tokens=1)
    ref = run(case, case.layout("dense"), True)
    try:
        out = run(case, case.layout("pallas_tpu", interpret=True), True)
    except Exception as err:  # noqa: BLE001 - the interpreter surfaces it as a runtime error
        pltpu.reset_tpu_interpret_mode_state()
        assert "ReshapeTransform" in str(err), err
        return
    np.testing.assert_allclose(out, ref, rtol=0, atol=f32_tolerance(case))


# bfloat16: inputs are bf16 values; the truth is float32 attention on those same values. Error
# sources: rounding the probabilities (dense) or the scaled queries (pallas_gpu) to bf16, each a
# relative error of at most u = 2^-8 on every weight, and rounding the output, another u; all
# scale with max |v|. 4u covers them with a factor of two to spare.
BF16_U = 2.0**-8


@pytest.mark.parametrize(
    ("impl", "layout_kw"),
    [("dense", {}), ("jax", {}), ("pallas_gpu", {"interpret": GPU_INTERPRET}), ("pallas_tpu", {})],
)
@pytest.mark.parametrize("causal", [True, False])
def test_bfloat16_within_bf16_rounding_of_float32_truth(impl, layout_kw, causal):
    case = make_case(50, groups=4)
    as_bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    case = dataclasses.replace(case, q_thd=as_bf16(case.q_thd), k_sckd=as_bf16(case.k_sckd),
                               v_sckd=as_bf16(case.v_sckd))
    truth = contiguous_reference(case, causal)
    if impl == "pallas_tpu":
        out = run_tpu_inputs(case, causal, jnp.bfloat16)
    else:
        out = run(case, case.layout(impl, **layout_kw), causal, jnp.bfloat16)
    np.testing.assert_allclose(out, truth, rtol=0,
                               atol=4 * BF16_U * float(np.abs(case.v_sckd).max()))
    assert_padding_zero(case, out)


@pytest.mark.parametrize("impl", ["dense", "jax", "pallas_tpu", "pallas_gpu"])
def test_write_kv_drops_invalid_tokens_and_leaves_other_slots_alone(impl):
    page_size, pages_per_slot = 4, 3
    layout = attn.PagedLayout(10, page_size, 2, 16, impl)
    table = jnp.array([[3, 7, 0], [5, 1, 0]], jnp.int32)  # slot 0 owns 3,7; slot 1 owns 5,1
    rng = np.random.default_rng(0)
    pool = attn.init_pages(layout, jnp.float32).kv
    before = attn.Pages(jnp.asarray(rng.standard_normal(pool.shape), pool.dtype))
    k_thd = jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.float32)
    v_thd = jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.float32)
    slot_t = jnp.array([0, 0, 1, 1, 0], jnp.int32)
    pos_t = jnp.array([5, 0, 2, 3, pages_per_slot * page_size], jnp.int32)
    valid_t = jnp.array([True, False, True, False, True])  # the last is past the page table
    after = jax.jit(attn.write_kv, static_argnames="layout")(
        before, layout, attn.stack_kv(k_thd, v_thd), table, slot_t, pos_t, valid_t)
    k_old, v_old = attn.gather_slot_kv(before, layout, table)
    k_new, v_new = attn.gather_slot_kv(after, layout, table)
    expect_k, expect_v = np.array(k_old), np.array(v_old)
    for t in (0, 2):
        expect_k[slot_t[t], pos_t[t]] = k_thd[t]
        expect_v[slot_t[t], pos_t[t]] = v_thd[t]
    # Slot rows hold logical page 2 -> physical 0 for both slots; compare owned pages only.
    np.testing.assert_array_equal(np.asarray(k_new)[:, :8], expect_k[:, :8])
    np.testing.assert_array_equal(np.asarray(v_new)[:, :8], expect_v[:, :8])
    # No page other than the two written ones changed anywhere in the pool.
    untouched_pages = [p for p in range(10) if p not in (7, 5)]
    page_axis = 2 if layout.stacked_kv else 0
    np.testing.assert_array_equal(np.take(np.asarray(before.kv), untouched_pages, axis=page_axis),
                                  np.take(np.asarray(after.kv), untouched_pages, axis=page_axis))


def _primitives(jaxpr) -> set[str]:
    """The primitives of a jaxpr's equations and of its sub-jaxprs'."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    names |= _primitives(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    names |= _primitives(sub)
    return names


def test_stacked_keys_and_values_are_a_select_and_pad_along_tokens():
    """`paged.stack_kv`: K at 0 and V at 1 bit for bit, built by a select (a concatenate would
    be a GPU kernel of its own in every layer); `pad_kv` pads the token axis with zeros."""
    rng = np.random.default_rng(2)
    k = jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.bfloat16)
    kv = paged.stack_kv(k, v)
    assert kv.shape == (2, 5, 2, 16) and kv.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kv[0], np.float32), np.asarray(k, np.float32))
    np.testing.assert_array_equal(np.asarray(kv[1], np.float32), np.asarray(v, np.float32))
    prims = _primitives(jax.make_jaxpr(paged.stack_kv)(k, v).jaxpr)
    assert "select_n" in prims and "concatenate" not in prims, prims
    (padded,) = paged.pad_kv((kv,), 8)
    assert padded.shape == (2, 8, 2, 16)
    np.testing.assert_array_equal(np.asarray(padded[:, :5], np.float32),
                                  np.asarray(kv, np.float32))
    assert not np.asarray(padded[:, 5:], np.float32).any()


@pytest.mark.parametrize(
    ("impl", "layout_kw"),
    [("dense", {}), ("jax", {}), ("pallas_gpu", {"interpret": GPU_INTERPRET})],
)
def test_one_program_across_lengths(impl, layout_kw):
    def attend_fn(*args, **kwargs):  # a fresh function: jit caches are per function object
        return attn.ragged_paged_attention(*args, **kwargs)

    attend = jax.jit(attend_fn, static_argnums=2, static_argnames=("scale", "causal"))
    shapes = None
    for seed, seqs in enumerate([[(9, 3), (4, 4), (1, 1)], [(2, 1), (0, 0), (17, 8)],
                                 [(12, 5), (6, 1), (3, 3)]]):
        case = make_case(60 + seed, groups=2, seqs=seqs, pad_tokens=14 - sum(q for _, q in seqs))
        # Same static shapes for every batch: pad the pool and tables to a common size.
        case = dataclasses.replace(
            case,
            num_pages=16,
            page_table_sp=np.pad(case.page_table_sp,
                                 ((0, 0), (0, 6 - case.page_table_sp.shape[1]))),
            k_sckd=np.pad(case.k_sckd, ((0, 0), (0, 24 - case.k_sckd.shape[1]), (0, 0), (0, 0))),
            v_sckd=np.pad(case.v_sckd, ((0, 0), (0, 24 - case.v_sckd.shape[1]), (0, 0), (0, 0))),
        )
        layout = case.layout(impl, **layout_kw)
        pages = fill(case, layout)
        q = jnp.asarray(case.q_thd)
        args = case.args()
        now = (q.shape, tuple(a.shape for a in args))
        assert shapes in (None, now)
        shapes = now
        out = attend(q, pages, layout, *args, scale=SCALE, causal=True)
        np.testing.assert_allclose(np.asarray(out), contiguous_reference(case, True), rtol=0,
                                   atol=f32_tolerance(case))
    assert attend._cache_size() == 1


def _largest_intermediate(jaxpr) -> int:
    """The largest array any equation of a jaxpr (or its sub-jaxprs) produces."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, int(np.prod(var.aval.shape, dtype=np.int64)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    biggest = max(biggest, _largest_intermediate(sub.jaxpr))
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    biggest = max(biggest, _largest_intermediate(sub))
    return biggest


@pytest.mark.parametrize(("impl", "follows_pool"), [("jax", False), ("dense", True)])
def test_work_per_step_does_not_follow_pool_or_table_width(impl, follows_pool):
    """The jax path's arrays are sized by the chunk, whatever the pool or page table size
    (its trip count follows the longest visible length); the dense reference's are not."""
    sizes = []
    for num_pages, pages_per_slot in ((64, 16), (1024, 256)):
        layout = attn.PagedLayout(num_pages, 4, 2, 16, impl, kv_chunk_pages=2)
        pages = attn.init_pages(layout, jnp.float32)
        jaxpr = jax.make_jaxpr(
            lambda q, p, t, layout=layout: attn.ragged_paged_attention(
                q, p, layout, t, jnp.arange(3, dtype=jnp.int32),
                jnp.array([0, 2, 5, 6], jnp.int32), jnp.array([7, 9, 3], jnp.int32),
                jnp.int32(3), scale=SCALE, causal=True))(
            jnp.ones((8, 4, 16)), pages, jnp.zeros((4, pages_per_slot), jnp.int32))
        sizes.append(_largest_intermediate(jaxpr.jaxpr))
    assert (sizes[1] > sizes[0]) == follows_pool, sizes


def test_the_environment_overrides_the_default_path(monkeypatch):
    monkeypatch.setenv("DSPARK_JAX_ATTENTION", "dense")
    assert attn.default_impl("gpu") == "dense"
    monkeypatch.setenv("DSPARK_JAX_ATTENTION", "triton")
    with pytest.raises(ValueError, match="DSPARK_JAX_ATTENTION='triton' is not an attention"):
        attn.default_impl()


def test_default_impl_by_backend():
    assert attn.default_impl("cpu") == "jax"
    assert attn.default_impl("tpu") == "pallas_tpu"
    assert attn.default_impl("gpu") == "pallas_gpu"
    assert attn.default_impl("cuda") == "pallas_gpu"
    backend = {"cpu": "jax", "gpu": "pallas_gpu", "tpu": "pallas_tpu"}[jax.default_backend()]
    assert attn.default_impl() == backend


def test_a_jax_without_the_triton_kernels_defaults_to_pure_jax_on_a_gpu(monkeypatch):
    """JAX 0.11 deprecates its Pallas Triton backend: where the kernels cannot be imported, the
    GPU default is the pure-JAX path, with a warning naming the import that failed, rather than
    an engine that fails to trace. Asking for the kernels by name still reaches the import."""
    monkeypatch.delenv("DSPARK_JAX_ATTENTION", raising=False)

    def removed():
        raise ImportError("No module named 'jax.experimental.pallas.triton'")

    monkeypatch.setattr(attn, "_gpu_modules", removed)
    with pytest.warns(RuntimeWarning, match=r"no Pallas Triton attention kernels .*pallas\.triton"):
        assert attn.default_impl("gpu") == "jax"
    assert attn.default_impl("tpu") == "pallas_tpu"
    monkeypatch.setenv("DSPARK_JAX_ATTENTION", "pallas_gpu")
    assert attn.default_impl("gpu") == "pallas_gpu"


class _FakeGpu:
    platform = "gpu"

    def __init__(self, kind, capability):
        self.device_kind = kind
        if capability is not None:
            self.compute_capability = capability


@pytest.mark.parametrize(
    ("kind", "capability", "expected"),
    [("Tesla T4", "7.5", "jax"), ("Tesla V100-SXM2-16GB", "7.0", "jax"),
     ("NVIDIA A100-SXM4-80GB", "8.0", "pallas_gpu"), ("NVIDIA H100 80GB HBM3", "9.0", "pallas_gpu"),
     ("AMD Instinct MI300X", None, "pallas_gpu"), ("odd", "sm_75", "pallas_gpu")],
)  # fmt: skip
def test_gpus_older_than_ampere_default_to_pure_jax(monkeypatch, kind, capability, expected):
    """Triton's kernels need Ampere or newer: on a T4 (Colab's free GPU) or a V100 the default
    is the pure-JAX path, with a warning that says why and how to override it; a device that
    does not state a readable capability keeps the kernels. A named backend (lowering for a
    GPU that is not here) is never second-guessed."""
    monkeypatch.delenv("DSPARK_JAX_ATTENTION", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [_FakeGpu(kind, capability)])
    if expected == "jax":
        with pytest.warns(RuntimeWarning, match=rf"{kind} \(compute capability {capability}\)"):
            assert attn.default_impl() == "jax"
    else:
        assert attn.default_impl() == expected
    assert attn.default_impl("gpu") == "pallas_gpu"
    monkeypatch.setenv("DSPARK_JAX_ATTENTION", "pallas_gpu")
    assert attn.default_impl() == "pallas_gpu"


def test_layout_rejects_unknown_impl_and_mismatched_queries():
    with pytest.raises(ValueError, match="unknown attention impl"):
        attn.PagedLayout(4, 4, 2, 16, "flash")
    layout = attn.PagedLayout(4, 4, 2, 16, "jax")
    pages = attn.init_pages(layout, jnp.float32)
    with pytest.raises(ValueError, match="do not fit"):
        attn.ragged_paged_attention(
            jnp.ones((2, 3, 16)), pages, layout, jnp.zeros((1, 1), jnp.int32),
            jnp.zeros((1,), jnp.int32), jnp.array([0, 2], jnp.int32), jnp.array([2], jnp.int32),
            1, scale=SCALE, causal=True)


def _new_kv(case: Case):
    """Each packed query token's own key and value (its sequence's position kv_len - q_len + j)."""
    k, v = np.zeros((2, case.q_thd.shape[0], case.kv_heads, case.head_dim), np.float32)
    for i in range(case.num_seqs):
        start, stop = case.cu_q_lens_n1[i], case.cu_q_lens_n1[i + 1]
        first = case.kv_lens_n[i] - (stop - start)
        slot = case.seq_slot_n[i]
        k[start:stop] = case.k_sckd[slot, first:first + stop - start]
        v[start:stop] = case.v_sckd[slot, first:first + stop - start]
    return jnp.asarray(k), jnp.asarray(v)


# Many short sequences, none longer than 3 tokens: T is far above 3 x 3, so a window of 3 takes
# the windowed path; sequences straddle window boundaries at every offset.
SHORT_SEQS = [(5, 3), (1, 1), (0, 0), (9, 2), (3, 3), (12, 1), (4, 3), (7, 2), (2, 2), (8, 3),
              (6, 1), (11, 3)]


@pytest.mark.parametrize("impl", ["dense", "jax", "pallas_gpu"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_new_kv_mode_matches_the_reference(impl, window, causal):
    """The engine's mode -- prefix from the pages, the new tokens from `new_kv` -- equals
    attention over the keys in place, whole or with the new tokens windowed (max_q_len)."""
    case = make_case(40, groups=2, page_size=4, seqs=SHORT_SEQS)
    layout = case.layout(impl, interpret=impl == "pallas_gpu" and GPU_INTERPRET)
    pages = fill(case, layout)
    out = _attend(jnp.asarray(case.q_thd), pages, layout, *case.args(), scale=SCALE,
                  causal=causal, new_kv=_new_kv(case), max_q_len=window)
    out = np.asarray(out, np.float32)
    np.testing.assert_allclose(out, contiguous_reference(case, causal), rtol=0,
                               atol=f32_tolerance(case))
    assert_padding_zero(case, out)


# One new token per sequence or none (plain decoding), some sequences seeing only that token.
ONE_TOKEN_SEQS = [(5, 1), (1, 1), (0, 0), (9, 1), (3, 0), (12, 1), (4, 1), (1, 1)]


@pytest.mark.parametrize("impl", ["dense", "jax", "pallas_gpu"])
@pytest.mark.parametrize("causal", [True, False])
def test_one_new_token_per_sequence_matches_the_reference(impl, causal):
    """max_q_len 1 (the engine's plain rounds): each token's new part is its own key alone,
    computed without the windowed or flash path; the result is still attention over the keys
    in place, and equals what the general path (max_q_len None) computes."""
    case = make_case(12, groups=4, page_size=4, seqs=ONE_TOKEN_SEQS)
    layout = case.layout(impl, interpret=impl == "pallas_gpu" and GPU_INTERPRET)
    pages = fill(case, layout)
    args = (jnp.asarray(case.q_thd), pages, layout, *case.args())
    one = _attend(*args, scale=SCALE, causal=causal, new_kv=_new_kv(case), max_q_len=1)
    general = _attend(*args, scale=SCALE, causal=causal, new_kv=_new_kv(case))
    one = np.asarray(one, np.float32)
    np.testing.assert_allclose(one, contiguous_reference(case, causal), rtol=0,
                               atol=f32_tolerance(case))
    np.testing.assert_allclose(one, np.asarray(general, np.float32), rtol=0,
                               atol=f32_tolerance(case))
    assert_padding_zero(case, one)
    if impl == "pallas_gpu":  # the paged kernel alone: no flash kernel for the new tokens
        kernels = [
            str(_attend.trace(*args, scale=SCALE, causal=causal, new_kv=_new_kv(case),
                              max_q_len=q).jaxpr).count("pallas_call")
            for q in (1, None)
        ]  # fmt: skip
        assert kernels[0] == 1 and kernels[1] == 2, kernels


@pytest.mark.parametrize("unrolled", [True, False])
def test_token_to_sequence_search(unrolled):
    """Which sequence a packed token belongs to: numpy's searchsorted (side "right") for sorted
    offsets with repeats (empty sequences) and values past the end, by a binary search whose
    steps are written out (a GPU target: as a while loop each step is a trip whose predicate
    its host reads back, 21 of them in a speculative round at 64 slots before) or a loop (CPU:
    written out, XLA:CPU runs the steps again for every element of each consumer)."""
    from dspark_jax.models.paged import TokenBatch

    rng = np.random.default_rng(2)
    search = jax.jit(functools.partial(attn.searchsorted_steps, unrolled=unrolled))
    for n in (1, 2, 7, 64, 65, 513):
        cu = np.cumsum(rng.integers(0, 4, n)).astype(np.int32)
        values = np.arange(-1, int(cu[-1]) + 3, dtype=np.int32)
        np.testing.assert_array_equal(search(cu, values), np.searchsorted(cu, values, "right"))
    cu, values = jnp.zeros(64, jnp.int32), jnp.arange(512, dtype=jnp.int32)
    loops = "stablehlo.while" in search.lower(cu, values).as_text()
    assert loops == (not unrolled)
    # The default: written out for a GPU, the loop on any other backend (CPU here).
    default = jax.jit(attn.searchsorted_steps).lower(cu, values).as_text()
    assert ("stablehlo.while" in default) == (jax.default_backend() != "gpu")
    count_s = jnp.array([3, 0, 1, 8, 0, 2], jnp.int32)
    start_s = jnp.array([5, 9, 0, 2, 4, 7], jnp.int32)
    batch = TokenBatch.per_slot(start_s, count_s, 16)
    np.testing.assert_array_equal(batch.slot_t[:14], [0] * 3 + [2] + [3] * 8 + [5] * 2)
    np.testing.assert_array_equal(batch.pos_t[:14], [5, 6, 7, 0, *range(2, 10), 7, 8])


def test_folds_follow_the_tokens_not_the_slots():
    """The static fold count bounded every one of n sequences as if it held tokens: one decode
    token over 16 slots made 14 folds (each gathering its pages) for 1 that holds a query."""
    n, per_fold = 16, 8
    for tokens, expected in ((1, 1), (3, 3), (8, 8), (64, 22), (128, 30)):
        cu = jnp.minimum(jnp.arange(n + 1, dtype=jnp.int32), tokens)
        rag = attn._ragged(
            tokens, jnp.arange(n, dtype=jnp.int32), cu, jnp.full((n,), 40), n, causal=True
        )
        folds = attn._folds(rag, tokens, per_fold)
        assert folds.valid_f.shape == (expected,), tokens
        # Every token sits in a fold that exists (the bound holds for these lengths).
        assert int(jnp.sum(folds.tok_valid_fr)) == min(tokens, n)
