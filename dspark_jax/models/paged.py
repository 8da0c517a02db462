"""Paged KV caches and packed (ragged) token batches: what the models need to run on slots.

A cache is a pool of fixed-size pages per layer (`attention.init_pages`) shared by every slot; a
slot owns the pages listed in its row of a page table [slots, pages_per_slot]. A forward pass
runs over a packed batch of tokens: token t belongs to slot `slot_t[t]` and sits at absolute
position `pos_t[t]`; tokens of one slot are contiguous and form one sequence of the ragged
attention (`seq_*` fields). Padding tokens (`valid_t` false) write nothing and read nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dspark_jax import sharding
from dspark_jax.config import Qwen3Config
from dspark_jax.models import attention
from dspark_jax.models.attention import PagedLayout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """The K/V pages of every layer of one model and the page table they share.

    `mesh`: the pools' KV heads are split over its `tensor` axis (None: one device)."""

    pages: tuple  # one `attention.init_pages` pytree per layer
    page_table_sp: jax.Array  # int32 [slots, pages_per_slot]
    layout: PagedLayout = dataclasses.field(metadata=dict(static=True))
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))

    def replace(self, **changes) -> PagedCache:
        return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """A packed batch of T tokens in N sequences (N and T static, `num_seqs` traced)."""

    slot_t: jax.Array  # int32 [T]
    pos_t: jax.Array  # int32 [T]
    valid_t: jax.Array  # bool [T]
    seq_slot_n: jax.Array  # int32 [N]
    cu_q_lens_n1: jax.Array  # int32 [N + 1]: tokens cu[i]:cu[i+1] are sequence i
    kv_lens_n: jax.Array  # int32 [N]: keys sequence i attends to (its new tokens included)
    num_seqs: jax.Array  # int32 scalar
    # A static bound on any sequence's tokens (None: T), which bounds the new tokens' attention
    # among themselves (see `attention.ragged_paged_attention`'s max_q_len).
    max_seq_tokens: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def per_slot(cls, start_s: jax.Array, count_s: jax.Array, width: int,
                 max_seq_tokens: int | None = None) -> TokenBatch:
        """Slot s's tokens at positions start_s.. packed in slot order, `count_s` of them each
        (0 for a slot that takes no part; at most `max_seq_tokens` when given), padded to
        `width` tokens. One sequence per slot: the sequences of empty slots have no tokens and
        no keys."""
        num_slots = start_s.shape[0]
        cu_n1 = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(count_s)]).astype(jnp.int32)
        tok_t = jnp.arange(width, dtype=jnp.int32)
        slot_t = jnp.clip(attention.searchsorted_steps(cu_n1, tok_t) - 1, 0, num_slots - 1)
        valid_t = tok_t < cu_n1[-1]
        pos_t = start_s[slot_t] + tok_t - cu_n1[slot_t]
        return cls(
            slot_t=slot_t.astype(jnp.int32),
            pos_t=jnp.where(valid_t, pos_t, 0).astype(jnp.int32),
            valid_t=valid_t,
            seq_slot_n=jnp.arange(num_slots, dtype=jnp.int32),
            cu_q_lens_n1=cu_n1,
            kv_lens_n=jnp.where(count_s > 0, start_s + count_s, 0).astype(jnp.int32),
            num_seqs=jnp.int32(num_slots),
            max_seq_tokens=max_seq_tokens,
        )

    def head(self, width: int) -> TokenBatch:
        """The first `width` tokens (a batch built wider than its tokens, cut to a bucket)."""
        return dataclasses.replace(
            self, slot_t=self.slot_t[:width], pos_t=self.pos_t[:width], valid_t=self.valid_t[:width]
        )


# A layer's new keys and values as the one array a forward hands out (see its docstring).
stack_kv = attention.stack_kv


def pad_kv(kv: tuple, width: int) -> tuple:
    """Every layer's stacked keys and values [2, T, KV, D] zero-padded to `width` tokens."""
    return tuple(jnp.pad(a, ((0, 0), (0, width - a.shape[1]), (0, 0), (0, 0))) for a in kv)


def write(cache: PagedCache, kv: tuple, batch: TokenBatch, after=None) -> PagedCache:
    """`cache` with every layer's keys and values ([2, T, KV, D], `stack_kv`) stored at the
    batch's valid tokens' slots and positions (padding tokens write nothing).

    `after`: values computed from reads of the same pages (e.g. the forward's hidden states). The
    write is ordered after them: otherwise XLA may schedule it before a read of the old pages and
    keep both versions alive, copying the whole pool every step.
    """
    if after is not None:
        kv = jax.lax.optimization_barrier((kv, after))[0]
    pages = tuple(
        attention.write_kv(
            layer_pages,
            cache.layout,
            kv_2thd,
            cache.page_table_sp,
            batch.slot_t,
            batch.pos_t,
            batch.valid_t,
        )
        for layer_pages, kv_2thd in zip(cache.pages, kv, strict=True)
    )
    return cache.replace(pages=pages)


def pages_logical_axes(layout: PagedLayout) -> tuple[str | None, ...]:
    """Logical axes of one layer's page arrays (`attention.Pages`), for the sharding rules."""
    if layout.stacked_kv:
        return (None, "kv_heads", "pages", None, None)
    # K and V of head h sit at 2h and 2h + 1: a split into whole heads keeps each pair together.
    return ("pages", None, "kv_heads", None)


def attend(
    cache: PagedCache, layer_pages, q_thd, batch: TokenBatch, *, scale, causal: bool, new_kv
):
    """Each valid query attends to its sequence's cached keys before its new tokens and to the
    new tokens `new_kv` (see `attention.ragged_paged_attention`).

    On a mesh with a `tensor` axis every device attends with its own heads over its own part of
    the pool (a `shard_map`): heads never interact, and the Pallas kernels, which XLA cannot
    partition, see an ordinary single-device problem.
    """
    mesh = cache.mesh
    tensor = 1 if mesh is None else mesh.shape["tensor"]
    layout = cache.layout
    if tensor > 1:
        layout = dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads // tensor)

    def run(q_thd, layer_pages, table_sp, seq_slot_n, cu_n1, kv_lens_n, num_seqs, new_kv):
        return attention.ragged_paged_attention(
            q_thd,
            layer_pages,
            layout,
            table_sp,
            seq_slot_n,
            cu_n1,
            kv_lens_n,
            num_seqs,
            scale=scale,
            causal=causal,
            new_kv=new_kv,
            max_q_len=batch.max_seq_tokens,
        )

    args = (
        q_thd,
        layer_pages,
        cache.page_table_sp,
        batch.seq_slot_n,
        batch.cu_q_lens_n1,
        batch.kv_lens_n,
        batch.num_seqs,
        new_kv,
    )
    if tensor == 1:
        return run(*args)
    heads = P(None, "tensor", None)
    pages_spec = P(*("tensor" if a == "kv_heads" else None for a in pages_logical_axes(layout)))
    in_specs = (
        heads,
        jax.tree.map(lambda _: pages_spec, layer_pages),
        P(),
        P(),
        P(),
        P(),
        P(),
        None if new_kv is None else (heads, heads),
    )
    return sharding.shard_map(run, mesh, in_specs, heads)(*args)


def new_cache(
    cfg: Qwen3Config,
    num_slots: int,
    max_len: int,
    dtype,
    page_size: int = 16,
    impl: str | None = None,
) -> PagedCache:
    """A cache for the layers of `cfg` in which slot s owns the consecutive pages
    s * pages_per_slot..: the simplest table, for callers that manage no pool (the engine
    allocates pages per request instead)."""
    pages_per_slot = -(-max_len // page_size)
    layout = PagedLayout(
        num_slots * pages_per_slot,
        page_size,
        cfg.num_key_value_heads,
        cfg.head_dim,
        impl or attention.default_impl(),
    )
    table = jnp.arange(num_slots * pages_per_slot, dtype=jnp.int32).reshape(num_slots, -1)
    return PagedCache(
        tuple(attention.init_pages(layout, dtype) for _ in range(cfg.num_hidden_layers)),
        table,
        layout,
    )
