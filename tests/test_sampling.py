import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr
from scipy import stats

from dspark_jax.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RESIDUAL,
    SamplingConfig,
    filtered_logprobs,
    position_keys,
    request_keys,
    sample_tokens,
)

# Probabilities 0.5, 0.3, 0.15, 0.05 placed at shuffled vocabulary ids.
PROBS_V = np.array([0.15, 0.5, 0.05, 0.3])
LOGITS_1V = jnp.log(jnp.asarray(PROBS_V, jnp.float32))[None]


def kept(cfg: SamplingConfig, logits_xv=LOGITS_1V) -> np.ndarray:
    return np.asarray(jnp.isfinite(filtered_logprobs(logits_xv, cfg)))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_k": 2.0},
        {"top_k": True},
        {"top_k": 2**31},  # past int32, where the engine holds it
        {"top_k": 2**40},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": float("nan")},
        {"temperature": None},  # used to be a bare TypeError from a comparison
        {"temperature": "0.7"},
        {"temperature": True},
        {"top_p": "0.9"},
        {"top_p": None},
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


def test_config_takes_numbers_of_any_kind_as_floats():
    cfg = SamplingConfig(np.float32(0.5), top_p=jnp.float32(0.75))
    assert cfg == SamplingConfig(0.5, top_p=0.75)
    assert type(cfg.temperature) is float and type(cfg.top_p) is float
    assert SamplingConfig(1).temperature == 1.0
    assert hash(SamplingConfig(1)) == hash(SamplingConfig(1.0))


def test_config_takes_numpy_integers_for_top_k():
    cfg = SamplingConfig(1.0, top_k=np.int64(5))
    assert cfg == SamplingConfig(1.0, top_k=5) and type(cfg.top_k) is int
    assert SamplingConfig(1.0, top_k=2**31 - 1).top_k == 2**31 - 1  # "off", like any k >= vocab


def test_config_is_frozen_hashable_and_static():
    cfg = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)
    assert not cfg.greedy and SamplingConfig().greedy
    assert hash(cfg) == hash(SamplingConfig(0.7, 5, 0.9))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.top_k = 3
    fn = jax.jit(filtered_logprobs, static_argnames="cfg")
    np.testing.assert_allclose(fn(LOGITS_1V, cfg=SamplingConfig(1.0)), jnp.log(PROBS_V[None]), 1e-6)


def test_greedy_is_first_argmax_one_hot():
    logits_2v = jnp.array([[1.0, 3.0, 3.0, 0.0], [0.0, -1.0, 2.0, 2.0]])
    logp_2v = np.asarray(filtered_logprobs(logits_2v, SamplingConfig()))
    expected = np.full((2, 4), -np.inf, np.float32)
    expected[0, 1] = expected[1, 2] = 0.0
    np.testing.assert_array_equal(logp_2v, expected)
    tokens = sample_tokens(request_keys(0, jnp.arange(2)), logits_2v, SamplingConfig())
    np.testing.assert_array_equal(tokens, [1, 2])
    assert tokens.dtype == jnp.int32


def test_temperature_scales_logits_in_float32():
    logits_v = jnp.array([[0.5, -1.0, 2.0, 0.0]], jnp.bfloat16)
    logp = filtered_logprobs(logits_v, SamplingConfig(temperature=0.5))
    assert logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, jax.nn.log_softmax(logits_v.astype(jnp.float32) * 2), 1e-6)


def test_top_k_keeps_k_largest():
    np.testing.assert_array_equal(kept(SamplingConfig(1.0, top_k=2)), [[0, 1, 0, 1]])
    np.testing.assert_array_equal(kept(SamplingConfig(1.0, top_k=1)), [[0, 1, 0, 0]])
    np.testing.assert_array_equal(kept(SamplingConfig(1.0, top_k=4)), [[1, 1, 1, 1]])
    np.testing.assert_array_equal(kept(SamplingConfig(1.0, top_k=9)), [[1, 1, 1, 1]])
    logp = filtered_logprobs(LOGITS_1V, SamplingConfig(1.0, top_k=2))
    np.testing.assert_allclose(jnp.exp(logp), [[0, 0.5 / 0.8, 0, 0.3 / 0.8]], atol=1e-6)


def test_filters_keep_ties_with_the_last_kept_value():
    logits_1v = jnp.array([[2.0, 1.0, 1.0, 0.0]])
    np.testing.assert_array_equal(kept(SamplingConfig(1.0, top_k=2), logits_1v), [[1, 1, 1, 0]])
    # Sorted mass before each token: 0, 0.58, 0.79, 1.0 -- equal with or without top-k.
    for top_k in (0, 2):
        cfg = SamplingConfig(1.0, top_k=top_k, top_p=0.7)
        np.testing.assert_array_equal(kept(cfg, logits_1v), [[1, 1, 1, 0]])
        cfg = SamplingConfig(1.0, top_k=top_k, top_p=0.5)
        np.testing.assert_array_equal(kept(cfg, logits_1v), [[1, 0, 0, 0]])


def test_top_p_keeps_smallest_prefix_reaching_p():
    # Sorted mass before each token: 0, 0.5, 0.8, 0.95.
    np.testing.assert_array_equal(kept(SamplingConfig(1.0, top_p=0.3)), [[0, 1, 0, 0]])
    np.testing.assert_array_equal(kept(SamplingConfig(1.0, top_p=0.7)), [[0, 1, 0, 1]])
    np.testing.assert_array_equal(kept(SamplingConfig(1.0, top_p=0.9)), [[1, 1, 0, 1]])
    np.testing.assert_array_equal(kept(SamplingConfig(1.0, top_p=0.99)), [[1, 1, 1, 1]])
    # The most likely token survives any top_p.
    np.testing.assert_array_equal(kept(SamplingConfig(1.0, top_p=1e-6)), [[0, 1, 0, 0]])
    logp = filtered_logprobs(LOGITS_1V, SamplingConfig(1.0, top_p=0.9))
    np.testing.assert_allclose(jnp.exp(logp), [[0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95]], 1e-6)


def test_top_p_is_applied_after_top_k_and_temperature():
    logits_1v = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]]))
    # top-k 3 renormalises to 0.44, 0.33, 0.22, so top_p 0.75 is reached after two tokens; the
    # reverse order would keep three.
    np.testing.assert_array_equal(kept(SamplingConfig(1.0, 3, 0.75), logits_1v), [[1, 1, 0, 0]])
    # Temperature 0.5 squares and renormalises: 0.533, 0.3, 0.133, 0.033.
    np.testing.assert_array_equal(kept(SamplingConfig(0.5, 0, 0.8), logits_1v), [[1, 1, 0, 0]])
    np.testing.assert_array_equal(kept(SamplingConfig(2.0, 0, 0.8), logits_1v), [[1, 1, 1, 0]])


def reference_filter(logits_v: np.ndarray, cfg: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
    """float64 numpy top-k then top-p: (kept mask, probability mass sorted before each token)."""
    x = logits_v.astype(np.float64) / cfg.temperature
    order = np.argsort(-x, kind="stable")
    keep = np.ones_like(x, bool)
    if cfg.top_k:
        keep[order[cfg.top_k :]] = False
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    mass_before = np.empty_like(p)
    mass_before[order] = np.cumsum(p[order]) - p[order]
    return keep & (mass_before < cfg.top_p), mass_before


@pytest.mark.parametrize("cfg", [SamplingConfig(0.8, 0, 0.9), SamplingConfig(1.3, 500, 0.7)])
def test_filters_match_numpy_reference_at_full_vocab_size(cfg):
    vocab = 151_936
    logits_2v = np.random.default_rng(0).normal(scale=3.0, size=(2, vocab)).astype(np.float32)
    mask_2v = np.asarray(jnp.isfinite(jax.jit(filtered_logprobs, static_argnums=1)(logits_2v, cfg)))
    for row in range(2):
        expected, mass_before = reference_filter(logits_2v[row], cfg)
        assert 1 < expected.sum() < vocab
        # float32 and float64 cumulative sums may disagree only on a token at the boundary.
        differ = mask_2v[row] != expected
        assert differ.sum() <= 1
        assert np.all(np.abs(mass_before[differ] - cfg.top_p) < 1e-4)


def _sorted_cutoffs(x_v: np.ndarray, top_k: int, top_p: float) -> float:
    """The cutoff of one row by sorting (the semantics `_filter_cutoffs` finds without a sort):
    top-k's k-th value, then the smallest value whose strictly larger values hold less than top_p
    of the top-k mass; ties kept."""
    v = np.sort(x_v.astype(np.float64))[::-1]
    kth = v[top_k - 1] if 0 < top_k < len(v) else -np.inf
    kept = v[v >= kth]
    p = np.exp(kept - kept.max())
    p /= p.sum()
    if top_p >= 1.0:
        return kth
    above = {u: p[kept > u].sum() for u in np.unique(kept)}
    return max(kth, min(u for u, m in above.items() if m < top_p))


def test_min_p_keeps_the_tokens_at_least_min_p_as_likely_as_the_likeliest():
    """Min-p after temperature, top-k and top-p (Hugging Face's order): a token stays when its
    probability is at least min_p times the likeliest's (the likeliest is never filtered, so
    the ratio is the same before and after the other filters), and what stays is
    renormalised. Held to a float64 reference over rows mixing every filter: min_p 0 changes
    nothing, 1 keeps the ties of the top."""
    from dspark_jax.sampling import RowSampling, logprobs_and_argmax

    rng = np.random.default_rng(11)
    rows, vocab = 40, 500
    x = rng.normal(scale=3.0, size=(rows, vocab)).astype(np.float32)
    x[::5, :3] = x[::5].max(axis=-1, keepdims=True)  # three tokens tied at the top
    temperature = rng.choice([0.5, 1.0, 1.7], rows).astype(np.float32)
    top_k = rng.choice([0, 0, 40], rows).astype(np.int32)
    top_p = rng.choice([1.0, 1.0, 0.8], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.02, 0.1, 0.5, 1.0], rows).astype(np.float32)
    settings = RowSampling(*(jnp.asarray(a) for a in (temperature, top_k, top_p, min_p)))
    logp = np.asarray(jax.jit(logprobs_and_argmax)(jnp.asarray(x), settings)[0])
    cut_by_min_p = []
    for r in range(rows):
        scaled = x[r] / temperature[r]  # float32, as the filters see it
        others = scaled >= _sorted_cutoffs(scaled, int(top_k[r]), float(top_p[r]))
        ratio = np.exp(scaled.astype(np.float64) - scaled.max())  # p / p_max
        keep = others & (ratio >= min_p[r])
        # Rounding decides a token within a hair of the threshold; none is checked there.
        with np.errstate(divide="ignore"):  # log(0): min-p off, nothing near its threshold
            clear = np.abs(np.log(ratio) - np.log(np.float64(min_p[r]))) > 1e-4
        np.testing.assert_array_equal(np.isfinite(logp[r])[clear], keep[clear], err_msg=str(r))
        want = np.log(ratio[keep] / ratio[keep].sum())
        np.testing.assert_allclose(logp[r][keep], want, rtol=0, atol=2e-5, err_msg=str(r))
        cut_by_min_p.append(int(others.sum() - keep.sum()))
        if min_p[r] == 1.0:  # the ties of the top (the row's own maximum and its copies)
            assert keep.sum() == (scaled == scaled.max()).sum() >= (3 if r % 5 == 0 else 1)
        if min_p[r] == 0.0:
            np.testing.assert_array_equal(keep, others)
    # Every row at min_p 0.1 or more without top-p (which may leave only tokens near the top)
    # lost tokens to min-p.
    biting = [n for n, m, p in zip(cut_by_min_p, min_p, top_p, strict=True) if m >= 0.1 and p == 1]
    assert len(biting) >= rows // 5 and min(biting) > 0


def test_cutoffs_are_row_values_found_without_sorting():
    """Mixed per-row settings over rows with ties and -inf entries: each cutoff is the value a
    sort finds, and the compiled filter holds no sort (the costliest pass over [rows, V])."""
    from dspark_jax.sampling import RowSampling, _filter_cutoffs

    rng = np.random.default_rng(3)
    rows, vocab = 48, 300
    x = np.round(rng.normal(scale=2.0, size=(rows, vocab)), 1).astype(np.float32)  # many ties
    x[rng.random((rows, vocab)) < 0.2] = -np.inf
    top_k = rng.choice([0, 1, 2, 7, 50, vocab - 1, vocab, vocab + 5], size=rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.999, 0.9, 0.5, 0.1, 1e-6], size=rows).astype(np.float32)
    settings = RowSampling(
        temperature=jnp.ones(rows),
        top_k=jnp.asarray(top_k),
        top_p=jnp.asarray(top_p),
        min_p=jnp.zeros(rows),
    )
    cut = jax.jit(_filter_cutoffs)
    got = np.asarray(cut(jnp.asarray(x), settings))[:, 0]
    for r in range(rows):
        want = _sorted_cutoffs(x[r], int(top_k[r]), float(top_p[r]))
        assert got[r] == np.float32(want), (r, top_k[r], top_p[r], got[r], want)
    hlo = cut.lower(jnp.asarray(x), settings).compile().as_text()
    assert " sort(" not in hlo and "sort." not in hlo


def test_sample_tokens_matches_filtered_distribution():
    """Chi-square goodness of fit, 20,000 draws, significance 1e-3."""
    cfg = SamplingConfig(temperature=1.5, top_k=3)
    n = 20_000
    keys = position_keys(request_keys(3, jnp.zeros(n, jnp.int32)), jnp.arange(n), STREAM_DRAFT)
    tokens = sample_tokens(keys, jnp.broadcast_to(LOGITS_1V, (n, 4)), cfg)
    counts = np.bincount(np.asarray(tokens), minlength=4)
    probs = np.asarray(jnp.exp(filtered_logprobs(LOGITS_1V, cfg)), np.float64)[0]
    assert counts[probs == 0].sum() == 0
    pvalue = stats.chisquare(counts[probs > 0], n * probs[probs > 0] / probs.sum()).pvalue
    assert pvalue > 1e-3


def test_sample_tokens_row_uses_only_its_own_key():
    cfg = SamplingConfig(temperature=1.0, top_p=0.95)
    rng = np.random.default_rng(1)
    logits_bv = jnp.asarray(rng.normal(size=(6, 50)), jnp.float32)
    keys_b = request_keys(7, jnp.arange(6))
    batched = sample_tokens(keys_b, logits_bv, cfg)
    for b in range(6):
        alone = sample_tokens(keys_b[b : b + 1], logits_bv[b : b + 1], cfg)
        assert int(alone[0]) == int(batched[b])
    legacy_b = jax.vmap(jax.random.PRNGKey)(jnp.arange(6))
    assert sample_tokens(legacy_b, logits_bv, cfg).shape == (6,)


def test_keys_depend_only_on_seed_request_position_stream():
    def key_data(seed, request_ids, positions, stream):
        keys = position_keys(request_keys(seed, jnp.asarray(request_ids)), positions, stream)
        return np.asarray(jax.random.key_data(keys))

    one = key_data(0, [7], jnp.array([12]), STREAM_ACCEPT)[0]
    many = key_data(0, [3, 7, 9], jnp.array([4, 12, 0]), STREAM_ACCEPT)
    np.testing.assert_array_equal(one, many[1])
    variants = [
        key_data(1, [7], jnp.array([12]), STREAM_ACCEPT)[0],
        key_data(0, [8], jnp.array([12]), STREAM_ACCEPT)[0],
        key_data(0, [7], jnp.array([13]), STREAM_ACCEPT)[0],
        key_data(0, [7], jnp.array([12]), STREAM_RESIDUAL)[0],
        key_data(0, [7], jnp.array([12]), STREAM_DRAFT)[0],
    ]
    for other in variants:
        assert not np.array_equal(one, other)
    grid = key_data(0, [3, 7], jnp.array([[4, 5, 6], [10, 11, 12]]), STREAM_ACCEPT)
    assert grid.shape == (2, 3, 2)
    np.testing.assert_array_equal(grid[1, 2], one)


def test_position_keys_accepts_legacy_keys():
    legacy_b = jax.vmap(jax.random.PRNGKey)(jnp.arange(3))
    typed_b = jax.random.wrap_key_data(legacy_b)
    positions_bk = jnp.arange(6).reshape(3, 2)
    legacy = position_keys(legacy_b, positions_bk, STREAM_DRAFT)
    typed = position_keys(typed_b, positions_bk, STREAM_DRAFT)
    assert legacy.shape == (3, 2, 2)
    np.testing.assert_array_equal(legacy, jax.random.key_data(typed))


# 100 rows search blocks of 8, 64 or all 100 rows of a 4096 vocabulary, of 64 or 100 of a 300 one.
BLOCK_ROWS, BLOCK_VOCAB = 100, 4096


def _full_width_cutoffs(scaled_xv, top_k_x, top_p_x, filters_x):
    """The cutoffs of one search over the whole batch (as before blocks), filters_x's rows only."""
    from dspark_jax.sampling import _row_cutoffs

    return _row_cutoffs(
        scaled_xv, jnp.where(filters_x, top_k_x, 0), jnp.where(filters_x, top_p_x, 1.0)
    )


def _top_p_flips(x_xv: np.ndarray, top_k_x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, two adjacent float32 top_p values between which the whole-batch search moves the
    row's cutoff: the row's top-p mass sits exactly there, so a block that rounds it by one ulp
    differently gets another cutoff at one of them."""
    from dspark_jax.sampling import _key_values, _ordered_keys

    full = jax.jit(lambda p: _full_width_cutoffs(x_xv, top_k_x, p, True)[:, 0])
    rows = x_xv.shape[0]
    start = full(jnp.full(rows, 1e-3, jnp.float32))
    lo = np.asarray(_ordered_keys(jnp.full(rows, 1e-3, jnp.float32)), np.int64)
    hi = np.asarray(_ordered_keys(jnp.full(rows, 0.999, jnp.float32)), np.int64)
    while np.any(hi - lo > 1):
        mid = (lo + hi) // 2
        same = np.asarray(full(_key_values(jnp.asarray(mid, jnp.int32))) == start)
        lo, hi = np.where(same, mid, lo), np.where(same, hi, mid)
    p_lo, p_hi = (np.asarray(_key_values(jnp.asarray(k, jnp.int32))) for k in (lo, hi))
    moved = np.asarray(full(jnp.asarray(p_lo)) != full(jnp.asarray(p_hi)))
    return p_lo, np.where(moved, p_hi, p_lo)


@pytest.fixture(scope="module", params=[BLOCK_VOCAB, 300], ids=["V4096", "V300"])
def block_batch(request):
    """Logits with ties and -inf, a top-k per row, and each row's top-p flip points with and
    without its top-k."""
    vocab = request.param
    rng = np.random.default_rng(11)
    x = np.round(rng.normal(scale=3.0, size=(BLOCK_ROWS, vocab)), 2).astype(np.float32)
    x[rng.random(x.shape) < 0.05] = -np.inf
    top_k = rng.choice([1, 2, 7, 50, 250, vocab - 1], size=BLOCK_ROWS).astype(np.int32)
    flips = {
        "top_p": _top_p_flips(x, np.zeros(BLOCK_ROWS, np.int32)),
        "both": _top_p_flips(x, top_k),
    }
    return x, top_k, flips


@pytest.mark.optimized
@pytest.mark.parametrize("filtering", [0, 1, 8, 9, 64, 65, BLOCK_ROWS])
@pytest.mark.parametrize("filters", ["top_k", "top_p", "both"])
def test_cutoffs_in_any_block_are_the_whole_batch_cutoffs(block_batch, filters, filtering):
    """Whichever block the filtering rows are gathered into, each gets bitwise the cutoff of the
    search over the whole batch, top_p set on either side of the very mass where that cutoff
    moves; rows that do not filter (greedy ones with top-k / top-p settings among them) get none.
    And a filtering row's log-probabilities are the same as when every row of the batch filters.
    Groups of `filtering` rows take turns, so most rows pass through the block's every place."""
    from dspark_jax.sampling import RowSampling, _filter_cutoffs

    x, top_k, flips = block_batch
    rng = np.random.default_rng(filtering)
    order = rng.permutation(BLOCK_ROWS)
    groups = [order[i : i + filtering] for i in range(0, BLOCK_ROWS, max(filtering, 1))][:12]
    cutoffs, full_width, logp = (
        jax.jit(_filter_cutoffs),
        jax.jit(_full_width_cutoffs),
        jax.jit(filtered_logprobs),
    )
    for group, side in ((g, s) for g in groups for s in (0, 1)):
        chosen = np.isin(np.arange(BLOCK_ROWS), group)
        greedy = ~chosen & (rng.random(BLOCK_ROWS) < 0.3)
        k = np.where(chosen & (filters != "top_p"), top_k, 0)
        k = np.where(greedy, 5, k).astype(np.int32)
        p = np.ones(BLOCK_ROWS, np.float32)
        if filters != "top_k":
            p_lo, p_hi = flips[filters]
            p = np.where(chosen, np.where(np.arange(BLOCK_ROWS) % 2 == side, p_lo, p_hi), 1.0)
            p = np.where(greedy, 0.5, p).astype(np.float32)
        settings = RowSampling(
            temperature=jnp.asarray(np.where(greedy, 0.0, 1.0), jnp.float32),
            top_k=jnp.asarray(k),
            top_p=jnp.asarray(p),
            min_p=jnp.zeros(BLOCK_ROWS),
        )
        got = np.asarray(cutoffs(jnp.asarray(x), settings))
        np.testing.assert_array_equal(got, np.asarray(full_width(x, k, p, chosen)))
        assert np.all(np.isneginf(got[~chosen]))

        everyone = RowSampling(
            temperature=jnp.ones(BLOCK_ROWS),
            top_k=jnp.asarray(np.where(chosen, k, 3), jnp.int32),
            top_p=jnp.asarray(np.where(chosen, p, 0.5), jnp.float32),
            min_p=jnp.zeros(BLOCK_ROWS),
        )
        np.testing.assert_array_equal(
            np.asarray(logp(x, settings))[chosen], np.asarray(logp(x, everyone))[chosen]
        )


def _ops(jaxpr) -> list:
    """Every equation of `jaxpr` and of the programs inside it."""
    eqns = []
    for eqn in jaxpr.eqns:
        eqns.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, ClosedJaxpr):
                    eqns += _ops(sub.jaxpr)
                elif isinstance(sub, Jaxpr):
                    eqns += _ops(sub)
    return eqns


def test_few_filtering_rows_search_a_block_not_the_batch():
    """One branch per block size and one that searches nothing: each branch's counts, sums and
    bounds over the vocabulary cover only its block's rows, so one filtering row of 512 costs 32
    passes over [8, V], not over [512, V]. Nothing sorts."""
    from dspark_jax.sampling import RowSampling, _filter_cutoffs, _row_blocks

    rows, vocab = 512, BLOCK_VOCAB
    assert _row_blocks(rows, vocab) == (8, 64, 512)
    assert _row_blocks(100, vocab) == (8, 64, 100) and _row_blocks(8, vocab) == (8,)
    assert _row_blocks(rows, 511) == (64, 512) and _row_blocks(rows, 63) == (rows,)
    settings = RowSampling.from_config(SamplingConfig(1.0, 50, 0.9), (rows,))
    jaxpr = jax.make_jaxpr(_filter_cutoffs)(jnp.zeros((rows, vocab)), settings).jaxpr
    assert not [e for e in _ops(jaxpr) if "sort" in e.primitive.name]
    (switch,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    none, *searches = switch.params["branches"]

    def over_vocab(branch):
        return [
            e.invars[0].aval.shape
            for e in _ops(branch.jaxpr)
            if e.primitive.name in ("reduce_sum", "reduce_max", "reduce_min")
            and e.invars[0].aval.shape[-1:] == (vocab,)
        ]

    assert over_vocab(none) == []
    for size, branch in zip(_row_blocks(rows, vocab), searches, strict=True):
        shapes = over_vocab(branch)
        # min and max keys, the top-k count, the top-p norm (a max and a sum), the top-p sum
        assert len(shapes) == 6
        assert set(shapes) == {(size, vocab)}, (size, set(shapes))


def test_logits_enter_the_cutoff_search_as_they_come():
    """The search's conditionals and halving loops get the bf16 logits themselves, and scale
    them as they read them: an operand of a conditional or a loop is a buffer of its own, and a
    float32 copy of [512, V] (or its int32 keys and float32 probabilities, read 32 times) would
    be written out every round on a GPU, where outside them XLA fuses the scaling into the
    passes that read the logits."""
    from dspark_jax.sampling import RowSampling, _filter_cutoffs

    rows, vocab = 512, BLOCK_VOCAB
    settings = RowSampling.from_config(SamplingConfig(0.7, 50, 0.9), (rows,))
    jaxpr = jax.make_jaxpr(_filter_cutoffs)(jnp.zeros((rows, vocab), jnp.bfloat16), settings)
    branching = [e for e in _ops(jaxpr.jaxpr) if e.primitive.name in ("cond", "while")]
    assert len(branching) >= 5  # the block switch, two filter conds and two loops per block
    for eqn in branching:
        large = [a for a in (v.aval for v in eqn.invars) if a.ndim == 2 and a.shape[-1] == vocab]
        assert all(a.dtype == jnp.bfloat16 for a in large), (eqn.primitive.name, large)


@pytest.mark.parametrize("vocab", [151, 4096])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_search_written_out_for_a_gpu_finds_the_loops_cutoffs(vocab, dtype, monkeypatch):
    """For a GPU whose CUDA graphs take no loops (DSPARK_JAX_GRAPH_LOOPS=0) the cutoff search's
    32 halvings are written out (no loop, whose every trip would be a round trip to the host)
    and each step reads the values afresh; here, on the CPU, that program gives bitwise the
    loop's cutoffs: ties, -inf, a row of one value tied throughout and one of a single finite
    value, top-k of 0, 1, V - 1, V and more, top-p down to 1e-6, with and without
    temperatures. Where the graphs take loops, the loop stays."""
    from dspark_jax import sampling

    rng = np.random.default_rng(vocab)
    rows = 48
    x = rng.normal(scale=3.0, size=(rows, vocab)).astype(np.float32)
    x[:, ::7] = np.round(x[:, ::7])  # ties
    x[rng.random((rows, vocab)) < 0.05] = -np.inf
    x[0] = 1.0
    x[1] = -np.inf
    x[1, 3] = 2.0
    top_k = rng.choice([0, 1, 2, 5, 50, vocab - 1, vocab, vocab + 5], size=rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.999999, 0.95, 0.5, 0.3, 1e-6], size=rows).astype(np.float32)
    temperature = rng.choice([0.3, 1.0, 1.7], size=rows).astype(np.float32)
    args = (jnp.asarray(x, dtype), jnp.asarray(top_k), jnp.asarray(top_p))

    def cutoffs():  # a new function for each trace: JAX would reuse a function's first trace
        return lambda *args: sampling._row_cutoffs(*args)

    def loops(*args):
        ops = _ops(jax.make_jaxpr(cutoffs())(*args).jaxpr)
        return [e.primitive.name for e in ops if e.primitive.name in ("scan", "while")]

    for extra in ((), (jnp.asarray(temperature),)):
        looped = jax.jit(cutoffs())(*args, *extra)
        assert loops(*args, *extra) == ["scan", "scan"]  # top-k's and top-p's
        with monkeypatch.context() as patch:
            patch.setattr(sampling, "target_backend", lambda: "gpu")
            patch.setattr(sampling, "graph_loops", lambda: True)
            assert loops(*args, *extra) == ["scan", "scan"]
            patch.setattr(sampling, "graph_loops", lambda: False)
            assert loops(*args, *extra) == []
            written_out = jax.jit(cutoffs())(*args, *extra)
        np.testing.assert_array_equal(written_out, looped)
        assert 0 < np.isfinite(np.asarray(looped)).sum() < rows  # some rows filter, not all


def test_cutoffs_follow_the_temperature_and_take_16_bit_logits():
    """Scaling inside the search gives bitwise the cutoffs of logits scaled beforehand, and bf16
    logits the cutoffs of the same values in float32."""
    from dspark_jax.sampling import RowSampling, _filter_cutoffs, _row_cutoffs

    rng = np.random.default_rng(11)
    rows, vocab = 16, 2048
    logits = jnp.asarray(rng.normal(scale=3.0, size=(rows, vocab)), jnp.bfloat16)
    temperature = jnp.asarray(rng.choice([0.3, 0.7, 1.0, 1.7], size=rows), jnp.float32)
    top_k = jnp.asarray(rng.choice([0, 5, 100], size=rows), jnp.int32)
    top_p = jnp.asarray(rng.choice([1.0, 0.95, 0.5], size=rows), jnp.float32)
    settings = RowSampling(temperature, top_k, top_p, jnp.zeros_like(top_p))
    scaled = logits.astype(jnp.float32) / temperature[:, None]
    want = jax.jit(_row_cutoffs)(scaled, top_k, top_p)
    np.testing.assert_array_equal(jax.jit(_filter_cutoffs)(logits, settings), want)
    np.testing.assert_array_equal(
        jax.jit(_filter_cutoffs)(logits.astype(jnp.float32), settings), want
    )
    assert np.isfinite(np.asarray(want)).sum() >= rows // 2  # most rows filter
    np.testing.assert_array_equal(
        jax.jit(filtered_logprobs)(logits, settings),
        jax.jit(filtered_logprobs)(logits.astype(jnp.float32), settings),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_softmax_takes_its_maximum_from_the_argmax(dtype):
    """`logprobs_and_argmax` reads the softmax's maximum off the argmax instead of reducing the
    kept values again: bitwise `jax.nn.log_softmax` of the kept scaled logits, with ties, large
    and tiny temperatures, filters and greedy rows in one batch; its argmax is numpy's first
    argmax, and sampling given it draws what sampling without it draws."""
    from dspark_jax.sampling import (
        RowSampling,
        _filter_cutoffs,
        logprobs_and_argmax,
        sample_from_logprobs,
    )

    rng = np.random.default_rng(5)
    rows, vocab = 48, 3000
    logits = rng.normal(scale=4.0, size=(rows, vocab))
    logits[::3] = np.round(logits[::3])  # many ties at the top
    logits[1::7, :50] = -np.inf
    logits = jnp.asarray(logits, dtype)
    settings = RowSampling(
        temperature=jnp.asarray(rng.choice([0.0, 0.05, 0.7, 1.0, 3.3], size=rows), jnp.float32),
        top_k=jnp.asarray(rng.choice([0, 1, 5, 100], size=rows), jnp.int32),
        top_p=jnp.asarray(rng.choice([1.0, 0.9, 0.3], size=rows), jnp.float32),
        min_p=jnp.zeros(rows),
    )

    def reference(logits, settings):
        scaled = logits.astype(jnp.float32) / jnp.where(
            settings.greedy, 1.0, settings.temperature
        )[:, None]
        kept = jnp.where(scaled >= _filter_cutoffs(logits, settings), scaled, -jnp.inf)
        return jax.nn.log_softmax(kept, axis=-1)

    logp, best = jax.jit(logprobs_and_argmax)(logits, settings)
    logp, greedy = np.asarray(logp), np.asarray(settings.greedy)
    assert greedy.any() and not greedy.all()
    want = np.asarray(jax.jit(reference)(logits, settings))
    np.testing.assert_array_equal(logp[~greedy], want[~greedy])
    first = np.argmax(np.asarray(logits.astype(jnp.float32)), axis=-1)
    np.testing.assert_array_equal(best, first)
    assert best.dtype == jnp.int32
    np.testing.assert_array_equal(logp[greedy] == 0.0, np.arange(vocab) == first[greedy, None])
    np.testing.assert_array_equal(logp, jax.jit(filtered_logprobs)(logits, settings))

    keys = request_keys(3, jnp.arange(rows))
    draw = jax.jit(sample_from_logprobs)
    given = np.asarray(draw(keys, jnp.asarray(logp), settings.greedy, best))
    np.testing.assert_array_equal(given, draw(keys, jnp.asarray(logp), settings.greedy))
    np.testing.assert_array_equal(given[greedy], first[greedy])


def test_one_pass_over_the_vocabulary_gives_argmax_and_softmax_maximum():
    """Outside the filters' search, the log-probabilities and the argmax reduce each row of
    [rows, V] twice: the argmax (which carries the maximum) and the softmax's sum. On a GPU
    each such reduction of a vocabulary-long row is one or two kernels at every draft
    position; the maximum reduced on its own again would add them back."""
    from dspark_jax.sampling import RowSampling, logprobs_and_argmax

    rows, vocab = 4, BLOCK_VOCAB
    settings = RowSampling.from_config(SamplingConfig(0.7, 50, 0.9), (rows,))
    jaxpr = jax.make_jaxpr(logprobs_and_argmax)(jnp.zeros((rows, vocab)), settings).jaxpr
    reductions = [
        e.primitive.name
        for e in jaxpr.eqns  # the top level: the filters' search is inside its own conditional
        if e.primitive.name.startswith(("reduce", "argmax", "argmin"))
        and e.invars[0].aval.shape[-1:] == (vocab,)
    ]
    assert sorted(reductions) == ["argmax", "reduce_sum"], reductions
