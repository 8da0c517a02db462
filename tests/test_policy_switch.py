"""A `PolicySwitch`: several verification policies in one engine program.

Each member, once selected, must behave exactly as an engine built with that member alone --
same verified lengths round by round, same sampled tokens -- and selecting another member must
not compile anything. The unit tests pin the step itself: the chosen member's lengths, and
carries that advance only while their member is chosen."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixture_models import load_pair, reference_traces
from test_scheduled_engine import CFG, PROFILE

from dspark_jax.decoding import policies
from dspark_jax.decoding.batching import Batcher, Request, generate
from dspark_jax.decoding.engine import Engine, EngineError
from dspark_jax.sampling import SamplingConfig

TABLE = jnp.asarray(1.0 / (1.0 + 0.1 * np.arange(40)), jnp.float32)


def _members():
    return (
        policies.ThresholdPolicy(0.5),
        policies.AsyncSchedulePolicy(TABLE),
        policies.FixedPolicy(2),
        policies.ThresholdPolicy(0.3, cumulative=True),
    )


def test_step_is_the_chosen_members_step_and_only_its_carry_moves():
    members = _members()
    switch = policies.PolicySwitch(members)
    assert switch.needs_confidence and len(switch) == 4
    rng = np.random.default_rng(0)
    rounds = [jnp.asarray(rng.normal(1.0, 2.0, size=(3, 5)), jnp.float32) for _ in range(5)]
    active = jnp.array([True, False, True])
    step = jax.jit(switch.step)
    for index, member in enumerate(members):
        carry = switch.init_carry(3, 5, index)
        own = member.init_carry(3, 5)
        for t, logits in enumerate(rounds):
            lengths, carry = step(logits, active, carry)
            want, own = member.step(logits, active, own)
            np.testing.assert_array_equal(lengths, want, err_msg=f"member {index}, round {t}")
            assert not np.any(np.asarray(lengths)[~np.asarray(active)])
        # The async member's history advanced only while it was the one chosen.
        assert int(carry.carries[1].rounds_seen) == (5 if index == 1 else 0)
        jax.tree.map(np.testing.assert_array_equal, carry.carries[index], own)


def test_reset_slots_reaches_every_member():
    switch = policies.PolicySwitch(_members())
    carry = switch.init_carry(3, 5, 1)
    logits = jnp.ones((3, 5), jnp.float32)
    _, carry = switch.step(logits, jnp.array([True, True, True]), carry)
    carry = switch.reset_slots(carry, jnp.array([False, True, False]))
    np.testing.assert_array_equal(carry.carries[1].active_2b[1], [True, False, True])
    assert int(carry.index) == 1


def test_bad_switches_and_indices_are_refused():
    with pytest.raises(policies.PolicyError, match="at least one policy"):
        policies.PolicySwitch(())
    with pytest.raises(policies.PolicyError, match="holds policies, got int"):
        policies.PolicySwitch((policies.FixedPolicy(1), 3))
    inner = policies.PolicySwitch((policies.FixedPolicy(1),))
    with pytest.raises(policies.PolicyError, match="cannot hold another switch"):
        policies.PolicySwitch((inner,))
    switch = policies.PolicySwitch((policies.FixedPolicy(1), policies.FixedPolicy(2)))
    assert not switch.needs_confidence
    for bad in (2, -1, 0.5, "1", True):
        with pytest.raises(policies.PolicyError, match=r"integer in 0\.\.1"):
            switch.init_carry(4, 3, bad)


def _requests(temperature):
    return [
        Request(
            t["prompt"],
            max_new_tokens=40,
            seed=i,
            sampling=SamplingConfig(temperature=temperature),
        )
        for i, t in enumerate(reference_traces("vanilla")["traces"])
    ]


# The one switch the engine tests below build (one decode program for all of them): a
# threshold, the asynchronous scheduler, a fixed length, and the two members the selection
# test adds, a cumulative threshold and the prefix scheduler.
SWITCH_MEMBERS = (
    policies.ThresholdPolicy(0.5),
    policies.AsyncSchedulePolicy(PROFILE),
    policies.FixedPolicy(3),
    policies.ThresholdPolicy(0.3, cumulative=True),
    policies.PrefixSchedulePolicy(PROFILE),
)


def test_each_member_runs_as_its_own_engine_without_recompiling():
    """Sampled at T=1, so the tokens depend on every verified length; the switch engine's
    results under member i equal an engine built with member i alone (for a threshold, the
    asynchronous scheduler and a fixed length), and selecting the other members compiles
    nothing after the first run."""
    target, drafter = load_pair("vanilla")
    members = SWITCH_MEMBERS[:3]
    switch = Engine(target, drafter, CFG, policy=policies.PolicySwitch(SWITCH_MEMBERS))
    assert switch.token_buckets == PROFILE.buckets
    switch.warm_up()
    programs = switch.compiled_programs()
    requests = _requests(1.0)
    runs = []
    for index in range(len(members)):
        got, _ = generate(switch, requests, policy_index=index)
        assert switch.compiled_programs() == programs, f"member {index} compiled"
        runs.append([(r.tokens, r.verified.tolist(), r.accepted.tolist()) for r in got])
    for index, member in enumerate(members):
        alone, _ = generate(Engine(target, drafter, CFG, policy=member), requests)
        want = [(r.tokens, r.verified.tolist(), r.accepted.tolist()) for r in alone]
        assert runs[index] == want, f"member {index} ({type(member).__name__})"
    # The members really differ: a switch that ignored its index would pass the above only if
    # they all coincided.
    assert len({str(run) for run in runs}) == len(members)


def test_engine_checks_the_switch():
    target, drafter = load_pair("vanilla")
    single = Engine(target, drafter, CFG, policy=policies.ThresholdPolicy(0.5))
    with pytest.raises(policies.PolicyError, match="built with a PolicySwitch"):
        single.select_policy(single.init_state(), 0)
    other = policies.SpsProfile((4, 8, 16, 32), [100, 90, 70, 50])
    two_profiles = policies.PolicySwitch(
        (policies.PrefixSchedulePolicy(PROFILE), policies.AsyncSchedulePolicy(other))
    )
    with pytest.raises(EngineError, match="different token buckets"):
        Engine(target, drafter, dataclasses.replace(CFG, token_buckets=None), policy=two_profiles)
    switch = Engine(
        target,
        drafter,
        CFG,
        policy=policies.PolicySwitch((policies.FixedPolicy(1), policies.FixedPolicy(2))),
    )
    with pytest.raises(policies.PolicyError, match=r"integer in 0\.\.1"):
        switch.select_policy(switch.init_state(), 2)


def test_buckets_hold_the_members_longest_verification():
    """A switch's buckets serve every member: the largest holds the most drafts any member asks
    for, and a switch of fixed policies starts at the shortest one's block."""
    target, drafter = load_pair("vanilla")
    unset = dataclasses.replace(CFG, token_buckets=None)
    slots, gamma = CFG.num_slots, drafter.cfg.block_size
    fixed = policies.PolicySwitch((policies.FixedPolicy(1), policies.FixedPolicy(3)))
    assert Engine(target, drafter, unset, policy=fixed).token_buckets == (2, 4, 8, 16)
    mixed = policies.PolicySwitch((policies.FixedPolicy(1), policies.ThresholdPolicy(0.5)))
    buckets = Engine(target, drafter, unset, policy=mixed).token_buckets
    assert buckets[0] == slots and buckets[-1] == slots * (gamma + 1)


def test_selecting_any_member_after_warm_up_compiles_nothing():
    """`Batcher(engine, policy_index=i)` (`Engine.select_policy`) builds the members' carries
    on the host and moves them explicitly: no program at all compiles after warm_up, not even
    the small eager ones a carry built with jnp ops needs."""
    target, drafter = load_pair("vanilla")
    members = SWITCH_MEMBERS
    engine = Engine(target, drafter, CFG, policy=policies.PolicySwitch(members))
    engine.warm_up()
    programs = engine.compiled_programs()
    request = dataclasses.replace(_requests(0.0)[0], max_new_tokens=8)
    compiles = []
    listener = lambda name, *a, **k: compiles.append(name) if "compile" in name else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for index in (*range(len(members)), 0):
            batcher = Batcher(engine, policy_index=index)
            batcher.submit(request, lambda *a: None)
            batcher.run_until_idle()
            assert compiles == [], f"member {index}"
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert engine.compiled_programs() == programs
