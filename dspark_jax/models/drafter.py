"""The DSpark drafter: a DFlash-style parallel backbone with KV injection plus sequential heads.

One block is [anchor, MASK x (gamma-1)] at positions start..start+gamma-1; output k predicts the
token at start+k+1. Every layer's keys/values are [k/v_proj(context) ; k/v_proj(block)], where the
context is hidden_norm(fc(target taps)) at absolute positions 0..start-1. Context K/V depend only
on the context features, so inference caches them in pages (`paged.PagedCache`, sharing the
target's page table) and appends new ones each round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.models import paged
from dspark_jax.models.heads import ConfidenceHead, MarkovHead
from dspark_jax.models.layers import Embed, Linear, RMSNorm, attention, target_backend
from dspark_jax.models.paged import PagedCache, TokenBatch, new_cache
from dspark_jax.models.qwen3 import DecoderLayer, paged_layers
from dspark_jax.sampling import (
    RowSampling,
    SamplingConfig,
    logprobs_and_argmax,
    sample_from_logprobs,
)


class DrafterLayer(DecoderLayer):
    """A Qwen3 layer whose block queries attend to injected context K/V and the whole block."""

    def __call__(self, x_btd, positions_bt, ctx_k_bshd, ctx_v_bshd, mask_bts):
        h = self.input_layernorm(x_btd)
        q = self.self_attn.query(h, positions_bt)
        k, v = self.self_attn.key_value(h, positions_bt)
        k = jnp.concatenate([ctx_k_bshd.astype(k.dtype), k], axis=1)
        v = jnp.concatenate([ctx_v_bshd.astype(v.dtype), v], axis=1)
        o = attention(q, k, v, mask_bts, self.self_attn.scale)
        x_btd = x_btd + self.self_attn.output(o)
        return x_btd + self.mlp(self.post_attention_layernorm(x_btd))


class DraftBlock(NamedTuple):
    tokens_bk: jax.Array  # sampled draft tokens
    logits_bkv: jax.Array  # Markov-corrected logits (float32)
    logprobs_bkv: jax.Array  # the filtered distribution each token was drawn from (float32)
    conf_logits_bk: jax.Array | None  # pre-sigmoid confidence, None without a confidence head


class DSparkDrafter(nnx.Module):
    """The drafter: backbone (`draft_hidden`), context cache, Markov and confidence heads."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, param_dtype=None):
        m = cfg.model
        param_dtype = jnp.dtype(param_dtype or m.dtype)
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        self.embed_tokens = Embed(m.vocab_size, m.hidden_size, **kw)
        self.layers = nnx.List([DrafterLayer(m, **kw) for _ in range(m.num_hidden_layers)])
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps, param_dtype=param_dtype)
        self.fc = Linear(cfg.num_context_features, m.hidden_size, axes=("context", "embed"), **kw)
        self.hidden_norm = RMSNorm(m.hidden_size, m.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = Embed(m.vocab_size, m.hidden_size, **kw)
        self.markov_head = (
            MarkovHead(cfg.markov_head_type, m.vocab_size, cfg.markov_rank, m.hidden_size, **kw)
            if cfg.has_markov_head
            else None
        )
        self.confidence_head = (
            ConfidenceHead(
                m.hidden_size, cfg.markov_rank if cfg.confidence_head_with_markov else 0, **kw
            )
            if cfg.enable_confidence_head
            else None
        )

    @property
    def dtype(self):
        return jnp.dtype(self.cfg.model.dtype)

    # -- context ---------------------------------------------------------------------------
    def context_kv(self, features_bsf, positions_bs):
        """Per-layer (k, v) of projected target features at their absolute positions."""
        ctx = self.hidden_norm(self.fc(features_bsf.astype(self.dtype)))
        return [layer.self_attn.key_value(ctx, positions_bs) for layer in self.layers]

    def new_context_cache(
        self, num_slots: int, max_len: int, page_size: int = 16, impl: str | None = None
    ) -> PagedCache:
        """A paged context cache where each slot owns pages for `max_len` positions."""
        return new_cache(self.cfg.model, num_slots, max_len, self.dtype, page_size, impl)

    def packed_context_kv(self, features_tf, batch: TokenBatch) -> tuple:
        """Every layer's context keys and values, stacked [2, T, KV, D], of packed target
        features at their positions, to be written into the context cache (`paged.write`)."""
        kv = self.context_kv(features_tf[None], batch.pos_t[None])
        return tuple(paged.stack_kv(k[0], v[0]) for k, v in kv)

    def append_context(self, cache: PagedCache, features_tf, batch: TokenBatch) -> PagedCache:
        """Writes the context K/V of packed target features at their slots and positions."""
        return paged.write(cache, self.packed_context_kv(features_tf, batch), batch)

    def draft_hidden(self, anchor_s, start_s, live_s, cache: PagedCache, slots_s=None):
        """Backbone over one block per row at positions start_s.. -> h [S, gamma, D].

        The block attends bidirectionally to its slot's context (the cached positions before
        start_s) and to the whole block, whose keys and values are never stored: the next
        round's context append overwrites those positions with the target's features. Rows that
        are not live attend to nothing. Row s reads the context of slot `slots_s[s]` (None: slot
        s), so a few rows can draft for chosen slots of a larger cache.
        """
        gamma = self.cfg.block_size
        num_rows = anchor_s.shape[0]
        if slots_s is None:
            slots_s = jnp.arange(num_rows, dtype=jnp.int32)
        row_t = jnp.repeat(jnp.arange(num_rows, dtype=jnp.int32), gamma)
        offset_t = jnp.tile(jnp.arange(gamma, dtype=jnp.int32), num_rows)
        batch = TokenBatch(
            slot_t=jnp.asarray(slots_s, jnp.int32)[row_t],
            pos_t=start_s[row_t] + offset_t,
            valid_t=live_s[row_t],
            seq_slot_n=jnp.asarray(slots_s, jnp.int32),
            cu_q_lens_n1=jnp.arange(num_rows + 1, dtype=jnp.int32) * gamma,
            kv_lens_n=jnp.where(live_s, start_s + gamma, 0).astype(jnp.int32),
            num_seqs=jnp.int32(num_rows),
            max_seq_tokens=gamma,
        )
        x_1td = self.embed_tokens(self.block_tokens(anchor_s).reshape(1, -1), self.dtype)
        x_1td, _, _ = paged_layers(self.layers, x_1td, batch, cache, causal=False)
        return self.norm(x_1td[0]).reshape(num_rows, gamma, -1)

    # -- backbone --------------------------------------------------------------------------
    def backbone(self, tokens_bt, positions_bt, ctx_k, ctx_v, mask_bts):
        """Block hidden states (after the final norm). `mask_bts` covers [context ; block] keys."""
        x = self.embed_tokens(tokens_bt, self.dtype)
        for layer, k, v in zip(self.layers, ctx_k, ctx_v, strict=True):
            x = layer(x, positions_bt, k, v, mask_bts)
        return self.norm(x)

    def block_tokens(self, anchor_b):
        gamma = self.cfg.block_size
        masks = jnp.full((anchor_b.shape[0], gamma - 1), self.cfg.mask_token_id, jnp.int32)
        return jnp.concatenate([anchor_b[:, None].astype(jnp.int32), masks], axis=1)

    def base_logits(self, h_xd):
        return self.lm_head.attend(h_xd)

    # -- heads -----------------------------------------------------------------------------
    def _prev_emb(self, prev_tokens):
        if self.markov_head is None:
            return None
        return self.markov_head.embed_prev(prev_tokens, self.dtype)

    def confidence_logits(self, h_bkd, prev_bk):
        if self.confidence_head is None:
            return None
        prev_emb = self._prev_emb(prev_bk) if self.cfg.confidence_head_with_markov else None
        return self.confidence_head(h_bkd, prev_emb)

    def sample_block(
        self,
        h_bkd,
        anchor_b,
        keys_bk,
        sampling: SamplingConfig | RowSampling,
        unroll: bool | None = None,
        adjust: Callable[[jax.Array], jax.Array] | None = None,
    ) -> DraftBlock:
        """Left-to-right sampling with the Markov bias (`lax.scan` over block positions).

        keys_bk[:, k] is the key of draft slot k of each request (unused by greedy rows);
        `sampling` is one config for all rows or per-row settings [B]. `adjust`, where given,
        maps every position's logits [B, V] to the float32 logits that are filtered (the
        engine's penalties and logit bias of each request, `engine._draft_adjustments`).

        `unroll` (None: for a GPU, `layers.target_backend()`) writes the positions out one
        after another. On a GPU a loop's step costs kernels of its own -- its test and counter,
        slicing each position's keys, stacking its outputs, the per-row settings recomputed
        inside the body -- about 7 of the 16 a position launches at 1 slot (47 kernels a round
        less compiled for an H100, at 1 and at 64 slots). Elsewhere the loop stays: on the CPU
        the written-out positions cost compile time (a tenth more for the engine's tests) and
        save nothing measurable. The same tokens and log-probabilities either way.
        """
        # The lm head over the block positions in the scan's order ([K, B, V]): its [B, K, V]
        # output swapped for the scan would be a transposed float32 copy of every draft
        # logit (272 MB a round at 64 slots, gamma 7 and Qwen3's vocabulary).
        base_kbv = self.base_logits(jnp.swapaxes(h_bkd, 0, 1))
        b = anchor_b.shape[0]
        rows_b = (
            RowSampling.from_config(sampling, (b,))
            if isinstance(sampling, SamplingConfig)
            else sampling
        )
        head = self.markov_head
        state0 = head.init_state((b,), self.dtype) if head is not None else jnp.zeros((b, 0))

        def body(carry, xs):
            prev_b, state = carry
            base_bv, h_bd, keys_b = xs
            logits_bv = base_bv
            if head is not None:
                bias_bv, state = head.step(head.embed_prev(prev_b, self.dtype), h_bd, state)
                logits_bv = base_bv + bias_bv
            if adjust is not None:
                logits_bv = adjust(logits_bv)
            logprobs_bv, best_b = logprobs_and_argmax(logits_bv, rows_b)
            token_b = sample_from_logprobs(keys_b, logprobs_bv, rows_b.greedy, best_b)
            return (token_b, state), (token_b, logits_bv, logprobs_bv)

        xs = (base_kbv, jnp.swapaxes(h_bkd, 0, 1), jnp.swapaxes(keys_bk, 0, 1))
        _, (tokens_kb, logits_kbv, logprobs_kbv) = jax.lax.scan(
            body,
            (anchor_b.astype(jnp.int32), state0),
            xs,
            unroll=target_backend() == "gpu" if unroll is None else bool(unroll),
        )
        tokens_bk = jnp.swapaxes(tokens_kb, 0, 1)
        prev_bk = jnp.concatenate([anchor_b[:, None].astype(jnp.int32), tokens_bk[:, :-1]], axis=1)
        return DraftBlock(
            tokens_bk,
            jnp.swapaxes(logits_kbv, 0, 1),
            jnp.swapaxes(logprobs_kbv, 0, 1),
            self.confidence_logits(h_bkd, prev_bk),
        )

    def teacher_forced(self, h_bkd, prev_bk):
        """(corrected logits, confidence logits) with the true previous tokens (training)."""
        logits = self.base_logits(h_bkd)
        if self.markov_head is not None:
            logits = logits + self.markov_head.teacher_forced(self._prev_emb(prev_bk), h_bkd)
        return logits, self.confidence_logits(h_bkd, prev_bk)
