"""The prefix cache: requests that start with the pages of an earlier prompt map those pages and
prefill only the rest -- and draw exactly the tokens they draw without the cache."""

import dataclasses

import numpy as np
import pytest
from fixture_models import TRACE_CFG, TRACE_PLAIN_CFG, load_pair

from dspark_jax.decoding.batching import Batcher, PageAllocator, Request, generate
from dspark_jax.decoding.engine import Engine, EngineError
from dspark_jax.sampling import SamplingConfig

CFG = TRACE_CFG  # tests/test_engine.py's engines: their programs are cache hits here
PAGE = CFG.page_size
SHARED = list(
    b"You are a careful assistant. Answer in one short paragraph, and cite the line you used.\n"
)  # 88 tokens: five full pages
T07 = SamplingConfig(temperature=0.7, top_p=0.9)


@pytest.fixture(scope="module", params=["spec", "plain"])
def engine(request):
    target, drafter = load_pair("vanilla")
    if request.param == "spec":
        engine = Engine(target, drafter, CFG)
    else:
        engine = Engine(target, None, TRACE_PLAIN_CFG)
    engine.warm_up()
    engine.models = (target, drafter if request.param == "spec" else None)  # for other pools
    return engine


def _prompt(tail: str) -> list[int]:
    return SHARED + list(tail.encode())


def _uncached(engine, request) -> list[int]:
    batcher = Batcher(engine, prefix_caching=False)
    out = {}
    batcher.submit(request, lambda kind, p: out.update(r=p) if kind == "done" else None)
    batcher.run_until_idle()
    assert out["r"].cached_tokens == 0
    return out["r"].tokens


def _submit(batcher, request, results, name):
    batcher.submit(request, lambda kind, p: results.update({name: p}) if kind == "done" else None)


def _decoding(engine, results) -> Batcher:
    """A batcher with a long request decoding ("bg"): from here on one prefill call per step."""
    batcher = Batcher(engine)
    _submit(batcher, Request(list(b"Keep going."), 230, seed=6, ignore_eos=True), results, "bg")
    batcher.step()
    batcher.step()
    return batcher


# -- the allocator alone ---------------------------------------------------------------------
def _tokens(*values):
    return np.array(values, np.int32)


def test_pages_are_matched_by_their_whole_prefix_not_their_own_tokens():
    pool = PageAllocator(8, page_size=2, prefix_caching=True)
    row = pool.reserve(3)
    a, mine = pool.add(-1, _tokens(1, 2), int(row[0]))
    b, _ = pool.add(a.serial, _tokens(3, 4), int(row[1]))
    assert mine and pool.cached == 2
    a.written = b.written = True
    assert pool.match(_tokens(1, 2, 3, 4, 5)) == ([a, b], [])
    # The last token is always left to prefill: it samples the first new token.
    assert pool.match(_tokens(1, 2, 3, 4)) == ([a], [])
    assert pool.match(_tokens(9, 9, 3, 4, 5)) == ([], [])  # page 2's tokens, another page 1
    # Content cached already: the entry that has it answers, the new page stays the caller's.
    again, mine = pool.add(-1, _tokens(1, 2), int(row[2]))
    assert again is a and not mine


def test_a_page_not_yet_written_is_waited_for_and_forgotten_if_never_written():
    pool = PageAllocator(4, page_size=2, prefix_caching=True)
    row = pool.reserve(2)
    a, _ = pool.add(-1, _tokens(1, 2), int(row[0]))
    b, _ = pool.add(a.serial, _tokens(3, 4), int(row[1]))
    a.written = True
    # `a` can be mapped; `b` is being prefilled by its writer: wait for it.
    assert pool.match(_tokens(1, 2, 3, 4, 5)) == ([a], [b])
    assert pool.match(_tokens(1, 2, 7, 7, 5)) == ([a], [])
    pool.drop([a, b])  # the writer ended before writing `b`: `b` goes, `a` stays idle
    assert pool.cached == 1 and pool.free == 4 and pool.in_use == 0
    assert pool.match(_tokens(1, 2, 3, 4, 5)) == ([a], [])


def test_idle_cached_pages_are_evicted_last_page_first_and_never_matched_as_orphans():
    pool = PageAllocator(3, page_size=1, prefix_caching=True)
    row = pool.reserve(3)
    assert pool.free == 0 and pool.reserve(1) is None
    first, _ = pool.add(-1, _tokens(7), int(row[0]))
    second, _ = pool.add(first.serial, _tokens(8), int(row[1]))
    first.written = second.written = True
    pool.drop([first, second])  # the request ended: its cached pages stay, idle
    pool.release(row[2:])
    assert pool.free == 3 and pool.in_use == 0 and pool.cached == 2
    assert pool.match(_tokens(7, 8, 0)) == ([first, second], [])
    taken = pool.reserve(2)  # the free page, then the deepest idle one
    assert sorted(taken.tolist()) == sorted([int(row[2]), second.page])
    assert pool.match(_tokens(7, 8, 0)) == ([first], [])
    pool.hold([first])  # a held page is never evicted
    assert pool.reserve(1) is None
    pool.drop([first])
    # `first`'s page goes to a prompt starting with 5; the child cached behind the old `first`
    # must not be found behind the new entry that took its page id.
    (page,) = pool.reserve(1).tolist()
    assert page == first.page and pool.cached == 0
    other, _ = pool.add(-1, _tokens(5), page)
    other.written = True
    assert pool.match(_tokens(5, 8, 0)) == ([other], [])


def test_without_prefix_caching_nothing_is_matched():
    pool = PageAllocator(4, page_size=1)
    (page,) = pool.reserve(1).tolist()
    assert pool.match(_tokens(1, 2, 3)) == ([], [])
    assert pool.free == 3


def test_prefix_caching_must_be_a_bool(engine):
    with pytest.raises(EngineError, match="prefix_caching"):
        Batcher(engine, prefix_caching="yes")


# -- through the engine ----------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [SamplingConfig(), T07], ids=["greedy", "T0.7-p0.9"])
def test_a_request_after_a_shared_prompt_prefills_the_rest_and_draws_the_same(engine, sampling):
    batcher = Batcher(engine)
    results = {}
    first = Request(_prompt("What is 2+2?"), 20, seed=1, sampling=sampling)
    _submit(batcher, first, results, "first")
    batcher.run_until_idle()
    assert results["first"].cached_tokens == 0
    # Its six full prompt pages stay cached though nothing holds them, and so does the seventh,
    # which its answer filled (100 prompt tokens, 20 new: the K/V of the first 119 written).
    assert batcher.allocator.cached == 7 and batcher.allocator.in_use == 0
    second = Request(_prompt("Name a prime number."), 24, seed=2, sampling=sampling)
    _submit(batcher, second, results, "second")
    batcher.run_until_idle()
    assert results["second"].cached_tokens == 5 * PAGE
    assert results["second"].tokens == _uncached(engine, second)
    assert results["first"].tokens == _uncached(engine, first)
    # The same prompt again: every page but the one holding its last token.
    again = dataclasses.replace(second, seed=3)
    _submit(batcher, again, results, "again")
    batcher.run_until_idle()
    assert results["again"].cached_tokens == (len(again.prompt_ids) - 1) // PAGE * PAGE
    assert results["again"].tokens == _uncached(engine, again)
    assert batcher.allocator.in_use == 0 and batcher.allocator.free == CFG.pool_pages


def test_requests_share_the_pages_of_a_prompt_that_is_still_decoding(engine):
    batcher = Batcher(engine)
    results = {}
    long = Request(_prompt("Count to fifty."), 120, seed=4, ignore_eos=True)
    _submit(batcher, long, results, "long")
    for _ in range(3):
        batcher.step()
    assert "long" not in results and batcher.allocator.cached == 6
    followers = [Request(_prompt(f"Question {i}?"), 16, seed=10 + i) for i in range(3)]
    for i, r in enumerate(followers):
        _submit(batcher, r, results, i)
    # All three are admitted at once, beside the decoding request: the first one's page of
    # "Question" is not worth waiting for (a call to write it, then another for a 3-token rest,
    # against one call prefilling both of the others' 19 tokens now).
    batcher.step()
    assert not batcher.waiting
    assert max(e.refs for e in batcher.allocator._cached.values()) == 4
    batcher.run_until_idle()
    assert [results[i].cached_tokens for i in range(3)] == [5 * PAGE] * 3
    for i, r in enumerate(followers):
        assert results[i].tokens == _uncached(engine, r)
    assert results["long"].tokens == _uncached(engine, long)
    assert batcher.allocator.in_use == 0


def test_prompts_arriving_together_prefill_their_shared_pages_once(engine):
    """Submitted together (95 tokens each, 80 shared), the second waits for the first call
    (prefill_chunk 64), which writes four of the five shared pages, and maps them; then it is
    admitted to prefill its last 31 tokens in the call writing the first one's last 31, rather
    than wait for it too. A long prompt after them maps the shared pages and prefills the rest
    over several chunks."""
    batcher = Batcher(engine)
    results = {}
    pair = [Request(_prompt(f"Say {w}."), 10, seed=i) for i, w in enumerate(("hi", "no"))]
    for i, r in enumerate(pair):
        _submit(batcher, r, results, i)
    batcher.run_until_idle()
    assert [results[i].cached_tokens for i in range(2)] == [0, 4 * PAGE]
    # Neither prompt's tail fills a page; each answer fills the sixth (95 + 10 tokens).
    assert batcher.allocator.cached == 5 + 2
    long = Request(_prompt("Summarise this: " + "lorem ipsum " * 7), 12, seed=5)
    assert len(long.prompt_ids) - 5 * PAGE > CFG.prefill_chunk
    _submit(batcher, long, results, "long")
    batcher.run_until_idle()
    assert results["long"].cached_tokens == 5 * PAGE
    assert results["long"].tokens == _uncached(engine, long)
    for i, r in enumerate(pair):
        assert results[i].tokens == _uncached(engine, r)


def test_a_small_pool_evicts_idle_pages_and_every_answer_stays_the_same(engine):
    """A pool of 40 pages (a request needs up to 13): cached pages are evicted for new
    requests, shared prefixes of different lengths come and go, and every page comes back."""
    small = Engine(*engine.models, dataclasses.replace(engine.cfg, num_pages=40))
    rng = np.random.default_rng(0)
    stems = [SHARED[:40], SHARED, list(b"Translate into French: ") * 3]
    requests = [
        Request(
            stems[int(rng.integers(len(stems)))] + rng.integers(32, 127, 20).tolist(),
            int(rng.integers(4, 40)),
            seed=i,
            sampling=T07,
        )
        for i in range(14)
    ]
    cached, _ = generate(small, requests)
    plain, _ = generate(small, requests, prefix_caching=False)
    assert [r.tokens for r in cached] == [r.tokens for r in plain]
    assert sum(r.cached_tokens for r in cached) > 0
    assert all(r.cached_tokens == 0 for r in plain)


@pytest.mark.parametrize("sampling", [SamplingConfig(), T07], ids=["greedy", "T0.7-p0.9"])
def test_a_follow_up_holding_a_prompt_and_its_answer_maps_the_answer_pages(engine, sampling):
    """The next turn of a conversation sent whole (as a chat client or an agent sends it): the
    first request's prompt, its answer and more. The follow-up maps every full page of the
    first prompt and answer whose K/V were written -- all but the answer's last token's -- and
    draws what it draws without the cache."""
    batcher = Batcher(engine)
    results = {}
    first = Request(_prompt("Tell me about pages."), 40, seed=1, sampling=sampling, ignore_eos=True)
    _submit(batcher, first, results, "first")
    batcher.run_until_idle()
    answer = results["first"].tokens
    written = len(first.prompt_ids) + len(answer) - 1
    assert (len(first.prompt_ids), len(answer), written // PAGE) == (108, 40, 9)
    assert batcher.allocator.cached == 9 and batcher.allocator.in_use == 0
    # Idle, the answer's pages are evicted before the prompt's: deepest first.
    serials = [entry.serial for entry in batcher.allocator._idle.values()]
    assert serials == sorted(serials, reverse=True)
    follow = Request(
        list(first.prompt_ids) + answer + list(b"\nAnd then?"), 24, seed=2, sampling=sampling
    )
    _submit(batcher, follow, results, "follow")
    batcher.run_until_idle()
    assert results["follow"].cached_tokens == 9 * PAGE
    assert results["follow"].tokens == _uncached(engine, follow)
    assert results["first"].tokens == _uncached(engine, first)
    assert batcher.allocator.in_use == 0 and batcher.allocator.free == CFG.pool_pages


def test_a_request_cancelled_mid_decode_leaves_the_pages_of_what_it_was_given(engine):
    """Cancelled while a decode chunk for its slot is still running (one that writes on past
    the tokens it was given): the pages entered hold only K/V that chunk does not touch, and a
    follow-up built on the tokens given draws what it draws without the cache."""
    batcher = Batcher(engine)
    results, given = {}, []

    def on_event(kind, payload):
        if kind == "tokens":
            given.extend(payload)
        elif kind == "done":
            results["long"] = payload

    long = Request(_prompt("Count slowly."), 120, seed=3, ignore_eos=True)
    handle = batcher.submit(long, on_event)
    while len(given) < 30:
        batcher.step()
    assert [kind for kind, *_ in batcher._unread] == ["decode"]  # a chunk for it still runs
    batcher.cancel(handle)
    batcher.run_until_idle()
    assert results["long"].finish_reason == "abort" and results["long"].tokens == given
    assert batcher.allocator.in_use == 0 and batcher.allocator.free == CFG.pool_pages
    written = len(long.prompt_ids) + len(given) - 1
    follow = Request(list(long.prompt_ids) + given + list(b" Stop."), 20, seed=4, sampling=T07)
    _submit(batcher, follow, results, "follow")
    batcher.run_until_idle()
    assert results["follow"].cached_tokens == written // PAGE * PAGE > 6 * PAGE
    assert results["follow"].tokens == _uncached(engine, follow)


def test_a_request_cancelled_while_prefilling_leaves_its_written_pages_cached(engine):
    results = {}
    batcher = _decoding(engine, results)
    long = Request(_prompt("x" * 100), 10, seed=7)
    handle = batcher.submit(long, lambda kind, p: results.update(long=p) if kind == "done" else 0)
    batcher.step()
    assert "bg" not in results and handle.prefilled == CFG.prefill_chunk
    batcher.cancel(handle)
    batcher.run_until_idle()
    assert results["long"].finish_reason == "abort"
    assert batcher.allocator.in_use == 0 and batcher.allocator.free == CFG.pool_pages
    again = dataclasses.replace(long, seed=8)
    _submit(batcher, again, results, "again")
    batcher.run_until_idle()
    assert results["again"].cached_tokens == CFG.prefill_chunk
    assert results["again"].tokens == _uncached(engine, again)


def test_a_request_waiting_for_pages_whose_writer_is_cancelled_prefills_them_itself(engine):
    results = {}
    batcher = _decoding(engine, results)
    writer = Request(_prompt("y" * 100), 10, seed=10)
    follower = Request(_prompt("y" * 90), 10, seed=11)
    handle = batcher.submit(writer, lambda kind, p: results.update(w=p) if kind == "done" else 0)
    _submit(batcher, follower, results, "follower")
    batcher.step()  # the writer's first chunk (pages 0-3); the follower waits for page 4
    assert handle.prefilled == CFG.prefill_chunk and len(batcher.waiting) == 1
    batcher.cancel(handle)
    batcher.run_until_idle()
    assert "bg" in results and results["w"].finish_reason == "abort"
    assert results["follower"].cached_tokens == CFG.prefill_chunk
    assert results["follower"].tokens == _uncached(engine, follower)
    assert batcher.allocator.in_use == 0 and batcher.allocator.free == CFG.pool_pages


def test_choices_of_a_long_prompt_wait_for_the_first_and_prefill_only_its_last_page(engine):
    """Three requests of one 188-token prompt (n = 3 choices) beside a decoding request, one
    prefill call of 64 tokens per step: the first prefills the prompt over three calls, the
    others wait for them (four calls each alone, sharing the FIFO with the first: six) and
    then map its eleven full pages, prefilling 12 tokens each."""
    results = {}
    batcher = _decoding(engine, results)
    choices = [Request(_prompt("z" * 100), 12, seed=20 + j, sampling=T07) for j in range(3)]
    for j, r in enumerate(choices):
        _submit(batcher, r, results, j)
    batcher.run_until_idle()
    assert [results[j].cached_tokens for j in range(3)] == [0, 11 * PAGE, 11 * PAGE]
    for j, r in enumerate(choices):
        assert results[j].tokens == _uncached(engine, r)
    assert batcher.allocator.in_use == 0


def test_requests_share_cached_pages_only_with_the_same_salt(engine):
    batcher = Batcher(engine)
    results = {}
    prompt = _prompt("Which tenant am I?")
    for name, salt in (("plain", None), ("a", "tenant-a"), ("a again", "tenant-a"), ("b", "b")):
        request = Request(prompt, 8, seed=1, cache_salt=salt)
        _submit(batcher, request, results, name)
        batcher.run_until_idle()
    cached = {name: r.cached_tokens for name, r in results.items()}
    # Only the second request of tenant-a finds pages: its own tenant's.
    assert cached == {"plain": 0, "a": 0, "a again": 6 * PAGE, "b": 0}
    assert len({tuple(r.tokens) for r in results.values()}) == 1  # same prompt, same seed
    assert results["plain"].tokens == _uncached(engine, Request(prompt, 8, seed=1))


@pytest.mark.parametrize("salt", ["", 7, b"a"])
def test_a_cache_salt_must_be_a_non_empty_string(engine, salt):
    with pytest.raises(EngineError, match="cache_salt must be a non-empty string") as e:
        Batcher(engine).submit(Request([1, 2, 3], 4, cache_salt=salt), lambda *a: None)
    assert e.value.field == "cache_salt"


def test_salted_first_pages_are_keyed_apart():
    pool = PageAllocator(4, page_size=2, prefix_caching=True)
    (page,) = pool.reserve(1).tolist()
    entry, _ = pool.add("t1", _tokens(1, 2), page)
    entry.written = True
    assert pool.match(_tokens(1, 2, 3), "t1") == ([entry], [])
    assert pool.match(_tokens(1, 2, 3), "t2") == ([], [])
    assert pool.match(_tokens(1, 2, 3)) == ([], [])
