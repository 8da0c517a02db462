"""DSpark / DFlash training loss as pure, jittable functions.

Shapes: b batch, l sequence, n anchors (blocks) per sequence, k block position (gamma of them),
v vocabulary.

A block with anchor p feeds [token_p, MASK x (gamma-1)] to the drafter; output k predicts the
token at p + k + 1 (the first label is the token after the anchor), and the target distribution
for that slot is the target's next-token distribution at position p + k. Training anchors are
drawn among positions whose token and next token are both assistant tokens. A block position is
supervised while every label up to it lies inside the sequence and in the loss mask (the prefix
mask), because under prefix verification nothing after an unsupervised slot can be accepted.

Every term is a weighted mean sum(w_k * m * term) / sum(w_k * m) over the batch, blocks and
positions, with w_k = exp(-k / decay) and m the prefix mask (DeepSpec's normalisation; the paper's
Section 3.3 writes the same weights as exp(-(k-1)/gamma) with k counted from 1).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """Mixing weights of the loss terms and the position-decay constant (hashable: jit-static)."""

    ce: float = 0.1
    l1: float = 0.9
    conf: float = 1.0
    decay: float = 4.0


DSPARK_WEIGHTS = LossWeights()
DFLASH_WEIGHTS = LossWeights(ce=1.0, l1=0.0, conf=0.0)


class BlockLabels(NamedTuple):
    """Teacher-forcing data of the sampled blocks."""

    labels_bnk: jax.Array
    label_valid_bnk: jax.Array
    prev_tokens_bnk: jax.Array
    prefix_mask_bnk: jax.Array


def decay_weights(gamma: int, decay: float, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Position weights w_k = exp(-k / decay), k = 0..gamma-1, [gamma]."""
    return jnp.exp(-jnp.arange(gamma, dtype=dtype) / decay)


def sample_anchors(
    key: jax.Array,
    loss_mask_bl: jax.Array,
    lengths_b: jax.Array,
    num_anchors: int,
) -> tuple[jax.Array, jax.Array]:
    """Uniformly random anchors without replacement, sorted ascending, per row.

    Candidates are positions p < length - 1 with loss_mask[p] and loss_mask[p + 1]. Rows with fewer
    candidates than `num_anchors` fill the tail with invalid anchors placed at l - 1, where every
    label falls outside the sequence, so `block_labels` gives them an all-zero prefix mask.
    Returns anchors_bn int32 and valid_bn bool.
    """
    b, seq_len = loss_mask_bl.shape
    in_mask_bl = loss_mask_bl.astype(bool)
    pos_l = jnp.arange(seq_len)
    next_in_mask_bl = jnp.pad(in_mask_bl[:, 1:], ((0, 0), (0, 1)))
    candidate_bl = in_mask_bl & next_in_mask_bl & (pos_l[None, :] + 1 < lengths_b[:, None])
    # The top num_anchors of i.i.d. uniform scores form a uniformly random subset of candidates.
    scores_bl = jnp.where(candidate_bl, jax.random.uniform(key, (b, seq_len)), -jnp.inf)
    k = min(num_anchors, seq_len)
    top_scores_bk, top_pos_bk = jax.lax.top_k(scores_bl, k)
    anchors_bk = jnp.where(jnp.isfinite(top_scores_bk), top_pos_bk, seq_len - 1)
    anchors_bn = jnp.pad(anchors_bk, ((0, 0), (0, num_anchors - k)), constant_values=seq_len - 1)
    # Valid anchors are at most l - 2, so sorting moves the invalid ones (l - 1) to the end.
    anchors_bn = jnp.sort(anchors_bn, axis=1).astype(jnp.int32)
    num_valid_b = jnp.minimum(candidate_bl.sum(axis=1), num_anchors)
    valid_bn = jnp.arange(num_anchors)[None, :] < num_valid_b[:, None]
    return anchors_bn, valid_bn


def gather_blocks(x_bl: jax.Array, anchors_bn: jax.Array, block_size: int) -> jax.Array:
    """x at positions anchor + k (k = 0..block_size-1), clipped to the sequence: [b, n, k, ...].

    Position anchor + k is where the target predicts label k, so this aligns target logits or
    final hidden states with the draft block. Clipped slots are masked out by the prefix mask.
    """
    b, seq_len = x_bl.shape[:2]
    n = anchors_bn.shape[1]
    pos_bnk = anchors_bn[:, :, None] + jnp.arange(block_size)[None, None, :]
    flat_pos = jnp.minimum(pos_bnk, seq_len - 1).reshape(b, n * block_size)
    flat_pos = flat_pos.reshape(flat_pos.shape + (1,) * (x_bl.ndim - 2))
    gathered = jnp.take_along_axis(x_bl, flat_pos, axis=1)
    return gathered.reshape((b, n, block_size) + x_bl.shape[2:])


def block_labels(
    tokens_bl: jax.Array,
    loss_mask_bl: jax.Array,
    anchors_bn: jax.Array,
    block_size: int,
) -> BlockLabels:
    """Labels, validity, teacher-forced previous tokens and the prefix mask of each block.

    labels[k] = token at anchor + k + 1 (an arbitrary in-sequence token where invalid);
    label_valid[k] = that position is inside the sequence and in the loss mask;
    prev_tokens = [anchor token, labels[0], ..., labels[k-2]] (the Markov heads' previous token);
    prefix_mask[k] = all(label_valid[:k + 1]).
    """
    seq_len = tokens_bl.shape[1]
    label_pos_bnk = anchors_bn[:, :, None] + 1 + jnp.arange(block_size)[None, None, :]
    labels_bnk = gather_blocks(tokens_bl, anchors_bn + 1, block_size)
    in_mask_bnk = gather_blocks(loss_mask_bl.astype(bool), anchors_bn + 1, block_size)
    label_valid_bnk = (label_pos_bnk < seq_len) & in_mask_bnk
    anchor_tokens_bn = jnp.take_along_axis(tokens_bl, anchors_bn, axis=1)
    prev_tokens_bnk = jnp.concatenate([anchor_tokens_bn[:, :, None], labels_bnk[:, :, :-1]], -1)
    prefix_mask_bnk = jnp.cumprod(label_valid_bnk.astype(jnp.int32), axis=-1).astype(bool)
    return BlockLabels(labels_bnk, label_valid_bnk, prev_tokens_bnk, prefix_mask_bnk)


def _masked_mean(x: jax.Array, w: jax.Array, axis: tuple[int, ...] | None = None) -> jax.Array:
    """sum(w * x) / sum(w) over `axis`, 0 where sum(w) is 0; slots with w = 0 are ignored even
    when x is infinite there (an unsupervised label the draft rules out)."""
    den = w.sum(axis=axis)
    safe_den = jnp.where(den > 0, den, 1.0)
    num = (w * jnp.where(w > 0, x, 0.0)).sum(axis=axis)
    return jnp.where(den > 0, num / safe_den, 0.0)


def dspark_loss(
    draft_logits_bnkv: jax.Array,
    target_logits_bnkv: jax.Array,
    labels_bnk: jax.Array,
    prefix_mask_bnk: jax.Array,
    conf_logits_bnk: jax.Array | None,
    weights: LossWeights = DSPARK_WEIGHTS,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """weights.ce * CE + weights.l1 * L1(p_d, p_t) + weights.conf * BCE(sigmoid(conf), c*).

    Computed in at least float32. p_t is the target's distribution at temperature 1 (no gradient);
    c* = clip(1 - 0.5 * ||p_d - p_t||_1, 0, 1) is a label: no gradient flows through it. DFlash is
    `DFLASH_WEIGHTS` with conf_logits None. Metrics (all without gradient):
      ce, l1, bce (if conf given): the weighted means entering the loss;
      accept_rate_k [gamma]: unweighted mean c* per position over supervised slots;
      tau: expected acceptance length, the mean over blocks with a supervised first slot of
        1 + sum_k prod_{i<=k} c*_i (products run over supervised slots only);
      conf_bias (if conf given): weighted mean of sigmoid(conf) - c*;
      acc_k0: accuracy of the draft argmax at k = 0; num_tokens: supervised slots.
    """
    if conf_logits_bnk is None and weights.conf != 0:
        raise ValueError(f"weights.conf = {weights.conf} needs conf_logits_bnk")
    draft_logits_bnkv = jnp.asarray(draft_logits_bnkv)
    gamma = draft_logits_bnkv.shape[2]
    dtype = jnp.promote_types(draft_logits_bnkv.dtype, jnp.float32)
    draft_logits_bnkv = draft_logits_bnkv.astype(dtype)
    target_logits_bnkv = jax.lax.stop_gradient(jnp.asarray(target_logits_bnkv, dtype))
    m_bnk = jnp.asarray(prefix_mask_bnk, dtype)
    w_bnk = decay_weights(gamma, weights.decay, dtype)[None, None, :] * m_bnk

    logp_d_bnkv = jax.nn.log_softmax(draft_logits_bnkv, axis=-1)
    p_d_bnkv = jnp.exp(logp_d_bnkv)
    p_t_bnkv = jax.nn.softmax(target_logits_bnkv, axis=-1)
    labels_bnk = jnp.asarray(labels_bnk, jnp.int32)
    ce_bnk = -jnp.take_along_axis(logp_d_bnkv, labels_bnk[..., None], axis=-1)[..., 0]
    l1_bnk = jnp.abs(p_d_bnkv - p_t_bnkv).sum(-1)
    tv_bnk = 0.5 * jnp.abs(jax.lax.stop_gradient(p_d_bnkv) - p_t_bnkv).sum(-1)
    c_star_bnk = jnp.clip(1.0 - tv_bnk, 0.0, 1.0)

    ce = _masked_mean(ce_bnk, w_bnk)
    l1 = _masked_mean(l1_bnk, w_bnk)
    loss = weights.ce * ce + weights.l1 * l1
    metrics = {"ce": ce, "l1": l1}
    if conf_logits_bnk is not None:
        x_bnk = jnp.asarray(conf_logits_bnk, dtype)
        # -[c log sigmoid(x) + (1 - c) log(1 - sigmoid(x))], stable for any x.
        bce_bnk = jnp.maximum(x_bnk, 0.0) - x_bnk * c_star_bnk + jnp.log1p(jnp.exp(-jnp.abs(x_bnk)))
        bce = _masked_mean(bce_bnk, w_bnk)
        loss = loss + weights.conf * bce
        metrics["bce"] = bce
        metrics["conf_bias"] = _masked_mean(jax.nn.sigmoid(x_bnk) - c_star_bnk, w_bnk)

    block_valid_bn = m_bnk[:, :, 0]
    survival_bnk = jnp.cumprod(c_star_bnk * m_bnk, axis=-1)
    correct_bn = jnp.argmax(draft_logits_bnkv[:, :, 0], axis=-1) == labels_bnk[:, :, 0]
    metrics["accept_rate_k"] = _masked_mean(c_star_bnk, m_bnk, axis=(0, 1))
    metrics["tau"] = _masked_mean(1.0 + survival_bnk.sum(-1), block_valid_bn)
    metrics["acc_k0"] = _masked_mean(correct_bn.astype(dtype), block_valid_bn)
    metrics["num_tokens"] = m_bnk.sum()
    metrics["loss"] = loss
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
