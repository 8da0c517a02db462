"""The slot engine reproduces the reference's greedy traces, and a request's tokens depend only on
itself and its seed: not on its slot mates, their settings, or when it joined a running batch."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_events import compile_threads
from fixture_models import (
    TRACE_CFG,
    TRACE_PLAIN_CFG,
    VARIANTS,
    VARIANTS_GATED_SLOW,
    load_pair,
    reference_traces,
)

from dspark_jax.decoding.batching import Batcher, Observer, Request, generate
from dspark_jax.decoding.engine import (
    COMPILE_WORKERS_ENV,
    FAST_TOP_K,
    TOP_LOGPROBS,
    Engine,
    EngineConfig,
    EngineError,
    _top_k,
    default_compile_workers,
    warm_up_all,
)
from dspark_jax.errors import UserError
from dspark_jax.models.attention import ATTENTION_ENV
from dspark_jax.models.layers import GRAPH_LOOPS_ENV
from dspark_jax.sampling import SamplingConfig

# The reference counts its 96 tokens after the first one, then keeps the first 96 overall.
REFERENCE_NEW_TOKENS = 97
CFG, PLAIN_CFG = TRACE_CFG, TRACE_PLAIN_CFG  # shared with tests/test_prefix_cache.py
GREEDY = SamplingConfig()
T1 = SamplingConfig(temperature=1.0)
T07_P09 = SamplingConfig(temperature=0.7, top_p=0.9)
T1_MIN_P = SamplingConfig(temperature=1.0, min_p=0.3)


@pytest.fixture(scope="module", params=VARIANTS)
def setup(request):
    target, drafter = load_pair(request.param)
    spec = Engine(target, drafter, CFG)
    spec.warm_up()
    return request.param, target, drafter, spec


def _requests(traces, **kw):
    return [Request(t["prompt"], max_new_tokens=REFERENCE_NEW_TOKENS, **kw) for t in traces]


def test_greedy_traces_alone_and_batched(setup):
    variant, target, _, spec = setup
    traces = reference_traces(variant)["traces"]
    batched, _ = generate(spec, _requests(traces))
    for trace, res in zip(traces, batched, strict=True):
        alone, _ = generate(spec, _requests([trace]))
        for r in (res, alone[0]):
            assert r.tokens[:96] == trace["output"]
            assert r.committed.tolist() == trace["acceptance_lengths"]
        assert res.tokens[:96] == trace["greedy"]
        assert res.finish_reason == "length"
    greedy, _ = generate(Engine(target, None, PLAIN_CFG), _requests(traces))
    for trace, res in zip(traces, greedy, strict=True):
        assert res.tokens[:96] == trace["greedy"]
        assert set(res.committed.tolist()) == {1}


def _mixed_requests(sampling, seed_base=0):
    text = b"def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description="
    return [
        Request(list(text[: 20 + 9 * i]), 12 + 5 * i, seed=seed_base + i, sampling=sampling)
        for i in range(6)
    ]


def _run_joining_late(engine, background, late, steps_before):
    """`late` submitted after the loop has run `steps_before` steps over `background`."""
    batcher = Batcher(engine)
    results = {}

    def keep(name):
        return lambda kind, payload: results.__setitem__(name, payload) if kind == "done" else None

    for i, r in enumerate(background):
        batcher.submit(r, keep(i))
    for _ in range(steps_before):
        batcher.step()
    assert any(o is not None for o in batcher.owners), "the background batch already finished"
    batcher.submit(late, keep("late"))
    batcher.run_until_idle()
    assert batcher.allocator.free == engine.cfg.pool_pages  # every page came back
    return results["late"]


@pytest.mark.parametrize("sampling", [GREEDY, T1, T07_P09], ids=["greedy", "T1", "T0.7-p0.9"])
def test_batch_invariance(setup, sampling):
    """Alone, with five other requests (more than the slots: some wait), or submitted while the
    others run: the same tokens."""
    _, _, _, spec = setup
    requests = _mixed_requests(sampling)
    together, _ = generate(spec, requests)
    for i in (0, 3):
        alone, _ = generate(spec, [requests[i]])
        assert alone[0].tokens == together[i].tokens
        assert len(together[i].tokens) == requests[i].max_new_tokens
    background = [
        dataclasses.replace(r, max_new_tokens=90) for r in _mixed_requests(sampling, 100)[:3]
    ]
    late = _run_joining_late(spec, background, requests[4], steps_before=2)
    assert late.tokens == together[4].tokens
    reseeded, _ = generate(spec, [dataclasses.replace(requests[3], seed=99)])
    if sampling.temperature > 0:
        assert reseeded[0].tokens != together[3].tokens


def test_settings_are_per_request(setup):
    """One batch mixing greedy, T=1 and filtered requests gives each what it gets alone."""
    variant, _, _, spec = setup
    trace = reference_traces(variant)["traces"][0]
    mixed = [
        Request(trace["prompt"], REFERENCE_NEW_TOKENS),
        *_mixed_requests(T1)[:2],
        _mixed_requests(T07_P09)[2],
        _mixed_requests(T1_MIN_P)[1],
    ]
    together, _ = generate(spec, mixed)
    assert together[0].tokens[:96] == trace["output"]
    for i in (1, 2, 3, 4):
        alone, _ = generate(spec, [mixed[i]])
        assert alone[0].tokens == together[i].tokens
    # The same request and seed without min-p draws otherwise: the setting reached its slot.
    assert together[4].tokens != together[2].tokens


def test_no_compilation_after_warmup(setup):
    """warm_up() builds every program; new temperatures, prompt lengths, batch mixes and
    cancellations then compile nothing."""
    _, _, _, spec = setup
    before = spec.compiled_programs()
    compiles = []
    listener = lambda name, *a, **k: compiles.append(name) if "compile" in name else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        odd = SamplingConfig(temperature=0.4321, top_k=7, top_p=0.77)
        generate(spec, _mixed_requests(odd, seed_base=5)[::-1])
        batcher = Batcher(spec)
        handles = [batcher.submit(r, lambda *a: None) for r in _mixed_requests(T1)]
        batcher.step()
        batcher.cancel(handles[0])
        batcher.run_until_idle()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert spec.compiled_programs() == before
    assert before == len(spec.prefill_widths) + 3  # prefills, decode, release, init


@pytest.mark.parametrize("variant", VARIANTS_GATED_SLOW)
@pytest.mark.parametrize("workers", [1, 2])
def test_warm_up_compiles_each_program_once(variant, workers):
    """warm_up() compiles every program (init, the prefill buckets, the decode chunk, release)
    on its worker threads, and the scratch run after them finds those executables: no program
    compiles twice; with one worker every program compiles on the calling thread."""
    target, drafter = load_pair(variant)
    engine = Engine(target, drafter, CFG)
    where = compile_threads(lambda: engine.warm_up(workers))
    programs = len(engine.prefill_widths) + 3
    on_pool = [w for w in where if w.startswith("dspark-compile")]
    assert len(on_pool) == (programs if workers > 1 else 0)
    # beyond the programs, at most the small op jnp.asarray of release's mask compiles (jax 0.10)
    assert programs <= len(where) <= programs + 1
    assert engine.compiled_programs() == programs


@pytest.mark.parametrize("variant", VARIANTS_GATED_SLOW)
def test_warm_up_all_compiles_every_engine_on_the_pool(variant):
    """warm_up_all builds every program of several engines at once; each engine's scratch run
    then compiles nothing of its own, and later calls compile nothing either."""
    target, drafter = load_pair(variant)
    engines = [Engine(target, None, PLAIN_CFG), Engine(target, drafter, CFG)]
    where = compile_threads(lambda: warm_up_all(engines, workers=2))
    programs = sum(len(e.prefill_widths) + 3 for e in engines)
    assert sum(w.startswith("dspark-compile") for w in where) == programs
    assert len(where) <= programs + 1
    for engine in engines:
        assert compile_threads(engine.warm_up) == []


def test_the_serving_loop_makes_no_implicit_transfers(setup):
    """Prefill, decode chunks, cancellation and release move data only by explicit transfers
    (the prefill batch, the results read), so jax.transfer_guard can police the loop."""
    _, _, _, spec = setup
    requests = _mixed_requests(T1)
    guards = (jax.transfer_guard_host_to_device, jax.transfer_guard_device_to_host)
    with guards[0]("disallow"), guards[1]("disallow"):
        batcher = Batcher(spec)
        done = []
        on_event = lambda kind, payload: done.append(payload) if kind == "done" else None  # noqa: E731
        handles = [batcher.submit(r, on_event) for r in requests]
        batcher.step()
        batcher.cancel(handles[0])
        batcher.run_until_idle()
        results, _ = generate(spec, requests[:2])
    assert len(done) == len(requests) and len(results) == 2
    assert sum(r.finish_reason == "abort" for r in done) == 1


def _prefilled(spec, max_new_tokens):
    """A batcher whose requests (one per entry of `max_new_tokens`) are prefilled and live."""
    batcher = Batcher(spec)
    for r, n in zip(_mixed_requests(GREEDY), max_new_tokens, strict=False):
        batcher.submit(dataclasses.replace(r, max_new_tokens=n), lambda *a: None)
    batcher._drain_inbox()
    batcher._admit()
    while batcher.prefilling:
        batcher._unread.append(("prefill", *batcher._dispatch_prefill()))
        batcher._read_unread()
    return batcher


def test_a_chunk_yields_when_a_request_finishes(setup):
    """With yield_on_finish the chunk ends in the round a request finishes; without it, the
    other slots run the chunk's remaining rounds. Both modes are one program."""
    _, _, _, spec = setup
    before = spec.compiled_programs()
    rounds = {}
    for flag in (False, True):
        batcher = _prefilled(spec, (3, 100))
        _, out = spec.decode_chunk(batcher.state, yield_on_finish=flag)
        assert np.asarray(out.finished_s).sum() == 1  # the 3-token request, in round 1 or 2
        rounds[flag] = int((np.asarray(out.verified_sr) >= 0).any(axis=0).sum())
    assert rounds[True] <= 2 and rounds[False] == CFG.rounds_per_chunk
    assert spec.compiled_programs() == before


def test_a_freed_slot_is_refilled_in_the_next_chunk_when_requests_wait(setup):
    """Under load the loop reads the chunk in flight before dispatching the next, so a request
    waiting for a slot is admitted (and prefilled) in the step right after the chunk in which
    a slot freed -- not one chunk later."""
    _, _, _, spec = setup
    batcher = Batcher(spec)
    slots = spec.cfg.num_slots
    requests = [dataclasses.replace(r, max_new_tokens=100) for r in _mixed_requests(GREEDY)]
    requests = [dataclasses.replace(requests[0], max_new_tokens=3), *requests[1 : slots + 1]]
    handles = [batcher.submit(r, lambda *a: None) for r in requests]
    batcher.step()  # admits and prefills `slots` requests, dispatches the first chunk
    assert handles[slots].slot is None and batcher.num_waiting == 1
    batcher.step()  # reads that chunk (the short request ended in it), admits the waiting one
    assert handles[0].finished and handles[slots].slot is not None
    batcher.run_until_idle()
    assert all(h.finished for h in handles)


def test_cancelled_requests_free_their_slot_and_pages(setup):
    _, _, _, spec = setup
    batcher = Batcher(spec)
    events = {}
    requests = [dataclasses.replace(r, max_new_tokens=60) for r in _mixed_requests(T1)]
    handles = [
        batcher.submit(r, lambda kind, p, i=i: events.setdefault(i, []).append(kind))
        for i, r in enumerate(requests)
    ]
    batcher.step()
    batcher.cancel(handles[0])  # running
    batcher.cancel(handles[5])  # still waiting: there are four slots
    batcher.run_until_idle()
    assert events[0][-1] == "done" and events[5] == ["done"]
    assert batcher.allocator.free == spec.cfg.pool_pages
    assert sorted(batcher.free_slots) == list(range(spec.cfg.num_slots))


def _stream_with_faults(spec, requests, fault):
    """Streams `requests` through one Batcher, calling `fault(event_count)` in every callback
    and stepping again after whatever a step raises: what each request was sent, its result."""
    batcher = Batcher(spec)
    streamed = {i: [] for i in range(len(requests))}
    results, raised, count = {}, [], [0]

    def callback(i):
        def on_event(kind, payload):
            count[0] += 1
            if kind == "tokens":
                streamed[i] += payload
            else:
                results[i] = payload
            fault(count[0])

        return on_event

    for i, r in enumerate(requests):
        batcher.submit(r, callback(i))
    for _ in range(1000):
        try:
            if not batcher.step():
                break
        except (RuntimeError, KeyboardInterrupt) as e:
            raised.append(e)
    else:
        pytest.fail(f"the loop did not finish; results for {sorted(results)}")
    return streamed, results, raised


def test_an_exception_in_a_callback_loses_and_repeats_no_token(setup):
    """A callback that raises (a user's bug, Ctrl-C in a notebook) makes step() raise once its
    bookkeeping is done: stepping on delivers every token exactly once."""
    _, _, _, spec = setup
    requests = [dataclasses.replace(r, max_new_tokens=40) for r in _mixed_requests(T1)[:3]]
    reference, _ = generate(spec, requests)

    def fault(n):
        if n in (2, 5):
            raise RuntimeError("a bug in the callback")
        if n == 7:
            raise KeyboardInterrupt

    streamed, results, raised = _stream_with_faults(spec, requests, fault)
    assert [type(e) for e in raised] == [RuntimeError, RuntimeError, KeyboardInterrupt]
    for i, ref in enumerate(reference):
        assert streamed[i] == results[i].tokens == ref.tokens
        assert results[i].finish_reason == ref.finish_reason


def test_an_interrupt_while_waiting_for_the_device_loses_no_token(setup, monkeypatch):
    """Ctrl-C most likely lands while the host waits for a chunk's results: the chunk stays
    unread and the next step reads it, so no token is lost or sent twice."""
    import dspark_jax.decoding.batching as batching

    _, _, _, spec = setup
    requests = [dataclasses.replace(r, max_new_tokens=40) for r in _mixed_requests(T1)[:3]]
    reference, _ = generate(spec, requests)
    fetches = [0]
    device_get = jax.device_get

    def interrupted(x):
        fetches[0] += 1
        if fetches[0] in (2, 4, 5):
            raise KeyboardInterrupt
        return device_get(x)

    monkeypatch.setattr(batching.jax, "device_get", interrupted)
    streamed, results, raised = _stream_with_faults(spec, requests, lambda n: None)
    monkeypatch.undo()
    assert len(raised) == 3
    for i, ref in enumerate(reference):
        assert streamed[i] == results[i].tokens == ref.tokens


def test_the_observer_times_every_token_the_engine_produced(setup):
    """benchmarks/throughput.py measures time to first token and inter-token latency with
    these two hooks."""
    _, _, _, spec = setup

    class Counting(Observer):
        first = later = 0

        def on_first_token(self, ttft_s: float) -> None:
            self.first += 1

        def on_tokens(self, count: int, inter_token_s: float) -> None:
            assert inter_token_s >= 0
            self.later += count

    observer = Counting()
    batcher = Batcher(spec, observer=observer)
    results = {}
    for i, r in enumerate(_mixed_requests(T1)[:3]):
        batcher.submit(r, lambda kind, p, i=i: results.update({i: p}) if kind == "done" else None)
    batcher.run_until_idle()
    assert observer.first == 3
    assert observer.first + observer.later == sum(len(r.tokens) for r in results.values())


def test_long_prompts_prefill_in_chunks(setup):
    """A prompt longer than prefill_chunk is prefilled over several calls interleaved with
    decoding, and its greedy answer is the target's own: each token the argmax of one
    whole-sequence forward over prompt + answer at the place before it (a stricter check than
    an engine prefilling in one call, and no 256-token prefill program to compile for it)."""
    variant, target, _, spec = setup
    trace = reference_traces(variant)["traces"][1]
    prompt = (list(trace["prompt"]) * 4)[:150]
    assert len(prompt) > 2 * CFG.prefill_chunk
    batcher = Batcher(spec, timed=True)
    got = {}
    batcher.submit(Request(trace["prompt"], 40), lambda k, p: got.setdefault("short", p))
    batcher.step()
    batcher.submit(Request(prompt, 40), lambda k, p: got.__setitem__("long", p))
    batcher.run_until_idle()
    assert batcher.timing.prefill_calls >= 3
    tokens = got["long"].tokens
    assert len(tokens) == 40 and max(got["long"].committed) > 1  # drafts were accepted
    seq = jnp.asarray(prompt + tokens, jnp.int32)[None]
    logits = np.asarray(target.logits(target(seq).hidden[0]))
    rows = logits[len(prompt) - 1 : -1]
    assert rows.argmax(axis=-1).tolist() == tokens
    # Not a near tie anywhere, so a last-bit difference between the two forwards cannot flip it.
    top2 = np.sort(rows, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-4


def test_requests_that_cannot_fit_are_refused(setup):
    _, _, _, spec = setup
    with pytest.raises(EngineError, match="max_model_len is 256"):
        generate(spec, [Request([1] * 200, max_new_tokens=100)])
    with pytest.raises(EngineError, match="empty prompt"):
        generate(spec, [Request([], max_new_tokens=4)])
    with pytest.raises(EngineError, match="max_new_tokens must be >= 1"):
        generate(spec, [Request([1, 2], max_new_tokens=0)])


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (Request([5, 6, 7, 8], 2.5), "max_new_tokens must be an integer"),
        (Request([5, 6, 7, 8], 4, sampling=0.7), "sampling must be a SamplingConfig"),
        (Request([5, 6], 4, logprobs=1), "logprobs must be True or False"),
        (Request([5, 6], 4, logprobs=True, top_logprobs=21), r"top_logprobs must be .* 0\.\.20"),
        (Request([5, 6], 4, top_logprobs=2), "top_logprobs needs logprobs=True"),
    ],
    ids=["float_max_new_tokens", "float_sampling", "int_logprobs", "top_21", "top_alone"],
)
def test_a_malformed_request_is_refused_at_submit_and_stalls_nothing(setup, bad, fragment):
    """A float max_new_tokens, a top_k past int32 or a sampling that is no SamplingConfig used to
    pass `submit` and then raise inside every later `step()`, so the good request queued beside
    it never finished."""
    _, _, _, spec = setup
    batcher = Batcher(spec)
    done = []
    batcher.submit(Request([5, 6, 7, 8], 4), lambda k, p: done.append(p) if k == "done" else 0)
    with pytest.raises(EngineError, match=fragment):
        batcher.submit(bad, lambda kind, payload: None)
    batcher.run_until_idle()
    assert [r.finish_reason for r in done] == ["length"]
    with pytest.raises(ValueError, match="top_k must be an integer in 0..2147483647"):
        SamplingConfig(1.0, top_k=2**40)
    with pytest.raises(EngineError, match=r"request 1: max_new_tokens must be an integer .* 5\.0"):
        generate(spec, [Request([5, 6], 4), Request([5, 6], 10 / 2)])


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "plain"])
def test_finished_requests_leave_no_sampling_work_behind(monkeypatch, speculative):
    """A finished request's settings stayed in its slot, so a lone greedy request beside seven
    finished top-k/top-p ones ran the filter search and the random draw every round (1.7x
    slower on the embedded pair): the rows the rounds filter and sample with are greedy for
    every slot without a live request, and for the verification's padding."""
    import dspark_jax.decoding.engine as engine_module

    seen = []

    def record(fn, rows_of):
        def wrapped(*args, **kwargs):
            rows = rows_of(args)
            jax.debug.callback(
                lambda *settings: seen.append(tuple(np.asarray(a) for a in settings)),
                rows.temperature,
                rows.top_k,
                rows.top_p,
                rows.min_p,
            )
            return fn(*args, **kwargs)

        return wrapped

    # The target's side: verification, plain steps and prefill's first token all sample
    # through it (logits, rows).
    monkeypatch.setattr(
        engine_module,
        "logprobs_and_argmax",
        record(engine_module.logprobs_and_argmax, lambda a: a[1]),
    )
    drafter_class = engine_module.DSparkDrafter
    # The drafter's block sampling (self, h, anchors, keys, sampling, ...).
    monkeypatch.setattr(
        drafter_class, "sample_block", record(drafter_class.sample_block, lambda a: a[4])
    )
    target, drafter = load_pair("vanilla")
    # One drafter branch over all eight slots and the fewest verification branches: the rows
    # of finished slots go through every sampling call (compiling fewer branches, not checking
    # fewer rows).
    buckets = (8, 64) if speculative else (8,)
    cfg = dataclasses.replace(CFG, num_slots=8, token_buckets=buckets, draft_buckets=(8,))
    engine = Engine(target, drafter if speculative else None, cfg)
    fancy = SamplingConfig(temperature=1.3, top_k=5, top_p=0.8, min_p=0.1)
    batcher = Batcher(engine)
    for i in range(7):  # each finishes at its first token
        batcher.submit(Request([5, 6, 7 + i], 1, seed=i, sampling=fancy), lambda k, p: 0)
    batcher.run_until_idle()
    seen.clear()
    batcher.submit(Request([5, 6, 7], 24, ignore_eos=True), lambda k, p: 0)
    batcher.run_until_idle()
    assert seen  # the rounds (and the prefill's first token) went through the recorded calls
    for temperature, top_k, top_p, min_p in seen:
        np.testing.assert_array_equal(temperature, 0.0)
        np.testing.assert_array_equal(top_k, 0)
        np.testing.assert_array_equal(top_p, 1.0)
        np.testing.assert_array_equal(min_p, 0.0)


def test_plain_decoding_lm_head_follows_the_token_bucket():
    """Plain decoding ran the lm head over every slot, live or not ([8, vocab] at one live slot
    of 8); it runs over the bucket's rows, and the tokens are those of before (checked by the
    traces and the seeded-sampling tests)."""
    target, _ = load_pair("vanilla")
    vocab = target.cfg.vocab_size
    cfg = EngineConfig(num_slots=8, max_model_len=64, token_buckets=(2, 8))
    text = Engine(target, None, cfg).lower()["decode_chunk"].as_text()
    rows = set(re.findall(rf"dot_general.*-> tensor<(\d+)x{vocab}x", text))
    assert rows == {"2", "8"}


def test_the_drafter_runs_over_the_slot_bucket_of_the_live_slots():
    """The drafter's block ran for every slot, live or not (one live request of 16 slots took
    3.0x the time per token of a 1-slot engine on the embedded pair, CPU): its lm head runs
    over the smallest slot bucket that holds the live slots, and over every slot only when
    the buckets are just `(num_slots,)`."""
    target, drafter = load_pair("vanilla")
    vocab = target.cfg.vocab_size
    gamma = drafter.cfg.block_size
    rows = {}
    for given in (None, (8,)):
        cfg = EngineConfig(
            num_slots=8, max_model_len=64, token_buckets=(8, 64), draft_buckets=given
        )
        engine = Engine(target, drafter, cfg)
        text = engine.lower()["decode_chunk"].as_text()
        rows[given] = set(re.findall(rf"dot_general.*-> tensor<{gamma}x(\d+)x{vocab}x", text))
        assert engine.draft_buckets == (given or (4, 8))
    assert rows == {None: {"4", "8"}, (8,): {"8"}}


@pytest.mark.parametrize("variant", VARIANTS_GATED_SLOW)
def test_slot_buckets_change_which_rows_draft_not_what_they_draw(variant):
    """Six requests of different lengths through four slots, so the live slots (and the slot
    bucket) change from round to round: the same tokens and verified lengths as an engine that
    drafts every slot, greedy and sampled, and the same confidences up to float32 rounding (the
    drafter's matrix products over 2 or 4 rows may round their last bit differently, as the
    target's over different token buckets do: docs/engine.md, "Batch invariance"). The rows
    are gathered before the drafter runs and its Markov head works on each row alone, so the
    gated pair (a second comparison engine to compile) runs in the slow set."""
    target, drafter = load_pair(variant)
    spec = Engine(target, drafter, CFG)  # the setup fixture's programs, from the cache
    assert spec.draft_buckets == (2, 4)
    every = Engine(target, drafter, dataclasses.replace(CFG, draft_buckets=(CFG.num_slots,)))
    for sampling in (GREEDY, T07_P09):
        requests = _mixed_requests(sampling)
        ours, _ = generate(spec, requests)
        theirs, _ = generate(every, requests)
        for a, b in zip(ours, theirs, strict=True):
            assert a.tokens == b.tokens
            np.testing.assert_array_equal(a.verified, b.verified)
            np.testing.assert_array_equal(a.committed, b.committed)
            np.testing.assert_allclose(a.conf_logits, b.conf_logits, rtol=1e-6, atol=1e-6)


def test_a_request_without_a_seed_gets_its_own(setup):
    """Requests that share a seed share their draws (the same prompt sampled alike: eight
    samples that are one); without a seed each request draws a fresh one, kept in its handle,
    and giving that seed back reproduces it."""
    _, _, _, spec = setup
    prompt = [5, 6, 7, 8]
    batcher = Batcher(spec)
    got: dict[int, list[int]] = {}

    def on(i):
        return lambda kind, payload: got.__setitem__(i, payload.tokens) if kind == "done" else 0

    handles = [batcher.submit(Request(prompt, 12, sampling=T1), on(i)) for i in range(8)]
    batcher.run_until_idle()
    seeds = [h.request.seed for h in handles]
    assert all(isinstance(s, int) and 0 <= s < 2**32 for s in seeds)
    assert len(set(seeds)) == 8
    assert len({tuple(got[i]) for i in range(8)}) > 1
    again, _ = generate(spec, [Request(prompt, 12, seed=seeds[3], sampling=T1)])
    assert again[0].tokens == got[3]
    shared, _ = generate(spec, [Request(prompt, 12, seed=7, sampling=T1) for _ in range(3)])
    assert len({tuple(r.tokens) for r in shared}) == 1


def test_a_page_size_the_kernels_cannot_take_is_refused(setup):
    _, target, drafter, _ = setup
    cfg = dataclasses.replace(CFG, page_size=12, attention_impl="pallas_gpu")
    with pytest.raises(EngineError, match="power-of-two page_size, got 12"):
        Engine(target, drafter, cfg)


def test_stop_tokens_end_requests(setup):
    variant, _, _, spec = setup
    trace = reference_traces(variant)["traces"][0]
    stop_at = trace["output"][10]
    res, _ = generate(spec, [Request(trace["prompt"], 97, stop_token_ids=(stop_at,))])
    first = trace["output"].index(stop_at)
    assert res[0].tokens == trace["output"][: first + 1]
    assert res[0].finish_reason == "stop"
    np.testing.assert_array_equal(res[0].accepted <= res[0].verified, True)


def _trace_prefix(variant, impl, interpret, num_tokens):
    """Two reference prompts batched through an engine on `impl`: (traces, results), each result
    `num_tokens` long."""
    target, drafter = load_pair(variant)
    traces = reference_traces(variant)["traces"][:2]
    # Two slots, one verification and one drafter branch: the two requests run side by side to
    # the end, and each branch compiles (and interprets) the attention path once more.
    cfg = dataclasses.replace(
        CFG,
        num_slots=2,
        token_buckets=(2 * (drafter.cfg.block_size + 1),),
        draft_buckets=(2,),
        attention_impl=impl,
        attention_interpret=interpret,
    )
    requests = [Request(t["prompt"], max_new_tokens=num_tokens) for t in traces]
    results, _ = generate(Engine(target, drafter, cfg), requests)
    return traces, results


# The Triton kernels run natively on a GPU and in Pallas interpret mode everywhere else.
GPU_INTERPRET = jax.default_backend() != "gpu"


@pytest.mark.parametrize(
    "impl, interpret",
    [("dense", False), ("pallas_gpu", GPU_INTERPRET)],
    ids=["dense", "pallas_gpu"],
)
def test_attention_paths_reproduce_the_traces(impl, interpret):
    """The engine's other attention paths -- the dense reference and the Pallas GPU kernels run
    in interpret mode -- give the reference's greedy tokens, prefill, packed verification and
    the drafter's context included. 24 tokens of two batched traces bound the interpreter's
    cost here; the slow test below runs the whole traces."""
    traces, results = _trace_prefix(VARIANTS[0], impl, interpret, 24)
    for trace, res in zip(traces, results, strict=True):
        assert res.tokens == trace["output"][:24]


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_path_reproduces_whole_traces_in_interpret_mode(variant):
    traces, results = _trace_prefix(variant, "pallas_gpu", GPU_INTERPRET, REFERENCE_NEW_TOKENS)
    for trace, res in zip(traces, results, strict=True):
        assert res.tokens[:96] == trace["output"]
        assert res.committed.tolist() == trace["acceptance_lengths"]


def _sixteen_bit_pool_run(engine):
    """The embedded 16-bit pair through `engine`: (whole-pool converts in its compiled decode
    chunk and prefill, the state's dtypes, its state_bytes, each request's tokens, verified
    lengths and confidence bytes, the target's pools after the run)."""
    cfg = engine.cfg
    layout = engine.target_layout
    pool = f"{cfg.num_pages},{cfg.page_size},{2 * layout.num_kv_heads},{layout.head_dim}"
    # An instruction giving a whole pool that is a convert (or a fusion named for one).
    convert = re.compile(
        rf"^\s*(ROOT )?%(\S*convert\S*) = \w+\[{pool}\]|= \w+\[{pool}\]\S* convert\("
    )
    lowered = engine.lower()
    pool_converts = [
        x
        for verb in ("decode_chunk", "prefill_64")
        for x in lowered[verb].compile().as_text().splitlines()
        if convert.search(x)
    ]
    dtypes = {p.dtype.name for p in jax.tree.leaves(jax.eval_shape(engine.init_state))}
    requests = [
        Request(list(range(5 + 7 * i, 30 + 9 * i)), 24, seed=i, sampling=s, ignore_eos=True)
        for i, s in enumerate((GREEDY, T1, T07_P09))
    ]
    batcher = Batcher(engine)
    done = {}
    for i, r in enumerate(requests):
        batcher.submit(r, lambda kind, p, i=i: done.__setitem__(i, p) if kind == "done" else 0)
    batcher.run_until_idle()
    results = [done[i] for i in range(len(requests))]
    runs = [(r.tokens, r.verified.tolist(), r.conf_logits.tobytes()) for r in results]
    pools = [np.asarray(p) for p in jax.tree.leaves(batcher.state.target_pages)]
    return pool_converts, dtypes, engine.state_bytes, runs, pools


def _sixteen_bit_pair():
    from dspark_jax.checkpoints.converted import load_decoding_models
    from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET

    models = load_decoding_models(EMBEDDED_TARGET, EMBEDDED_DRAFT, progress=False)
    assert models.target.dtype == np.dtype("bfloat16")
    cfg = EngineConfig(
        num_slots=2,
        max_model_len=256,
        num_pages=40,  # a pool shape no other array has
        page_size=16,
        rounds_per_chunk=4,
        prefill_chunk=64,
        prefill_buckets=(64,),
        token_buckets=(16,),
    )
    return models, cfg


def test_cpu_16_bit_pools_are_stored_in_float32_holding_16_bit_values(monkeypatch):
    """jax 0.10's XLA:CPU gathers and scatters bfloat16 arrays through a float32 copy of the
    whole array, so a bf16 pool cost a pass over every layer's pool per step (a step's cost
    followed the pool size, not the context). There the pools of a 16-bit pair store float32:
    the compiled decode chunk and prefill convert no whole pool, the state is measured in
    float32 (the memory check), and what the pools hold are bfloat16 values (rounded as they are
    written), so the results are those of bfloat16 pools; the slow test below compares the two
    bit for bit. Where XLA:CPU gathers bfloat16 natively the pools stay bfloat16."""
    from dspark_jax.models import attention

    models, cfg = _sixteen_bit_pair()
    engine = models.engine(cfg)
    converts, dtypes, state_bytes, runs, pools = _sixteen_bit_pool_run(engine)
    assert converts == [] and all(len(tokens) == 24 for tokens, _, _ in runs)
    if not attention.cpu_gathers_through_float32("bfloat16"):
        # Newer XLA:CPU (jax >= 0.11) gathers bfloat16 natively: the pools stay bfloat16.
        assert "bfloat16" in dtypes
        return
    assert "bfloat16" not in dtypes
    assert {p.dtype for p in pools} == {np.dtype("float32")}
    written = np.concatenate([p.ravel() for p in pools])
    assert np.count_nonzero(written) > 1000  # the run wrote keys and values
    as_bf16 = np.asarray(jnp.asarray(written, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(written, as_bf16)
    # The memory check weighs the pools as stored: 2 more bytes per element than bfloat16's.
    with monkeypatch.context() as m:
        m.setattr(attention, "pool_value_dtype", lambda *a: None)
        old_bytes = models.engine(cfg).state_bytes
    state = jax.eval_shape(engine.init_state)
    pool_elements = sum(x.size for x in jax.tree.leaves((state.target_pages, state.draft_pages)))
    assert state_bytes - old_bytes == 2 * pool_elements


@pytest.mark.slow
def test_cpu_16_bit_pools_in_float32_give_the_results_of_16_bit_pools(monkeypatch):
    """The float32-stored pools of the test above against bfloat16 pools as before: the same
    tokens, verified lengths and confidences bit for bit (a second engine to compile and run;
    the default run checks that the stored values are bfloat16's)."""
    from dspark_jax.models import attention

    models, cfg = _sixteen_bit_pair()
    _, _, _, runs, _ = _sixteen_bit_pool_run(models.engine(cfg))
    with monkeypatch.context() as m:  # the 16-bit pools as before, for comparison
        m.setattr(attention, "pool_value_dtype", lambda *a: None)
        old_converts, old_dtypes, _, old_runs, _ = _sixteen_bit_pool_run(models.engine(cfg))
    assert runs == old_runs
    if attention.cpu_gathers_through_float32("bfloat16"):
        assert old_converts and "bfloat16" in old_dtypes  # what the check above would have seen


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the Triton path is this backend's")
def test_environment_switches_are_refused_as_the_users_error(monkeypatch):
    """A nonsense DSPARK_JAX_GRAPH_LOOPS, or the Triton attention asked for off a GPU, is one
    line of the user's error, not a traceback (a ValueError from deep in tracing before)."""
    target, _ = load_pair("vanilla")
    cfg = EngineConfig(num_slots=1, max_model_len=64)
    monkeypatch.setenv(GRAPH_LOOPS_ENV, "maybe")
    with pytest.raises(UserError, match=r"^DSPARK_JAX_GRAPH_LOOPS='maybe': expected 0 \(off\)"):
        Engine(target, None, cfg)
    monkeypatch.delenv(GRAPH_LOOPS_ENV)
    monkeypatch.setenv(ATTENTION_ENV, "pallas_gpu")
    engine = Engine(target, None, cfg)  # built: it may be lowered for a GPU from here
    for run in (engine.warm_up, engine.init_state):
        with pytest.raises(EngineError, match=r"^the pallas_gpu attention is a Triton kernel"):
            run()
    # Interpreted (the CPU tests of the kernel), it runs.
    Engine(target, None, dataclasses.replace(cfg, attention_interpret=True)).init_state()


def test_compile_workers_come_from_the_environment(monkeypatch):
    """DSPARK_JAX_COMPILE_WORKERS sets how many programs warm-up compiles at once; nonsense is
    refused by name instead of silently compiling one at a time."""
    monkeypatch.setenv(COMPILE_WORKERS_ENV, "3")
    assert default_compile_workers() == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(COMPILE_WORKERS_ENV, bad)
        with pytest.raises(EngineError, match=COMPILE_WORKERS_ENV):
            default_compile_workers()
    monkeypatch.delenv(COMPILE_WORKERS_ENV)
    assert default_compile_workers() >= 1


def _check_logprobs(target, prompts, results) -> None:
    """Each token's reported log-probability is log_softmax of the target's logits at the
    position it was sampled at, from one whole-sequence forward over prompt + answer."""
    spread = []
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.logprobs) == len(result.tokens) > 1
        seq = jnp.asarray(prompt + result.tokens, jnp.int32)[None]
        logp = jax.nn.log_softmax(target.logits(target(seq).hidden[0]), axis=-1)
        start, n = len(prompt), len(result.tokens)
        rows = np.asarray(logp[start - 1 : start - 1 + n])
        want = rows[np.arange(n), result.tokens]
        np.testing.assert_allclose(result.logprobs, want, atol=2e-4, rtol=1e-4)
        spread.append(np.min(want))
        if result.top_logprobs is not None:  # the k likeliest at each place, likeliest first
            assert len(result.top_logprobs) == n
            k = len(result.top_logprobs[0])
            ids = np.array([[i for i, _ in alts] for alts in result.top_logprobs])
            values = np.array([[v for _, v in alts] for alts in result.top_logprobs])
            np.testing.assert_array_equal(ids, np.argsort(-rows, axis=-1, kind="stable")[:, :k])
            np.testing.assert_allclose(values, -np.sort(-rows, axis=-1)[:, :k], atol=2e-4)
    assert min(spread) < -0.5  # not all near 0, which a constant 0 would pass


@pytest.mark.parametrize("sampling", [GREEDY, T07_P09], ids=["greedy", "top-p"])
def test_token_logprobs_are_the_targets_own(setup, sampling):
    """Drafted and accepted tokens, corrections and bonus tokens, and the first token (sampled
    in prefill) all report the target's log-probability, before temperature and top-p."""
    name, target, _, spec = setup
    prompts = [t["prompt"] for t in reference_traces(name)["traces"][:3]]
    requests = [
        Request(p, max_new_tokens=40, sampling=sampling, seed=5, logprobs=True) for p in prompts
    ]
    results, _ = generate(spec, requests)
    assert any(len(r.committed) < len(r.tokens) - 1 for r in results)  # rounds took drafts
    _check_logprobs(target, prompts, results)
    # Asked or not, the same tokens (the pass over the logits only reads them); not asked,
    # none reported. Beside requests that ask, a request that does not still gets none.
    unasked, _ = generate(spec, [dataclasses.replace(r, logprobs=False) for r in requests])
    assert [r.tokens for r in unasked] == [r.tokens for r in results]
    assert all(r.logprobs is None for r in unasked)
    # Beside requests that ask, one that does not still gets none; alternatives for the one
    # that asks for them, its neighbour's token log-probabilities alone.
    mixed = [
        dataclasses.replace(r, logprobs=i != 1, top_logprobs=18 if i == 0 else 0)
        for i, r in enumerate(requests)
    ]
    mixed_results, _ = generate(spec, mixed)
    assert [r.logprobs is None for r in mixed_results] == [False, True, False]
    assert [r.top_logprobs is None for r in mixed_results] == [False, True, True]
    assert [len(alts) for alts in mixed_results[0].top_logprobs] == [18] * 40
    assert [r.tokens for r in mixed_results] == [r.tokens for r in results]
    _check_logprobs(target, prompts[::2], mixed_results[::2])


def test_token_logprobs_of_plain_decoding():
    target, _ = load_pair("vanilla")
    prompts = [t["prompt"] for t in reference_traces("vanilla")["traces"][:2]]
    cfg = EngineConfig(
        num_slots=2, max_model_len=128, prefill_chunk=64, prefill_buckets=(64,), token_buckets=(2,)
    )
    requests = [
        Request(p, max_new_tokens=24, sampling=T1, seed=3, logprobs=True, top_logprobs=3)
        for p in prompts
    ]
    results, _ = generate(Engine(target, None, cfg), requests)
    _check_logprobs(target, prompts, results)


def test_top_k_in_pieces_is_lax_top_k():
    """Past FAST_TOP_K the alternatives come one by one after a top-k of FAST_TOP_K (XLA's GPU
    compiler sorts whole rows for a larger k): the same values and ids as one top-k."""
    x = jax.random.normal(jax.random.key(0), (6, 1000))
    # Ties (a few distinct values, as bfloat16 logits have), a row with fewer finite entries
    # than TOP_LOGPROBS, and a row of equal values: the lower id first, as lax.top_k.
    ties = jnp.round(x * 2) / 2
    ties = ties.at[1, 12:].set(-jnp.inf).at[2].set(1.0)
    for x_tv in (x, ties):
        for k in (3, FAST_TOP_K, TOP_LOGPROBS):
            values, ids = _top_k(x_tv, k)
            want_values, want_ids = jax.lax.top_k(x_tv, k)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(values, want_values)


def test_prompt_logprobs_over_chunks_and_past_the_prefix_cache(setup):
    """A prompt's own log-probabilities (each token given those before it) come from its prefill
    calls, chunk after chunk, and equal a whole-sequence forward's; a request asking for them
    prefills its whole prompt even where the prefix cache holds it."""
    _, target, _, spec = setup
    prompt = list(b"def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n" * 2)
    prompt += list(b"    return total / len(xs)\n")
    assert len(prompt) > 2 * CFG.prefill_chunk  # three prefill calls
    first, _ = generate(spec, [Request(prompt, 4)])  # caches the prompt's pages
    asked = Request(prompt, 4, prompt_logprobs=3, logprobs=True)
    (result, beside), _ = generate(spec, [asked, Request(prompt, 4)])
    assert result.cached_tokens == 0 and beside.cached_tokens > 0
    assert beside.prompt_logprobs is None
    assert result.tokens == first[0].tokens
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
    seq = jnp.asarray(prompt, jnp.int32)[None]
    rows = np.asarray(jax.nn.log_softmax(target.logits(target(seq).hidden[0]), axis=-1))
    want = rows[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(result.prompt_logprobs[1:], want, atol=2e-4, rtol=1e-4)
    assert result.prompt_top_logprobs[0] is None
    ids = np.array([[i for i, _ in alts] for alts in result.prompt_top_logprobs[1:]])
    np.testing.assert_array_equal(ids, np.argsort(-rows[:-1], axis=-1, kind="stable")[:, :3])
    assert result.top_logprobs is None and len(result.logprobs) == len(result.tokens)
    # A stream gets them with the first tokens (an echoed prompt comes before the answer).
    events = []
    batcher = Batcher(spec)
    batcher.submit(asked, lambda kind, payload: events.append(payload))
    batcher.run_until_idle()
    *tokens, done = events
    assert len(tokens) > 1 and done.prompt_logprobs[0] is None
    assert tokens[0].prompt_logprobs == done.prompt_logprobs
    assert tokens[0].prompt_top_logprobs == done.prompt_top_logprobs
    assert all(e.prompt_logprobs is None and e.prompt_top_logprobs is None for e in tokens[1:])
