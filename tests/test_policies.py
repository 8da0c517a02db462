"""Verification-length policies: unit behaviour, and Appendix A run through the whole engine.

The engine-level Appendix A test builds a target and a drafter whose distributions are exactly
the paper's toy (vocabulary {A, B}; p_t = (0.7, 0.3), p_d = (0.5, 0.5) at the first position,
c_1 = 0.8, c_2 = 0.9 after A and ~0 after B) by setting the weights of tiny Qwen3/DSpark models
by hand, then samples through prefill, drafting, the policy, verification and commit.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from dspark_jax.calibration.records import records_from_results
from dspark_jax.calibration.sts import CalibrationInputError, conditional_events
from dspark_jax.checkpoints.convert import (
    DictSource,
    drafter_from_torch,
    export_to_torch,
    target_from_torch,
)
from dspark_jax.config import DrafterConfig, Qwen3Config
from dspark_jax.decoding import policies, scheduler
from dspark_jax.decoding.batching import Request, Result, generate
from dspark_jax.decoding.engine import Engine, EngineConfig, EngineError
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sampling import SamplingConfig, filtered_logprobs

# ------------------------------------------------------------------ unit tests


def test_threshold_policy_is_threshold_lengths_on_sigmoid():
    logits = jnp.array([[2.0, -1.0, 3.0], [0.5, 0.5, 0.5], [4.0, 4.0, -4.0]])
    active = jnp.array([True, True, False])
    conf = jax.nn.sigmoid(logits)
    for cumulative in (False, True):
        policy = policies.ThresholdPolicy(0.6, cumulative)
        lengths, carry = jax.jit(policy.step)(logits, active, ())
        want = np.where(active, scheduler.threshold_lengths(conf, 0.6, cumulative), 0)
        np.testing.assert_array_equal(lengths, want)
        assert carry == ()
    np.testing.assert_array_equal(
        policies.ThresholdPolicy(0.6).step(logits, active, ())[0], [1, 3, 0]
    )
    with pytest.raises(policies.PolicyError, match="threshold"):
        policies.ThresholdPolicy(1.5)
    with pytest.raises(policies.PolicyError, match="confidence head"):
        policies.ThresholdPolicy(0.5).step(None, active, ())


def test_table_is_a_step_function_of_the_token_buckets():
    """A step verifying B tokens costs what the smallest profiled bucket >= B costs; past the
    largest bucket nothing can be scheduled (0 steps/s)."""
    profile = policies.SpsProfile((1, 2, 4, 8), [10.0, 9.0, 8.0, 4.0])
    np.testing.assert_allclose(profile.table(10), [10, 10, 9, 8, 8, 4, 4, 4, 4, 0, 0])
    with pytest.raises(policies.SpsProfileError, match="increasing"):
        policies.SpsProfile((4, 2), [1.0, 1.0])
    with pytest.raises(policies.SpsProfileError, match="positive"):
        policies.SpsProfile((1, 2), [1.0, 0.0])
    with pytest.raises(policies.SpsProfileError, match=r"\[buckets\]"):
        policies.SpsProfile((1, 2), [[1.0, 1.0]])


def test_sps_profile_round_trip_and_errors(tmp_path):
    profile = policies.SpsProfile((1, 2, 8), [9.0, 8.0, 6.0], {"device": "cpu", "date": "today"})
    profile.save(tmp_path / "sps.json")
    loaded = policies.SpsProfile.load(tmp_path / "sps.json")
    assert loaded.buckets == (1, 2, 8)
    np.testing.assert_array_equal(loaded.sps, profile.sps)
    assert loaded.meta == {"device": "cpu", "date": "today"}
    np.testing.assert_array_equal(loaded.table(9), [9, 9, 8, 6, 6, 6, 6, 6, 6, 0])
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(policies.SpsProfileError, match="not an SPS table"):
        policies.SpsProfile.load(tmp_path / "bad.json")
    (tmp_path / "missing.json").write_text(json.dumps({"format": policies.SPS_FORMAT}))
    with pytest.raises(policies.SpsProfileError, match="lacks"):
        policies.SpsProfile.load(tmp_path / "missing.json")


def test_prefix_policy_with_profile_matches_algorithm_1_on_its_table():
    profile = policies.SpsProfile((4, 8, 16, 32), [9.0, 8.0, 7.0, 4.0])
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(1.0, 1.5, size=(4, 7)), jnp.float32)
    active = jnp.array([True, False, True, True])
    policy = policies.PrefixSchedulePolicy(profile)
    lengths, _ = jax.jit(policy.step)(logits, active, policy.init_carry(4, 7))
    # 4 slots x (anchor + 7 drafts): the table covers up to 32 verified tokens.
    table = jnp.asarray(profile.table(32), jnp.float32)
    want = scheduler.prefix_schedule(jax.nn.sigmoid(logits), table, True, active)
    np.testing.assert_array_equal(lengths, want)
    assert int(lengths[1]) == 0  # the inactive slot verifies nothing


def test_async_policy_uses_capacity_from_two_rounds_before():
    table = jnp.asarray(1.0 / (1.0 + 0.2 * np.arange(40)), jnp.float32)
    policy = policies.AsyncSchedulePolicy(table)
    rng = np.random.default_rng(1)
    rounds = [jnp.asarray(rng.normal(1.0, 2.0, size=(3, 5)), jnp.float32) for _ in range(5)]
    actives = [jnp.array([True, True, True])] * 4 + [jnp.array([True, False, True])]
    step = jax.jit(policy.step)
    carry = policy.init_carry(3, 5)
    for t, (logits, active) in enumerate(zip(rounds, actives, strict=True)):
        lengths, carry = step(logits, active, carry)
        conf = jax.nn.sigmoid(logits)
        if t < 2:
            want = scheduler.prefix_schedule(conf, table, True, active)
        else:
            old_conf, old_active = jax.nn.sigmoid(rounds[t - 2]), actives[t - 2]
            capacity = scheduler.capacity_from_history(old_conf, table, old_active)
            want = scheduler.top_k_schedule(conf, capacity, active)
        np.testing.assert_array_equal(lengths, want, err_msg=f"round {t}")
    assert int(carry.rounds_seen) == 5


def test_make_policy():
    assert isinstance(policies.make_policy("fixed", 5), policies.FixedPolicy)
    assert policies.make_policy("cumulative-threshold", 7, threshold=0.4).cumulative
    with pytest.raises(policies.PolicyError, match="needs a threshold"):
        policies.make_policy("threshold", 7)
    with pytest.raises(policies.PolicyError, match="SPS table"):
        policies.make_policy("scheduler", 7)
    with pytest.raises(policies.PolicyError, match="unknown policy"):
        policies.make_policy("oracle", 7)


def _result(conf, verified, accepted):
    rounds = len(verified)
    return Result(
        [],
        "length",
        1,
        np.asarray(verified),
        np.asarray(accepted),
        np.ones(rounds, int),
        np.asarray(conf, float).reshape(rounds, 3),
    )


def test_records_from_results_conditional_events():
    results = [
        _result([[1, 2, 3], [4, 5, 6]], [3, 1], [1, 1]),
        _result(np.zeros((0, 3)), [], []),
        _result([[7, 8, 9]], [2], [2]),
    ]
    records = records_from_results(results)
    assert len(records) == 3
    np.testing.assert_array_equal(records.conf_logits_nk[:, 0], [1, 4, 7])
    observed, accepted = conditional_events(records)
    # l=3, n=1: accepted at 1, rejected at 2; l=1, n=1: accepted at 1; l=2, n=2: both accepted.
    np.testing.assert_array_equal(observed, [[1, 1, 0], [1, 0, 0], [1, 1, 0]])
    np.testing.assert_array_equal(accepted[observed], [1, 0, 1, 1, 1])
    with pytest.raises(CalibrationInputError, match="no verification rounds"):
        records_from_results([results[1]])


# ------------------------------------------------------------------ Appendix A in the engine

A, B, S, P, MASK, EOS = 0, 1, 2, 3, 4, 5
VOCAB, HIDDEN = 8, 16
P_T = {P: {S: 1.0}, S: {A: 0.7, B: 0.3}, A: {A: 0.6, B: 0.4}, B: {A: 0.2, B: 0.8}}
P_D = {S: {A: 0.5, B: 0.5}, A: {A: 0.9, B: 0.1}, B: {A: 0.5, B: 0.5}}
CONF = {S: 0.8, A: 0.9, B: 1e-13}  # c_k as a function of the previous token
APPENDIX_SPS = [0.0, 1.0, 0.5, 0.45]  # SPS(1) = 1, SPS(2) = 0.5, SPS(3) = 0.45
ADMITTING_SPS = [0.0, 1.0, 0.6, 0.45]  # early stop admits x_1, and x_2 only after A
N_TOY = 4096
ALPHA = 1e-3
# Block size 2: every slot verifying its whole block is 3 tokens.
TOY_CFG = EngineConfig(
    num_slots=N_TOY,
    max_model_len=16,
    page_size=8,
    rounds_per_chunk=4,
    prefill_chunk=2048,
    prefill_seqs=2048,
    prefill_buckets=(2048,),
    token_buckets=(N_TOY * 3,),
    draft_buckets=(N_TOY,),  # one program branch each, as for the tokens: compile time
)


def _log_table(rows):
    """[V, V] table t[prev, next] = log p(next | prev); unlisted pairs get ~0 probability."""
    table = np.full((VOCAB, VOCAB), np.log(1e-12))
    table[:, A] = table[:, B] = np.log(0.5)  # contexts the toy never reaches
    for prev, dist in rows.items():
        table[prev] = np.log(1e-12)
        for nxt, p in dist.items():
            table[prev, nxt] = np.log(p)
    return table


def _silence_layers(tensors, prefix):
    """Zero every attention and MLP output, so the residual stream is the token embedding."""
    for key in tensors:
        if key.startswith(prefix + "layers.") and key.endswith(
            ("o_proj.weight", "down_proj.weight")
        ):
            tensors[key] = np.zeros_like(tensors[key])


def _toy_models():
    """A bigram target with p_t[prev] = P_T and a drafter drawing from P_D with confidence
    CONF[prev]: one-hot embeddings, silenced layers, all drafter logits from the Markov bias."""
    target_cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        eos_token_id=EOS,
        dtype="float32",
    )
    drafter_cfg = DrafterConfig(
        model=dataclasses.replace(target_cfg, num_hidden_layers=1),
        block_size=2,
        mask_token_id=MASK,
        target_layer_ids=(0,),
        num_target_layers=2,
        markov_rank=VOCAB,
    )
    one_hot = np.eye(VOCAB, HIDDEN, dtype=np.float32)
    # RMSNorm maps a one-hot row to sqrt(HIDDEN) times itself; lm_head undoes the factor.
    tensors = export_to_torch(Qwen3(target_cfg, rngs=nnx.Rngs(0)), "model.")
    _silence_layers(tensors, "model.")
    tensors["model.embed_tokens.weight"] = one_hot
    tensors["lm_head.weight"] = (_log_table(P_T).T @ one_hot / np.sqrt(HIDDEN)).astype(np.float32)
    target = target_from_torch(target_cfg, DictSource(tensors))

    tensors = export_to_torch(DSparkDrafter(drafter_cfg, rngs=nnx.Rngs(0)), "")
    _silence_layers(tensors, "")
    tensors["lm_head.weight"] = np.zeros_like(tensors["lm_head.weight"])
    tensors["markov_head.markov_w1.weight"] = np.eye(VOCAB, dtype=np.float32)
    tensors["markov_head.markov_w2.weight"] = _log_table(P_D).T.astype(np.float32)
    conf_w = np.zeros((1, HIDDEN + VOCAB), np.float32)
    for prev, c in CONF.items():
        conf_w[0, HIDDEN + prev] = np.log(c / (1 - c))
    tensors["confidence_head.proj.weight"] = conf_w
    tensors["confidence_head.proj.bias"] = np.zeros(1, np.float32)
    drafter = drafter_from_torch(drafter_cfg, DictSource(tensors))
    return target, drafter


@dataclasses.dataclass(frozen=True, eq=False)
class PerRequest:
    """Schedules every row alone (R = 1), as in the paper's single-request example: the rows
    of the batch are independent replicas of the toy."""

    inner: policies.Policy
    needs_confidence = True

    def init_carry(self, batch, gamma):
        return self.inner.init_carry(1, gamma)  # a batch of one: the SPS table of one row

    def reset_slots(self, carry, mask_b):
        return carry

    def step(self, conf_logits_bk, active_b, carry):
        def one(z_k, a):
            return self.inner.step(z_k[None], a[None], carry)[0][0]

        return jax.vmap(one)(conf_logits_bk, active_b), carry


@pytest.fixture(scope="module")
def toy():
    return _toy_models()


def _toy_law(target):
    """Exact joint law of (y1, y2) after the anchor S, from the toy target's own logits."""
    logp = filtered_logprobs(
        target.logits(target(jnp.array([[P, S, A], [P, S, B]])).hidden),
        SamplingConfig(temperature=1.0),
    )
    p1 = np.exp(np.asarray(logp[0, 1], np.float64))
    p2 = np.exp(np.asarray(logp[:, 2], np.float64))
    return np.array([[p1[a] * p2[a, b] for b in (A, B)] for a in (A, B)]).ravel()


def _run_toy(toy, policy):
    target, drafter = toy
    engine = Engine(target, drafter, TOY_CFG, PerRequest(policy))
    t1 = SamplingConfig(temperature=1.0)
    results, _ = generate(engine, [Request([P], 3, seed=i, sampling=t1) for i in range(N_TOY)])
    tokens = np.array([r.tokens for r in results])
    assert np.all(tokens[:, 0] == S)
    assert np.all(np.isin(tokens[:, 1:], [A, B]))
    first_round = np.array([r.verified[0] for r in results])
    return tokens[:, 1], tokens[:, 2], first_round


def _p_value(y1, y2, law):
    observed = np.bincount(2 * y1 + y2, minlength=4)
    return stats.chisquare(observed, law / np.sum(law) * y1.size).pvalue


def test_appendix_a_through_the_engine(toy):
    """N = 4096 requests per policy, chi-square on the first two tokens after the anchor
    (4 cells, 3 d.o.f.) against the exact target law at ALPHA = 0.001. The early-stop scheduler
    must pass with both SPS tables; the retrospective search (no early stop) must fail, with the
    paper's analytic first-token law (0.85, 0.15). Power: the retrospective bias gives
    lambda = N (0.15^2/0.7 + 0.15^2/0.3) = 439 on y1 alone, so missing it has probability ~0."""
    law = _toy_law(toy[0])
    np.testing.assert_allclose(law, [0.42, 0.28, 0.06, 0.24], rtol=1e-4)

    y1, y2, lengths = _run_toy(toy, policies.PrefixSchedulePolicy(APPENDIX_SPS))
    np.testing.assert_array_equal(np.unique(lengths), [0])
    assert _p_value(y1, y2, law) > ALPHA

    y1, y2, lengths = _run_toy(toy, policies.PrefixSchedulePolicy(ADMITTING_SPS))
    assert set(np.unique(lengths)) == {1, 2}  # 2 exactly when x_1 = A was drafted
    assert _p_value(y1, y2, law) > ALPHA

    y1, y2, lengths = _run_toy(toy, policies.PrefixSchedulePolicy(APPENDIX_SPS, early_stop=False))
    assert set(np.unique(lengths)) == {0, 2}
    assert _p_value(y1, y2, law) < ALPHA
    assert (
        stats.chisquare(np.bincount(y1, minlength=2), [0.85 * N_TOY, 0.15 * N_TOY]).pvalue > ALPHA
    )


def test_engine_takes_policy_objects_only(toy):
    policy = policies.FixedPolicy(2)
    assert isinstance(policy, policies.Policy) and not policy.needs_confidence
    lengths, carry = policy.step(None, jnp.array([True, False]), policy.init_carry(2, 4))
    np.testing.assert_array_equal(lengths, [2, 0])
    target, drafter = toy
    assert Engine(target, drafter, TOY_CFG, policy=policy).policy is policy

    def first_two(conf_logits_bk, active_b):
        return jnp.where(active_b, 2, 0)

    for bad in (first_two, 3):
        with pytest.raises(policies.PolicyError, match="must be a Policy"):
            Engine(target, drafter, TOY_CFG, policy=bad)


def test_token_buckets_follow_the_most_drafts_a_policy_verifies(toy):
    # A fixed gamma below the block verifies gamma + 1 tokens per slot at most: the derived
    # buckets (hence the compiled target forwards) stop there, and a bucket of that size is
    # enough; every other policy may ask for the whole block (gamma 2 here).
    target, drafter = toy
    unset = dataclasses.replace(TOY_CFG, token_buckets=None)
    one = Engine(target, drafter, unset, policy=policies.FixedPolicy(1)).token_buckets
    assert one[0] == 2 and one[-1] == N_TOY * 2
    assert Engine(target, drafter, unset).token_buckets[-1] == N_TOY * 3
    assert Engine(target, drafter, unset, policy=policies.FixedPolicy(5)).token_buckets[-1] == (
        N_TOY * 3
    )
    threshold = policies.ThresholdPolicy(0.5)
    assert Engine(target, drafter, unset, policy=threshold).token_buckets[-1] == N_TOY * 3
    small = dataclasses.replace(TOY_CFG, token_buckets=(N_TOY * 2,))
    assert Engine(target, drafter, small, policy=policies.FixedPolicy(1)).token_buckets == (
        N_TOY * 2,
    )
    with pytest.raises(EngineError, match="all slots verifying 2 drafts each would not fit"):
        Engine(target, drafter, small)


def test_engine_requires_confidences_for_confidence_policies(toy):
    target, drafter = toy
    no_head = dataclasses.replace(
        drafter.cfg, enable_confidence_head=False, confidence_head_with_markov=False
    )
    bare = DSparkDrafter(no_head, rngs=nnx.Rngs(0))
    with pytest.raises(EngineError, match="confidence head"):
        Engine(target, bare, TOY_CFG, policy=policies.ThresholdPolicy(0.5))
    Engine(target, bare, TOY_CFG, policy=policies.FixedPolicy(1))


@pytest.mark.parametrize(
    ("field", "value", "refusal"),
    [
        ("buckets", ["a"], "buckets must be strictly increasing positive integers"),
        ("buckets", 5, "buckets must be strictly increasing positive integers, got 5"),
        ("buckets", None, "got None"),
        ("buckets", [8.7], r"got \[8\.7\]"),  # was truncated to 8
        ("sps", ["x"], r"sps must be numbers, got \['x'\]"),
        ("num_slots", "2", "num_slots must be an integer >= 1, got '2'"),
    ],
)
def test_a_hand_edited_sps_table_is_refused_by_name(field, value, refusal, tmp_path):
    """A table is a file users edit: a bad field raised a raw TypeError or ValueError (a
    traceback from the commands), and a string num_slots read 'profiled for 2 slots, but the
    engine has 2'."""
    path = tmp_path / "sps.json"
    policies.SpsProfile((8, 16), [10.0, 9.0], {"num_slots": 2}).save(path)
    body = json.loads(path.read_text())
    body[field] = value
    path.write_text(json.dumps(body))
    with pytest.raises(policies.SpsProfileError, match=f"^{path}: .*{refusal}"):
        policies.SpsProfile.load(path)


def test_sps_metadata_cannot_shadow_the_table_and_numpy_values_are_saved(tmp_path):
    """`meta` is spread into the file beside the table: a "buckets" key was dropped on the round
    trip and a "format" one made a file `load` refused; numpy scalars failed `save`."""
    for key in ("format", "buckets", "sps"):
        with pytest.raises(policies.SpsProfileError, match=f"table's own fields \\['{key}'\\]"):
            policies.SpsProfile((8,), [1.0], {key: 1})
    path = tmp_path / "sps.json"
    table = policies.SpsProfile((8,), [1.0], {"num_slots": np.int64(2), "spread": np.float32(0.5)})
    table.save(path)
    assert policies.SpsProfile.load(path).meta == {"num_slots": 2, "spread": 0.5}
    with pytest.raises(policies.SpsProfileError, match="meta must be JSON data"):
        policies.SpsProfile((8,), [1.0], {"when": object()}).save(tmp_path / "other.json")
    assert not (tmp_path / "other.json").exists()


@pytest.mark.parametrize(
    ("build", "refusal"),
    [
        (lambda: policies.FixedPolicy(2.5), r"gamma must be an integer >= 0, got 2\.5"),
        (lambda: policies.FixedPolicy("3"), "gamma must be an integer >= 0, got '3'"),
        (lambda: policies.FixedPolicy(None), "got None"),
        (lambda: policies.ThresholdPolicy("0.5"), "threshold must be a number in .*, got '0.5'"),
        (lambda: policies.ThresholdPolicy(None), "threshold must be a number"),
        (lambda: policies.ThresholdPolicy(float("nan")), r"must lie in \[0, 1\], got nan"),
    ],
)
def test_policy_parameters_are_refused_when_the_policy_is_built(build, refusal):
    """FixedPolicy(2.5) built an engine with token buckets (3.5, 7.0) that failed at warm_up
    with Python's "'float' object cannot be interpreted as an integer"; a string threshold
    failed on a comparison."""
    with pytest.raises(policies.PolicyError, match=refusal):
        build()
    assert policies.FixedPolicy(np.int64(3)).gamma == 3
