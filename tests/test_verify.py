import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.decoding import verify as verify_module
from dspark_jax.decoding.verify import VerifyResult, verify
from dspark_jax.sampling import (
    NO_STOP_TOKEN,
    PAD_TOKEN,
    STREAM_DRAFT,
    STREAM_RESIDUAL,
    SamplingConfig,
    position_keys,
    request_keys,
    sample_tokens,
)
from dspark_jax.sampling import filtered_logprobs as _filtered_logprobs

GREEDY = SamplingConfig()
T1 = SamplingConfig(temperature=1.0)
FILTERED = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)
NO_STOP = jnp.array([NO_STOP_TOKEN], jnp.int32)

jit_verify = jax.jit(verify, static_argnames="cfg")
# Jitted: run eagerly, the filter compiled each of its operations (and the branches of its
# cutoff search) once per shape, most of this file's compile time.
filtered_logprobs = jax.jit(_filtered_logprobs, static_argnums=1)


def peaked(tokens, vocab: int, height: float = 30.0) -> jnp.ndarray:
    """Logits with all mass (at any temperature used here) on `tokens`."""
    return height * jax.nn.one_hot(jnp.asarray(tokens), vocab)


def run(drafts, draft_logits, target_logits, lengths, cfg, stop=NO_STOP, seed=0, positions=None):
    batch = len(lengths)
    positions = jnp.full(batch, 5) if positions is None else jnp.asarray(positions)
    keys_b = request_keys(seed, jnp.arange(batch))
    return jit_verify(
        jnp.asarray(drafts, jnp.int32),
        filtered_logprobs(jnp.asarray(draft_logits, jnp.float32), cfg),
        jnp.asarray(target_logits, jnp.float32),
        jnp.asarray(lengths, jnp.int32),
        keys_b,
        positions,
        cfg=cfg,
        stop_tokens_s=jnp.asarray(stop, jnp.int32),
    )


def committed(result: VerifyResult, b: int) -> list[int]:
    return [int(t) for t in result.tokens_bj[b, : int(result.num_committed_b[b])]]


def test_greedy_accepts_while_equal_then_commits_target_argmax():
    vocab = 10
    drafts = [[4, 5, 6], [4, 5, 6], [4, 5, 6]]
    target_bj = [[4, 5, 1, 2], [4, 5, 6, 7], [8, 5, 6, 7]]
    draft_logits = jnp.zeros((3, 3, vocab))
    res = run(drafts, draft_logits, peaked(target_bj, vocab), [3, 3, 3], GREEDY)
    np.testing.assert_array_equal(res.num_accepted_b, [2, 3, 0])
    assert committed(res, 0) == [4, 5, 1]
    assert committed(res, 1) == [4, 5, 6, 7]
    assert committed(res, 2) == [8]
    np.testing.assert_array_equal(res.tokens_bj[2], [8, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN])
    np.testing.assert_array_equal(res.next_token_b, [1, 7, 8])
    np.testing.assert_array_equal(res.num_committed_b, [3, 4, 1])
    assert not res.stopped_b.any()
    np.testing.assert_array_equal(res.accepted_bk, [[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(res.accept_prob_bk, [[1, 1, 0], [1, 1, 1], [0, 1, 1]])


def test_greedy_bonus_comes_from_row_lengths():
    vocab = 10
    target_bj = [[4, 5, 6, 7]] * 4
    res = run(
        [[4, 5, 6]] * 4, jnp.zeros((4, 3, vocab)), peaked(target_bj, vocab), [0, 1, 2, 3], GREEDY
    )
    np.testing.assert_array_equal(res.num_accepted_b, [0, 1, 2, 3])
    assert [committed(res, b) for b in range(4)] == [[4], [4, 5], [4, 5, 6], [4, 5, 6, 7]]


@pytest.mark.parametrize("cfg", [T1, FILTERED])
def test_all_accepted_when_draft_equals_target_then_bonus_from_row_lengths(cfg):
    vocab, gamma = 12, 4
    rng = np.random.default_rng(0)
    target_bjv = rng.normal(size=(5, gamma + 1, vocab)).astype(np.float32)
    # The draft equals the target, so every ratio is 1; drafts are any tokens in its support.
    support_bjv = np.asarray(jnp.isfinite(filtered_logprobs(target_bjv, cfg)))
    drafts_bk = np.argmax(support_bjv[:, :gamma] * rng.random((5, gamma, vocab)), axis=-1)
    bonus_b = np.array([3, 0, 7, 11, 5])
    lengths = np.array([0, 1, 2, 3, 4])
    target_bjv[np.arange(5), lengths] = peaked(bonus_b, vocab)
    res = run(drafts_bk, target_bjv[:, :gamma], target_bjv, lengths, cfg)
    np.testing.assert_array_equal(res.num_accepted_b, lengths)
    for b in range(5):
        assert committed(res, b) == [*drafts_bk[b, : lengths[b]], bonus_b[b]]
    np.testing.assert_allclose(res.accept_prob_bk, np.arange(gamma) < lengths[:, None])


@pytest.mark.parametrize("cfg", [T1, FILTERED])
def test_lengths_zero_is_target_only_sampling_of_row_zero(cfg):
    vocab, gamma, batch = 12, 3, 64
    rng = np.random.default_rng(1)
    target_bjv = jnp.asarray(rng.normal(size=(batch, gamma + 1, vocab)), jnp.float32)
    draft_bkv = jnp.asarray(rng.normal(size=(batch, gamma, vocab)), jnp.float32)
    drafts = rng.integers(0, vocab, (batch, gamma))
    positions = jnp.arange(batch) * 3
    res = run(drafts, draft_bkv, target_bjv, [0] * batch, cfg, positions=positions)
    np.testing.assert_array_equal(res.num_committed_b, 1)
    np.testing.assert_array_equal(res.num_accepted_b, 0)
    keys_b = position_keys(request_keys(0, jnp.arange(batch)), positions, STREAM_RESIDUAL)
    np.testing.assert_array_equal(res.next_token_b, sample_tokens(keys_b, target_bjv[:, 0], cfg))
    np.testing.assert_array_equal(res.tokens_bj[:, 0], res.next_token_b)
    assert (res.tokens_bj[:, 1:] == PAD_TOKEN).all()


def test_draft_token_outside_target_support_is_always_rejected():
    vocab, gamma, batch = 8, 2, 256
    cfg = SamplingConfig(temperature=1.0, top_k=3)
    target_1jv = jnp.log(jnp.array([[[0.4, 0.3, 0.2, 0.05, 0.05, 0, 0, 0]] * (gamma + 1)]) + 1e-9)
    target_bjv = jnp.broadcast_to(target_1jv, (batch, gamma + 1, vocab))
    draft_bkv = jnp.zeros((batch, gamma, vocab))
    res = run([[4, 0]] * batch, draft_bkv, target_bjv, [2] * batch, cfg)
    np.testing.assert_array_equal(res.num_accepted_b, 0)
    np.testing.assert_array_equal(res.accept_prob_bk[:, 0], 0.0)
    # Residual mass is on 0, 1, 2 only, proportional to p_t - p_d = 0.44-1/8, 0.33-1/8, 0.22-1/8.
    counts = np.bincount(np.asarray(res.next_token_b), minlength=vocab)
    assert counts[3:].sum() == 0 and counts[:3].min() > 0


def test_stop_token_truncates_after_first_stop():
    vocab = 10
    target_bj = [[4, 3, 6, 3], [4, 5, 6, 3], [3, 5, 6, 7], [1, 2, 6, 7]]
    drafts = [[4, 3, 6], [4, 5, 6], [4, 5, 6], [1, 2, 6]]
    res = run(drafts, jnp.zeros((4, 3, vocab)), peaked(target_bj, vocab), [3, 3, 3, 3], GREEDY,
              stop=[3, 9, -1])  # fmt: skip
    assert committed(res, 0) == [4, 3]  # accepted stop draft ends the request
    assert committed(res, 1) == [4, 5, 6, 3]  # stop as the bonus token
    assert committed(res, 2) == [3]  # stop as the correction token
    assert committed(res, 3) == [1, 2, 6, 7]
    np.testing.assert_array_equal(res.stopped_b, [True, True, True, False])
    np.testing.assert_array_equal(res.next_token_b, [3, 3, 3, 7])
    np.testing.assert_array_equal(res.num_accepted_b, [3, 3, 0, 3])
    np.testing.assert_array_equal(res.num_committed_b, [2, 4, 1, 4])
    np.testing.assert_array_equal(res.tokens_bj[0], [4, 3, PAD_TOKEN, PAD_TOKEN])


def test_stop_token_in_sampled_path():
    vocab = 10
    res = run([[4, 5]], peaked([[4, 5]], vocab), peaked([[4, 5, 9]], vocab), [2], T1, stop=[5])
    assert committed(res, 0) == [4, 5] and bool(res.stopped_b[0])


def random_inputs(rng, batch, gamma, vocab):
    return (
        rng.integers(0, vocab, (batch, gamma)),
        rng.normal(size=(batch, gamma, vocab)).astype(np.float32),
        rng.normal(size=(batch, gamma + 1, vocab)).astype(np.float32),
    )


@pytest.mark.parametrize("cfg", [GREEDY, T1, FILTERED])
def test_padding_beyond_lengths_is_ignored(cfg):
    vocab, gamma, batch = 9, 4, 40
    rng = np.random.default_rng(2)
    drafts, draft_logits, target_logits = random_inputs(rng, batch, gamma, vocab)
    # Greedy rows accept more often when the drafts are the target argmax.
    drafts = np.where(rng.random((batch, gamma)) < 0.7, target_logits[:, :gamma].argmax(-1), drafts)
    lengths = np.arange(batch) % (gamma + 1)
    clean = run(drafts, draft_logits, target_logits, lengths, cfg, stop=[2, -1])

    pad_k = np.arange(gamma) >= lengths[:, None]
    pad_j = np.arange(gamma + 1) > lengths[:, None]
    junk_tokens = rng.choice([-5, vocab, 10**6, 2], size=(batch, gamma))
    junk_logits = rng.choice([np.nan, np.inf, -np.inf, 1e30], size=(batch, gamma + 1, vocab))
    dirty = run(
        np.where(pad_k, junk_tokens, drafts),
        np.where(pad_k[..., None], junk_logits[:, :gamma], draft_logits),
        np.where(pad_j[..., None], junk_logits, target_logits),
        lengths,
        cfg,
        stop=[2, -1],
    )
    for name, a, b in zip(VerifyResult._fields, clean, dirty, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert np.all(np.isfinite(dirty.accept_prob_bk))
    assert 0 < int(clean.num_accepted_b.sum()) < int(lengths.sum())


@pytest.mark.parametrize("cfg", [GREEDY, T1, FILTERED])
def test_row_result_is_independent_of_batch_companions(cfg):
    vocab, gamma, batch = 11, 3, 6
    rng = np.random.default_rng(3)
    drafts, draft_logits, target_logits = random_inputs(rng, batch, gamma, vocab)
    drafts[:, 0] = target_logits[:, 0].argmax(-1)
    lengths = np.array([3, 1, 2, 0, 3, 2])
    request_ids = jnp.array([10, 11, 12, 13, 14, 15])
    positions = jnp.array([7, 3, 20, 0, 9, 4])
    keys_b = request_keys(42, request_ids)
    stop = jnp.array([5, -1], jnp.int32)

    def call(rows):
        return jit_verify(
            jnp.asarray(drafts[rows]),
            filtered_logprobs(jnp.asarray(draft_logits[rows]), cfg),
            jnp.asarray(target_logits[rows]),
            jnp.asarray(lengths[rows]),
            keys_b[rows],
            positions[rows],
            cfg=cfg,
            stop_tokens_s=stop,
        )

    full = call(np.arange(batch))
    for b in range(batch):
        alone = call(np.array([b]))
        for name, a, c in zip(VerifyResult._fields, alone, full, strict=True):
            np.testing.assert_allclose(a[0], c[b], rtol=1e-6, err_msg=f"{name} row {b}")


def test_rejects_inconsistent_shapes():
    keys_b = request_keys(0, jnp.arange(2))
    drafts, draft_logits, target_logits = random_inputs(np.random.default_rng(4), 2, 3, 5)
    ok = dict(
        draft_tokens_bk=drafts,
        draft_logprobs_bkv=filtered_logprobs(draft_logits, T1),
        target_logits_bjv=target_logits,
        lengths_b=jnp.array([1, 2]),
        keys_b=keys_b,
        positions_b=jnp.array([0, 0]),
        cfg=T1,
        stop_tokens_s=NO_STOP,
    )
    bad = [
        ("target_logits_bjv", target_logits[:, :3]),
        ("draft_logprobs_bkv", draft_logits[:, :, :4]),
        ("lengths_b", jnp.array([1, 2, 3])),
        ("positions_b", jnp.array(0)),
        ("draft_tokens_bk", drafts[:, :0]),
    ]
    for name, value in bad:
        with pytest.raises(ValueError, match=name):
            verify(**{**ok, name: value})


# --- Statistical losslessness ---------------------------------------------------------------
#
# Toy models: the target's next-token distribution is a fixed random function of the previous
# token, the draft is a worse Markov chain (the target's logits plus noise). Speculative decoding
# is simulated for NUM_SAMPLES independent requests, each round drafting GAMMA tokens, verifying
# a random number 0..GAMMA of them, and committing; the joint law of the first NUM_TOKENS
# generated tokens is compared with the exact (filtered) target chain by a chi-square test at
# significance ALPHA. Cells with expected count below 5 are pooled.

VOCAB, GAMMA, NUM_TOKENS = 8, 3, 3
NUM_SAMPLES = 200_000
ALPHA = 1e-3
DETECTABLE_TV = 0.02
FIRST_ANCHOR = 0


def toy_chains(seed: int = 0) -> tuple[jnp.ndarray, jnp.ndarray]:
    rng = np.random.default_rng(seed)
    target_vv = rng.normal(scale=1.5, size=(VOCAB, VOCAB))
    draft_vv = target_vv + rng.normal(scale=1.2, size=(VOCAB, VOCAB))
    return jnp.asarray(target_vv, jnp.float32), jnp.asarray(draft_vv, jnp.float32)


def exact_joint(target_vv, cfg) -> np.ndarray:
    step_vv = np.asarray(jnp.exp(filtered_logprobs(target_vv, cfg)), np.float64)
    joint = step_vv[FIRST_ANCHOR]
    for _ in range(NUM_TOKENS - 1):
        # The step matrix pairs the last generated token with the next one.
        joint = joint[..., None] * step_vv
    return joint.reshape(-1)


def speculative_joint_counts(target_vv, draft_vv, cfg, seed: int) -> np.ndarray:
    """Histogram of the first NUM_TOKENS tokens over NUM_SAMPLES simulated requests."""
    n = NUM_SAMPLES
    keys_b = request_keys(seed, jnp.arange(n))
    length_key = jax.random.key(seed + 1)
    buffer = NUM_TOKENS * (GAMMA + 1)
    rows_b = jnp.arange(n)

    def draft_step(carry, k):
        prev_b, start_b = carry
        logits_bv = draft_vv[prev_b]
        token_b = sample_tokens(position_keys(keys_b, start_b + k, STREAM_DRAFT), logits_bv, cfg)
        return (token_b, start_b), (token_b, logits_bv)

    def round_(r, state):
        out_bt, count_b, anchor_b = state
        # The anchor sits at position count_b (the prompt token at 0), so drafts start at +1.
        start_b = count_b + 1
        _, (drafts_kb, draft_logits_kbv) = jax.lax.scan(
            draft_step, (anchor_b, start_b), jnp.arange(GAMMA)
        )
        drafts_bk = drafts_kb.T
        prev_bj = jnp.concatenate([anchor_b[:, None], drafts_bk], axis=1)
        lengths_b = jax.random.randint(jax.random.fold_in(length_key, r), (n,), 0, GAMMA + 1)
        res = verify(
            drafts_bk,
            filtered_logprobs(jnp.swapaxes(draft_logits_kbv, 0, 1), cfg),
            target_vv[prev_bj],
            lengths_b,
            keys_b,
            start_b,
            cfg,
            NO_STOP,
        )
        slots_bj = count_b[:, None] + jnp.arange(GAMMA + 1)
        new_bj = jnp.where(
            jnp.arange(GAMMA + 1) < res.num_committed_b[:, None],
            res.tokens_bj,
            out_bt[rows_b[:, None], slots_bj],
        )
        out_bt = out_bt.at[rows_b[:, None], slots_bj].set(new_bj)
        return out_bt, count_b + res.num_committed_b, res.next_token_b

    @jax.jit
    def simulate():
        state = (
            jnp.full((n, buffer), -1, jnp.int32),
            jnp.zeros(n, jnp.int32),
            jnp.full(n, FIRST_ANCHOR, jnp.int32),
        )
        out_bt, count_b, _ = jax.lax.fori_loop(0, NUM_TOKENS, round_, state)
        return out_bt[:, :NUM_TOKENS], count_b

    out_bt, count_b = simulate()
    assert int(count_b.min()) >= NUM_TOKENS
    cells_b = np.asarray(out_bt) @ (VOCAB ** np.arange(NUM_TOKENS - 1, -1, -1))
    return np.bincount(cells_b, minlength=VOCAB**NUM_TOKENS)


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value; cells with zero probability must be empty."""
    assert counts[probs == 0].sum() == 0, "sampled a token sequence the target cannot produce"
    expected = counts.sum() * probs[probs > 0]
    observed = counts[probs > 0]
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    statistic = np.sum((observed - expected) ** 2 / expected)
    return float(stats.chi2.sf(statistic, df=len(expected) - 1))


def test_sample_size_detects_tv_of_002():
    """With N samples a TV distance d gives noncentrality >= 4 N d^2 (Cauchy-Schwarz)."""
    df = VOCAB**NUM_TOKENS - 1
    critical = stats.chi2.isf(ALPHA, df)
    power = stats.ncx2.sf(critical, df, 4 * NUM_SAMPLES * DETECTABLE_TV**2)
    assert power > 0.99


@pytest.mark.optimized
@pytest.mark.parametrize("cfg", [T1, SamplingConfig(temperature=0.7, top_p=0.9)])
def test_speculative_sampling_is_lossless(cfg):
    target_vv, draft_vv = toy_chains()
    probs = exact_joint(target_vv, cfg)
    counts = speculative_joint_counts(target_vv, draft_vv, cfg, seed=11)
    assert chi_square_pvalue(counts, probs) > ALPHA


def correction_from_target(target_logp_bv, draft_logp_bv, rejected_b):
    return target_logp_bv


def accept_with_target_prob(target_logp_bk, draft_logp_bk, log_u_bk):
    return log_u_bk < target_logp_bk


@pytest.mark.optimized
@pytest.mark.parametrize(
    "helper, broken",
    [("_correction_logprobs", correction_from_target), ("_accept_slots", accept_with_target_prob)],
)
def test_broken_verifier_fails_the_same_test(monkeypatch, helper, broken):
    monkeypatch.setattr(verify_module, helper, broken)
    target_vv, draft_vv = toy_chains()
    probs = exact_joint(target_vv, T1)
    counts = speculative_joint_counts(target_vv, draft_vv, T1, seed=11)
    assert chi_square_pvalue(counts, probs) < ALPHA


def test_exact_joint_is_the_markov_chain():
    target_vv, _ = toy_chains()
    step_vv = np.asarray(jax.nn.softmax(target_vv), np.float64)
    joint = exact_joint(target_vv, T1).reshape((VOCAB,) * NUM_TOKENS)
    np.testing.assert_allclose(joint[2, 5, 1], step_vv[0, 2] * step_vv[2, 5] * step_vv[5, 1], 1e-6)
    np.testing.assert_allclose(joint.sum(), 1.0, 1e-6)
