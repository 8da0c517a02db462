"""Speculative sampling through the engine draws from the target's own distribution.

For one prompt per sampling config, the first three generated tokens (t1, t2, t3) of N seeded
requests are compared with the exact target distribution by a chi-square goodness-of-fit test at
alpha = 1e-3. t1 comes from prefill; t2 and t3 come from the first speculative round(s). Each
config verifies a fixed number of drafts per round, chosen so that between them every path of
the verifier reaches t2 or t3: at T=1 one draft (accepted -> t2 is the draft and t3 the bonus
token; rejected -> t2 is the residual sample), at T=0.7 / top-p 0.9 two drafts (so a rejection of
the second draft after an accepted first puts a residual sample at t3). Verifying more drafts
would only add tokens after t3 and cost: the target's work per round follows the drafts verified.

Cells: every (t1, t2, t3) whose exact probability gives an expected count >= 5 is enumerated from
the target before sampling (so the binning does not depend on the data); everything else is one
"other" cell holding the exact remaining mass (merged into the rarest kept cell when its own
expected count is below 5). A sequence that emits EOS early is a shorter cell.

Power: with m + 1 bins the statistic is asymptotically noncentral chi2(m, lam),
lam = N * sum_i (q_i - p_i)^2 / p_i for a sampler with bin probabilities q. By Cauchy-Schwarz,
2 TV = sum_i |q_i - p_i| <= sqrt(sum_i (q_i - p_i)^2 / p_i) * sqrt(sum_i p_i), so
lam >= 4 N TV^2 whatever the shape of the difference. For TV = 0.02 (of the binned distribution)
that is lam >= 104.9 at N = 65536 (T=1: 160 cells + other, critical value 221.0, power 0.95)
and lam >= 32.8 at N = 20480 (T=0.7 / top-p 0.9: 6 cells, the other mass 5e-8 merged, critical
value 20.5, power 0.94). Each test recomputes the power ncx2.sf(critical value, m, 4 N TV^2) for
its actual m and asserts it is at least 0.9.

The prompts are windows of Python standard-library source (the fixture target's training data)
chosen for few cells and a first-draft acceptance well below 1, so rejections (the residual path)
are frequent: draft 1 is accepted in about 0.81 of rounds at T=1 and 0.45 at T=0.7 / top-p 0.9.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixture_models import load_pair
from scipy import stats

from dspark_jax.decoding import verify as verify_module
from dspark_jax.decoding.batching import Request, generate
from dspark_jax.decoding.engine import Engine, EngineConfig
from dspark_jax.decoding.policies import FixedPolicy
from dspark_jax.sampling import (
    SamplingConfig,
    apply_logit_bias,
    apply_penalties,
    apply_repetition_penalty,
    filtered_logprobs,
)

# Tens of thousands of samples through a few programs: the time is in running them
# (tests/conftest.py).
pytestmark = pytest.mark.optimized

ALPHA = 1e-3
BATCH = 4096
MIN_EXPECTED = 5.0
DETECT_TV = 0.02
MIN_POWER = 0.9
NEW_TOKENS = 3

T1 = SamplingConfig(temperature=1.0)
T07_P09 = SamplingConfig(temperature=0.7, top_p=0.9)
T1_MIN_P = SamplingConfig(temperature=1.0, min_p=0.1)
# Penalties apply to the target's logits before temperature and top-p: after "ti", a second
# "m" ("mmo", "mme": the likeliest cells unpenalised) pays them, which moves the mass and
# which tokens top-p keeps. That each verified row counts the drafts before it is held token
# for token by tests/test_penalties.py (its greedy traces part without it); here few samples
# reach a row whose drafts repeat, so this test would hardly see that counting go.
T07_P09_PENALISED = SamplingConfig(
    temperature=0.7, top_p=0.9, presence_penalty=1.5, frequency_penalty=0.5
)
# The repetition penalty divides the positive logits of the prompt's tokens ("t", "i", "o", "c",
# ...) and the drawn ones from the first token on, which moves mass away from "tim"/"tio" cells.
T07_P09_REPEATED = SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.1)
# A logit bias moves mass between the likeliest cells after "ti" ("m" down, "o" and "c" up)
# before temperature and top-p, at every one of the tokens (the first, sampled at prefill, too).
T07_P09_BIASED = SamplingConfig(
    temperature=0.7, top_p=0.9, logit_bias={ord("m"): -1.0, ord("o"): 1.5, ord("c"): 0.75}
)

# (prompt, number of samples, drafts verified per round) per sampling config.
CASES = {
    T1: (b"rcname = sel", 65536, 1),
    T07_P09: (b"th socket ti", 20480, 2),
    T1_MIN_P: (b"th socket ti", 32768, 2),
    T07_P09_PENALISED: (b"th socket ti", 32768, 2),
    T07_P09_BIASED: (b"th socket ti", 32768, 2),
    T07_P09_REPEATED: (b"th socket ti", 32768, 2),
}
PROMPT_LEN = 12


def _engine_config(gamma, penalties=False, max_logit_bias=0):
    """The cache holds the prompt, the new tokens and a last round's block. One token bucket
    (every slot verifying its anchor and `gamma` drafts) keeps compilation to one branch. One
    prefill call takes a prompt for every slot: requests finish after a round or two, so
    admitting fewer per step would leave most slots idle through rounds that cost the whole
    bucket (it halves the test's time)."""
    return EngineConfig(
        num_slots=BATCH,
        max_model_len=PROMPT_LEN + NEW_TOKENS + 8,
        page_size=8,
        rounds_per_chunk=4,
        prefill_chunk=PROMPT_LEN * BATCH,
        prefill_seqs=BATCH,
        prefill_buckets=(PROMPT_LEN * BATCH,),
        token_buckets=(BATCH * (gamma + 1),),
        # One drafter branch (each more is seconds of compiling): the samples fill every slot in
        # each wave, so smaller slot buckets would not be used.
        draft_buckets=(BATCH,),
        penalties=penalties,
        max_logit_bias=max_logit_bias,
    )


@functools.cache
def _models():
    return load_pair("vanilla")


@functools.cache
def target_logprobs_fn(sampling):
    """ids [B, T] -> the target's filtered log-probabilities [B, T, V] at every position, one
    program per input shape: the filter run eagerly would compile each of its small operations
    (and the conditionals of its cutoff search) once per row count."""
    target, _ = _models()
    return jax.jit(lambda ids_bt: filtered_logprobs(target.logits(target(ids_bt).hidden), sampling))


@functools.cache
def penalised_logprobs_fn(sampling):
    """(ids [B, T], generated-token counts [B, V], tokens seen in the row [B, V]) -> the
    filtered log-probabilities [B, V] of the token after each row, its logits with the
    repetition penalty on the row's tokens, less the penalties of its generated tokens, plus
    the config's logit bias."""
    target, _ = _models()

    def fn(ids_bt, counts_bv, seen_bv):
        logits_bv = target.logits(target(ids_bt).hidden[:, -1])
        rows = ids_bt.shape[:1]
        repetition_b = jnp.full(rows, sampling.repetition_penalty)
        logits_bv = apply_repetition_penalty(logits_bv, seen_bv, repetition_b)
        presence_b = jnp.full(rows, sampling.presence_penalty)
        frequency_b = jnp.full(rows, sampling.frequency_penalty)
        adjusted_bv = apply_penalties(logits_bv, counts_bv, presence_b, frequency_b)
        if sampling.logit_bias:
            ids_k, bias_k = (jnp.asarray(x) for x in zip(*sampling.logit_bias, strict=True))
            shape = (rows[0], len(ids_k))
            adjusted_bv = apply_logit_bias(
                adjusted_bv, jnp.broadcast_to(ids_k, shape), jnp.broadcast_to(bias_k, shape)
            )
        return filtered_logprobs(adjusted_bv, sampling.filters)

    return jax.jit(fn)


@functools.cache
def banned_logprobs_fn(sampling, banned):
    """ids [B, T] -> the filtered log-probabilities [B, V] of the token after each row, the
    `banned` tokens masked out of its logits first (min_tokens)."""
    target, _ = _models()

    def fn(ids_bt):
        logits_bv = target.logits(target(ids_bt).hidden[:, -1]).astype(jnp.float32)
        return filtered_logprobs(logits_bv.at[:, list(banned)].set(-jnp.inf), sampling)

    return jax.jit(fn)


def _next_logprobs(prefixes, sampling, banned=()):
    """[len(prefixes), V] filtered log-probabilities of the token after each prefix (one length):
    the prompt, then generated tokens, which a config's penalties count; `banned` tokens have
    none.

    Rows are padded to a power of two so that few batch shapes get compiled.
    """
    ids = np.asarray(prefixes, np.int32)
    padded = np.zeros((1 << (len(ids) - 1).bit_length(), ids.shape[1]), np.int32)
    padded[: len(ids)] = ids
    if banned:
        assert not sampling.adjusted
        return np.asarray(banned_logprobs_fn(sampling, banned)(padded)[: len(ids)], np.float64)
    if not sampling.adjusted:
        return np.asarray(target_logprobs_fn(sampling)(padded)[: len(ids), -1], np.float64)
    vocab = _models()[0].cfg.vocab_size
    counts = np.zeros((len(padded), vocab), np.int32)
    seen = np.zeros((len(padded), vocab), bool)
    for row, generated in enumerate(ids[:, PROMPT_LEN:]):
        np.add.at(counts[row], generated, 1)
        seen[row, ids[row]] = True
    logp = penalised_logprobs_fn(sampling)(padded, counts, seen)
    return np.asarray(logp[: len(ids)], np.float64)


def _banned(ends, level):
    """The stop tokens the target may not draw at `level` (0-based) under ends' min_tokens."""
    stops, min_tokens = ends
    return tuple(stops) if level < min_tokens else ()


def _expected_cells(prompt, sampling, ends, min_prob):
    """{cell: exact probability} for every cell with probability >= min_prob. `ends`: (stop
    tokens, min_tokens): a cell ends at a stop token, which cannot come before min_tokens.

    Prefixes are expanded level by level; a prefix below min_prob cannot lead to a kept cell.
    """
    cells = {}
    frontier = {(): 0.0}
    for level in range(NEW_TOKENS):
        keys = list(frontier)
        prefixes = [list(prompt) + list(k) for k in keys]
        logp = _next_logprobs(prefixes, sampling, _banned(ends, level))
        nxt = {}
        for row, key in enumerate(keys):
            total = frontier[key] + logp[row]
            for token in np.flatnonzero(total >= np.log(min_prob)):
                cell = key + (int(token),)
                if token in ends[0] or level == NEW_TOKENS - 1:
                    cells[cell] = float(np.exp(total[token]))
                else:
                    nxt[cell] = total[token]
        frontier = nxt
    return cells


def _cell_probabilities(prompt, cells, sampling, ends):
    """Exact probabilities of cells (sequences of up to NEW_TOKENS tokens), batched per level."""
    logp = np.zeros(len(cells))
    for i in range(NEW_TOKENS):
        rows = [j for j, cell in enumerate(cells) if len(cell) > i]
        if not rows:
            break
        prefixes = [list(prompt) + list(cells[j][:i]) for j in rows]
        level = _next_logprobs(prefixes, sampling, _banned(ends, i))
        logp[rows] += level[np.arange(len(rows)), [cells[j][i] for j in rows]]
    return np.exp(logp)


def _sample(sampling, prompt, num_samples, gamma, stop_token_ids=(), min_tokens=0):
    """The first NEW_TOKENS tokens of `num_samples` seeded requests, and every round's accepts."""
    target, drafter = _models()
    cfg = _engine_config(gamma, sampling.penalized, len(sampling.logit_bias))
    engine = Engine(target, drafter, cfg, policy=FixedPolicy(gamma))
    requests = [
        Request(
            list(prompt),
            NEW_TOKENS,
            seed=i,
            sampling=sampling,
            stop_token_ids=stop_token_ids,
            min_tokens=min_tokens,
        )
        for i in range(num_samples)
    ]
    results, _ = generate(engine, requests)
    return [tuple(r.tokens) for r in results], np.concatenate([r.accepted for r in results])


def _chi_square(sampling, n=None, stop_token_ids=(), min_tokens=0):
    """(p-value, degrees of freedom, power at DETECT_TV, share of rounds accepting draft 1), on
    `n` samples (default: the case's) of requests with those stop tokens and min_tokens."""
    prompt, case_n, gamma = CASES[sampling]
    n = n or case_n
    assert len(prompt) == PROMPT_LEN
    ends = ((*stop_token_ids, *_models()[0].cfg.eos_token_ids), min_tokens)
    expected = _expected_cells(prompt, sampling, ends, MIN_EXPECTED / n)
    kept = sorted(expected, key=expected.get, reverse=True)
    probs = [expected[c] for c in kept]
    other = max(1.0 - sum(probs), 0.0)
    if n * other < MIN_EXPECTED:
        probs[-1] += other
    else:
        probs.append(other)
    bins = {c: i for i, c in enumerate(kept)}
    rest = len(probs) - 1
    samples, accepted = _sample(sampling, prompt, n, gamma, stop_token_ids, min_tokens)
    counts = np.zeros(len(probs))
    for cell in samples:
        counts[bins.get(cell, rest)] += 1

    rare = sorted(set(samples) - set(kept))
    impossible = [
        c
        for c, p in zip(rare, _cell_probabilities(prompt, rare, sampling, ends), strict=True)
        if p <= 0
    ]
    assert not impossible, f"sampled sequences the target cannot produce: {impossible[:5]}"

    expected_counts = n * np.asarray(probs)
    statistic = float(np.sum((counts - expected_counts) ** 2 / expected_counts))
    df = len(probs) - 1
    critical = stats.chi2.ppf(1.0 - ALPHA, df)
    power = float(stats.ncx2.sf(critical, df, 4.0 * n * DETECT_TV**2))
    return float(stats.chi2.sf(statistic, df)), df, power, float(np.mean(accepted >= 1))


# T=1 (65536 samples, 1.5 minutes of the default run) is slow: the default run keeps the filtered
# case, whose two drafts reach the residual at t2 and at t3 through the same verifier, and
# test_scheduled_lossless's whole-sequence test samples at T=1 unfiltered.
@pytest.mark.parametrize(
    "sampling",
    [
        pytest.param(T1, marks=pytest.mark.slow),
        T07_P09,
        # Min-p is one more cutoff in the same filter both sides apply; its default-run tests
        # hold it per row (test_sampling.py) and per slot (test_engine.py).
        pytest.param(T1_MIN_P, marks=pytest.mark.slow),
        # Penalties: the default run holds greedy tokens to the penalised target exactly
        # (test_penalties.py); this adds the draws, the residual and top-p under them.
        pytest.param(T07_P09_PENALISED, marks=pytest.mark.slow),
        # Logit bias: the default run holds greedy tokens to the biased target exactly
        # (test_logit_bias.py); this adds the draws, the residual and top-p under it.
        pytest.param(T07_P09_BIASED, marks=pytest.mark.slow),
        # Repetition penalty: the default run holds greedy tokens to the penalised target
        # exactly, prompt tokens included (test_repetition_penalty.py); this adds the draws.
        pytest.param(T07_P09_REPEATED, marks=pytest.mark.slow),
    ],
    ids=[
        "T1",
        "T0.7-top_p0.9",
        "T1-min_p0.1",
        "T0.7-top_p0.9-penalties",
        "T0.7-top_p0.9-bias",
        "T0.7-top_p0.9-repetition",
    ],
)
def test_speculative_sampling_matches_target(sampling):
    p_value, df, power, first_accept = _chi_square(sampling)
    assert power >= MIN_POWER, f"{df} degrees of freedom leave power {power:.3f}"
    # Rejections must be frequent, or the residual path would go untested.
    assert 0.3 < first_accept < 0.9, first_accept
    assert p_value > ALPHA, f"chi-square p = {p_value:.2e} with {df} degrees of freedom"


# min_tokens: after "th socket ti", "m" is the likeliest token ("time", "timeout"); as a stop token
# it may end a request only from its third token on, so the first two levels draw from the target
# with "m" masked out (the first at prefill, the second in the round's verification, where the
# drafter, which is not told, drafts "m" and is rejected) and the third from the target as is.
# The mass "m" leaves spreads over some 170 cells: 65536 samples keep the power above 0.9.
@pytest.mark.slow
def test_min_tokens_sampling_matches_the_masked_target():
    p_value, df, power, first_accept = _chi_square(T07_P09, 65536, (ord("m"),), 2)
    assert power >= MIN_POWER, f"{df} degrees of freedom leave power {power:.3f}"
    assert 0.3 < first_accept < 0.9, first_accept
    assert p_value > ALPHA, f"chi-square p = {p_value:.2e} with {df} degrees of freedom"


def _broken_correction(target_logp_bv, draft_logp_bv, rejected_b):
    """Samples the target row after a rejection instead of the residual max(p_t - p_d, 0)."""
    return target_logp_bv


# Samples the broken verifier is tested on. At T=0.7 / top-p 0.9 it is so far off (p 3e-258 on
# 4096 samples, measured 2026-11-27) that a fifth of the case's samples, one engine batch,
# shows the test rejects it: for a fixed alternative the chi-square test's power only grows
# with the samples, so the full test rejects it too. At T=1 the difference is small (p 0.06 on
# 4096 samples): that one runs on the case's 65536. Both are slow: they check the test's power,
# not the engine (the patched verifier is a program of its own, half a minute of compiling),
# and a broken residual in the engine's verifier also fails the default run's unit tests
# (tests/test_verify.py) and the T=0.7 / top-p 0.9 test above.
BROKEN_SAMPLES = {T07_P09: BATCH, T1: CASES[T1][1]}


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [T07_P09, T1], ids=["T0.7-top_p0.9", "T1"])
def test_broken_verifier_fails(sampling, monkeypatch):
    # The engine is built (so its round is traced) after patching: it uses the broken helper.
    monkeypatch.setattr(verify_module, "_correction_logprobs", _broken_correction)
    p_value, df, power, _ = _chi_square(sampling, BROKEN_SAMPLES[sampling])
    if BROKEN_SAMPLES[sampling] == CASES[sampling][1]:
        assert power >= MIN_POWER
    assert p_value < ALPHA, f"a broken verifier passed: p = {p_value:.2e} with {df} dof"
