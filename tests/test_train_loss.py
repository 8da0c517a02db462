"""The training loss against an independent, plainly written NumPy implementation."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.training.loss import (
    DFLASH_WEIGHTS,
    DSPARK_WEIGHTS,
    LossWeights,
    block_labels,
    decay_weights,
    dspark_loss,
    gather_blocks,
    sample_anchors,
)


def softmax(x):
    z = np.exp(x - x.max())
    return z / z.sum()


def np_reference(draft, target, labels, prefix, conf, weights, label_draft=None):
    """The loss and metrics, one slot at a time in float64.

    c* is computed from `label_draft` (default `draft`): holding it fixed while `draft` moves
    gives the derivative of a loss whose confidence label is a constant.
    """
    label_draft = draft if label_draft is None else label_draft
    b, n, gamma, v = draft.shape
    sums = dict(ce=0.0, l1=0.0, bce=0.0, bias=0.0, den=0.0)
    acc_num = acc_den = tau_num = tau_den = 0.0
    c_sum = np.zeros(gamma)
    c_cnt = np.zeros(gamma)
    for i in range(b):
        for j in range(n):
            survival, tau = 1.0, 1.0
            for k in range(gamma):
                if not prefix[i, j, k]:
                    continue
                w = math.exp(-k / weights.decay)
                p_d = softmax(draft[i, j, k])
                p_t = softmax(target[i, j, k])
                tv = 0.5 * sum(abs(p_d[x] - p_t[x]) for x in range(v))
                p_label = softmax(label_draft[i, j, k])
                c = min(max(1.0 - 0.5 * sum(abs(p_label[x] - p_t[x]) for x in range(v)), 0.0), 1.0)
                sums["ce"] += w * -math.log(p_d[labels[i, j, k]])
                sums["l1"] += w * 2.0 * tv
                sums["den"] += w
                c_sum[k] += c
                c_cnt[k] += 1
                survival *= c
                tau += survival
                if conf is not None:
                    s = 1.0 / (1.0 + math.exp(-conf[i, j, k]))
                    sums["bce"] += w * -(c * math.log(s) + (1.0 - c) * math.log(1.0 - s))
                    sums["bias"] += w * (s - c)
            if prefix[i, j, 0]:
                tau_num += tau
                tau_den += 1
                acc_num += float(np.argmax(draft[i, j, 0]) == labels[i, j, 0])
                acc_den += 1
    den = sums["den"]
    out = dict(
        ce=sums["ce"] / den,
        l1=sums["l1"] / den,
        accept_rate_k=np.where(c_cnt > 0, c_sum / np.maximum(c_cnt, 1), 0.0),
        tau=tau_num / tau_den,
        acc_k0=acc_num / acc_den,
        num_tokens=float(prefix.sum()),
    )
    loss = weights.ce * out["ce"] + weights.l1 * out["l1"]
    if conf is not None:
        out["bce"] = sums["bce"] / den
        out["conf_bias"] = sums["bias"] / den
        loss += weights.conf * out["bce"]
    out["loss"] = loss
    return loss, out


def random_case(seed, b=2, n=3, gamma=4, v=11):
    rng = np.random.default_rng(seed)
    draft = rng.normal(size=(b, n, gamma, v)) * 2.0
    # Correlated target so that c* spreads over (0, 1) instead of sitting near 0.
    target = draft + rng.normal(size=draft.shape)
    labels = rng.integers(0, v, size=(b, n, gamma))
    valid = rng.random((b, n, gamma)) < 0.85
    prefix = np.cumprod(valid, axis=-1).astype(bool)
    prefix[0, 0] = True
    conf = rng.normal(size=(b, n, gamma)) * 1.5
    return draft, target, labels, prefix, conf


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_metrics_match_numpy_float32(seed):
    draft, target, labels, prefix, conf = random_case(seed)
    want_loss, want = np_reference(draft, target, labels, prefix, conf, DSPARK_WEIGHTS)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, metrics = jax.jit(dspark_loss)(
        f32(draft), f32(target), jnp.asarray(labels), jnp.asarray(prefix), f32(conf)
    )
    # float32 inputs vs float64 reference: rounding of the inputs and of ~100-term sums.
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(metrics[name]), value, rtol=1e-5, atol=1e-6)


def test_loss_matches_numpy_float64():
    draft, target, labels, prefix, conf = random_case(7)
    weights = LossWeights(ce=0.3, l1=0.5, conf=2.0, decay=2.5)
    want_loss, want = np_reference(draft, target, labels, prefix, conf, weights)
    with jax.enable_x64(True):
        loss, metrics = dspark_loss(draft, target, labels, prefix, conf, weights)
        assert loss.dtype == jnp.float64
        np.testing.assert_allclose(float(loss), want_loss, rtol=1e-12)
        for name, value in want.items():
            np.testing.assert_allclose(np.asarray(metrics[name]), value, rtol=1e-12, atol=1e-14)


def test_dflash_is_weighted_cross_entropy_only():
    draft, target, labels, prefix, _ = random_case(3)
    want_loss, want = np_reference(draft, target, labels, prefix, None, DFLASH_WEIGHTS)
    with jax.enable_x64(True):
        loss, metrics = dspark_loss(draft, target, labels, prefix, None, DFLASH_WEIGHTS)
    np.testing.assert_allclose(float(loss), want["ce"], rtol=1e-12)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-12)
    assert "bce" not in metrics and "conf_bias" not in metrics
    with pytest.raises(ValueError, match="conf_logits"):
        dspark_loss(draft, target, labels, prefix, None, DSPARK_WEIGHTS)


def _finite_difference(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    for idx in itertools.product(*map(range, x.shape)):
        hi, lo = x.copy(), x.copy()
        hi[idx] += eps
        lo[idx] -= eps
        grad[idx] = (f(hi) - f(lo)) / (2 * eps)
    return grad


def test_gradients_match_finite_differences_of_numpy_loss():
    draft, target, labels, prefix, conf = random_case(4, b=1, n=2, gamma=3, v=5)
    weights = DSPARK_WEIGHTS
    want_d = _finite_difference(
        lambda d: np_reference(d, target, labels, prefix, conf, weights, label_draft=draft)[0],
        draft,
    )
    want_c = _finite_difference(
        lambda c: np_reference(draft, target, labels, prefix, c, weights)[0], conf
    )
    # No |p_d - p_t| may be crossed by the +-1e-6 logit steps (a kink of the L1 term).
    p = lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True)  # noqa: E731
    assert np.abs(p(draft) - p(target)).min() > 1e-5

    def loss_fn(d, c):
        return dspark_loss(d, target, labels, prefix, c, weights)[0]

    with jax.enable_x64(True):
        got_d, got_c = jax.grad(loss_fn, argnums=(0, 1))(draft, conf)
    np.testing.assert_allclose(np.asarray(got_d), want_d, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(got_c), want_c, rtol=1e-6, atol=1e-9)
    # Masked-out slots get no gradient.
    assert not np.asarray(got_d)[~prefix].any() and not np.asarray(got_c)[~prefix].any()
    # float32 gradients agree with the float64 ones to float32 precision.
    got32_d, got32_c = jax.grad(loss_fn, argnums=(0, 1))(
        jnp.asarray(draft, jnp.float32), jnp.asarray(conf, jnp.float32)
    )
    np.testing.assert_allclose(np.asarray(got32_d), want_d, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got32_c), want_c, rtol=1e-4, atol=1e-6)


def test_confidence_label_carries_no_gradient():
    draft, target, labels, prefix, conf = random_case(5)
    conf_only = LossWeights(ce=0.0, l1=0.0, conf=1.0)
    with jax.enable_x64(True):
        grad_d, grad_c = jax.grad(
            lambda d, c: dspark_loss(d, target, labels, prefix, c, conf_only)[0], argnums=(0, 1)
        )(draft, conf)
        _, metrics = dspark_loss(draft, target, labels, prefix, conf, conf_only)
    assert not np.asarray(grad_d).any()
    # d BCE / d x = sigmoid(x) - c*, weighted: the label enters as a constant.
    w = np.exp(-np.arange(draft.shape[2]) / 4.0)[None, None, :] * prefix
    p = lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True)  # noqa: E731
    c_star = np.clip(1 - 0.5 * np.abs(p(draft) - p(target)).sum(-1), 0, 1)
    want = w * (1 / (1 + np.exp(-conf)) - c_star) / w.sum()
    np.testing.assert_allclose(np.asarray(grad_c), want, rtol=1e-12, atol=1e-15)
    assert float(metrics["bce"]) > 0


def test_empty_prefix_mask_gives_zero_loss_and_finite_gradients():
    draft, target, labels, prefix, conf = random_case(6)
    prefix = np.zeros_like(prefix)
    loss, metrics = dspark_loss(draft, target, labels, prefix, conf)
    assert float(loss) == 0.0
    assert all(np.isfinite(np.asarray(m)).all() for m in metrics.values())
    grad = jax.grad(lambda c: dspark_loss(draft, target, labels, prefix, c)[0])(conf)
    assert np.isfinite(np.asarray(grad)).all() and not np.asarray(grad).any()


def test_decay_weights():
    np.testing.assert_allclose(
        np.asarray(decay_weights(7, 4.0)), np.exp(-np.arange(7) / 4.0), rtol=1e-7
    )


def test_block_labels_hand_made():
    tokens = jnp.array([[10, 11, 12, 13, 14, 15, 16, 17]])
    loss_mask = jnp.array([[0, 0, 1, 1, 1, 0, 1, 1]], bool)
    anchors = jnp.array([[2, 3, 6, 7]], jnp.int32)
    got = block_labels(tokens, loss_mask, anchors, 3)
    np.testing.assert_array_equal(got.labels_bnk[0, :3], [[13, 14, 15], [14, 15, 16], [17, 17, 17]])
    np.testing.assert_array_equal(
        got.label_valid_bnk[0],
        [[1, 1, 0], [1, 0, 1], [1, 0, 0], [0, 0, 0]],
    )
    np.testing.assert_array_equal(
        got.prev_tokens_bnk[0, :3], [[12, 13, 14], [13, 14, 15], [16, 17, 17]]
    )
    np.testing.assert_array_equal(
        got.prefix_mask_bnk[0],
        [[1, 1, 0], [1, 0, 0], [1, 0, 0], [0, 0, 0]],
    )
    # Target logits for label k sit at anchor + k.
    x = jnp.arange(8 * 2).reshape(1, 8, 2)
    np.testing.assert_array_equal(gather_blocks(x, anchors, 3)[0, 1, :, 0], [6, 8, 10])


def _candidates(mask, length):
    return {p for p in range(len(mask) - 1) if mask[p] and mask[p + 1] and p + 1 < length}


def test_sample_anchors_valid_unique_sorted():
    rng = np.random.default_rng(0)
    b, seq_len, num_anchors = 16, 40, 8
    density = rng.uniform(0.05, 0.95, size=(b, 1))
    mask = rng.random((b, seq_len)) < density
    mask[0] = False
    lengths = rng.integers(1, seq_len + 1, size=b)
    lengths[1] = seq_len
    mask[1] = True
    sample = jax.jit(sample_anchors, static_argnums=3)
    for seed in range(5):
        anchors, valid = sample(jax.random.key(seed), jnp.asarray(mask), lengths, num_anchors)
        anchors, valid = np.asarray(anchors), np.asarray(valid)
        assert anchors.shape == valid.shape == (b, num_anchors) and anchors.dtype == np.int32
        for i in range(b):
            cand = _candidates(mask[i], lengths[i])
            chosen = anchors[i][valid[i]]
            assert valid[i].sum() == min(len(cand), num_anchors)
            assert set(chosen.tolist()) <= cand
            assert len(set(chosen.tolist())) == len(chosen)
            assert (np.diff(chosen) > 0).all()
            assert (anchors[i][~valid[i]] == seq_len - 1).all()
        # An invalid anchor's block is never supervised.
        labels = block_labels(jnp.zeros((b, seq_len), jnp.int32), mask, anchors, 4)
        assert not np.asarray(labels.prefix_mask_bnk)[~valid].any()
        assert np.asarray(labels.prefix_mask_bnk)[valid][:, 0].all()


def test_sample_anchors_more_anchors_than_positions():
    mask = jnp.ones((2, 5), bool)
    anchors, valid = sample_anchors(jax.random.key(0), mask, jnp.array([5, 3]), 8)
    np.testing.assert_array_equal(anchors[0, :4], [0, 1, 2, 3])
    np.testing.assert_array_equal(valid.sum(1), [4, 2])
    np.testing.assert_array_equal(anchors[1, :2], [0, 1])
    assert (np.asarray(anchors)[~np.asarray(valid)] == 4).all()


def test_sample_anchors_uniform_over_subsets():
    """Chi-square goodness of fit, 3000 draws of 2 anchors from 5 candidates, alpha = 0.001."""
    mask = jnp.array([[1, 1, 1, 0, 1, 1, 1, 1, 0, 0]], bool)
    cand = sorted(_candidates(np.asarray(mask[0]), 10))
    assert cand == [0, 1, 4, 5, 6]
    draws = 3000
    keys = jax.random.split(jax.random.key(123), draws)
    anchors, _ = jax.vmap(lambda k: sample_anchors(k, mask, jnp.array([10]), 2))(keys)
    pairs = [tuple(a) for a in np.asarray(anchors)[:, 0].tolist()]
    subsets = list(itertools.combinations(cand, 2))
    counts = np.array([pairs.count(s) for s in subsets])
    assert counts.sum() == draws
    expected = draws / len(subsets)
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 27.877  # chi-square 0.999 quantile, 9 degrees of freedom
