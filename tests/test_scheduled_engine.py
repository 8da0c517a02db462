"""The engine with confidence policies on the fixture models: greedy outputs are exactly the
target's, the verified lengths are Algorithm 1's on the (STS-calibrated) confidences of each
round with the SPS table over total verified tokens, an STS artifact applies only to requests
sampled at its temperature, and artifacts of another drafter or block size are refused."""

import dataclasses

import jax
import numpy as np
import pytest
from compile_events import compile_threads
from fixture_models import VARIANTS_GATED_SLOW, load_pair, reference_traces
from test_scheduler import _reference_alg1, _survival

from dspark_jax.calibration.sts import StsArtifact, StsArtifactMismatchError
from dspark_jax.checkpoints.fingerprint import drafter_fingerprint
from dspark_jax.decoding import policies
from dspark_jax.decoding.batching import Request, generate
from dspark_jax.decoding.engine import Engine, EngineConfig, EngineError
from dspark_jax.sampling import SamplingConfig

# Steps/s per total verified tokens with a real trade-off: more tokens cost throughput. Three
# buckets: each is a branch of the decode program, and on this CPU the six of (4, 8, 12, 16, 24,
# 32) took 23 s to compile per engine against 13 s for these three, for the same checks.
PROFILE = policies.SpsProfile((8, 16, 32), [96, 82, 55])
# The four 48-token prompts are prefilled in one call, so the requests' rounds line up.
CFG = EngineConfig(
    num_slots=4,
    max_model_len=256,
    prefill_chunk=256,
    prefill_buckets=(256,),
    rounds_per_chunk=16,
    token_buckets=PROFILE.buckets,
)
STS_TEMPS = (1.5, 0.8, 1.2, 0.6, 1.0, 2.0, 0.9)


def _requests(variant):
    return [Request(t["prompt"], max_new_tokens=97) for t in reference_traces(variant)["traces"]]


def _check_greedy(variant, results):
    for trace, res in zip(reference_traces(variant)["traces"], results, strict=True):
        assert res.tokens[:96] == trace["greedy"]
        assert np.all(res.accepted <= res.verified)
        assert np.all(res.committed <= res.accepted + 1)


@pytest.mark.parametrize(
    "policy",
    [
        policies.ThresholdPolicy(0.5),
        policies.ThresholdPolicy(0.3, cumulative=True),
        policies.AsyncSchedulePolicy(PROFILE),
    ],
    ids=["threshold", "cumulative", "async"],
)
def test_greedy_output_is_the_target_greedy_output(policy):
    target, drafter = load_pair("vanilla")
    results, _ = generate(Engine(target, drafter, CFG, policy=policy), _requests("vanilla"))
    _check_greedy("vanilla", results)
    verified = np.concatenate([r.verified for r in results])
    assert 0 < verified.mean() < drafter.cfg.block_size  # the policy really cuts blocks short


@pytest.mark.parametrize("variant", VARIANTS_GATED_SLOW)
def test_engine_lengths_are_algorithm_1_and_greedy_is_exact(variant):
    """Each round's verified lengths equal the paper's Algorithm 1 loop (which asserts that it
    never admits position j of a request before j-1) run on that round's confidences after STS,
    with the profile's SPS over total verified tokens; the output stays the greedy one."""
    target, drafter = load_pair(variant)
    fingerprint = drafter_fingerprint(drafter)
    sts = StsArtifact(STS_TEMPS, fingerprint, 0.0, n_records=1)
    engine = Engine(
        target,
        drafter,
        CFG,
        policy=policies.PrefixSchedulePolicy(PROFILE),
        sts=sts,
        drafter_fingerprint=fingerprint,
    )
    assert engine.token_buckets == PROFILE.buckets
    results, _ = generate(engine, _requests(variant))
    _check_greedy(variant, results)

    gamma = drafter.cfg.block_size
    table = PROFILE.table(4 * (gamma + 1)).astype(np.float32)
    n_rounds = max(r.rounds for r in results)
    lengths_seen = set()
    for t in range(n_rounds):
        active = np.array([r.rounds > t for r in results])
        conf = np.zeros((4, gamma), np.float32)
        for b, r in enumerate(results):
            if active[b]:
                conf[b] = jax.nn.sigmoid(r.conf_logits[t] / np.asarray(STS_TEMPS, np.float32))
        want = _reference_alg1(_survival(conf), table, True, active)
        got = [r.verified[t] if active[b] else 0 for b, r in enumerate(results)]
        np.testing.assert_array_equal(got, want, err_msg=f"round {t}")
        lengths_seen.update(int(x) for x in got)
    assert len(lengths_seen) >= 3  # the schedule varies with the confidences


def test_sts_applies_to_requests_at_its_temperature():
    """An artifact fitted at T=1 changes the lengths of T=1 requests and leaves greedy requests
    in the same batch with their raw confidences; artifacts of another drafter or block size,
    or without the fingerprint to check, are refused."""
    target, drafter = load_pair("vanilla")
    fingerprint = drafter_fingerprint(drafter)
    # Temperatures far from 1 move many confidences across the threshold (not one of 0.5: scaling
    # a logit keeps its sign).
    policy = policies.ThresholdPolicy(0.7)
    sharp = StsArtifact((0.05,) * 7, fingerprint, 1.0, n_records=1)
    trace = reference_traces("vanilla")["traces"][0]
    greedy = Request(trace["prompt"], 60)
    hot = Request(trace["prompt"], 60, seed=3, sampling=SamplingConfig(temperature=1.0))
    raw = Engine(target, drafter, CFG, policy=policy)
    calibrated = Engine(
        target, drafter, CFG, policy=policy, sts=sharp, drafter_fingerprint=fingerprint
    )
    (raw_greedy, raw_hot), _ = generate(raw, [greedy, hot])
    (cal_greedy, cal_hot), _ = generate(calibrated, [greedy, hot])
    np.testing.assert_array_equal(cal_greedy.verified, raw_greedy.verified)
    assert cal_greedy.tokens == raw_greedy.tokens
    rounds = min(raw_hot.rounds, cal_hot.rounds)
    assert not np.array_equal(cal_hot.verified[:rounds], raw_hot.verified[:rounds])

    _, gated = load_pair("gated")
    with pytest.raises(StsArtifactMismatchError, match="calibrated for drafter"):
        Engine(target, drafter, CFG, sts=sharp, drafter_fingerprint=drafter_fingerprint(gated))
    short = dataclasses.replace(sharp, temperatures=(0.05,) * 5)
    with pytest.raises(StsArtifactMismatchError, match="5 temperatures"):
        Engine(target, drafter, CFG, sts=short, drafter_fingerprint=fingerprint)
    with pytest.raises(EngineError, match="drafter_fingerprint"):
        Engine(target, drafter, CFG, sts=sharp)
    with pytest.raises(EngineError, match="needs a drafter"):
        Engine(target, None, CFG, sts=sharp, drafter_fingerprint=fingerprint)


def test_profile_buckets_must_match_the_engine():
    target, drafter = load_pair("vanilla")
    policy = policies.PrefixSchedulePolicy(PROFILE)
    with pytest.raises(EngineError, match="differ from the SPS profile"):
        Engine(target, drafter, dataclasses.replace(CFG, token_buckets=(8, 32)), policy=policy)
    small = policies.SpsProfile((4, 8, 16), [3.0, 2.0, 1.0])
    # Buckets left to the profile, which stops short of every slot verifying its whole block.
    unset = dataclasses.replace(CFG, token_buckets=None)
    with pytest.raises(EngineError, match="num_slots x \\(drafts \\+ 1\\)"):
        Engine(target, drafter, unset, policy=policies.PrefixSchedulePolicy(small))


def test_engines_apart_only_in_their_sps_profile_share_the_decode_program():
    """A scheduler's SPS table is data in the policy carry, not a constant of the decode
    program: engines whose profiles differ only in the step rates measured lower to the same
    decode and prefill programs, which the persistent compilation cache builds once (a table
    profiled again, or a placeholder compiled while the real table is measured). Only the small
    init program, which writes the table into the state, differs."""
    target, drafter = load_pair("vanilla")
    other = policies.SpsProfile(PROFILE.buckets, [50.0, 40.0, 30.0])

    def lowered(profile):
        switch = policies.PolicySwitch(
            (
                policies.FixedPolicy(7),
                policies.PrefixSchedulePolicy(profile),
                policies.AsyncSchedulePolicy(profile),
            )
        )
        programs = Engine(target, drafter, CFG, policy=switch).lower()
        return {name: program.as_text() for name, program in programs.items()}

    ours, theirs = lowered(PROFILE), lowered(other)
    assert ours.keys() == theirs.keys() and "decode_chunk" in ours
    same = {name for name in ours if ours[name] == theirs[name]}
    assert same == set(ours) - {"init"}, sorted(same)


def test_a_switch_compiled_beside_the_profile_on_a_stand_in_table_is_built_once(monkeypatch):
    """What benchmarks/throughput.py and `--sps-table auto` do: the engine to be built on the
    measured table is first built on a stand-in table of the same buckets and compiled with the
    profiled round; the engine on the measured table then finds every program but its init (the
    one that writes the table into the state) in the persistent compilation cache."""
    from dspark_jax.decoding.engine import COMPILE_WORKERS_ENV
    from dspark_jax.decoding.profiling import profile_engine, stand_in_profile

    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("the persistent compilation cache is off (DSPARK_JAX_COMPILATION_CACHE)")
    target, drafter = load_pair("vanilla")
    # A configuration no other test builds: its programs are in no cache yet.
    cfg = EngineConfig(
        num_slots=2, max_model_len=88, prefill_chunk=32, prefill_buckets=(32,),
        token_buckets=(2, 16),
    )  # fmt: skip

    def switch(sps):
        return policies.PolicySwitch(
            (policies.FixedPolicy(7), policies.PrefixSchedulePolicy(sps),
             policies.AsyncSchedulePolicy(sps))
        )  # fmt: skip

    # Only where compile threads are to spare: two compiles sharing two cores gain nothing.
    monkeypatch.setenv(COMPILE_WORKERS_ENV, "2")
    assert stand_in_profile(cfg, drafter.cfg.block_size) is None
    monkeypatch.setenv(COMPILE_WORKERS_ENV, "4")
    placeholder = stand_in_profile(cfg, drafter.cfg.block_size)
    buckets = placeholder.buckets
    stand_in = Engine(target, drafter, cfg, policy=switch(placeholder))
    events = {"compiles": 0, "hits": 0}

    def compiled(name, *args, **kwargs):
        if name.endswith("backend_compile_duration"):
            events["compiles"] += 1

    def hit(name, **kwargs):
        if name == "/jax/compilation_cache/cache_hits":
            events["hits"] += 1

    names = (
        "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes"
    )  # fmt: skip
    saved = {n: getattr(jax.config, n) for n in names}
    for n in names:  # every program cached, however quickly it compiles here
        jax.config.update(n, 0)
    try:
        quick = {"context_len": 8, "steps": 1, "repeats": 1}
        profile = profile_engine(target, drafter, cfg, compile_with=(stand_in,), **quick)
        assert profile.buckets == buckets == (2, 16)
        engine = Engine(target, drafter, cfg, policy=switch(profile))
        jax.monitoring.register_event_duration_secs_listener(compiled)
        jax.monitoring.register_event_listener(hit)
        try:
            engine.warm_up()
        finally:
            jax.monitoring.unregister_event_duration_listener(compiled)
            jax.monitoring.unregister_event_listener(hit)
    finally:
        for n, value in saved.items():
            jax.config.update(n, value)
    assert events["compiles"] == len(engine.lower()) == 4, events  # init, prefill, decode, release
    assert events["hits"] == events["compiles"] - 1, events


def test_profile_engine_compile_only_times_nothing():
    """compile_only: the profiled round program (and `compile_with`'s) compiled, nothing run,
    None returned; verify mode, which compiles its own programs as it times, refuses it."""
    from dspark_jax.decoding.profiling import ProfileError, profile_engine

    target, drafter = load_pair("vanilla")
    cfg = EngineConfig(num_slots=2, max_model_len=64, prefill_chunk=32, prefill_buckets=(32,),
                       token_buckets=(16,))  # fmt: skip
    quick = {"context_len": 8, "steps": 1, "repeats": 1}
    with pytest.raises(ProfileError, match="verify mode has none"):
        profile_engine(target, drafter, cfg, mode="verify", compile_only=True, **quick)
    plain = Engine(target, None, dataclasses.replace(cfg, token_buckets=(2,)))
    returned = []
    built = compile_threads(
        lambda: returned.append(
            profile_engine(target, drafter, cfg, compile_with=(plain,), compile_only=True, **quick)
        )
    )
    assert returned == [None]
    # The round program and the plain engine's, each once: no state filled, nothing timed.
    assert len(built) == 1 + len(plain.lower())


def _profile(**meta):
    return policies.SpsProfile(PROFILE.buckets, PROFILE.sps, meta)


def test_an_engine_refuses_an_sps_profile_of_another_slot_count_or_model():
    """A profile's step times describe one batch of one model. The CLI refused a mismatch, but
    an engine built from Python took it silently and scheduled with another engine's times."""
    target, drafter = load_pair("vanilla")
    ours = policies.sps_model(target.cfg, drafter.cfg)
    Engine(target, drafter, CFG, policy=policies.PrefixSchedulePolicy(_profile(num_slots=4)))
    Engine(
        target,
        drafter,
        CFG,
        policy=policies.PrefixSchedulePolicy(_profile(num_slots=4, model=ours)),
    )
    eight = policies.PrefixSchedulePolicy(_profile(num_slots=8, model=ours))
    with pytest.raises(policies.PolicyError, match="profiled for 8 slots, but the engine has 4"):
        Engine(target, drafter, CFG, policy=eight)
    other = {**ours, "drafter": {**ours["drafter"], "block_size": 5}}
    with pytest.raises(
        policies.PolicyError, match=r"another model \(drafter block_size: 5 in the table, 7 here"
    ):
        Engine(
            target,
            drafter,
            CFG,
            policy=policies.AsyncSchedulePolicy(_profile(num_slots=4, model=other)),
        )
    # Every member of a switch is checked.
    switch = policies.PolicySwitch((policies.FixedPolicy(7), eight))
    with pytest.raises(policies.PolicyError, match="profiled for 8 slots"):
        Engine(target, drafter, CFG, policy=switch)


def test_profile_engine_records_the_models_it_timed(capsys):
    """Only the CLI recorded the model (through a CLI helper), so a table profiled from Python
    later drew a false "an older dspark-jax profile wrote it" warning and went unchecked."""
    from dspark_jax.cli import args as cli_args
    from dspark_jax.decoding.profiling import ProfileError, profile_engine

    target, drafter = load_pair("vanilla")
    cfg = EngineConfig(num_slots=2, token_buckets=(2, 16))
    quick = {"mode": "verify", "context_len": 16, "steps": 1, "repeats": 1}
    profile = profile_engine(target, drafter, cfg, **quick)
    assert profile.meta["model"] == policies.sps_model(target.cfg)  # verify mode: no drafter
    assert "temperature" not in profile.meta  # verify mode samples nothing
    with pytest.raises(ProfileError, match="records the models it times itself"):
        profile_engine(target, drafter, cfg, model={"target": {}}, **quick)

    scheduled = dataclasses.replace(CFG, num_slots=2, token_buckets=None)
    Engine(target, drafter, scheduled, policy=policies.PrefixSchedulePolicy(profile))
    with pytest.raises(policies.PolicyError, match="profiled for 2 slots, but the engine has 4"):
        Engine(target, drafter, CFG, policy=policies.PrefixSchedulePolicy(profile))
    # The command line takes it without the warning meant for tables of older versions.
    cli_args.check_sps_table("sps.json", profile, 2, target.cfg, drafter.cfg, lambda p, n: "")
    assert capsys.readouterr().err == ""


def test_profile_engine_compiles_the_callers_next_engines_with_its_round():
    """`compile_with`: the caller's next engine (benchmarks/throughput.py's plain one) compiles
    on the profiler's threads, beside the profiled round and before any timing, so that its own
    warm-up afterwards compiles nothing and the round program is still built only once."""
    from dspark_jax.decoding.profiling import profile_engine

    target, drafter = load_pair("vanilla")
    cfg = EngineConfig(
        num_slots=2, max_model_len=64, prefill_chunk=32, prefill_buckets=(32,), token_buckets=(16,)
    )
    plain = Engine(target, None, dataclasses.replace(cfg, token_buckets=(2,)))
    quick = {"context_len": 8, "steps": 1, "repeats": 1}
    built = compile_threads(
        lambda: profile_engine(target, drafter, cfg, compile_with=(plain,), **quick)
    )
    pooled = [name for name in built if name.startswith("dspark-compile")]
    # The round program and every program of the plain engine, each once; what the profile
    # compiled on its own thread afterwards are small eager operations (filling its state).
    assert len(pooled) == 1 + len(plain.lower())
    programs = plain.compiled_programs()
    assert compile_threads(plain.warm_up) == []
    assert plain.compiled_programs() == programs
