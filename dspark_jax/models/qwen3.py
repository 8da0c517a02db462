"""The Qwen3 target: causal decoder with a paged KV cache and hidden-state taps for the drafter."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import Qwen3Config
from dspark_jax.models import paged
from dspark_jax.models.layers import (
    MLP,
    Attention,
    Embed,
    RMSNorm,
    causal_attention,
    target_backend,
)
from dspark_jax.models.paged import PagedCache, TokenBatch, new_cache


class DecoderLayer(nnx.Module):
    """Pre-norm attention and SwiGLU MLP blocks, each with a residual connection."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.self_attn = Attention(cfg, rngs=rngs, param_dtype=param_dtype)
        self.mlp = MLP(cfg, rngs=rngs, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype
        )

    def __call__(self, x_btd, positions_bt):
        """A cache-free forward over whole sequences (training, parity checks), causal through
        `causal_attention`: no [T, T] mask, and cuDNN flash attention on a GPU."""
        h = self.input_layernorm(x_btd)
        q = self.self_attn.query(h, positions_bt)
        k, v = self.self_attn.key_value(h, positions_bt)
        o = causal_attention(q, k, v, self.self_attn.scale)
        x_btd = x_btd + self.self_attn.output(o)
        return x_btd + self.mlp(self.post_attention_layernorm(x_btd))

    def paged(self, x_1td, batch: TokenBatch, cache: PagedCache, layer_pages, causal: bool = True):
        """The layer over a packed batch: every token attends to its sequence's keys in
        `layer_pages` before its new tokens, and to the new tokens themselves (causally for the
        target); returns (x, this layer's new keys and values stacked [2, T, KV, D]) for the
        caller to write."""
        positions_1t = batch.pos_t[None]
        h = self.input_layernorm(x_1td)
        q, k, v = self.self_attn.query_key_value(h, positions_1t, fused=fuse_qkv(cache))
        new_kv = paged.stack_kv(k[0], v[0])
        scale = self.self_attn.scale
        o = paged.attend(cache, layer_pages, q[0], batch, scale=scale, causal=causal,
                         new_kv=(new_kv[0], new_kv[1]))
        x_1td = x_1td + self.self_attn.output(o[None])
        x_1td = x_1td + self.mlp(self.post_attention_layernorm(x_1td))
        return x_1td, new_kv


def fuse_qkv(cache: PagedCache) -> bool:
    """Whether a paged forward computes its layers' query, key and value projections as one
    GEMM (`Attention.query_key_value`): for a GPU, where no mesh splits the heads."""
    split = cache.mesh is not None and cache.mesh.shape.get("tensor", 1) > 1
    return target_backend() == "gpu" and not split


def _layer_program(method: str, **options):
    """`DecoderLayer.<method>(*args, **options)` jitted, taking the layer as (graphdef, state)
    before `args`: one per forward.

    A forward runs each of its layers as a call of this one function, so the layers (which
    share their structure and shapes) are traced and lowered once per forward and token width,
    not once per layer: the program holds one layer body that every layer calls, and XLA, which
    inlines calls, optimises the same graph as that of the layers written out one after another
    (36 for Qwen3-4B, in each token bucket of a decode program: `benchmarks/lowering_time.py`).
    A new function each forward keeps what a trace decided (cuDNN or not, say) to that forward.
    """

    def run(graphdef, state, *args):
        return getattr(nnx.merge(graphdef, state), method)(*args, **options)

    run.__name__ = run.__qualname__ = "decoder_layer"  # the lowered function's name
    return jax.jit(run, static_argnums=0)


def paged_layers(layers, x_1td, batch: TokenBatch, cache: PagedCache, causal: bool = True):
    """`DecoderLayer.paged` of each layer in turn over `cache.pages`: the last layer's x, x
    after each layer and every layer's new (k, v), each layer a call of one layer program."""
    run = _layer_program("paged", causal=causal)
    shared = cache.replace(pages=())  # what attention needs besides the layer's own pages
    outs, new_kv = [], []
    for layer, layer_pages in zip(layers, cache.pages, strict=True):
        x_1td, kv = run(*nnx.split(layer), x_1td, batch, shared, layer_pages)
        outs.append(x_1td)
        new_kv.append(kv)
    return x_1td, outs, tuple(new_kv)


class TargetOutput(NamedTuple):
    hidden: jax.Array  # final hidden state after the final norm (what lm_head reads)
    taps: jax.Array | None  # concatenated hidden states of the tapped layers
    kv: tuple | None  # paged forwards: every layer's new (k, v) [T, KV, D], to be written


class Qwen3(nnx.Module):
    """Qwen3ForCausalLM; call it on tokens (with or without a cache), `logits` on hidden states."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs, param_dtype=None):
        param_dtype = jnp.dtype(param_dtype or cfg.dtype)
        self.cfg = cfg
        self.embed_tokens = Embed(
            cfg.vocab_size, cfg.hidden_size, rngs=rngs, param_dtype=param_dtype
        )
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, rngs=rngs, param_dtype=param_dtype)
                for _ in range(cfg.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs, param_dtype=param_dtype)
        )

    @property
    def dtype(self):
        return jnp.dtype(self.cfg.dtype)

    def new_cache(
        self, num_slots: int, max_len: int, page_size: int = 16, impl: str | None = None
    ) -> PagedCache:
        """A paged cache where each of `num_slots` slots owns pages for `max_len` positions."""
        return new_cache(self.cfg, num_slots, max_len, self.dtype, page_size, impl)

    def __call__(self, tokens_bt, tap_layer_ids: tuple[int, ...] = ()) -> TargetOutput:
        """The decoder over whole sequences at positions 0..T-1, causal (training, parity
        checks): hidden [B, T, D], taps [B, T, F]. Attention is `layers.causal_attention`, so
        no [T, T] mask or score tensor is built where cuDNN runs it.

        `tap_layer_ids` follow the transformers `hidden_states` convention shifted by one: -1 is
        the embedding output and i the output of layer i.
        """
        b, t = tokens_bt.shape
        positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
        x_btd = self.embed_tokens(tokens_bt, self.dtype)
        layer_out_btd = {-1: x_btd}
        run = _layer_program("__call__")
        for i, layer in enumerate(self.layers):
            x_btd = run(*nnx.split(layer), x_btd, positions_bt)
            layer_out_btd[i] = x_btd
        taps_btf = (
            jnp.concatenate([layer_out_btd[i] for i in tap_layer_ids], axis=-1)
            if tap_layer_ids
            else None
        )
        return TargetOutput(self.norm(x_btd), taps_btf, None)

    def paged_forward(
        self, tokens_t, batch: TokenBatch, cache: PagedCache, tap_layer_ids: tuple[int, ...] = ()
    ) -> TargetOutput:
        """Runs the decoder over a packed batch (prefill chunks and verification alike).

        Token t sits at position batch.pos_t[t] of slot batch.slot_t[t] and attends causally to
        its slot's keys: those in the cache before its sequence's new tokens, and the new tokens
        of this batch. Returns hidden states [T, D], taps [T, F] and every layer's new keys and
        values, which `paged.write` stores (the cache itself is only read here). Rolling a slot
        back (rejected drafts) is only a matter of the lengths its next batch states: keys past
        them are never read and are overwritten later.
        """
        emb_1td = self.embed_tokens(tokens_t[None], self.dtype)
        x_1td, outs, new_kv = paged_layers(self.layers, emb_1td, batch, cache)
        layer_out = {-1: emb_1td, **dict(enumerate(outs))}
        taps_tf = (
            jnp.concatenate([layer_out[i][0] for i in tap_layer_ids], axis=-1)
            if tap_layer_ids
            else None
        )
        return TargetOutput(self.norm(x_1td[0]), taps_tf, new_kv)

    def logits(self, hidden_xd):
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.attend(hidden_xd).astype(jnp.float32)
