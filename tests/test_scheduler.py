"""Verification-length schedulers: Algorithm 1, its Section 5.2 variant and Appendix A."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.decoding import scheduler

# ------------------------------------------------------------------ helpers (NumPy references)


def _survival(conf_rk):
    """The survival products exactly as the scheduler computes them (float32 cumprod)."""
    return np.asarray(jnp.cumprod(jnp.asarray(conf_rk, jnp.float32), axis=1), np.float64)


def _sps(table, n_tokens):
    return float(table[n_tokens]) if 0 <= n_tokens < len(table) else 0.0


def _theta(a_rk, lengths, table, active=None):
    active = np.ones(a_rk.shape[0], bool) if active is None else np.asarray(active, bool)
    n_req = int(active.sum())
    tau = n_req + sum(a_rk[r, :n].sum() for r, n in enumerate(lengths) if active[r])
    return tau * _sps(table, n_req + int(np.sum(lengths)))


def _exhaustive_max(a_rk, table, active):
    """Best Theta over every length vector of the active requests, restricted to prefixes of
    positive survival (the paper's candidate space)."""
    n_pos = (a_rk > 0).sum(axis=1) * np.asarray(active, bool)
    return max(
        _theta(a_rk, ls, table, active)
        for ls in itertools.product(*(range(int(n) + 1) for n in n_pos))
    )


def _reference_alg1(a_rk, table, early_stop, active=None):
    """Algorithm 1 as written in the paper (a Python loop), ties ordered by (j, r)."""
    n_r, gamma = a_rk.shape
    active = np.ones(n_r, bool) if active is None else np.asarray(active, bool)
    cands = sorted(
        (-a_rk[r, j], j, r)
        for r in range(n_r)
        for j in range(gamma)
        if active[r] and a_rk[r, j] > 0
    )
    lengths = np.zeros(n_r, int)
    best_lengths = lengths.copy()
    n_tok = n_req = int(active.sum())
    tau = float(n_req)
    best = n_req * _sps(table, n_req)
    for neg_a, j, r in cands:
        assert lengths[r] == j, "admitted position j+1 before position j"
        lengths[r] = j + 1
        n_tok += 1
        tau += -neg_a
        theta = tau * _sps(table, n_tok)
        if theta > best:
            best, best_lengths = theta, lengths.copy()
        elif early_stop:
            break
    return best_lengths


def _is_unimodal(theta_path):
    """Strictly rising, then never above the last strict improvement."""
    theta = np.asarray(theta_path, np.float64)
    first_stop = next((i for i in range(1, len(theta)) if theta[i] <= theta[i - 1]), len(theta))
    return bool(np.all(theta[first_stop:] <= theta[first_stop - 1]))


_batched_schedule = jax.jit(
    jax.vmap(scheduler.prefix_schedule, in_axes=(0, 0, None, 0)), static_argnums=2
)


def _random_sizes(rng, n_inst, conf):
    """Realise R <= 3 and gamma <= 4 inside one [3, 4] shape (one compilation): requests past R
    are inactive and positions past gamma get confidence 0, which puts them outside the
    candidate space exactly as a shorter block would be."""
    n_r = rng.integers(1, 4, size=n_inst)
    gamma = rng.integers(1, 5, size=n_inst)
    active = np.arange(3)[None, :] < n_r[:, None]
    conf = np.where(np.arange(4)[None, None, :] < gamma[:, None, None], conf, 0.0)
    return conf.astype(np.float32), active


# ------------------------------------------------------------------ simple schedulers


def test_threshold_lengths():
    conf = jnp.array([[0.9, 0.5, 0.9], [0.4, 0.9, 0.9], [0.9, 0.9, 0.9]])
    np.testing.assert_array_equal(scheduler.threshold_lengths(conf, 0.6), [1, 0, 3])
    # cumulative: 0.9, 0.81, 0.729 against 0.75 -> 2
    np.testing.assert_array_equal(
        scheduler.threshold_lengths(conf, 0.75, cumulative=True), [1, 0, 2]
    )
    assert scheduler.threshold_lengths(conf, 0.6).dtype == jnp.int32


def test_tie_break_and_hand_example():
    # Equal survivals everywhere: order (r0,j1), (r1,j1), (r0,j2), (r1,j2), ...
    conf = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    table = jnp.array([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # room for 5 tokens = 2 anchors + 3
    np.testing.assert_array_equal(scheduler.prefix_schedule(conf, table), [2, 1])
    # Appendix A numbers: Theta path 1.0, 0.9, 1.134
    table = jnp.array([0.0, 1.0, 0.5, 0.45])
    np.testing.assert_allclose(
        scheduler.admission_throughput(jnp.array([[0.8, 0.9]]), table), [1.0, 0.9, 1.134], rtol=1e-6
    )
    assert int(scheduler.prefix_schedule(jnp.array([[0.8, 0.9]]), table)[0]) == 0
    assert int(scheduler.prefix_schedule(jnp.array([[0.8, 0.9]]), table, early_stop=False)[0]) == 2


def test_out_of_range_tokens_and_zero_survival_never_admitted():
    conf = jnp.array([[0.99, 0.99, 0.99], [0.99, 0.0, 0.9]])
    short = jnp.array([0.0, 1.0, 1.0, 1.0])  # no entry for 4+ tokens
    for early in (True, False):
        lengths = np.asarray(scheduler.prefix_schedule(conf, short, early_stop=early))
        assert lengths.sum() + 2 <= 3 and lengths[1] <= 1
    flat = jnp.ones(32)
    np.testing.assert_array_equal(scheduler.prefix_schedule(conf, flat, early_stop=False), [3, 1])


def test_inactive_requests_are_excluded():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.3, 1.0, size=(4, 3)).astype(np.float32)
    table = jnp.asarray(1.0 / (1.0 + 0.15 * np.arange(16)), jnp.float32)
    active = jnp.array([True, False, True, False])
    for early in (True, False):
        got = scheduler.prefix_schedule(jnp.asarray(conf), table, early, active_b=active)
        sub = scheduler.prefix_schedule(jnp.asarray(conf[[0, 2]]), table, early)
        np.testing.assert_array_equal(np.asarray(got)[[0, 2]], sub)
        np.testing.assert_array_equal(np.asarray(got)[[1, 3]], 0)
    none = scheduler.prefix_schedule(jnp.asarray(conf), table, active_b=jnp.zeros(4, bool))
    np.testing.assert_array_equal(none, 0)


# ------------------------------------------------------------------ Algorithm 1 vs references


def test_matches_paper_loop_with_ties():
    """Dyadic confidences and SPS values make every float32 sum and product exact, so ties in
    both survival and Theta are real ties; the jitted scheduler must reproduce the literal loop
    (which asserts that j is never admitted before j-1) on every instance."""
    rng = np.random.default_rng(1)
    n_inst = 600
    conf = rng.choice(
        [0.0, 0.25, 0.5, 0.75, 1.0], p=[0.05, 0.2, 0.25, 0.25, 0.25], size=(n_inst, 3, 4)
    )
    conf, active = _random_sizes(rng, n_inst, conf)
    tables = rng.integers(1, 17, size=(n_inst, 17)) / 16.0
    tables = (-np.sort(-tables, axis=1)).astype(np.float32)  # non-increasing, many repeats
    for early in (True, False):
        got = np.asarray(
            _batched_schedule(jnp.asarray(conf), jnp.asarray(tables), early, jnp.asarray(active))
        )
        for i in range(n_inst):
            want = _reference_alg1(_survival(conf[i]), tables[i], early, active[i])
            np.testing.assert_array_equal(got[i], want, err_msg=f"{conf[i]} {tables[i]}")


def test_real_shapes_match_paper_loop():
    rng = np.random.default_rng(5)
    for n_r, gamma in ((1, 1), (2, 3), (3, 4)):
        conf = rng.choice([0.25, 0.5, 0.75, 1.0], size=(n_r, gamma)).astype(np.float32)
        table = np.sort(rng.integers(1, 17, size=n_r * (gamma + 1) + 1))[::-1] / 16.0
        for early in (True, False):
            got = scheduler.prefix_schedule(jnp.asarray(conf), jnp.asarray(table), early)
            want = _reference_alg1(_survival(conf), table, early)
            np.testing.assert_array_equal(got, want)


def test_admitted_set_is_top_of_sorted_survivals():
    rng = np.random.default_rng(2)
    conf = rng.choice([0.5, 0.75, 1.0], size=(200, 3, 4)).astype(np.float32)
    tables = np.cumprod(rng.uniform(0.8, 1.0, size=(200, 20)), axis=1).astype(np.float32)
    for early in (True, False):
        lengths = np.asarray(
            _batched_schedule(
                jnp.asarray(conf), jnp.asarray(tables), early, jnp.ones((200, 3), bool)
            )
        )
        for i in range(200):
            a = _survival(conf[i])
            admitted = np.arange(4)[None, :] < lengths[i][:, None]
            if admitted.any() and (~admitted).any():
                assert a[admitted].min() >= a[~admitted].max()


def test_agrees_with_exhaustive_search_when_unimodal():
    """Along the admission path Theta is maximised over all length vectors (for a fixed token
    count the best choice is the top survivals), so the global variant always reaches the
    exhaustive optimum and the early-stop variant does whenever Theta is unimodal on the path."""
    rng = np.random.default_rng(3)
    n_inst = 480
    conf, active = _random_sizes(rng, n_inst, rng.uniform(0.05, 1.0, size=(n_inst, 3, 4)))
    n_tok = np.arange(17)
    # Half the tables have a linear step time (Theta unimodal by construction), half are one
    # cliff between flat plateaus, like a bucketed profile, so the unimodality check sees both.
    alpha, beta = rng.uniform(0.2, 1.0, size=(2, n_inst, 1))
    smooth = 1.0 / (alpha + beta * n_tok[None, :])
    cliff = rng.integers(2, 7, size=(n_inst, 1))
    drop = rng.uniform(0.7, 0.95, size=(n_inst, 1))
    jagged = np.where(n_tok[None, :] < cliff, 1.0, drop)
    tables = np.where(np.arange(n_inst)[:, None] % 2 == 0, smooth, jagged).astype(np.float32)
    conf_j, tables_j, active_j = jnp.asarray(conf), jnp.asarray(tables), jnp.asarray(active)
    early = np.asarray(_batched_schedule(conf_j, tables_j, True, active_j))
    glob = np.asarray(_batched_schedule(conf_j, tables_j, False, active_j))
    paths = np.asarray(
        jax.jit(jax.vmap(scheduler.admission_throughput))(conf_j, tables_j, active_j)
    )
    n_unimodal = n_multimodal = n_early_suboptimal = 0
    for i in range(n_inst):
        a = _survival(conf[i])
        best = _exhaustive_max(a, tables[i], active[i])
        theta_glob = _theta(a, glob[i], tables[i], active[i])
        assert theta_glob == pytest.approx(best, rel=1e-5)
        assert theta_glob == pytest.approx(paths[i].max(), rel=1e-5)
        theta_early = _theta(a, early[i], tables[i], active[i])
        if _is_unimodal(paths[i]):
            n_unimodal += 1
            assert theta_early == pytest.approx(best, rel=1e-5)
        else:
            n_multimodal += 1
            n_early_suboptimal += theta_early < best * (1 - 1e-5)
    # Both branches must be exercised; on a multimodal path the early stop is always short of
    # the later peak, which is exactly why Section 5.2 needs another way to search globally.
    assert n_unimodal >= 300 and n_multimodal >= 20
    assert n_early_suboptimal == n_multimodal


# ------------------------------------------------------------------ Section 5.2 variant


def test_top_k_and_capacity_from_history():
    rng = np.random.default_rng(4)
    conf = jnp.asarray(rng.uniform(0.2, 1.0, size=(5, 4)), jnp.float32)
    table = jnp.asarray(np.cumprod(rng.choice([1.0, 0.97, 0.7], size=40)), jnp.float32)
    glob = scheduler.prefix_schedule(conf, table, early_stop=False)
    k_cap = scheduler.capacity_from_history(conf, table)
    assert int(k_cap) == int(glob.sum())
    # Top-K with the same confidences and K from the global search reproduces the global search.
    np.testing.assert_array_equal(scheduler.top_k_schedule(conf, k_cap), glob)
    a = _survival(np.asarray(conf))
    for k in range(0, 22, 3):
        lengths = np.asarray(jax.jit(scheduler.top_k_schedule)(conf, k))
        assert lengths.sum() == min(k, 20)
        admitted = np.arange(4)[None, :] < lengths[:, None]
        if admitted.any() and (~admitted).any():
            assert a[admitted].min() >= a[~admitted].max()
    with_zero = jnp.array([[0.9, 0.0, 0.9], [0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(scheduler.top_k_schedule(with_zero, 6), [1, 3])


# ------------------------------------------------------------------ Appendix A, statistically

# The toy of Appendix A: one request, gamma = 2, vocabulary {A=0, B=1}. c_1 = 0.8 does not depend
# on the draft; c_2 depends on the sampled x_1 through the Markov feature (0.9 after A, 0 after
# B). The paper only specifies position 1; position 2's distributions below are ours, so that the
# joint law of the first two output tokens can be checked.
P_T1 = np.array([0.7, 0.3])
P_D1 = np.array([0.5, 0.5])
C2_GIVEN_X1 = np.array([0.9, 0.0])
P_T2 = np.array([[0.6, 0.4], [0.2, 0.8]])  # target at position 2 given token 1
P_D2 = np.array([[0.9, 0.1], [0.5, 0.5]])
APPENDIX_SPS = jnp.array([0.0, 1.0, 0.5, 0.45])  # SPS(1) = 1, SPS(2) = 0.5, SPS(3) = 0.45
ADMITTING_SPS = jnp.array([0.0, 1.0, 0.6, 0.45])  # early stop admits x_1, and x_2 only after A
N_SAMPLES = 40_000
ALPHA = 1e-3


def _categorical(rng, probs_n2):
    return (rng.uniform(size=probs_n2.shape[0]) >= probs_n2[:, 0]).astype(int)


def _residual(p_t, p_d):
    r = np.maximum(p_t - p_d, 0.0)
    return r / r.sum(axis=-1, keepdims=True)


def _simulate_two_tokens(rng, lengths, x1, x2):
    """First two output tokens of speculative decoding with verified lengths `lengths` (draft
    tokens x1, x2 already sampled). Tokens not produced by this round come from later rounds,
    which are lossless and therefore sample the target directly."""
    n = lengths.shape[0]
    y1 = _categorical(rng, np.broadcast_to(P_T1, (n, 2)))  # l = 0: target's own token
    acc1 = rng.uniform(size=n) < np.minimum(1.0, P_T1[x1] / P_D1[x1])
    res1 = _categorical(rng, np.broadcast_to(_residual(P_T1, P_D1), (n, 2)))
    y1 = np.where(lengths >= 1, np.where(acc1, x1, res1), y1)
    y2 = _categorical(rng, P_T2[y1])  # bonus token or next round
    verify2 = (lengths >= 2) & acc1
    acc2 = rng.uniform(size=n) < np.minimum(1.0, P_T2[x1, x2] / P_D2[x1, x2])
    res2 = _categorical(rng, _residual(P_T2, P_D2)[x1])
    y2 = np.where(verify2, np.where(acc2, x2, res2), y2)
    return y1, y2


def _draft(rng, n):
    x1 = _categorical(rng, np.broadcast_to(P_D1, (n, 2)))
    x2 = _categorical(rng, P_D2[x1])
    conf = np.stack([np.full(n, 0.8), C2_GIVEN_X1[x1]], axis=1)[:, None, :]  # [n, R=1, gamma=2]
    return x1, x2, jnp.asarray(conf, jnp.float32)


def _joint_p_value(y1, y2):
    """Chi-square goodness of fit (3 d.o.f.) of the (y1, y2) counts against the target law."""
    observed = np.bincount(2 * y1 + y2, minlength=4)
    expected = (P_T1[:, None] * P_T2).ravel() * y1.size
    return stats.chisquare(observed, expected).pvalue


def test_appendix_a_lengths_are_exactly_as_in_the_paper():
    for x1, want_global in ((0, 2), (1, 0)):
        conf = jnp.array([[0.8, C2_GIVEN_X1[x1]]])
        assert int(scheduler.prefix_schedule(conf, APPENDIX_SPS)[0]) == 0
        got = scheduler.prefix_schedule(conf, APPENDIX_SPS, early_stop=False)
        assert int(got[0]) == want_global


def test_appendix_a_early_stop_is_lossless_retrospective_is_biased():
    """N = 40,000 rounds per scheduler; chi-square test of the first two output tokens against
    the target at significance ALPHA = 0.001. Lossless schedulers must not be rejected; the
    retrospective one must be, and its first token must match the paper's analytic (0.85, 0.15)."""
    rng = np.random.default_rng(2024)
    schedule = jax.jit(
        jax.vmap(scheduler.prefix_schedule, in_axes=(0, None, None)), static_argnums=2
    )
    for table in (APPENDIX_SPS, ADMITTING_SPS):
        x1, x2, conf = _draft(rng, N_SAMPLES)
        lengths = np.asarray(schedule(conf, table, True))[:, 0]
        y1, y2 = _simulate_two_tokens(rng, lengths, x1, x2)
        assert _joint_p_value(y1, y2) > ALPHA
    # With ADMITTING_SPS the early stop admits x_1 always and x_2 only after A: not trivial.
    np.testing.assert_array_equal(np.unique(lengths[x1 == 0]), [2])
    np.testing.assert_array_equal(np.unique(lengths[x1 == 1]), [1])

    x1, x2, conf = _draft(rng, N_SAMPLES)
    lengths = np.asarray(schedule(conf, APPENDIX_SPS, False))[:, 0]
    y1, y2 = _simulate_two_tokens(rng, lengths, x1, x2)
    assert _joint_p_value(y1, y2) < ALPHA
    p_first = stats.chisquare(np.bincount(y1, minlength=2), np.array([0.85, 0.15]) * N_SAMPLES)
    assert p_first.pvalue > ALPHA
    assert abs(np.mean(y1 == 0) - 0.85) < 0.01


def test_appendix_a_async_global_search_on_old_confidences_is_lossless():
    """Section 5.2: the global search (no early stop) runs on confidences from two rounds
    earlier, whose draft is independent of this round's; this round admits the top-K of its own
    survivals. Same test, N and ALPHA as above."""
    rng = np.random.default_rng(7)
    _, _, conf_old = _draft(rng, N_SAMPLES)
    x1, x2, conf = _draft(rng, N_SAMPLES)
    capacity = jax.jit(jax.vmap(scheduler.capacity_from_history, in_axes=(0, None)))(
        conf_old, APPENDIX_SPS
    )
    lengths = np.asarray(jax.jit(jax.vmap(scheduler.top_k_schedule))(conf, capacity))[:, 0]
    assert set(np.unique(np.asarray(capacity))) == {0, 2}
    y1, y2 = _simulate_two_tokens(rng, lengths, x1, x2)
    assert _joint_p_value(y1, y2) > ALPHA
