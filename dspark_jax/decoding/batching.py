"""The host loop that keeps the engine's slots full: continuous batching.

Requests wait in a FIFO queue; a request is admitted when a slot is free and the KV pool can
reserve every page it may need (prompt + max new tokens + one block), so an admitted request can
always finish: nothing is preempted. Its prompt is prefilled in chunks packed with other prompts'
chunks (`prefill_chunk` tokens per call), one prefill call between two decode chunks, so a long
prompt never stalls the running requests for its whole length. Its pages return to the pool the
moment it finishes or is cancelled -- except the full pages of its prompt and of its answer,
which the prefix cache keeps (`PageAllocator`): a later request starting with the same tokens (a
shared system prompt, or the next turn of a conversation, which holds this prompt and answer)
maps them and prefills only the rest, and idle cached pages are evicted when the pool needs
them.

Each `step()` dispatches the next prefill and decode chunk *before* reading what the previous
decode chunk produced, so the device is busy while the host streams tokens. A decode chunk ends
early, after the round in which some request finishes (`yield_on_finish`), so a finished request
is noticed within one short chunk. While requests wait for a slot the loop reads the chunk in
flight *before* dispatching the next, so a slot freed in it is refilled in the very next chunk
instead of idling through one: under load a host turn between chunks costs less than a chunk of
empty slot-rounds (on the embedded pair, occupancy while requests wait rose from 0.77-0.93 to
0.94-0.98; docs/benchmarks.md). A snapshot of which request owned each slot
travels with every dispatched chunk, so tokens are never delivered to a request that took over
the slot later.

A request's tokens depend only on itself and its seed (the engine's randomness is addressed by
the request's seed and the position; a request without one draws a fresh seed at submit), never
on when it joined or which requests share the slots -- except under policies that size
verification by the whole batch (the schedulers), which keep the output distribution but not
the exact tokens, and up to rounding: the verification is padded to a token bucket chosen by
the load, and in bfloat16 that shape can tip a near-tie between two logits (docs/engine.md,
"What holds"); so can K/V taken from the prefix cache, computed in another split of prefill
chunks.

Threads: `submit` and `cancel` may be called from any thread; everything else runs on the thread
that drives the loop (`run_until_idle` for offline work; the server's engine thread calls `step`).
Callbacks run on that thread and must be quick.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from dspark_jax.decoding.engine import TOP_LOGPROBS, Engine, EngineError, PrefillItem
from dspark_jax.errors import as_integer
from dspark_jax.sampling import GREEDY, SamplingConfig


class QueueFullError(RuntimeError):
    """The waiting queue is full; try again later (not a fault of the request)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request. `sampling` is per request; `stop_token_ids` add to the model's
    end-of-turn tokens unless `ignore_eos`. `seed` fixes the request's random draws; None (the
    default, as in OpenAI's API) draws a fresh one at `Batcher.submit`, kept in the handle's
    `request`: requests that share a seed share their draws (sampled alike, the same prompt
    gives the same answer), and the schedulers, which size each request's verification by the
    whole batch's confidences, keep the output distribution exactly only over independent
    draws."""

    prompt_ids: Sequence[int]
    max_new_tokens: int = 256
    seed: int | None = None
    sampling: SamplingConfig = GREEDY
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # No stop token (the request's or the model's) ends it before this many new tokens: they
    # are banned from the target's logits at the places before (vLLM's min_tokens). At most
    # max_new_tokens.
    min_tokens: int = 0
    # Requests share prefix-cache pages only with requests of the same salt (None: unsalted),
    # so one tenant's time to first token cannot tell what another's prompts began with.
    cache_salt: str | None = None
    # Report each token's log-probability under the target (`Result.logprobs`, `Tokens`): a
    # pass over the verified rows' logits in the rounds where some live request asks; with
    # `top_logprobs` (at most engine.TOP_LOGPROBS), also that many likeliest tokens at each
    # place and theirs (a top-k over the vocabulary in those rounds).
    logprobs: bool = False
    top_logprobs: int = 0
    # The prompt tokens' log-probabilities too (each after the first, given those before it),
    # with that many alternatives (0 to engine.TOP_LOGPROBS); None: not asked. Such a request
    # prefills its whole prompt (it maps no cached pages): the logits of every prompt row, in
    # the prefill calls it is part of.
    prompt_logprobs: int | None = None
    # Admission order (vLLM's priority): among the requests waiting for a slot, a lower value
    # is given one first; equal values are first come, first served. A request that runs is
    # never preempted for one of a lower value.
    priority: int = 0


@dataclasses.dataclass
class Result:
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token), "length" (max new tokens) or "abort" (cancelled)
    prompt_len: int
    verified: np.ndarray  # per round: drafts verified
    accepted: np.ndarray  # per round: drafts accepted
    committed: np.ndarray  # per round: tokens committed, bonus included
    conf_logits: np.ndarray  # per round x block position: confidence logits
    ttft_s: float = float("nan")  # submit -> first token
    latency_s: float = float("nan")  # submit -> finished
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # Each token's log-probability under the target's own distribution (before temperature and
    # filters; `engine.token_logprobs`), in `tokens` order; None unless the request asked.
    logprobs: list[float] | None = None
    # Per token, the request's top_logprobs likeliest (token id, log-probability) pairs at its
    # place, likeliest first; None unless it asked for alternatives.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Per prompt token (the first has none: None), its log-probability and alternatives, when
    # the request asked (`Request.prompt_logprobs`).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def rounds(self) -> int:
        return len(self.committed)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification round (bonus included)."""
        return float(np.mean(self.committed)) if len(self.committed) else 0.0


class Tokens(list):
    """A "tokens" event's payload: the new token ids (a list, as ever) and, in `logprobs`, the
    log-probability of each under the target's own distribution (None unless the request asked:
    `Request.logprobs`), in `top_logprobs` the alternatives (`Result.top_logprobs`). A request
    that asked for its prompt's log-probabilities (`Request.prompt_logprobs`) gets them with its
    first token, in `prompt_logprobs` and `prompt_top_logprobs` (as `Result` has them), so a
    stream can show the prompt before the answer; None in every other event."""

    def __init__(
        self,
        ids: list[int],
        logprobs: list[float] | None = None,
        top_logprobs: list[list[tuple[int, float]]] | None = None,
    ):
        super().__init__(ids)
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.prompt_logprobs: list[float | None] | None = None
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


# (kind, payload): ("tokens", Tokens) any number of times, then ("done", Result). (The
# server's EngineRunner may also send ("error", exception) when its engine thread fails.)
EventCallback = Callable[[str, Any], None]


class Observer:
    """Hooks the loop calls (on its thread) for metrics; every method is a no-op here.

    They see what the engine produced. A driver that cuts answers short of that (the server's
    stop strings) counts finish reasons and tokens, and times the tokens it keeps, itself."""

    def on_step(self, waiting: int, running: int, slots_busy: int, pages_reserved: int) -> None:
        pass

    def on_admit(self, prompt_tokens: int, cached_tokens: int, queued_s: float) -> None:
        """A request took a slot `queued_s` after it was submitted; `cached_tokens` of its prompt
        came from the prefix cache."""

    def on_first_token(self, ttft_s: float) -> None:
        pass

    def on_tokens(self, count: int, inter_token_s: float) -> None:
        pass

    def on_rounds(self, verified_r: np.ndarray, accepted_r: np.ndarray, gamma: int) -> None:
        pass

    def on_chunk(self, slot_rounds: int, device_rounds: int, num_slots: int) -> None:
        """A decode chunk ran `device_rounds` rounds in which live slots took `slot_rounds`
        turns: slot occupancy is slot_rounds / (device_rounds * num_slots)."""


@dataclasses.dataclass(eq=False)
class Handle:
    """A submitted request: its id, callback and (once admitted) its slot and pages: `pages` is
    its page row, `held` the prefix cache's pages in it (those it mapped and those of its prompt
    it entered; the rest of the row returns to the free list when it ends), `writes` the entered
    pages its prefill has yet to write, as (index in the row, entry)."""

    id: int
    request: Request
    on_event: EventCallback
    stop_ids: tuple[int, ...]
    submitted: float
    batcher: Batcher | None = None  # the one it was submitted to, the only one that may cancel it
    slot: int | None = None
    pages: np.ndarray | None = None
    held: list[CachedPage] = dataclasses.field(default_factory=list)
    writes: collections.deque[tuple[int, CachedPage]] = dataclasses.field(
        default_factory=collections.deque
    )
    cached_tokens: int = 0
    # The prefix cache's entry for the last full page of its prompt (None: no full page or no
    # caching), the parent of the first page of its answer when that enters the cache.
    tail: CachedPage | None = None
    prefilled: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float | None] = dataclasses.field(default_factory=lambda: [None])
    prompt_top_logprobs: list = dataclasses.field(default_factory=lambda: [None])
    # Packed rows (first row, count) of the prefill calls dispatched for its prompt, not yet read.
    prompt_rows: collections.deque = dataclasses.field(default_factory=collections.deque)
    verified: list[np.ndarray] = dataclasses.field(default_factory=list)
    accepted: list[np.ndarray] = dataclasses.field(default_factory=list)
    committed: list[np.ndarray] = dataclasses.field(default_factory=list)
    conf: list[np.ndarray] = dataclasses.field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    cancelled: bool = False


@dataclasses.dataclass(eq=False)
class CachedPage:
    """A full page of K/V in the prefix cache (a prompt's, or a prompt's and its answer's), found
    by `key`: the serial of the cached page before it (-1 for a prompt's first page) and the
    page's own tokens. `serial` names this entry in its children's keys; serials are never
    reused, so a child whose parent was evicted can never be matched behind another entry that
    took the parent's page id."""

    page: int
    serial: int
    # (the parent's serial, or for a first page -1 or the requests' cache salt; the page's
    # token ids as int32 bytes)
    key: tuple[int | str, bytes]
    refs: int = 0  # admitted requests whose page rows hold it
    # The prefill call that writes it has been dispatched. Until then only its writer holds it:
    # a request whose prompt runs into it either waits to map it or prefills its own copy.
    written: bool = False


class PageAllocator:
    """The KV pool's page ids: a free list and, with `prefix_caching`, the prefix cache.

    The cache keeps the full pages of prompts' K/V -- target and drafter context alike, as they
    share the page table -- keyed by their tokens and everything before them (the chain of
    parent pages), so a request whose prompt starts with a cached run of pages maps them into its
    page row and prefills only the rest. A request enters its prompt's pages when it is
    admitted, marked written once the prefill call writing each is dispatched; a request whose
    prompt runs into pages not yet written may wait to map them (`Batcher` decides), so requests
    arriving together (the choices of one request, a burst sharing a system prompt) can prefill
    their common prefix once. A cached page that no request holds stays cached but
    idle; reservations take free pages first, then evict idle ones, least recently released
    first (a released request's last pages before its first, so a shared prefix outlives its
    tails). When a request ends, the full pages of its prompt and answer past its prompt's
    enter too, written (`Batcher._enter_answer_pages`). A page enters only where no round
    writes again: a prompt's pages lie behind every position decoding writes, an answer's
    behind the slot's last anchor, so a cached page is never written while it is cached."""

    def __init__(self, num_pages: int, page_size: int = 1, prefix_caching: bool = False):
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self._free = collections.deque(range(num_pages))
        self._cached: dict[tuple[int | str, bytes], CachedPage] = {}
        self._idle: collections.OrderedDict[int, CachedPage] = collections.OrderedDict()
        self._serials = itertools.count()

    @property
    def free(self) -> int:
        """Pages a reservation can take: free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def in_use(self) -> int:
        """Pages held by admitted requests (their own and the cached ones they map)."""
        return self.num_pages - self.free

    @property
    def cached(self) -> int:
        """Pages in the prefix cache, held or idle."""
        return len(self._cached)

    def reserve(self, count: int) -> np.ndarray | None:
        if count > self.free:
            return None
        pages = []
        while len(pages) < count:
            if self._free:
                pages.append(self._free.popleft())
            else:
                page, entry = self._idle.popitem(last=False)
                del self._cached[entry.key]
                pages.append(page)
        return np.array(pages, np.int32)

    def release(self, pages: Sequence[int]) -> None:
        """Returns pages no cache entry holds to the free list."""
        self._free.extend(int(p) for p in pages)

    def match(
        self, prompt: np.ndarray, salt: str | None = None
    ) -> tuple[list[CachedPage], list[CachedPage]]:
        """The longest run of cached pages of requests salted `salt` that starts `prompt`
        (int32), leaving at least its last token to prefill (whose prefill samples the first new
        one), split into the written pages that lead it, which can be mapped now, and the rest,
        which can be mapped once written."""
        found: list[CachedPage] = []
        if not self.prefix_caching:
            return found, []
        parent, size = _root(salt), self.page_size
        for i in range((len(prompt) - 1) // size):
            entry = self._cached.get((parent, prompt[i * size : (i + 1) * size].tobytes()))
            if entry is None:
                break
            found.append(entry)
            parent = entry.serial
        ready = next((i for i, e in enumerate(found) if not e.written), len(found))
        return found[:ready], found[ready:]

    def entry(self, key: tuple[int | str, bytes]) -> CachedPage | None:
        """The cached entry under `key`, if any."""
        return self._cached.get(key)

    def hold(self, entries: Sequence[CachedPage]) -> None:
        for entry in entries:
            if entry.refs == 0:
                del self._idle[entry.page]
            entry.refs += 1

    def drop(self, entries: Sequence[CachedPage]) -> None:
        """Lets go of cached pages a request held, deepest first into the idle order. A page
        never written (its writer ended before its prefill) leaves the cache for the free
        list; nobody else holds it, as nobody maps a page before it is written."""
        for entry in reversed(entries):
            entry.refs -= 1
            if not entry.written:
                del self._cached[entry.key]
                self._free.append(entry.page)
            elif entry.refs == 0:
                self._idle[entry.page] = entry

    def add(self, parent: int | str, tokens: np.ndarray, page: int) -> tuple[CachedPage, bool]:
        """Caches `page`, whose K/V will hold `tokens` after the cached page `parent` (for a
        first page, `_root` of the request's salt), held by the caller, who marks it `written`
        once the prefill call writing it is dispatched. Returns (the entry for that content,
        whether it is `page`'s): when the content is cached already (a prompt's last page,
        which `match` leaves to prefill), the existing entry names it and `page` stays the
        caller's own."""
        key = (parent, tokens.tobytes())
        entry = self._cached.get(key)
        if entry is not None:
            return entry, False
        entry = CachedPage(page, next(self._serials), key, refs=1)
        self._cached[key] = entry
        return entry, True


def _parent(handle: Handle) -> int | str:
    """The key parent of the handle's next page: the serial of its `tail`, or the root of its
    salt."""
    return _root(handle.request.cache_salt) if handle.tail is None else handle.tail.serial


def _root(salt: str | None) -> int | str:
    """The parent in a prompt's first page's key: -1 unsalted, else the salt itself (a string,
    never equal to a serial)."""
    return -1 if salt is None else salt


@dataclasses.dataclass
class LoopTiming:
    """Where the loop's time went when it runs with `timed=True` (each call waited for)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_calls: int = 0
    decode_chunks: int = 0
    decoded_tokens: int = 0  # tokens from decode rounds (each request's first comes from prefill)
    rounds: int = 0  # device rounds

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode throughput; 0.0 when no decode round ran (see `decode_rate`)."""
        return self.decoded_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def decode_rate(self) -> float | None:
        """Decode throughput, or None when no decode round ran and nothing was measured: what
        reports show ("-", null) rather than a rate of 0."""
        return self.decoded_tokens / self.decode_s if self.decode_s else None


class Batcher:
    """Continuous batching over an `Engine`; see the module docstring.

    `max_waiting` bounds the queue: the requests submitted beyond the free slots, or all of
    them while the KV pool is short of pages for the first in line (`submit` raises
    QueueFullError past it). `timed` makes every device call wait for its result and
    books its time in `timing` (offline measurement; the server runs untimed so the device
    never waits for the host). `policy_index`: for an engine built with a `PolicySwitch`, the
    member that chooses the verified lengths (else the first). `prefix_caching` keeps the full
    pages of prompts' and answers' K/V for later requests that start with the same tokens (see
    `PageAllocator`): they prefill only the rest.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int = 4096,
        observer: Observer | None = None,
        timed: bool = False,
        policy_index: int | None = None,
        prefix_caching: bool = True,
    ):
        if not isinstance(prefix_caching, bool | np.bool_):
            raise EngineError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        self.engine = engine
        cfg = engine.cfg
        self.max_waiting = max_waiting
        self.observer = observer or Observer()
        self.timed = timed
        self.timing = LoopTiming()
        self.slot_rounds = 0  # turns live slots took in decode rounds
        self.device_rounds = 0
        self.state = engine.init_state()
        if policy_index is not None:
            self.state = engine.select_policy(self.state, policy_index)
        self.allocator = PageAllocator(cfg.pool_pages, cfg.page_size, bool(prefix_caching))
        self.free_slots = collections.deque(range(cfg.num_slots))
        self.owners: list[Handle | None] = [None] * cfg.num_slots
        self.waiting: collections.deque[Handle] = collections.deque()
        self.prefilling: collections.deque[Handle] = collections.deque()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet admitted (inbox + waiting)
        # Set by the loop when the head of the queue found free slots but too few free KV pages:
        # until pages come back, free slots take nobody, so they discount nothing in `submit`.
        self._short_of_pages = False
        # Dispatched device calls not yet read, oldest first: ("prefill", out, handles) and
        # ("decode", out, owners). A call leaves this queue only once its results are on the
        # host, so an interrupt while waiting for them (Ctrl-C) loses nothing: the next step
        # reads it again.
        self._unread: collections.deque[tuple[str, Any, list]] = collections.deque()
        self._callback_error: BaseException | None = None

    # -- any thread ----------------------------------------------------------------------------
    def submit(self, request: Request, on_event: EventCallback) -> Handle:
        """Queues a request. Raises EngineError for one that can never run, QueueFullError when
        the queue is full."""
        if not isinstance(request, Request):
            raise EngineError(f"submit takes a Request, got {type(request).__name__}")
        if not callable(on_event):
            raise EngineError(f"on_event must be a function (kind, payload), got {on_event!r}")
        if not isinstance(request.ignore_eos, bool | np.bool_):
            raise EngineError(f"ignore_eos must be True or False, got {request.ignore_eos!r}")
        if not isinstance(request.logprobs, bool | np.bool_):
            raise EngineError(f"logprobs must be True or False, got {request.logprobs!r}")
        most = min(TOP_LOGPROBS, self.engine.target_cfg.vocab_size)
        top = as_integer(request.top_logprobs)
        if top is None or not 0 <= top <= most:
            raise EngineError(
                f"top_logprobs must be an integer in 0..{most}, got {request.top_logprobs!r}"
            )
        if top and not request.logprobs:
            raise EngineError("top_logprobs needs logprobs=True")
        prompt_top = request.prompt_logprobs
        if prompt_top is not None and (
            as_integer(prompt_top) is None or not 0 <= prompt_top <= most
        ):
            raise EngineError(
                f"prompt_logprobs must be None or an integer in 0..{most}, got {prompt_top!r}"
            )
        if as_integer(request.priority) is None:
            raise EngineError(f"priority must be an integer, got {request.priority!r}", "priority")
        if request.cache_salt is not None and not (
            isinstance(request.cache_salt, str) and request.cache_salt
        ):
            raise EngineError(
                f"cache_salt must be a non-empty string or None, got {request.cache_salt!r}",
                "cache_salt",
            )
        # The loop reads the prompt later, on its own thread: what is checked is a copy, so a
        # list the caller changes after submitting cannot carry unchecked ids into the engine.
        try:
            prompt = tuple(request.prompt_ids)
        except TypeError:
            prompt = request.prompt_ids  # not a sequence: check_request names it
        seed = secrets.randbelow(2**32) if request.seed is None else request.seed
        request = dataclasses.replace(request, prompt_ids=prompt, seed=seed)
        self.engine.check_request(
            request.prompt_ids,
            request.max_new_tokens,
            request.seed,
            request.stop_token_ids,
            request.sampling,
        )
        least = as_integer(request.min_tokens)
        if least is None or not 0 <= least <= request.max_new_tokens:
            raise EngineError(
                f"min_tokens must be an integer in 0..max_new_tokens ({request.max_new_tokens}), "
                f"got {request.min_tokens!r}",
                "min_tokens",
            )
        stop_ids = tuple(
            dict.fromkeys(
                (*request.stop_token_ids, *(() if request.ignore_eos else self.engine.stop_tokens))
            )
        )
        allowed = request.sampling.allowed_token_ids
        if least and allowed and set(allowed) <= set(stop_ids):
            raise EngineError(
                f"allowed_token_ids {list(allowed)} are all stop tokens, which min_tokens "
                f"{least} bans from the first tokens: nothing could be drawn there",
                "allowed_token_ids",
            )
        limit = self.engine.cfg.max_stop_tokens
        if len(stop_ids) > limit:
            own = len(set(request.stop_token_ids))
            raise EngineError(
                f"{len(stop_ids)} stop token ids ({own} of the request's and "
                f"{len(stop_ids) - own} of the model's end-of-turn ids) exceed the limit of "
                f"{limit} (EngineConfig.max_stop_tokens): give at most "
                f"{max(limit - (len(stop_ids) - own), 0)}, or ignore_eos",
                "stop_token_ids",
            )
        with self._lock:
            # A request that a free slot will take at the next step waits for nothing, however
            # many arrived since the last step: only those beyond the free slots are queued.
            # While the KV pool is what is short, free slots take nobody and every one waits.
            takers = 0 if self._short_of_pages else len(self.free_slots)
            waiting = self._queued - takers
            if waiting >= self.max_waiting:
                raise QueueFullError(
                    f"{waiting} requests are already waiting for a slot"
                    f"{' and KV pages' if self._short_of_pages else ''} "
                    f"(limit {self.max_waiting})"
                )
            self._queued += 1
            handle = Handle(next(self._ids), request, on_event, stop_ids, time.monotonic(), self)
            self._inbox.put(("submit", handle))
        return handle

    def cancel(self, handle: Handle) -> None:
        """Ends a request early (finish reason "abort"); its slot and pages are freed."""
        if handle.batcher is not self:
            # Another batcher's loop would skip it without counting it out of its queue.
            raise EngineError(f"request {handle.id} was submitted to another Batcher")
        self._inbox.put(("cancel", handle))

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet given a slot (free slots take them at the next step)."""
        return self._queued

    # -- the loop thread -----------------------------------------------------------------------
    @property
    def occupancy(self) -> float:
        """Share of slot turns in decode rounds so far that served a live request."""
        total = self.device_rounds * self.engine.cfg.num_slots
        return self.slot_rounds / total if total else 0.0

    @property
    def busy(self) -> bool:
        return bool(
            self.waiting
            or self.prefilling
            or bool(self._unread)
            or any(o is not None for o in self.owners)
        )

    def step(self) -> bool:
        """One turn of the loop; returns whether work remains.

        An exception raised by a callback is held until the turn's bookkeeping is done and then
        raised from here (the first one, if several), so the loop stays consistent: calling
        `step` again goes on without losing or repeating a token."""
        self._drain_inbox()
        if self._unread and self.waiting:
            self._read_unread()
            self._drain_inbox()  # callbacks may have submitted follow-up requests
        self._admit()
        # With nothing decoding there is nothing to stall: prefill everything admitted first.
        if not self._running():
            while self.prefilling:
                self._unread.append(("prefill", *self._dispatch_prefill()))
                self._read_unread()
                self._admit()
        prefill = self._dispatch_prefill()
        if prefill is not None:
            self._unread.append(("prefill", *prefill))
        chunk = self._dispatch_decode()
        if chunk is not None:
            self._unread.append(("decode", *chunk))
        # Everything but the chunk just dispatched, which runs while the host streams the rest.
        self._read_unread(keep=int(chunk is not None))
        self.observer.on_step(
            len(self.waiting),
            sum(o is not None for o in self.owners),
            self.engine.cfg.num_slots - len(self.free_slots),
            self.allocator.in_use,
        )
        if self._callback_error is not None:
            error, self._callback_error = self._callback_error, None
            raise error
        return self.busy or not self._inbox.empty()

    def run_until_idle(self) -> None:
        """Drives the loop on this thread until every submitted request has finished."""
        while self.step():
            pass

    # -- internals -----------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                if handle.cancelled:
                    continue
                self._enqueue(handle)
            else:
                self._cancel(handle)

    def _enqueue(self, handle: Handle) -> None:
        """Into the waiting queue, behind every request of its priority or a lower value."""
        priority = handle.request.priority
        at = len(self.waiting)
        while at and self.waiting[at - 1].request.priority > priority:
            at -= 1
        self.waiting.insert(at, handle)

    def _cancel(self, handle: Handle) -> None:
        if handle.finished or handle.cancelled:
            return
        handle.cancelled = True
        if handle in self.waiting:
            self.waiting.remove(handle)
            with self._lock:
                self._queued -= 1
        elif handle in self.prefilling:
            self.prefilling.remove(handle)
            self._free(handle)
        elif handle.slot is not None:
            mask = np.zeros((self.engine.cfg.num_slots,), bool)
            mask[handle.slot] = True
            self.state = self.engine.release(self.state, mask)
            self._free(handle)
        self._finish(handle, "abort")

    def _admit(self) -> None:
        short = False
        while self.waiting and self.free_slots:
            handle = self.waiting[0]
            r = handle.request
            prompt = np.asarray(r.prompt_ids, np.int32)
            # A request that asks for its prompt's log-probabilities prefills every token.
            cached, pending = (
                self.allocator.match(prompt, r.cache_salt)
                if r.prompt_logprobs is None
                else ([], [])
            )
            if pending and self._worth_waiting(len(prompt), len(cached), pending):
                break  # a request ahead is prefilling this prompt's next pages: map them after
            self.allocator.hold(cached)
            pages = self.allocator.reserve(
                self.engine.pages_needed(len(prompt), r.max_new_tokens) - len(cached)
            )
            if pages is None:
                self.allocator.drop(cached)
                short = True  # first come, first served: later requests wait behind it
                break
            self.waiting.popleft()
            with self._lock:
                self._queued -= 1
            handle.slot = self.free_slots.popleft()
            handle.pages = np.concatenate([np.array([c.page for c in cached], np.int32), pages])
            handle.held = cached
            handle.cached_tokens = handle.prefilled = len(cached) * self.allocator.page_size
            self._enter_prompt_pages(handle, prompt, cached)
            self.observer.on_admit(
                len(prompt), handle.cached_tokens, time.monotonic() - handle.submitted
            )
            self.owners[handle.slot] = handle
            self.prefilling.append(handle)
        with self._lock:
            self._short_of_pages = short

    def _dispatch_prefill(self):
        cfg = self.engine.cfg
        budget = cfg.prefill_chunk
        items: list[PrefillItem] = []
        for handle in self.prefilling:
            if budget == 0 or len(items) == cfg.prefill_seqs:
                break
            r = handle.request
            take = min(len(r.prompt_ids) - handle.prefilled, budget)
            first = handle.prefilled == handle.cached_tokens
            items.append(
                PrefillItem(
                    slot=handle.slot,
                    tokens=np.asarray(
                        r.prompt_ids[handle.prefilled : handle.prefilled + take], np.int32
                    ),
                    start=handle.prefilled,
                    prompt_len=len(r.prompt_ids),
                    page_row=handle.pages,
                    temperature=r.sampling.temperature,
                    top_k=r.sampling.top_k,
                    top_p=r.sampling.top_p,
                    min_p=r.sampling.min_p,
                    presence_penalty=r.sampling.presence_penalty,
                    frequency_penalty=r.sampling.frequency_penalty,
                    repetition_penalty=r.sampling.repetition_penalty,
                    prompt_ids=(
                        np.asarray(r.prompt_ids, np.int32)
                        if first and r.sampling.repetition_penalty != 1.0
                        else None
                    ),
                    logit_bias=r.sampling.logit_bias,
                    allowed_token_ids=r.sampling.allowed_token_ids,
                    max_new_tokens=r.max_new_tokens,
                    min_new_tokens=r.min_tokens,
                    stop_tokens=handle.stop_ids,
                    seed=r.seed,
                    first=first,
                    logprobs=int(r.top_logprobs) if r.logprobs else -1,
                    **self._prompt_scoring(handle, take, sum(len(it.tokens) for it in items)),
                )
            )
            budget -= take
        if not items:
            return None
        t0 = time.perf_counter()
        self.state, out = self.engine.prefill(self.state, self.engine.pack_prefill(items))
        if self.timed:
            jax.block_until_ready(out.first_token_n)
            self.timing.prefill_s += time.perf_counter() - t0
            self.timing.prefill_calls += 1
        handles = []
        size = cfg.page_size
        for item in items:
            handle = self.prefilling.popleft()
            handle.prefilled += len(item.tokens)
            # Written by the call just dispatched: later calls, which take the state this one
            # returns, may read them.
            while handle.writes and (handle.writes[0][0] + 1) * size <= handle.prefilled:
                handle.writes.popleft()[1].written = True
            if handle.prefilled < len(handle.request.prompt_ids):
                self.prefilling.appendleft(handle)  # the rest next call, ahead of the others
            handles.append(handle)
        return out, handles

    @staticmethod
    def _prompt_scoring(handle: Handle, take: int, row: int) -> dict[str, Any]:
        """A prefill item's prompt log-probability fields, for its next `take` tokens at packed
        `row`; notes the rows to read them from."""
        r = handle.request
        if r.prompt_logprobs is None:
            return {}
        start = handle.prefilled
        handle.prompt_rows.append((row, len(r.prompt_ids[start + 1 : start + take + 1])))
        return dict(
            prompt_logprobs=int(r.prompt_logprobs),
            next_tokens=np.asarray(r.prompt_ids[start + 1 : start + take + 1], np.int32),
        )

    def _worth_waiting(self, prompt_len: int, written: int, pending: list[CachedPage]) -> bool:
        """Whether a request whose prompt runs into `pending` pages (after `written` mapped
        ones), which requests ahead of it are prefilling, should wait to map them rather than
        be admitted now and prefill its own copies: yes unless waiting would make its prefill
        end in a later call. Counted in calls of `prefill_chunk` tokens through the FIFO of
        prompts being prefilled; waiting also saves the copies' compute and pages, so a tie
        waits."""
        size, budget = self.allocator.page_size, self.engine.cfg.prefill_chunk
        last = next(e for e in reversed(pending) if not e.written)
        ahead, written_by = 0, None
        for handle in self.prefilling:
            for i, entry in handle.writes:
                if entry is last:
                    written_by = ahead + (i + 1) * size - handle.prefilled
            ahead += len(handle.request.prompt_ids) - handle.prefilled
        if written_by is None:  # not being prefilled (cannot happen: its writer would hold it)
            return False
        calls = lambda tokens: -(-tokens // budget)  # noqa: E731
        now = calls(ahead + prompt_len - written * size)
        tail = prompt_len - (written + len(pending)) * size
        wait = calls(written_by)
        return wait + calls(max(ahead - wait * budget, 0) + tail) <= now

    def _enter_prompt_pages(
        self, handle: Handle, prompt: np.ndarray, cached: list[CachedPage]
    ) -> None:
        """Enters the admitted request's full prompt pages past the `cached` ones in the prefix
        cache, to be marked written as its prefill calls are dispatched."""
        if not self.allocator.prefix_caching:
            return
        handle.tail = cached[-1] if cached else None
        self._enter_pages(handle, prompt, len(cached), len(prompt) // self.allocator.page_size)

    def _enter_pages(
        self, handle: Handle, tokens: np.ndarray, first: int, end: int, written: bool = False
    ) -> None:
        """Enters pages first..end-1 of the handle's row, holding `tokens`' pages of the same
        index, in the prefix cache behind its `tail`, which follows them. Those the cache did
        not hold already become the handle's (`held`); pages yet to be written are noted in
        `writes`, to be marked when the prefill call writing them is dispatched."""
        size = self.allocator.page_size
        for i in range(first, end):
            entry, mine = self.allocator.add(
                _parent(handle), tokens[i * size : (i + 1) * size], int(handle.pages[i])
            )
            if mine:
                handle.held.append(entry)  # `_free` lets go of them, deepest first
                if written:
                    entry.written = True
                else:
                    handle.writes.append((i, entry))
            handle.tail = entry

    def _enter_answer_pages(self, handle: Handle) -> None:
        """Enters the full pages of the ending request's prompt and answer past its prompt's
        full pages in the prefix cache, written: the K/V of every committed token but the last
        (the next round's anchor, which no round wrote) was written by the decode chunks that
        produced them, all dispatched before the chunk that delivered them was read. A chunk
        still in flight for the slot (a request cancelled mid-decode) writes only from the
        device's anchor on, at or past the host's last delivered token, so no page entered here
        is written again. A follow-up whose prompt holds this prompt and answer (the next turn
        of a chat, an agent extending its transcript) maps them."""
        allocator, r = self.allocator, handle.request
        # No tokens: it ended before its prefill did, and has no answer.
        if not allocator.prefix_caching or not handle.tokens:
            return
        tail = handle.tail
        if tail is not None and (not tail.written or allocator.entry(tail.key) is not tail):
            return  # the chain it would hang from is gone (evicted) or was never written
        size, prompt_len = allocator.page_size, len(r.prompt_ids)
        sequence = np.concatenate(
            [np.asarray(r.prompt_ids, np.int32), np.asarray(handle.tokens, np.int32)]
        )
        last = min((prompt_len + len(handle.tokens) - 1) // size, len(handle.pages))
        self._enter_pages(handle, sequence, prompt_len // size, last, written=True)

    def _running(self) -> bool:
        return any(
            o is not None and o not in self.prefilling and not o.finished for o in self.owners
        )

    def _dispatch_decode(self):
        if not self._running():
            return None
        t0 = time.perf_counter()
        self.state, out = self.engine.decode_chunk(self.state, yield_on_finish=True)
        owners = list(self.owners)
        if self.timed:
            jax.block_until_ready(out.count_s)
            self.timing.decode_s += time.perf_counter() - t0
            self.timing.decode_chunks += 1
        return out, owners

    def _read_unread(self, keep: int = 0) -> None:
        """Reads the dispatched calls in the order they ran, all but the newest `keep`."""
        while len(self._unread) > keep:
            kind, out, who = self._unread[0]
            # Alternatives are copied only when a request they were computed for wants them.
            top = any(h is not None and h.request.top_logprobs for h in who)
            if kind == "prefill":
                prompt = [h.request.prompt_logprobs for h in who]
                prompt_top = any(prompt)
                host = jax.device_get(
                    (
                        out.first_token_n,
                        out.first_logprob_n,
                        (out.first_top_ids_nk, out.first_top_logprobs_nk) if top else None,
                        out.finished_n,
                        out.stopped_n,
                        out.prompt_logprobs_t if any(p is not None for p in prompt) else None,
                        (out.prompt_top_ids_tk, out.prompt_top_logprobs_tk)
                        if prompt_top
                        else None,
                    )
                )
            else:
                if not top:
                    out = dataclasses.replace(out, top_ids_sck=None, top_logprobs_sck=None)
                host = jax.device_get(out)
            self._unread.popleft()  # on the host: from here on nothing waits to be interrupted
            if kind == "prefill":
                self._read_prefill(*host, who)
            else:
                self._read_chunk(host, who)

    def _read_prefill(
        self,
        first,
        first_logprob,
        first_top,
        finished,
        stopped,
        prompt_logprobs,
        prompt_top,
        handles: list[Handle],
    ) -> None:
        now = time.monotonic()
        for handle in handles:
            k = handle.request.prompt_logprobs
            if k is None:
                continue
            row, count = handle.prompt_rows.popleft()
            handle.prompt_logprobs += prompt_logprobs[row : row + count].tolist()
            if k:
                ids = prompt_top[0][row : row + count, :k].tolist()
                values = prompt_top[1][row : row + count, :k].tolist()
                handle.prompt_top_logprobs += [
                    list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)
                ]
        for i, handle in enumerate(handles):
            if handle.cancelled or handle.prefilled < len(handle.request.prompt_ids):
                continue  # a later chunk of the same prompt is still to come
            handle.first_token_at = handle.last_token_at = now
            self.observer.on_first_token(now - handle.submitted)
            top = None if first_top is None else (first_top[0][i : i + 1], first_top[1][i : i + 1])
            self._deliver(handle, [int(first[i])], [float(first_logprob[i])], top)
            if finished[i]:
                self._free(handle)
                self._finish(handle, "stop" if stopped[i] else "length")

    def _read_chunk(self, host, owners: list[Handle | None]) -> None:
        now = time.monotonic()
        gamma = self.engine.gamma
        ran = host.verified_sr >= 0
        if gamma:
            self.observer.on_rounds(host.verified_sr[ran], host.accepted_sr[ran], gamma)
        device_rounds = int(ran.any(axis=0).sum())
        self.slot_rounds += int(ran.sum())
        self.device_rounds += device_rounds
        self.observer.on_chunk(int(ran.sum()), device_rounds, self.engine.cfg.num_slots)
        if self.timed:
            self.timing.rounds += device_rounds
        for slot, handle in enumerate(owners):
            if handle is None or handle.cancelled or handle.finished:
                continue
            rounds = ran[slot]
            if rounds.any():
                handle.verified.append(host.verified_sr[slot, rounds])
                handle.accepted.append(host.accepted_sr[slot, rounds])
                handle.committed.append(host.committed_sr[slot, rounds])
                handle.conf.append(host.conf_logits_srk[slot, rounds])
            count = int(host.count_s[slot])
            if count:
                if self.timed:
                    self.timing.decoded_tokens += count
                gap = now - (handle.last_token_at or now)
                self.observer.on_tokens(count, gap / count)
                handle.last_token_at = now
                self._deliver(
                    handle,
                    host.tokens_sc[slot, :count].tolist(),
                    host.logprobs_sc[slot, :count].tolist(),
                    None
                    if host.top_ids_sck is None
                    else (host.top_ids_sck[slot, :count], host.top_logprobs_sck[slot, :count]),
                )
            if host.finished_s[slot]:
                self._free(handle)
                self._finish(handle, "stop" if host.stopped_s[slot] else "length")

    def _deliver(
        self,
        handle: Handle,
        tokens: list[int],
        logprobs: list[float],
        top: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Hands the request its new tokens, with the log-probabilities it asked for (`top`:
        the alternatives' ids and log-probabilities [tokens, TOP_LOGPROBS], when fetched)."""
        handle.tokens += tokens
        request = handle.request
        event = Tokens(tokens)
        if request.logprobs:
            handle.logprobs += logprobs
            event.logprobs = logprobs
            if request.top_logprobs:
                k = request.top_logprobs
                ids, values = top[0][:, :k].tolist(), top[1][:, :k].tolist()
                event.top_logprobs = [
                    list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)
                ]
                handle.top_logprobs += event.top_logprobs
        # The first tokens: the prompt has been read whole.
        if request.prompt_logprobs is not None and len(handle.tokens) == len(tokens):
            event.prompt_logprobs = list(handle.prompt_logprobs)
            if request.prompt_logprobs:
                event.prompt_top_logprobs = list(handle.prompt_top_logprobs)
        self._call(handle, "tokens", event)

    def _free(self, handle: Handle) -> None:
        self._enter_answer_pages(handle)
        if handle.slot is not None:
            self.owners[handle.slot] = None
            self.free_slots.append(handle.slot)
            handle.slot = None
        if handle.pages is not None:
            cached = {entry.page for entry in handle.held}
            self.allocator.drop(handle.held)
            self.allocator.release([p for p in handle.pages.tolist() if p not in cached])
            handle.pages, handle.held = None, []
            handle.writes.clear()

    def _finish(self, handle: Handle, reason: str) -> None:
        handle.finished = True
        gamma = max(self.engine.gamma, 1)
        cat = lambda parts, shape: np.concatenate(parts) if parts else np.zeros(shape)  # noqa: E731
        now = time.monotonic()
        result = Result(
            tokens=list(handle.tokens),
            finish_reason=reason,
            prompt_len=len(handle.request.prompt_ids),
            verified=cat(handle.verified, (0,)).astype(np.int32),
            accepted=cat(handle.accepted, (0,)).astype(np.int32),
            committed=cat(handle.committed, (0,)).astype(np.int32),
            conf_logits=cat(handle.conf, (0, gamma)).astype(np.float32),
            ttft_s=(handle.first_token_at or now) - handle.submitted,
            latency_s=now - handle.submitted,
            cached_tokens=handle.cached_tokens,
            logprobs=list(handle.logprobs) if handle.request.logprobs else None,
            top_logprobs=list(handle.top_logprobs) if handle.request.top_logprobs else None,
            prompt_logprobs=None
            if handle.request.prompt_logprobs is None
            else list(handle.prompt_logprobs),
            prompt_top_logprobs=list(handle.prompt_top_logprobs)
            if handle.request.prompt_logprobs
            else None,
        )
        self._call(handle, "done", result)

    def _call(self, handle: Handle, kind: str, payload: Any) -> None:
        try:
            handle.on_event(kind, payload)
        except BaseException as e:  # noqa: BLE001 -- held and raised by step(), Ctrl-C included
            if self._callback_error is None:
                self._callback_error = e


def generate(
    engine: Engine,
    requests: Sequence[Request],
    on_tokens: Callable[[int, list[int]], None] | None = None,
    progress: bool = False,
    policy_index: int | None = None,
    *,
    progress_label: str = "generate",
    prefix_caching: bool = True,
) -> tuple[list[Result], LoopTiming]:
    """Offline batch inference: every request through one continuously batched loop.

    `on_tokens(i, new_tokens)` streams request i's tokens as they are read. Returns the results
    in request order and where the time went (each device call is timed). `progress` shows a
    bar of finished requests on stderr, named `progress_label`. `policy_index`: see
    `Batcher`, as is `prefix_caching`."""
    batcher = Batcher(
        engine,
        max_waiting=max(len(requests), 1),
        timed=True,
        policy_index=policy_index,
        prefix_caching=prefix_caching,
    )
    results: list[Result | None] = [None] * len(requests)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), unit="req", desc=progress_label)

    def callback(i: int) -> EventCallback:
        def on_event(kind: str, payload: Any) -> None:
            if kind == "tokens" and on_tokens is not None:
                on_tokens(i, payload)
            elif kind == "done":
                results[i] = payload
                if bar is not None:
                    bar.update(1)

        return on_event

    for i, r in enumerate(requests):
        try:
            batcher.submit(r, callback(i))
        except EngineError as e:
            raise EngineError(f"request {i}: {e}") from None
    batcher.run_until_idle()
    if bar is not None:
        bar.close()
    return results, batcher.timing
