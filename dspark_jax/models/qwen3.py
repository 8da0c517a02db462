"""The Qwen3 target: causal decoder with a KV cache and hidden-state taps for the drafter."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import Qwen3Config
from dspark_jax.models import paged
from dspark_jax.models.layers import MLP, Attention, Embed, KVCache, RMSNorm, attention, write_rows
from dspark_jax.models.paged import PagedCache, TokenBatch


class DecoderLayer(nnx.Module):
    """Pre-norm attention and SwiGLU MLP blocks, each with a residual connection."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.self_attn = Attention(cfg, rngs=rngs, param_dtype=param_dtype)
        self.mlp = MLP(cfg, rngs=rngs, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype
        )

    def __call__(self, x_btd, positions_bt, mask_fn, cache_kv, key_window=None):
        """`cache_kv` is (k_bshd, v_bshd, start_b) or None for a cache-free causal forward.

        `key_window` (static) limits attention to the first cache positions.
        """
        h = self.input_layernorm(x_btd)
        q = self.self_attn.query(h, positions_bt)
        k, v = self.self_attn.key_value(h, positions_bt)
        if cache_kv is not None:
            k_cache, v_cache, start_b = cache_kv
            k_cache, v_cache = write_rows(k_cache, k, start_b), write_rows(v_cache, v, start_b)
            k, v = k_cache[:, :key_window], v_cache[:, :key_window]
            cache_kv = (k_cache, v_cache)
        o = attention(q, k, v, mask_fn(k.shape[1]), self.self_attn.scale)
        x_btd = x_btd + self.self_attn.output(o)
        x_btd = x_btd + self.mlp(self.post_attention_layernorm(x_btd))
        return x_btd, cache_kv

    def paged(self, x_1td, batch: TokenBatch, cache: PagedCache, layer_pages, causal: bool = True):
        """The layer over a packed batch: its keys/values are written to `layer_pages` first, then
        every token attends to its sequence's keys (causally for the target's own tokens)."""
        positions_1t = batch.pos_t[None]
        h = self.input_layernorm(x_1td)
        q = self.self_attn.query(h, positions_1t)
        k, v = self.self_attn.key_value(h, positions_1t)
        layer_pages = paged.write(cache, layer_pages, k[0], v[0], batch)
        o = paged.attend(cache, layer_pages, q[0], batch, scale=self.self_attn.scale, causal=causal)
        x_1td = x_1td + self.self_attn.output(o[None])
        x_1td = x_1td + self.mlp(self.post_attention_layernorm(x_1td))
        return x_1td, layer_pages


class TargetOutput(NamedTuple):
    hidden_btd: jax.Array  # final hidden state after the final norm (what lm_head reads)
    taps_btf: jax.Array | None  # concatenated hidden states of the tapped layers
    cache: KVCache | None


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

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.init(self.cfg, batch, max_len)

    def __call__(
        self,
        tokens_bt,
        cache: KVCache | None = None,
        tap_layer_ids: tuple[int, ...] = (),
        key_window: int | None = None,
    ) -> TargetOutput:
        """Runs the decoder over `tokens_bt`.

        Without a cache: positions 0..T-1 with a causal mask (training, parity checks). With a
        cache: row b's tokens sit at positions cache.lengths[b] + t, are written into the cache
        and attend to everything before them; the returned cache has lengths + T (callers that
        padded or later reject tokens set `lengths` themselves). A prefill into an empty cache
        can pass `key_window=T` so attention reads T keys instead of the whole cache.
        `tap_layer_ids` follow the transformers `hidden_states` convention shifted by one: -1 is
        the embedding output and i the output of layer i.
        """
        b, t = tokens_bt.shape
        start_b = cache.lengths if cache is not None else jnp.zeros((b,), jnp.int32)
        positions_bt = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

        def mask_fn(num_keys):
            return jnp.arange(num_keys)[None, None, :] <= positions_bt[:, :, None]

        x_btd = self.embed_tokens(tokens_bt, self.dtype)
        layer_out_btd = {-1: x_btd}
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else (cache.k[i], cache.v[i], start_b)
            x_btd, layer_cache = layer(x_btd, positions_bt, mask_fn, layer_cache, key_window)
            if layer_cache is not None:
                new_k.append(layer_cache[0])
                new_v.append(layer_cache[1])
            layer_out_btd[i] = x_btd
        taps_btf = (
            jnp.concatenate([layer_out_btd[i] for i in tap_layer_ids], axis=-1)
            if tap_layer_ids
            else None
        )
        if cache is not None:
            cache = cache.replace(k=tuple(new_k), v=tuple(new_v), lengths=start_b + t)
        return TargetOutput(self.norm(x_btd), taps_btf, cache)

    def paged_forward(
        self, tokens_t, batch: TokenBatch, cache: PagedCache, tap_layer_ids: tuple[int, ...] = ()
    ) -> TargetOutput:
        """Runs the decoder over a packed batch (prefill chunks and verification alike).

        Token t sits at position batch.pos_t[t] of slot batch.slot_t[t]; its keys and values are
        written into the slot's pages (padding tokens write nothing) and it attends causally to
        its slot's keys. Returns hidden states [T, D], taps [T, F] and the updated cache.
        """
        x_1td = self.embed_tokens(tokens_t[None], self.dtype)
        layer_out = {-1: x_1td}
        pages = []
        for i, layer in enumerate(self.layers):
            x_1td, layer_pages = layer.paged(x_1td, batch, cache, cache.pages[i])
            pages.append(layer_pages)
            layer_out[i] = x_1td
        taps_tf = (
            jnp.concatenate([layer_out[i][0] for i in tap_layer_ids], axis=-1)
            if tap_layer_ids
            else None
        )
        return TargetOutput(self.norm(x_1td[0]), taps_tf, cache.replace(pages=tuple(pages)))

    def logits(self, hidden_xd):
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.attend(hidden_xd).astype(jnp.float32)
