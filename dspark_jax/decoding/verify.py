"""Lossless verification of draft tokens (Leviathan et al. 2023 / Chen et al. 2023), batched.

Shapes: b = request, k = draft slot 0..gamma-1, j = target row 0..gamma, v = vocabulary,
s = stop-token list. Target row j is the target's distribution for the token after
[anchor, x_1..x_j], so it checks draft slot j, and row lengths_b[b] supplies the bonus token.
Draft slot k and target row j sit at absolute positions positions_b + k and positions_b + j; all
randomness comes from `position_keys` at those positions, so a request's outcome depends only on
its own key, inputs and positions. The drafter should sample slot k with
`position_keys(keys_b, positions_b + k, STREAM_DRAFT)`; acceptance uniforms use STREAM_ACCEPT and
the correction or bonus token STREAM_RESIDUAL at its own position, so every committed token at a
position is drawn from that position's keys only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.sampling import (
    PAD_TOKEN,
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    RowSampling,
    SamplingConfig,
    as_rows,
    filtered_logprobs,
    position_keys,
    sample_from_logprobs,
)


class VerifyShapeError(ValueError):
    """verify() inputs have inconsistent shapes."""


class VerifyResult(NamedTuple):
    """Outcome of one verification round.

    num_accepted_b: leading drafts accepted by rejection sampling (before stop truncation).
    tokens_bj: [B, gamma+1] committed tokens, left-aligned (accepted drafts, then the correction
        or bonus token), cut after the first stop token; PAD_TOKEN past num_committed_b.
    num_committed_b: committed tokens, 1..num_accepted_b+1.
    next_token_b: the last committed token (the next anchor).
    stopped_b: a stop token was committed.
    accepted_bk: draft slot k was accepted (k < num_accepted_b).
    accept_prob_bk: min(1, p_t/p_d) of draft slot k (1/0 for greedy match/mismatch); 0 for slots
        beyond lengths_b.
    """

    num_accepted_b: jax.Array
    tokens_bj: jax.Array
    num_committed_b: jax.Array
    next_token_b: jax.Array
    stopped_b: jax.Array
    accepted_bk: jax.Array
    accept_prob_bk: jax.Array


def _accept_slots(
    target_logp_bk: jax.Array, draft_logp_bk: jax.Array, log_u_bk: jax.Array
) -> jax.Array:
    """Accept slot k iff u < p_t(x_k) / p_d(x_k), in log space so p_d(x) = 0 does not divide."""
    return log_u_bk + draft_logp_bk < target_logp_bk


def _correction_logprobs(
    target_logp_bv: jax.Array, draft_logp_bv: jax.Array, rejected_b: jax.Array
) -> jax.Array:
    """Log of normalize(max(p_t - p_d, 0)) on rejected rows, p_t on the others (bonus)."""
    draft_p_bv = jnp.where(rejected_b[:, None], jnp.exp(draft_logp_bv), 0.0)
    residual_bv = jnp.maximum(jnp.exp(target_logp_bv) - draft_p_bv, 0.0)
    # p_t <= p_d everywhere means p_t == p_d up to rounding, where a rejection is a rounding
    # artefact; p_t is then the exact residual's limit.
    empty_b1 = jnp.sum(residual_bv, axis=-1, keepdims=True) <= 0.0
    return jnp.where(empty_b1, target_logp_bv, jnp.log(residual_bv))


def verify(
    draft_tokens_bk: jax.Array,
    draft_logprobs_bkv: jax.Array,
    target_logits_bjv: jax.Array,
    lengths_b: jax.Array,
    keys_b: jax.Array,
    positions_b: jax.Array,
    cfg: SamplingConfig | RowSampling,
    stop_tokens_s: jax.Array,
) -> VerifyResult:
    """Accept a prefix of each request's drafts and commit one target-sampled token after it.

    The rectangular form of `verify_packed`: target row j of request b is target_logits_bjv[b, j].
    lengths_b (0..gamma) drafts of row b are verified; slots and rows past it are ignored.
    draft_logprobs_bkv are the log-probabilities the drafts were sampled from (`filtered_logprobs`
    of the draft logits under the same cfg), passed in rather than recomputed so that a token on a
    top-p boundary is judged under exactly the distribution it was drawn from. Greedy rows
    compare drafts with the target argmax and ignore draft_logprobs_bkv and keys_b.
    stop_tokens_s is int32 [S] (shared) or [B, S] (per request), padded with negative ids.
    """
    batch, gamma = draft_tokens_bk.shape
    if gamma < 1:
        raise VerifyShapeError(f"draft_tokens_bk needs at least one draft slot, got {gamma}")
    if target_logits_bjv.shape[:2] != (batch, gamma + 1):
        raise VerifyShapeError(
            f"target_logits_bjv must be [B, gamma+1, V] = [{batch}, {gamma + 1}, V] for "
            f"draft_tokens_bk {draft_tokens_bk.shape}, got {target_logits_bjv.shape}"
        )
    vocab = target_logits_bjv.shape[-1]
    rows_bj = jnp.arange(batch * (gamma + 1), dtype=jnp.int32).reshape(batch, gamma + 1)
    rows = as_rows(cfg, (batch,))
    target_logp_tv = filtered_logprobs(
        target_logits_bjv.reshape(batch * (gamma + 1), vocab),
        rows.take(rows_bj.reshape(-1) // (gamma + 1)),
    )
    return verify_packed(
        draft_tokens_bk,
        draft_logprobs_bkv,
        target_logp_tv,
        rows_bj,
        lengths_b,
        keys_b,
        positions_b,
        rows,
        stop_tokens_s,
    )


def verify_packed(
    draft_tokens_bk: jax.Array,
    draft_logprobs_bkv: jax.Array,
    target_logp_tv: jax.Array,
    rows_bj: jax.Array,
    lengths_b: jax.Array,
    keys_b: jax.Array,
    positions_b: jax.Array,
    sampling_b: RowSampling,
    stop_tokens_s: jax.Array,
) -> VerifyResult:
    """`verify` over target distributions kept in a packed token axis.

    target_logp_tv [T, V] holds `filtered_logprobs` of the target's logits for every verified
    token of the batch, each under its own request's settings; rows_bj[b, j] is the packed row of
    request b's target row j (read only for j <= lengths_b[b]). Nothing of size B x gamma x V is
    built from the target side: only the gathered log-probabilities of the drafts and one row per
    request (where it stops) are read.
    """
    batch, gamma = draft_tokens_bk.shape
    vocab = target_logp_tv.shape[-1]
    if draft_logprobs_bkv.shape != (batch, gamma, vocab):
        raise VerifyShapeError(
            f"draft_logprobs_bkv must be [B, gamma, V] = {(batch, gamma, vocab)}, "
            f"got {draft_logprobs_bkv.shape}"
        )
    if rows_bj.shape != (batch, gamma + 1):
        raise VerifyShapeError(f"rows_bj must be [B, gamma+1], got {rows_bj.shape}")
    for name, arr in (("lengths_b", lengths_b), ("positions_b", positions_b)):
        if jnp.shape(arr) != (batch,):
            raise VerifyShapeError(f"{name} must be [B] = [{batch}], got {jnp.shape(arr)}")

    lengths_b = jnp.clip(lengths_b, 0, gamma).astype(jnp.int32)
    positions_b = jnp.asarray(positions_b, jnp.int32)
    greedy_b = sampling_b.greedy
    slot_k = jnp.arange(gamma, dtype=jnp.int32)
    valid_bk = slot_k < lengths_b[:, None]
    # Padding slots may hold anything, including ids outside the vocabulary.
    safe_drafts_bk = jnp.where(valid_bk, draft_tokens_bk, 0).astype(jnp.int32)
    rows_bj = jnp.clip(rows_bj, 0, target_logp_tv.shape[0] - 1)

    target_logp_bk = target_logp_tv[rows_bj[:, :gamma], safe_drafts_bk]
    draft_logp_bkv = draft_logprobs_bkv.astype(jnp.float32)
    draft_logp_bk = jnp.take_along_axis(draft_logp_bkv, safe_drafts_bk[..., None], axis=-1)[..., 0]

    accept_keys_bk = position_keys(keys_b, positions_b[:, None] + slot_k, STREAM_ACCEPT)
    uniform = jax.vmap(jax.vmap(lambda key: jax.random.uniform(key, dtype=jnp.float32)))
    log_u_bk = jnp.log(uniform(accept_keys_bk))
    # A greedy target's log-probabilities are 0 at its argmax and -inf elsewhere.
    match_bk = target_logp_bk == 0.0
    sampled_accept_bk = _accept_slots(target_logp_bk, draft_logp_bk, log_u_bk)
    accept_bk = jnp.where(greedy_b[:, None], match_bk, sampled_accept_bk) & valid_bk
    accepted_bk = jnp.cumprod(accept_bk, axis=-1).astype(bool)
    num_accepted_b = jnp.sum(accepted_bk, axis=-1, dtype=jnp.int32)
    ratio_bk = jnp.exp(jnp.minimum(target_logp_bk - draft_logp_bk, 0.0))
    ratio_bk = jnp.where(greedy_b[:, None], match_bk.astype(jnp.float32), ratio_bk)
    accept_prob_bk = jnp.where(valid_bk, jnp.nan_to_num(ratio_bk, nan=0.0), 0.0)

    # Only the row where each request stops is needed: the first rejected slot, or the bonus
    # row lengths_b when every verified draft was accepted.
    target_row_bv = target_logp_tv[jnp.take_along_axis(rows_bj, num_accepted_b[:, None], 1)[:, 0]]
    draft_row_bv = jnp.take_along_axis(
        draft_logp_bkv, jnp.minimum(num_accepted_b, gamma - 1)[:, None, None], axis=1
    )[:, 0]
    rejected_b = (num_accepted_b < lengths_b) & ~greedy_b
    correction_logp_bv = _correction_logprobs(target_row_bv, draft_row_bv, rejected_b)
    residual_keys_b = position_keys(keys_b, positions_b + num_accepted_b, STREAM_RESIDUAL)
    last_token_b = sample_from_logprobs(residual_keys_b, correction_logp_bv, greedy_b)

    stop_bs = jnp.broadcast_to(
        stop_tokens_s if stop_tokens_s.ndim == 2 else stop_tokens_s[None],
        (batch, stop_tokens_s.shape[-1]),
    )
    row_j = jnp.arange(gamma + 1, dtype=jnp.int32)
    drafts_bj = jnp.pad(safe_drafts_bk, ((0, 0), (0, 1)))
    n_b1 = num_accepted_b[:, None]
    proposed_bj = jnp.where(row_j < n_b1, drafts_bj, last_token_b[:, None])
    in_range_bj = row_j <= n_b1
    is_stop_bj = in_range_bj & jnp.any(proposed_bj[..., None] == stop_bs[:, None, :], axis=-1)
    stopped_b = jnp.any(is_stop_bj, axis=-1)
    first_stop_b = jnp.where(stopped_b, jnp.argmax(is_stop_bj, axis=-1), num_accepted_b)
    num_committed_b = (first_stop_b + 1).astype(jnp.int32)
    tokens_bj = jnp.where(row_j < num_committed_b[:, None], proposed_bj, PAD_TOKEN)
    next_token_b = jnp.take_along_axis(tokens_bj, first_stop_b[:, None], axis=1)[:, 0]
    return VerifyResult(
        num_accepted_b=num_accepted_b,
        tokens_bj=tokens_bj.astype(jnp.int32),
        num_committed_b=num_committed_b,
        next_token_b=next_token_b.astype(jnp.int32),
        stopped_b=stopped_b,
        accepted_bk=accepted_bk,
        accept_prob_bk=accept_prob_bk,
    )
