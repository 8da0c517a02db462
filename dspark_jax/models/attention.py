"""TEMPORARY dense reference of the paged attention interface (replaced by the attention branch)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspark_jax.models.layers import MASK_VALUE


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    impl: str = "dense"
    interpret: bool = False


def default_impl(backend: str | None = None) -> str:
    return "dense"


def init_pages(layout: PagedLayout, dtype):
    shape = (layout.num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim)
    return (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def write_kv(pages, layout, k_thd, v_thd, page_table_sp, slot_t, pos_t, valid_t):
    k_pages, v_pages = pages
    page_t = page_table_sp[slot_t, pos_t // layout.page_size]
    page_t = jnp.where(valid_t, page_t, layout.num_pages)
    off_t = pos_t % layout.page_size
    k_pages = k_pages.at[page_t, off_t].set(k_thd.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page_t, off_t].set(v_thd.astype(v_pages.dtype), mode="drop")
    return (k_pages, v_pages)


def ragged_paged_attention(
    q_thd,
    pages,
    layout,
    page_table_sp,
    seq_slot_n,
    cu_q_lens_n1,
    kv_lens_n,
    num_seqs,
    *,
    scale,
    causal,
):
    k_pages, v_pages = pages
    t = q_thd.shape[0]
    n = seq_slot_n.shape[0]
    tok = jnp.arange(t)
    seq_t = jnp.clip(jnp.searchsorted(cu_q_lens_n1, tok, side="right") - 1, 0, n - 1)
    in_seq_t = (tok < cu_q_lens_n1[jnp.minimum(num_seqs, n)]) & (seq_t < num_seqs)
    slot_t = seq_slot_n[seq_t]
    kv_len_t = jnp.where(in_seq_t, kv_lens_n[seq_t], 0)
    q_len_t = cu_q_lens_n1[seq_t + 1] - cu_q_lens_n1[seq_t]
    qpos_t = kv_len_t - q_len_t + (tok - cu_q_lens_n1[seq_t])
    pages_per_slot = page_table_sp.shape[1]
    max_keys = pages_per_slot * layout.page_size
    k = k_pages[page_table_sp[slot_t]].reshape(t, max_keys, layout.num_kv_heads, layout.head_dim)
    v = v_pages[page_table_sp[slot_t]].reshape(t, max_keys, layout.num_kv_heads, layout.head_dim)
    key_pos = jnp.arange(max_keys)
    mask_ts = key_pos[None, :] < kv_len_t[:, None]
    if causal:
        mask_ts &= key_pos[None, :] <= qpos_t[:, None]
    h = q_thd.shape[1]
    kvh = layout.num_kv_heads
    q = q_thd.reshape(t, kvh, h // kvh, layout.head_dim)
    scores = jnp.einsum("tkgd,tskd->tkgs", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask_ts[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask_ts[:, None, None], probs, 0.0).astype(v.dtype)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(t, h, layout.head_dim).astype(q_thd.dtype)
