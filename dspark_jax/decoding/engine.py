"""The slot engine: a fixed set of request slots over paged KV caches, driven chunk by chunk.

Verbs (all jitted, state donated, no host sync inside):

  prefill(state, batch)   writes up to `prefill_seqs` prompt chunks (packed, one token bucket)
                          into their slots' pages; the last chunk of a prompt samples the
                          request's first token and makes its slot live. The first chunk of a
                          prompt also installs the request's page-table row and its settings.
  decode_chunk(state, yield_on_finish)
                          runs up to `rounds_per_chunk` rounds over all slots (live or not) in a
                          `lax.while_loop` -- with `yield_on_finish`, only until the round in
                          which some request ends, so the host can refill its slot at once;
                          returns the new state and a small `ChunkOutput` (tokens committed
                          this chunk, per-round statistics, finished flags) that the host reads
                          without touching the caches.
  release(state, mask)    ends the slots in `mask` (a cancelled request): they stop at once.
  mark_prompts            (an engine with penalties) marks the prompt tokens of requests whose
                          repetition penalty is on; `Engine.prefill` calls it when it must.

Everything a request owns lives in its slot row: its page-table row (the pages are reserved by
the host, see `batching`), committed length, anchor token, PRNG key, sampling settings
(temperature, top-k, top-p as arrays: one program serves every mix), max new tokens, stop
tokens, counters and its policy carry row.

One speculative round: the drafter drafts a block for every live slot (over the smallest slot
bucket that holds them, `draft_buckets`); the policy picks how many drafts each live slot
verifies (l_s); every live slot's anchor and l_s drafts are packed into one token axis padded
to the smallest token bucket >= sum(l_s + 1), and the target runs over exactly that (a
`lax.switch` over the buckets: only the chosen branch runs); rejection sampling accepts a
prefix per slot; the accepted tokens' target features are appended to the drafter's context.
Rejected tokens are rolled back by length alone. Plain decoding packs one token per live slot.

Compiled programs: one prefill per token bucket of `prefill_buckets`, one decode chunk, one
release, one state initialisation and, with penalties, one prompt marking -- fixed at
construction and all built by `warm_up()`.

On a mesh (`mesh=`), parameters and state carry shardings from the rules table in
`dspark_jax.sharding`: weights split by their logical axes (heads, MLP width and vocabulary over
`tensor`), page pools by KV head over `tensor`, slot rows over `data`; every verb's state output
is pinned to the same shardings, so donation holds and no call compiles a second program.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax.calibration.sts import STS_TEMP_RTOL, StsArtifact
from dspark_jax.decoding import policies
from dspark_jax.decoding.policies import FixedPolicy, Policy, PolicyError, PolicySwitch, SpsProfile
from dspark_jax.decoding.verify import verify_packed
from dspark_jax.errors import UserError, as_integer
from dspark_jax.models import attention, paged
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.layers import compiler_options
from dspark_jax.models.paged import PagedCache, TokenBatch
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sampling import (
    GREEDY,
    NO_STOP_TOKEN,
    PAD_TOKEN,
    STREAM_DRAFT,
    STREAM_RESIDUAL,
    RowSampling,
    SamplingConfig,
    allowed_rows,
    apply_allowed_tokens,
    apply_logit_bias,
    apply_penalties,
    apply_repetition_penalty,
    ban_tokens,
    bias_entries,
    logprobs_and_argmax,
    penalties,
    position_keys,
    sample_from_logprobs,
)
from dspark_jax.sharding import check_model_split, logical_sharding, state_shardings


class EngineError(UserError):
    """A request or setting the engine cannot serve as configured. `field`: the `Request` field
    at fault where there is one (`prompt_ids`, `stop_token_ids`, `max_new_tokens`, `seed`,
    `sampling`, `logit_bias`, `min_tokens`), so a server can name the parameter of its own API
    that carried it."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


# The most alternatives a token's log-probabilities come with (OpenAI's bound on top_logprobs),
# and the most that XLA's GPU compiler finds in one kernel over a row (beyond, it sorts the row).
TOP_LOGPROBS = 20
FAST_TOP_K = 16

# A slot's (presence, frequency, repetition) penalties when its request has none.
NO_PENALTIES = (0.0, 0.0, 1.0)
# (slot, token) pairs of prompt tokens one call of the marking program takes: a prompt's distinct
# tokens, so a few calls even for the longest prompts (`Engine.prefill`).
PROMPT_MARKS = 2048


def block_positions(gamma: int) -> int:
    """Cache positions a request may write past its last token: its final round verifies an
    anchor and gamma drafts there. A server sizes max_model_len this much above the prompt +
    answer tokens it takes."""
    return gamma + 1


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shapes of the engine.

    num_slots: requests decoded at once. max_model_len: most positions one request may use
    (prompt + generated tokens + one block). page_size: tokens per KV page. num_pages: the KV
    pool shared by all slots (None: enough for every slot at max_model_len). prefill_chunk: most
    prompt tokens per prefill call (longer prompts take several, interleaved with decode
    chunks). prefill_seqs: most prompts (chunks) packed into one prefill call. prefill_buckets:
    token counts a prefill call is padded to, one program each (None: 16, 32, 64, ... below
    prefill_chunk, then prefill_chunk; the largest must reach prefill_chunk).
    token_buckets: token counts the packed verification is padded to (None: derived from the
    slots and the most drafts the policy verifies: the block, or a fixed policy's gamma).
    draft_buckets: slot counts the drafter's block runs over, the live slots gathered first
    (None: doublings from an eighth of num_slots, at least 4, up to num_slots: at most four
    buckets; the largest must be num_slots; `(num_slots,)` drafts every slot, live or not,
    with no gather).
    max_stop_tokens: most stop ids per request, its own `stop_token_ids` and the engine's
    `stop_tokens` together. rounds_per_chunk: rounds per `decode_chunk` call. attention_impl:
    the paged attention path ("dense", "jax", "pallas_tpu", "pallas_gpu"; None: by backend);
    attention_interpret runs the Pallas paths in interpret mode (tests on CPU).
    penalties: serve requests with presence, frequency or repetition penalties
    (`SamplingConfig`). The state then counts each slot's generated tokens ([num_slots,
    vocabulary] int32) and marks its prompt's ([num_slots, vocabulary] bool, for the repetition
    penalty), which the decode program's second sampling of the verified rows applies to their
    logits: the one that
    runs only in rounds where some live request adjusts its logits (a penalty, a logit bias, or
    stop tokens banned before its min_tokens; the other rounds cost nothing but the counting).
    Off, a request with a penalty is refused.
    max_logit_bias: the most tokens a request's `SamplingConfig.logit_bias` may bias (0: none;
    a request with a logit_bias is refused). The state then holds each slot's bias ids and
    values ([num_slots, max_logit_bias] each), added to its logits in the same conditional
    sampling as the penalties (run only in rounds where some live request adjusts its logits),
    and the same entries hold a request's `SamplingConfig.allowed_token_ids` (at most this many).
    """

    num_slots: int = 8
    max_model_len: int = 2048
    page_size: int = 16
    num_pages: int | None = None
    rounds_per_chunk: int = 8
    prefill_chunk: int = 256
    prefill_seqs: int = 4
    prefill_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    draft_buckets: tuple[int, ...] | None = None
    max_stop_tokens: int = 16
    attention_impl: str | None = None
    attention_interpret: bool = False
    penalties: bool = False
    max_logit_bias: int = 0

    def __post_init__(self) -> None:
        # Sizes become array shapes: a float (64.5, or 64.0 from a division) would fail deep
        # inside JAX, an empty bucket tuple with a bare IndexError.
        sizes = ("num_slots", "max_model_len", "page_size", "rounds_per_chunk", "prefill_chunk")
        for name in (*sizes, "prefill_seqs", "max_stop_tokens", "num_pages"):
            value = getattr(self, name)
            if value is None and name == "num_pages":
                continue
            number = as_integer(value)
            if number is None:
                raise EngineError(f"{name} must be an integer >= 1, got {value!r}")
            if number < 1:
                raise EngineError(f"{name} must be >= 1, got {value}")
            object.__setattr__(self, name, number)  # a numpy integer becomes a plain int
        bias = as_integer(self.max_logit_bias)
        if bias is None or bias < 0:
            raise EngineError(
                f"max_logit_bias must be an integer >= 0 (0: no logit_bias), got "
                f"{self.max_logit_bias!r}"
            )
        object.__setattr__(self, "max_logit_bias", bias)
        for flag in ("attention_interpret", "penalties"):
            # "no" would count as true (for attention_interpret, Pallas in interpret mode:
            # slow, and CPU-only in effect).
            if not isinstance(getattr(self, flag), bool | np.bool_):
                raise EngineError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        for name, derived in (
            ("prefill_buckets", "derived from prefill_chunk"),
            ("token_buckets", "derived from the slots and the policy"),
            ("draft_buckets", "doublings up to num_slots"),
        ):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                widths = tuple(as_integer(w) for w in value)
            except TypeError:
                widths = ()
            if not widths or any(w is None or w < 1 for w in widths):
                raise EngineError(
                    f"{name} must be a non-empty tuple of integers >= 1 (or None: {derived}), "
                    f"got {value!r}"
                )
            object.__setattr__(self, name, widths)
        if self.draft_buckets is not None:
            # A bucket above the slots would draft for slots that do not exist; without one
            # of num_slots a round with more live slots than the largest would have no branch.
            slots = set(self.draft_buckets)
            if max(slots) != self.num_slots:
                raise EngineError(
                    f"draft_buckets {tuple(sorted(slots))} must end at num_slots "
                    f"{self.num_slots}: each is a number of slots the drafter runs over"
                )
            object.__setattr__(self, "draft_buckets", tuple(sorted(slots)))

    def slot_buckets(self) -> tuple[int, ...]:
        """The slot counts the drafter's block runs over (`draft_buckets`, or doublings).

        Each is a branch of the decode program holding the drafter (compiled once, but
        compiled: on the CPU each adds a fifth to a small speculative decode program's compile
        time). The default doubles from an eighth of the slots, and from no fewer than 4: on an
        accelerator a few rows cost what one does (the drafter's weights are read once either
        way), so smaller buckets would add compile time and save nothing, and at most four
        branches bound what the buckets add."""
        if self.draft_buckets is not None:
            return self.draft_buckets
        return _geometric(min(max(4, -(-self.num_slots // 8)), self.num_slots), self.num_slots)

    @property
    def pages_per_slot(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def pool_pages(self) -> int:
        return self.num_pages or self.num_slots * self.pages_per_slot

    def prefill_widths(self) -> tuple[int, ...]:
        if self.prefill_buckets is not None:
            widths = tuple(sorted(set(self.prefill_buckets)))
            if widths[-1] < self.prefill_chunk:
                raise EngineError(
                    f"the largest prefill bucket {widths[-1]} is below prefill_chunk "
                    f"{self.prefill_chunk}"
                )
            return widths
        return _geometric(16, self.prefill_chunk)


# Headroom left to activations and compiled programs when sizing the slot state against memory.
MEMORY_FRACTION = 0.9


HOST_MEMORY = "host memory"  # where `memory_budget` found it: the devices report none


def memory_budget(devices: Sequence[jax.Device]) -> tuple[int, str]:
    """(bytes free, where) on the devices the slot state goes to: the least free that any of
    them reports (each holds a share, the fullest runs out first), or on backends that report
    nothing (CPU) the host's available memory (MemAvailable, else all of its physical memory).
    Parameters are loaded by then, so they are already counted as used."""
    reported = []
    for device in devices:
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
            reported.append((free, str(device)))
    if reported:
        return min(reported, key=lambda r: r[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, HOST_MEMORY
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), HOST_MEMORY


def is_compile_only(device: jax.Device) -> bool:
    """Whether `device` stands in for hardware that is not there (a device of a
    `jax.experimental.topologies` topology): programs compile for it, nothing is put on it."""
    client = getattr(device, "client", None)
    return getattr(client, "runtime_type", None) == "compile_only_runtime"


def _state_bytes(abstract: SlotState, shardings: SlotState | None) -> int:
    """Bytes of the slot state on one device: on a mesh, that device's shard of every array."""
    leaves = jax.tree.leaves(abstract)
    if shardings is None:
        return sum(x.size * x.dtype.itemsize for x in leaves)
    return sum(
        int(np.prod(sh.shard_shape(x.shape))) * x.dtype.itemsize
        for x, sh in zip(leaves, jax.tree.leaves(shardings), strict=True)
    )


def _check_memory(state_bytes: int, cfg: EngineConfig, devices: Sequence[jax.Device]) -> None:
    """Refuses an engine whose slot state (the KV page pools above all) cannot fit, before
    anything is allocated: the allocation would fail, or summon the kernel's OOM killer, only
    after minutes of loading and compiling. `state_bytes` is one device's share of the state,
    `devices` this host's devices that hold a share."""
    free, where = memory_budget(devices)
    num_devices = len(devices)
    # Devices without memory of their own (CPU) all take their shares from the host's.
    need = state_bytes * num_devices if where == HOST_MEMORY else state_bytes
    if need > MEMORY_FRACTION * free:
        per = " per device" if num_devices > 1 and where != HOST_MEMORY else ""
        raise EngineError(
            f"the KV pool and slot state need {format_bytes(need)}{per} ({cfg.pool_pages} "
            f"pages of {cfg.page_size} tokens, {cfg.num_slots} slot"
            f"{'s' if cfg.num_slots != 1 else ''}, max_model_len "
            f"{cfg.max_model_len}) but {where} has {format_bytes(max(free, 0))} free: lower "
            "--kv-pages, --max-model-len, --max-new-tokens or --max-num-seqs (profile: "
            "--context-len)"
        )


def format_bytes(n: float) -> str:
    """'12.34 GiB', '5.6 MiB' or '789 KiB': a small state's size does not read as 0.00 GiB."""
    for unit, scale, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n / 2**10:.0f} KiB"


def _geometric(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... below hi, then hi."""
    out, w = [], lo
    while w < hi:
        out.append(w)
        w *= 2
    return (*out, hi)


def default_token_buckets(num_slots: int, gamma: int, smallest: int) -> tuple[int, ...]:
    """Verification token buckets: `smallest`, doubling, up to num_slots * (gamma + 1).

    Each bucket is a branch of the decode program (compiled once, but compiled), so doublings
    trade at most half a step of padding against compile time and program size."""
    top = num_slots * (gamma + 1)
    out, w = [], min(smallest, top)
    while w < top:
        out.append(w)
        w *= 2
    return (*out, top)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """Per-slot decoding state (row s is slot s) plus the KV page pools."""

    target_pages: tuple  # per layer (see `attention.init_pages`)
    draft_pages: tuple | None  # the drafter's context K/V, same page table
    page_table_sp: jax.Array  # int32 [slots, pages_per_slot]: the slot's pages
    lengths_s: jax.Array  # committed tokens in the cache = position of the anchor
    anchor_s: jax.Array  # last committed token, not yet in the cache
    # The request's PRNG key as raw key data [slots, key words]: typed key arrays make jit keep
    # a second dispatch entry for sharded arguments, which would read as a recompilation.
    key_data_s: jax.Array
    sampling_s: RowSampling
    max_new_s: jax.Array  # tokens to generate, the first (from prefill) included
    # Tokens the request generates before a stop token may end it (`Request.min_tokens`): its
    # stop tokens are banned from the target's logits at the places before (0: none).
    min_new_s: jax.Array
    stop_sk: jax.Array  # stop token ids, NO_STOP_TOKEN-padded
    num_generated_s: jax.Array
    live_s: jax.Array  # holds a request that has not finished
    rounds_s: jax.Array  # rounds the request has run
    # The request's log-probabilities: -1 none, else each token's and that many alternatives'
    # (at most TOP_LOGPROBS).
    logprobs_s: jax.Array
    policy_carry: Any
    # With `EngineConfig.penalties` (else None): each slot's (presence, frequency, repetition)
    # penalties [slots, 3] float32 (off: 0, 0, 1), how many times its request generated each
    # token [slots, V] int32, and which tokens its prompt holds [slots, V] bool (marked by
    # `Engine.prefill` for a request whose repetition penalty is on; stale rows are read only
    # with the penalty 1, which changes nothing).
    penalties_s: jax.Array | None = None
    counts_sv: jax.Array | None = None
    prompt_sv: jax.Array | None = None
    # With `EngineConfig.max_logit_bias` K (else None): each slot's logit_bias as token ids
    # [slots, K] int32 and biases [slots, K] float32 (unused entries: id 0, bias 0), and
    # whether its request draws only those ids ([slots] bool: allowed_token_ids, which then
    # fill the entries, each with its bias, the unused ones repeating the first at bias 0).
    bias_ids_sk: jax.Array | None = None
    bias_sk: jax.Array | None = None
    allowed_s: jax.Array | None = None

    def replace(self, **changes) -> SlotState:
        return dataclasses.replace(self, **changes)

    @property
    def keys_s(self) -> jax.Array:
        return jax.random.wrap_key_data(self.key_data_s)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkOutput:
    """What one decode chunk produced, small enough to copy to the host every chunk."""

    tokens_sc: jax.Array  # tokens committed this chunk, left-aligned, PAD_TOKEN after count_s
    logprobs_sc: jax.Array  # each token's log-probability under the target (`token_logprobs`)
    # The TOP_LOGPROBS likeliest tokens where each was sampled, and their log-probabilities.
    top_ids_sck: jax.Array
    top_logprobs_sck: jax.Array
    count_s: jax.Array
    verified_sr: jax.Array  # per round of the chunk: drafts verified (-1: the slot did not run)
    accepted_sr: jax.Array  # drafts accepted (before stop truncation)
    committed_sr: jax.Array  # tokens committed by the round, bonus included
    conf_logits_srk: jax.Array  # confidence logits of the round's block (before STS)
    step_tokens_r: jax.Array  # tokens the round verified in total (its packed width before
    # padding to a token bucket; 0 for rounds not run)
    finished_s: jax.Array  # the request ended during this chunk
    stopped_s: jax.Array  # ... because it committed a stop token (else: length)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillOutput:
    first_token_n: jax.Array  # the request's first token (sequences completing their prompt)
    first_logprob_n: jax.Array  # its log-probability under the target (`token_logprobs`)
    first_top_ids_nk: jax.Array  # the likeliest first tokens (`top_logprobs`)
    first_top_logprobs_nk: jax.Array
    finished_n: jax.Array  # the request ended with its first token
    stopped_n: jax.Array
    # Prompt log-probabilities, for calls where a sequence asked (PrefillItem.prompt_logprobs):
    # row t's the log-probability of the prompt token after it (`next_tokens_t`), and the
    # likeliest tokens there; zeros otherwise.
    prompt_logprobs_t: jax.Array
    prompt_top_ids_tk: jax.Array
    prompt_top_logprobs_tk: jax.Array


@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """Host arrays of one prefill call (built by `Engine.pack_prefill`)."""

    tokens_t: np.ndarray
    batch: TokenBatch  # numpy fields
    first_n: np.ndarray  # bool: the sequence's first chunk (install its slot)
    last_row_n: np.ndarray  # int32: packed row of the prompt's last token, -1 if not final
    page_rows_np: np.ndarray  # int32 [N, pages_per_slot]
    temperature_n: np.ndarray
    top_k_n: np.ndarray
    top_p_n: np.ndarray
    min_p_n: np.ndarray
    penalties_n3: np.ndarray  # float32 [N, 3]: presence, frequency, repetition
    bias_ids_nk: np.ndarray  # int32 [N, max(1, max_logit_bias)]: logit_bias token ids
    bias_nk: np.ndarray  # float32, the same shape: their biases (0 past a request's own)
    allowed_n: np.ndarray  # bool [N]: the request draws only its bias_ids (allowed_token_ids)
    max_new_n: np.ndarray
    min_new_n: np.ndarray  # int32: PrefillItem.min_new_tokens
    stop_nk: np.ndarray
    seed_n: np.ndarray  # uint32
    prompt_len_n: np.ndarray
    logprobs_n: np.ndarray  # int32: the request's logprobs level (SlotState.logprobs_s)
    prompt_logprobs_n: np.ndarray  # int32: the same for its prompt's tokens (-1: none)
    next_tokens_t: np.ndarray  # int32 [width]: the prompt token after each row's (-1: none)
    # Host only (`Engine.prefill` marks them before the call, `batch_to_device` leaves them out):
    # (slot, token) pairs of the prompts of requests installed by this call whose repetition
    # penalty is on (`SlotState.prompt_sv`).
    prompt_slot_m: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    prompt_ids_m: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))


@dataclasses.dataclass(frozen=True)
class PrefillItem:
    """One prompt chunk to prefill: tokens prompt[start:start+len(tokens)] of a request in slot.

    The request's first chunk installs it in its slot (page-table row, settings). That is the
    chunk at start 0 unless `first` says otherwise: a request whose first pages came from the
    prefix cache starts prefilling past them, their K/V already in its page row."""

    slot: int
    tokens: np.ndarray
    start: int
    prompt_len: int
    page_row: np.ndarray
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    stop_tokens: tuple[int, ...]
    seed: int
    min_p: float = 0.0
    min_new_tokens: int = 0  # no stop token before this many tokens (`Request.min_tokens`)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # The request's whole prompt, needed with the chunk that installs it when its repetition
    # penalty is on (the penalty applies to every prompt token, prefix-cached ones included).
    prompt_ids: np.ndarray | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # SamplingConfig.logit_bias's pairs
    allowed_token_ids: tuple[int, ...] = ()  # SamplingConfig.allowed_token_ids
    first: bool | None = None  # installs the request; None: start == 0
    # Log-probabilities the calls report for its tokens: -1 none, else each token's and that many
    # alternatives' (SlotState.logprobs_s).
    logprobs: int = -1
    # The same for the prompt tokens after this chunk's: `next_tokens` holds them
    # (prompt[start + 1 : start + len(tokens) + 1]).
    prompt_logprobs: int = -1
    next_tokens: np.ndarray | None = None


def _check_sts(sts: StsArtifact, drafter: DSparkDrafter | None, fingerprint: str | None) -> None:
    """Refuses an STS artifact the engine cannot apply or one fitted for another drafter or block
    size. Its sampling temperature decides per request where it applies (see `_spec_round`)."""
    if drafter is None:
        raise EngineError("an STS artifact needs a drafter; plain decoding has no confidences")
    if drafter.confidence_head is None:
        raise EngineError("an STS artifact needs a drafter with a confidence head")
    if fingerprint is None:
        raise EngineError(
            "pass drafter_fingerprint (as returned by load_drafter) with an STS artifact, so the "
            "engine can check that the artifact belongs to this drafter"
        )
    sts.check(fingerprint, None, drafter.cfg.block_size)


def token_buckets(cfg: EngineConfig, policy: Policy, gamma: int) -> tuple[int, ...]:
    """The verification buckets; a policy with a measured SPS profile must use its buckets,
    since its SPS values describe exactly those token counts (the profiles of a switch's members
    must agree). The largest must hold every slot verifying as many drafts as the policy can ask
    for: the block, or a fixed policy's gamma."""
    most = most_drafts(policy, gamma)
    top = cfg.num_slots * (most + 1)
    profiles = {
        p.sps.buckets: p.sps
        for p in policies.members(policy)
        if isinstance(getattr(p, "sps", None), SpsProfile)
    }
    if len(profiles) > 1:
        raise EngineError(
            f"the switch's SPS profiles measure different token buckets ({sorted(profiles)}); "
            "one engine runs one set of buckets"
        )
    if profiles:
        (profile,) = profiles.values()
        if cfg.token_buckets is not None and tuple(sorted(cfg.token_buckets)) != profile.buckets:
            raise EngineError(
                f"token_buckets {tuple(sorted(cfg.token_buckets))} differ from the SPS profile's "
                f"buckets {profile.buckets}; use the profile's (or leave them unset)"
            )
        buckets = profile.buckets
    elif cfg.token_buckets is not None:
        buckets = tuple(sorted(set(cfg.token_buckets)))
    else:
        # Plain decoding packs one token per live slot; a policy verifying whole blocks packs
        # multiples of a block; other policies start at one token per slot.
        if most == 0:
            smallest = 1
        elif all(isinstance(p, FixedPolicy) for p in policies.members(policy)):
            smallest = min(most_drafts(p, gamma) for p in policies.members(policy)) + 1
        else:
            smallest = cfg.num_slots
        buckets = default_token_buckets(cfg.num_slots, most, smallest)
    if buckets[-1] < top:
        raise EngineError(
            f"the largest token bucket {buckets[-1]} is below num_slots x (drafts + 1) = {top}: a "
            f"round of all slots verifying {most} drafts each would not fit"
        )
    return buckets


def most_drafts(policy: Policy, gamma: int) -> int:
    """The most drafts `policy` (any member of a switch) verifies per slot in one round of a
    block of `gamma`."""
    return max(
        min(p.gamma, gamma) if isinstance(p, FixedPolicy) else gamma
        for p in policies.members(policy)
    )


def _check_token_ids(name: str, ids: Sequence[int], vocab: int, field: str | None = None) -> None:
    """Refuses `ids` (described by `name`, the Request's `field`) unless they are a flat
    sequence of integers in the vocabulary: the model would read past its embedding table, and
    a stop id outside it can never match."""
    ids_n = np.asarray(ids)
    if ids_n.size and (ids_n.ndim != 1 or not np.issubdtype(ids_n.dtype, np.integer)):
        raise EngineError(f"{name} must be a flat sequence of integers", field)
    bad = ids_n[(ids_n < 0) | (ids_n >= vocab)] if ids_n.size else ids_n
    if bad.size:
        raise EngineError(
            f"{name} must lie in 0..{vocab - 1} (the vocabulary); got "
            f"{', '.join(map(str, bad[:5].tolist()))}",
            field,
        )


def _is_stop(tokens_s, stop_sk):
    return jnp.any(tokens_s[:, None] == stop_sk, axis=-1)


class Engine:
    """Jitted slot verbs over a target (and optionally a drafter); see the module docstring.

    The models are split into (graphdef, state) once; the jitted functions are pure functions of
    the parameter states and a donated `SlotState`. `policy` (default: verify the whole block)
    chooses the verified lengths (an `SpsProfile` it holds must be profiled for `cfg.num_slots`
    and these models' shapes, `policies.check_sps_profile`); `sts` (an `StsArtifact`, checked
    against `drafter_fingerprint`) calibrates the confidence logits the policy sees.
    `stop_tokens`: the ids that end every request (unless it asks `ignore_eos`); default the
    target config's EOS ids, which for Qwen3 is <|im_end|> alone. The CLI and the server add
    generation_config.json's <|endoftext|>: pass `load_decoding_models(...).stop_tokens` (or
    `dspark_jax.tokenizer.stop_token_ids(...)`) to do the same. `mesh`: run sharded over a
    (data, fsdp, tensor) mesh (parameters already placed there stay where they are).
    """

    def __init__(
        self,
        target: Qwen3,
        drafter: DSparkDrafter | None,
        cfg: EngineConfig,
        policy: Policy | None = None,
        stop_tokens: tuple[int, ...] = (),
        sts: StsArtifact | None = None,
        drafter_fingerprint: str | None = None,
        mesh: Mesh | None = None,
    ):
        self.cfg = cfg
        self.mesh = mesh
        self.target_cfg = target.cfg
        self.speculative = drafter is not None
        self.gamma = drafter.cfg.block_size if drafter is not None else 0
        if drafter is not None:
            drafter.cfg.check_target(target.cfg)
        if sts is not None:
            _check_sts(sts, drafter, drafter_fingerprint)
        self.sts = sts
        if drafter is None and policy is not None:
            raise EngineError(
                f"a policy ({type(policy).__name__}) needs a drafter; plain decoding verifies no "
                "drafts, so it would be ignored: give the drafter or leave policy unset"
            )
        gamma = self.gamma
        policy = policy if policy is not None else FixedPolicy(gamma)
        if not isinstance(policy, Policy):
            raise PolicyError(f"policy must be a Policy, got {type(policy).__name__}")
        if drafter is not None and policy.needs_confidence and drafter.confidence_head is None:
            names = [type(p).__name__ for p in policies.members(policy) if p.needs_confidence]
            raise EngineError(
                f"{', '.join(names)} needs confidences; this drafter has no confidence head"
            )
        # A measured SPS profile describes one batch of one model: this engine's slots and
        # models, or the scheduler would trade against another engine's step times.
        for member in policies.members(policy):
            sps = getattr(member, "sps", None)
            if isinstance(sps, SpsProfile):
                policies.check_sps_profile(sps, cfg.num_slots, target.cfg, drafter.cfg, mesh=mesh)
        self.policy = policy
        # Checked as a request's stop ids are: one that is no integer or lies past int32 would
        # fail at the first generate, one outside the vocabulary could never match.
        try:
            given = tuple(stop_tokens)
        except TypeError:  # not a sequence: refused as one below
            given = stop_tokens
        _check_token_ids("stop_tokens", given, target.cfg.vocab_size)
        self.stop_tokens = tuple(int(t) for t in given) or target.cfg.eos_token_ids
        if len(self.stop_tokens) > cfg.max_stop_tokens:
            raise EngineError(
                f"{len(self.stop_tokens)} stop tokens exceed max_stop_tokens {cfg.max_stop_tokens}"
            )
        limit = target.cfg.max_position_embeddings
        if cfg.max_model_len > limit:
            raise EngineError(
                f"max_model_len {cfg.max_model_len} exceeds the model's context "
                f"(max_position_embeddings {limit})"
            )
        if cfg.max_model_len <= block_positions(gamma):
            # Such an engine builds and compiles, and refuses every request.
            raise EngineError(
                f"max_model_len {cfg.max_model_len} leaves no room for a request: each needs "
                f"its prompt and tokens plus {block_positions(gamma)} verification positions"
            )
        self.token_buckets = token_buckets(cfg, policy, gamma)
        self.draft_buckets = cfg.slot_buckets() if drafter is not None else ()
        self.prefill_widths = cfg.prefill_widths()
        # XLA:CPU gathers and scatters 16-bit pools through a float32 copy of the whole pool
        # every step; there the pools store float32 holding the 16-bit values (same results).
        platform = (jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform
        try:  # a page size or head dim the attention path cannot take is the user's to change
            impl = cfg.attention_impl or attention.default_impl()
            self.target_layout = attention.PagedLayout(
                cfg.pool_pages,
                cfg.page_size,
                target.cfg.num_key_value_heads,
                target.cfg.head_dim,
                impl,
                interpret=cfg.attention_interpret,
                value_dtype=attention.pool_value_dtype(impl, target.dtype, platform),
            )
            self.draft_layout = (
                None
                if drafter is None
                else attention.PagedLayout(
                    cfg.pool_pages,
                    cfg.page_size,
                    drafter.cfg.model.num_key_value_heads,
                    drafter.cfg.model.head_dim,
                    impl,
                    interpret=cfg.attention_interpret,
                    value_dtype=attention.pool_value_dtype(impl, drafter.dtype, platform),
                )
            )
        except ValueError as err:
            raise EngineError(str(err)) from err
        # The Triton kernel off a GPU can be lowered for one (`lower(platforms=("cuda",))`),
        # not run here: running is refused by name (`_check_runnable`), not by Pallas mid-trace.
        self._off_gpu_triton = (
            impl == "pallas_gpu"
            and platform not in ("gpu", "cuda")
            and not cfg.attention_interpret
            and not any(map(is_compile_only, mesh.devices.flat if mesh is not None else ()))
        )
        self._target_graph, self.target_params = nnx.split(target)
        self._drafter_graph, self.drafter_params = (
            nnx.split(drafter) if drafter is not None else (None, None)
        )
        if mesh is not None:
            self._place_params(target, drafter, mesh)
        layouts = (self.target_layout, self.draft_layout, mesh)
        tg, dg = self._target_graph, self._drafter_graph
        taps = () if drafter is None else drafter.cfg.target_layer_ids

        def merge(target_params, drafter_params):
            t = nnx.merge(tg, target_params)
            d = nnx.merge(dg, drafter_params) if dg is not None else None
            return t, d

        def init(target_params, drafter_params):
            t, d = merge(target_params, drafter_params)
            return self._init_state(t, d)

        def prefill(target_params, drafter_params, state, host):
            t, d = merge(target_params, drafter_params)
            return _prefill(t, d, taps, policy, layouts, state, host)

        def decode(target_params, drafter_params, state, yield_on_finish):
            t, d = merge(target_params, drafter_params)
            if d is None:
                round_fn = lambda s, o, r: _plain_round(  # noqa: E731
                    t, self.token_buckets, layouts, s, o, r
                )
            else:
                round_fn = lambda s, o, r: _spec_round(  # noqa: E731
                    t, d, policy, sts, self.token_buckets, self.draft_buckets, layouts, s, o, r
                )
            return _run_chunk(round_fn, cfg.rounds_per_chunk, gamma, state, yield_on_finish)

        def release(state, mask_s):
            return state.replace(live_s=state.live_s & ~mask_s)

        def mark_prompts(state, clear_s, slot_m, ids_m):
            prompt_sv = jnp.where(clear_s[:, None], False, state.prompt_sv)
            return state.replace(prompt_sv=prompt_sv.at[slot_m, ids_m].set(True, mode="drop"))

        abstract = jax.eval_shape(init, self.target_params, self.drafter_params)
        if mesh is None:
            state_sh = out_sh = None
        else:
            state_sh = slot_state_shardings(abstract, layouts)
            # The host reads every result whole.
            out_sh = NamedSharding(mesh, PartitionSpec())
        self.state_shardings = state_sh
        self.state_bytes = _state_bytes(abstract, state_sh)
        # Unplaced arrays go to the default device, the first local one.
        local = jax.local_devices()[:1] if mesh is None else mesh.local_devices
        # A mesh of a topology's stand-in devices (`jax.experimental.topologies`: a TPU or GPU
        # compiled for without one) holds nothing, and parameters of shapes alone
        # (`nnx.eval_shape`: a memory or lowering-time measurement) cannot run: either way the
        # programs are lowered and compiled only, and nothing is weighed against free memory.
        shapes_only = any(
            isinstance(x, jax.ShapeDtypeStruct)
            for x in jax.tree.leaves((self.target_params, self.drafter_params))
        )
        self.compile_only = shapes_only or any(map(is_compile_only, local))
        if not self.compile_only:
            _check_memory(self.state_bytes, cfg, local)
        # On an NVIDIA GPU, loops and conditionals go into XLA's CUDA graphs: a decode chunk
        # is one launch, its rounds, buckets and filters decided on the device (graph_loops).
        self.compiler_options = compiler_options(local[0])
        jit = functools.partial(jax.jit, compiler_options=self.compiler_options)
        self._init = jit(init, out_shardings=state_sh)
        self._prefill = jit(prefill, donate_argnums=(2,), out_shardings=(state_sh, out_sh))
        self._decode = jit(decode, donate_argnums=(2,), out_shardings=(state_sh, out_sh))
        self._release = jit(release, donate_argnums=(0,), out_shardings=state_sh)
        # With penalties: marks the prompt tokens of requests whose repetition penalty is on.
        self._mark_prompts = (
            jit(mark_prompts, donate_argnums=(0,), out_shardings=state_sh)
            if cfg.penalties
            else None
        )
        # decode_chunk's flag, on the device once (a host bool would be an implicit transfer
        # per chunk, which jax.transfer_guard could not tell from a leak): replicated on a mesh,
        # uncommitted on the default device otherwise.
        if self.compile_only:  # traced with, never passed
            self._yield_flags = (jax.ShapeDtypeStruct((), np.bool_, sharding=out_sh),) * 2
        else:
            self._yield_flags = tuple(jax.device_put(np.asarray(f), out_sh) for f in (False, True))

    def _place_params(self, target: Qwen3, drafter: DSparkDrafter | None, mesh: Mesh) -> None:
        """Checks that the models split over `mesh` and puts their parameters in the rules
        table's shardings (a no-op for parameters loaded there, see `load_decoding_models`)."""
        check_model_split("target", target.cfg, mesh)
        self.target_params = _place(self.target_params, mesh, "target")
        if drafter is not None:
            check_model_split("drafter", drafter.cfg.model, mesh)
            self.drafter_params = _place(self.drafter_params, mesh, "drafter")

    # -- state ---------------------------------------------------------------------------------
    def _init_state(self, target: Qwen3, drafter: DSparkDrafter | None) -> SlotState:
        cfg, s = self.cfg, self.cfg.num_slots
        return SlotState(
            target_pages=tuple(
                attention.init_pages(self.target_layout, target.dtype)
                for _ in range(target.cfg.num_hidden_layers)
            ),
            draft_pages=None
            if drafter is None
            else tuple(
                attention.init_pages(self.draft_layout, drafter.dtype)
                for _ in range(drafter.cfg.model.num_hidden_layers)
            ),
            page_table_sp=jnp.zeros((s, cfg.pages_per_slot), jnp.int32),
            lengths_s=jnp.zeros((s,), jnp.int32),
            anchor_s=jnp.zeros((s,), jnp.int32),
            key_data_s=jax.random.key_data(jax.vmap(jax.random.key)(jnp.zeros((s,), jnp.uint32))),
            sampling_s=RowSampling(
                jnp.zeros((s,), jnp.float32),
                jnp.zeros((s,), jnp.int32),
                jnp.ones((s,), jnp.float32),
                jnp.zeros((s,), jnp.float32),
            ),
            max_new_s=jnp.zeros((s,), jnp.int32),
            min_new_s=jnp.zeros((s,), jnp.int32),
            stop_sk=jnp.full((s, cfg.max_stop_tokens), NO_STOP_TOKEN, jnp.int32),
            num_generated_s=jnp.zeros((s,), jnp.int32),
            live_s=jnp.zeros((s,), bool),
            rounds_s=jnp.zeros((s,), jnp.int32),
            logprobs_s=jnp.full((s,), -1, jnp.int32),
            policy_carry=self.policy.init_carry(s, max(self.gamma, 1)),
            penalties_s=(
                jnp.tile(jnp.asarray(NO_PENALTIES, jnp.float32), (s, 1)) if cfg.penalties else None
            ),
            counts_sv=(
                jnp.zeros((s, target.cfg.vocab_size), jnp.int32) if cfg.penalties else None
            ),
            prompt_sv=jnp.zeros((s, target.cfg.vocab_size), bool) if cfg.penalties else None,
            bias_ids_sk=(
                jnp.zeros((s, cfg.max_logit_bias), jnp.int32) if cfg.max_logit_bias else None
            ),
            bias_sk=(
                jnp.zeros((s, cfg.max_logit_bias), jnp.float32) if cfg.max_logit_bias else None
            ),
            allowed_s=jnp.zeros((s,), bool) if cfg.max_logit_bias else None,
        )

    def _check_runnable(self) -> None:
        """Refuses, by name, to run an engine that can only be lowered (and compiled)."""
        if self.compile_only:
            raise EngineError(
                "this engine's mesh stands in for devices that are not there (a "
                "jax.experimental.topologies topology), or its parameters are shapes alone "
                "(nnx.eval_shape): its programs can be lowered and compiled (`lower`), not run"
            )
        if self._off_gpu_triton:
            platform = jax.devices()[0].platform if self.mesh is None else (
                self.mesh.devices.flat[0].platform
            )
            raise EngineError(
                f"the pallas_gpu attention is a Triton kernel for NVIDIA GPUs and this engine "
                f"runs on {platform}: it can be lowered for a GPU (`lower(platforms=...)`), not "
                f"run here; choose another path (unset {attention.ATTENTION_ENV} for this "
                "backend's own, or 'jax', which runs everywhere)"
            )

    def init_state(self) -> SlotState:
        self._check_runnable()
        return self._init(self.target_params, self.drafter_params)

    def select_policy(self, state: SlotState, index: int) -> SlotState:
        """`state` with member `index` of the engine's `PolicySwitch` choosing the verified
        lengths from the next round on, with no new program. Every member's carry starts
        afresh, as in a new state (a history-based policy first waits for its history)."""
        if not isinstance(self.policy, PolicySwitch):
            raise PolicyError(
                f"select_policy needs an engine built with a PolicySwitch; this one runs "
                f"{type(self.policy).__name__} only"
            )
        carry = self.policy.init_carry(self.cfg.num_slots, max(self.gamma, 1), index)
        # Host arrays moved by explicit transfers (eager jnp ops here would compile small
        # programs after warm-up), placed exactly as the carry they replace, committed to its
        # devices or not: an argument placed differently is a new entry in the programs'
        # dispatch caches -- a recompilation.
        carry = jax.tree.map(
            lambda new, old: jax.device_put(new, old.sharding if old.committed else None),
            carry,
            state.policy_carry,
        )
        return state.replace(policy_carry=carry)

    # -- verbs ---------------------------------------------------------------------------------
    def prefill(self, state: SlotState, batch: PrefillBatch) -> tuple[SlotState, PrefillOutput]:
        """One prefill call (`pack_prefill`). Requests it installs whose repetition penalty is
        on first have their prompts' tokens marked (`SlotState.prompt_sv`), PROMPT_MARKS at a
        time, by one more program: the penalty then holds from the first token on, for
        prefix-cached prompt tokens too."""
        slot_m, ids_m = batch.prompt_slot_m, batch.prompt_ids_m
        if len(slot_m):
            clear_s = np.zeros((self.cfg.num_slots,), bool)
            clear_s[slot_m] = True
            for at in range(0, len(slot_m), PROMPT_MARKS):
                part = slice(at, at + PROMPT_MARKS)
                state = self._mark(state, clear_s, slot_m[part], ids_m[part])
                clear_s = np.zeros_like(clear_s)  # cleared once, before the first marks
        return self._prefill(self.target_params, self.drafter_params, state, batch_to_device(batch))

    def _mark(self, state: SlotState, clear_s, slot_m, ids_m) -> SlotState:
        """`mark_prompts` over up to PROMPT_MARKS (slot, token) pairs, padded to that size (one
        program); `clear_s` first unmarks whole slots."""
        slots = np.full((PROMPT_MARKS,), self.cfg.num_slots, np.int32)  # padding: dropped
        ids = np.zeros((PROMPT_MARKS,), np.int32)
        slots[: len(slot_m)], ids[: len(ids_m)] = slot_m, ids_m
        return self._mark_prompts(state, *jax.device_put((clear_s, slots, ids)))

    def decode_chunk(
        self, state: SlotState, yield_on_finish: bool = False
    ) -> tuple[SlotState, ChunkOutput]:
        """Up to `rounds_per_chunk` rounds; with `yield_on_finish` the chunk ends after the round
        in which a request finishes (a traced flag: both modes share one program)."""
        flag = self._yield_flags[bool(yield_on_finish)]
        return self._decode(self.target_params, self.drafter_params, state, flag)

    def release(self, state: SlotState, mask_s: np.ndarray) -> SlotState:
        """`state` with the slots where `mask_s` ([num_slots] bools) is true freed."""
        mask = np.asarray(mask_s)
        # Another shape would broadcast (a scalar True frees every slot) and compile a program
        # of its own after warm-up, or fail inside jit.
        if mask.shape != (self.cfg.num_slots,):
            raise EngineError(
                f"release takes one flag per slot, shape ({self.cfg.num_slots},), got {mask.shape}"
            )
        if mask.dtype != bool:
            # Converted here, not on the device: a device-side cast is one more program, compiled
            # after warm-up.
            if not np.issubdtype(mask.dtype, np.integer) or not np.isin(mask, (0, 1)).all():
                raise EngineError(f"release takes bools (or 0/1), got {mask.dtype} {mask}")
            mask = mask.astype(bool)
        return self._release(state, jax.device_put(mask))

    # -- host helpers --------------------------------------------------------------------------
    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache positions a request can touch: its prompt, its tokens and one block beyond."""
        return prompt_len + max_new_tokens + block_positions(self.gamma)

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + new tokens one request may have: max_model_len less one block."""
        return self.cfg.max_model_len - block_positions(self.gamma)

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        return -(-self.positions_needed(prompt_len, max_new_tokens) // self.cfg.page_size)

    def check_sampling(self, sampling: SamplingConfig) -> None:
        """Raises EngineError for sampling this engine cannot apply: not a `SamplingConfig`,
        penalties or more logit-bias tokens than it holds, or a bias on a token outside the
        vocabulary. Part of `check_request`; the commands call it alone before compiling, since
        a text prompt's ids are only known once its turn comes."""
        vocab = self.target_cfg.vocab_size
        if not isinstance(sampling, SamplingConfig):
            raise EngineError(
                f"sampling must be a SamplingConfig (e.g. SamplingConfig(temperature=0.7, "
                f"top_p=0.9); the default is greedy), got {sampling!r}",
                "sampling",
            )
        if sampling.penalized and not self.cfg.penalties:
            raise EngineError(
                "presence_penalty, frequency_penalty and repetition_penalty need an engine that "
                "counts each request's tokens: build it with EngineConfig(penalties=True) "
                "(`dspark-jax serve --penalties`; generate and eval turn it on when asked for "
                "penalties)",
                "sampling",
            )
        bias, allowed = sampling.logit_bias, sampling.allowed_token_ids
        # Allowed tokens fill the entries the bias would (`SamplingConfig.bias_entries`).
        field, needs, what = (
            ("allowed_token_ids", "need", f"{len(allowed)} allowed_token_ids; this engine holds")
            if allowed
            else ("logit_bias", "needs", f"a logit_bias of {len(bias)} tokens; this engine takes")
        )
        if len(sampling.bias_entries) > self.cfg.max_logit_bias:
            raise EngineError(
                (
                    f"{what} at most {self.cfg.max_logit_bias} "
                    f"(EngineConfig.max_logit_bias, `dspark-jax serve --max-logit-bias`)"
                )
                if self.cfg.max_logit_bias
                else f"{field} {needs} an engine that holds each request's tokens and biases: "
                "build it with EngineConfig(max_logit_bias=N) (`dspark-jax serve "
                "--max-logit-bias N`)",
                field,
            )
        if bias and bias[-1][0] >= vocab:
            raise EngineError(
                f"logit_bias token {bias[-1][0]} is outside the vocabulary (0..{vocab - 1})",
                "logit_bias",
            )
        if allowed and allowed[-1] >= vocab:
            raise EngineError(
                f"allowed token {allowed[-1]} is outside the vocabulary (0..{vocab - 1})",
                "allowed_token_ids",
            )

    def check_request(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        sampling: SamplingConfig = GREEDY,
    ) -> None:
        """Raises EngineError for a request this engine can never serve: token ids outside the
        vocabulary (the model would read past its embedding table), a max_new_tokens or seed
        that is not an integer (Python or numpy) in range, sampling that is not a
        `SamplingConfig` or that asks for penalties or a logit bias the engine does not hold,
        or more positions than max_model_len or pages than the pool holds.
        Every entry point (the CLI, the server, `Batcher.submit`) validates requests here, so a
        request that passes cannot fail later inside the batching loop."""
        vocab = self.target_cfg.vocab_size
        _check_token_ids("prompt ids", prompt_ids, vocab, "prompt_ids")
        _check_token_ids("stop token ids", stop_token_ids, vocab, "stop_token_ids")
        prompt_len = len(prompt_ids)
        if prompt_len < 1:
            raise EngineError("empty prompt: a request needs at least one token", "prompt_ids")
        if as_integer(max_new_tokens) is None:
            raise EngineError(
                f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}", "max_new_tokens"
            )
        if max_new_tokens < 1:
            raise EngineError(
                f"max_new_tokens must be >= 1, got {max_new_tokens}", "max_new_tokens"
            )
        if as_integer(seed) is None:
            raise EngineError(f"seed must be an integer in 0..{2**32 - 1}, got {seed!r}", "seed")
        if not 0 <= seed < 2**32:
            raise EngineError(f"seed must lie in 0..{2**32 - 1}, got {seed}", "seed")
        self.check_sampling(sampling)
        need = self.positions_needed(prompt_len, max_new_tokens)
        if need > self.cfg.max_model_len:
            raise EngineError(
                f"a prompt of {prompt_len} tokens plus {max_new_tokens} new "
                f"token{'s' if max_new_tokens != 1 else ''} (and "
                f"{self.gamma + 1} verification positions) needs {need} positions; the engine's "
                f"max_model_len is {self.cfg.max_model_len}",
                "max_new_tokens",
            )
        pages = self.pages_needed(prompt_len, max_new_tokens)
        if pages > self.cfg.pool_pages:
            raise EngineError(
                f"the request needs {pages} KV pages; the pool holds {self.cfg.pool_pages}"
            )

    @property
    def max_chunk_tokens(self) -> int:
        """Most tokens one sequence brings to a prefill call: a chunk is at most prefill_chunk
        tokens of a prompt, and no prompt is longer than max_model_len. It bounds the window of
        the prompt tokens' attention among themselves (a call packing 512 short prompts then
        costs 512 small windows, not one square of all their tokens)."""
        return min(self.cfg.prefill_chunk, self.cfg.max_model_len)

    def pack_prefill(self, items: list[PrefillItem], width: int | None = None) -> PrefillBatch:
        """Host arrays of one prefill call over `items` (<= prefill_seqs chunks whose tokens fit
        the largest prefill bucket), padded to the smallest bucket that holds them or to the
        bucket `width`."""
        cfg = self.cfg
        n = cfg.prefill_seqs
        if not 1 <= len(items) <= n:
            raise EngineError(f"a prefill call takes 1..{n} chunks, got {len(items)}")
        total = sum(len(it.tokens) for it in items)
        if max(len(it.tokens) for it in items) > self.max_chunk_tokens:
            raise EngineError(
                f"a prefill chunk holds at most {self.max_chunk_tokens} tokens (prefill_chunk "
                f"{cfg.prefill_chunk}, max_model_len {cfg.max_model_len})"
            )
        if width is not None and width not in self.prefill_widths:
            raise EngineError(f"{width} is not a prefill bucket ({self.prefill_widths})")
        if width is None or width < total:
            width = next((w for w in self.prefill_widths if w >= total), None)
        if width is None:
            raise EngineError(f"{total} prompt tokens exceed the largest prefill bucket")
        tokens = np.zeros((width,), np.int32)
        slot_t = np.zeros((width,), np.int32)
        pos_t = np.zeros((width,), np.int32)
        valid_t = np.zeros((width,), bool)
        seq_slot = np.zeros((n,), np.int32)
        cu = np.zeros((n + 1,), np.int32)
        kv_lens = np.zeros((n,), np.int32)
        first = np.zeros((n,), bool)
        last_row = np.full((n,), -1, np.int32)
        page_rows = np.zeros((n, cfg.pages_per_slot), np.int32)
        temperature = np.zeros((n,), np.float32)
        top_k = np.zeros((n,), np.int32)
        top_p = np.ones((n,), np.float32)
        min_p = np.zeros((n,), np.float32)
        penalties_n3 = np.tile(np.asarray(NO_PENALTIES, np.float32), (n, 1))
        prompt_slot, prompt_ids = [], []
        bias_ids = np.zeros((n, max(1, cfg.max_logit_bias)), np.int32)
        bias = np.zeros((n, max(1, cfg.max_logit_bias)), np.float32)
        allowed = np.zeros((n,), bool)
        max_new = np.zeros((n,), np.int32)
        min_new = np.zeros((n,), np.int32)
        stop = np.full((n, cfg.max_stop_tokens), NO_STOP_TOKEN, np.int32)
        seed = np.zeros((n,), np.uint32)
        prompt_len = np.zeros((n,), np.int32)
        logprobs = np.full((n,), -1, np.int32)
        prompt_logprobs = np.full((n,), -1, np.int32)
        next_tokens = np.full((width,), -1, np.int32)
        at = 0
        for i, it in enumerate(items):
            c = len(it.tokens)
            tokens[at : at + c] = it.tokens
            slot_t[at : at + c] = it.slot
            pos_t[at : at + c] = np.arange(it.start, it.start + c)
            valid_t[at : at + c] = True
            seq_slot[i] = it.slot
            cu[i + 1] = at + c
            kv_lens[i] = it.start + c
            first[i] = it.start == 0 if it.first is None else it.first
            if it.start + c == it.prompt_len:
                last_row[i] = at + c - 1
            page_rows[i, : len(it.page_row)] = it.page_row
            temperature[i], top_k[i], top_p[i] = it.temperature, it.top_k, it.top_p
            min_p[i] = it.min_p
            penalties_n3[i] = it.presence_penalty, it.frequency_penalty, it.repetition_penalty
            if it.repetition_penalty != 1.0 and first[i]:
                if it.prompt_ids is None:
                    raise EngineError(
                        "a request with a repetition penalty needs its whole prompt "
                        "(PrefillItem.prompt_ids) with the chunk that installs it"
                    )
                seen = np.unique(np.asarray(it.prompt_ids, np.int32))
                prompt_ids.append(seen)
                prompt_slot.append(np.full(seen.shape, it.slot, np.int32))
            entries = bias_entries(it.logit_bias, it.allowed_token_ids)
            if it.allowed_token_ids:
                allowed[i] = True
                bias_ids[i] = it.allowed_token_ids[0]  # unused entries repeat one, at bias 0
            if len(entries) > cfg.max_logit_bias:
                raise EngineError(
                    f"{len(entries)} logit_bias or allowed tokens exceed max_logit_bias "
                    f"{cfg.max_logit_bias}"
                )
            for j, (token, value) in enumerate(entries):
                bias_ids[i, j], bias[i, j] = token, value
            max_new[i] = it.max_new_tokens
            min_new[i] = it.min_new_tokens
            if len(it.stop_tokens) > cfg.max_stop_tokens:
                raise EngineError(
                    f"{len(it.stop_tokens)} stop tokens exceed max_stop_tokens "
                    f"{cfg.max_stop_tokens}"
                )
            stop[i, : len(it.stop_tokens)] = it.stop_tokens
            seed[i] = it.seed
            prompt_len[i] = it.prompt_len
            logprobs[i] = it.logprobs
            prompt_logprobs[i] = it.prompt_logprobs
            if it.next_tokens is not None:
                next_tokens[at : at + len(it.next_tokens)] = it.next_tokens
            at += c
        cu[len(items) + 1 :] = at
        batch = TokenBatch(
            slot_t=slot_t,
            pos_t=pos_t,
            valid_t=valid_t,
            seq_slot_n=seq_slot,
            cu_q_lens_n1=cu,
            kv_lens_n=kv_lens,
            num_seqs=np.int32(len(items)),
            max_seq_tokens=self.max_chunk_tokens,
        )
        return PrefillBatch(
            tokens,
            batch,
            first,
            last_row,
            page_rows,
            temperature,
            top_k,
            top_p,
            min_p,
            penalties_n3,
            bias_ids,
            bias,
            allowed,
            max_new,
            min_new,
            stop,
            seed,
            prompt_len,
            logprobs,
            prompt_logprobs,
            next_tokens,
            np.concatenate(prompt_slot) if prompt_slot else np.zeros(0, np.int32),
            np.concatenate(prompt_ids) if prompt_ids else np.zeros(0, np.int32),
        )

    @staticmethod
    def _scratch_item() -> PrefillItem:
        # One token, padded by `pack_prefill` to the bucket, so the program depends on the width
        # alone; never the prompt's last chunk, so no slot is made live.
        return PrefillItem(
            0, np.zeros((1,), np.int32), 0, 2, np.zeros(1, np.int32), 0.0, 0, 1.0, 1, (), 0,
        )  # fmt: skip

    def lower(
        self, platforms: tuple[str, ...] | None = None, gpu_kind: str = "NVIDIA H100"
    ) -> dict[str, Any]:
        """Every program lowered from shapes alone (verb name -> `jax.stages.Lowered`).

        Works for models built with `nnx.eval_shape`, whose parameters are never allocated:
        `.compile().memory_analysis()` then gives XLA's per-device memory for a model that does
        not fit this machine (benchmarks/mesh_memory.py). `platforms` (e.g. ("cuda",)) lowers
        for other backends than the one at hand, without their devices (Pallas kernels included;
        such programs can be inspected, not compiled, here). Lowering for a GPU on a machine
        without one targets `gpu_kind` (a device kind as JAX reports it), which the Triton
        kernels' lowering asks for on jax >= 0.11."""
        platforms = None if platforms is None else tuple(platforms)
        lowered = {}
        for name, (fn, args) in self.programs().items():
            with self.lowering_target(platforms, gpu_kind):
                lowered[name] = fn.trace(*args).lower(lowering_platforms=platforms)
        return lowered

    def lowering_target(self, platforms: tuple[str, ...] | None, gpu_kind: str = "NVIDIA H100"):
        """The context to trace and lower a program in (see `lower`): where the GPU compiled
        for is not this process' backend -- `platforms` names one, or the mesh is a GPU's
        stand-ins (its device kind then) -- the Triton kernels' lowering is told which GPU."""
        device = None if self.mesh is None else self.mesh.devices.flat[0]
        if self.compile_only and device is not None and device.platform == "gpu":
            return absent_gpu_target(("cuda",), device.device_kind)
        return absent_gpu_target(platforms, gpu_kind)

    def programs(self) -> dict[str, tuple[Any, tuple]]:
        """Every program as (jitted verb, arguments to trace it with: the parameters, a state
        of shapes alone, a scratch prefill batch), by the names `lower` gives them."""
        tp, dp = self.target_params, self.drafter_params
        state = jax.eval_shape(self._init, tp, dp)
        if self.state_shardings is not None:
            state = jax.tree.map(
                lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                state,
                self.state_shardings,
            )
        programs = {
            "init": (self._init, (tp, dp)),
            "decode_chunk": (self._decode, (tp, dp, state, self._yield_flags[0])),
            "release": (self._release, (state, np.zeros((self.cfg.num_slots,), bool))),
        }
        if self._mark_prompts is not None:
            slots, ids = np.zeros((PROMPT_MARKS,), np.int32), np.zeros((PROMPT_MARKS,), np.int32)
            clear = np.zeros((self.cfg.num_slots,), bool)
            programs["mark_prompts"] = (self._mark_prompts, (state, clear, slots, ids))
        for width in self.prefill_widths:
            batch = batch_to_device(self.pack_prefill([self._scratch_item()], width))
            programs[f"prefill_{width}"] = (self._prefill, (tp, dp, state, batch))
        return programs

    def warm_up(self, workers: int | None = None) -> None:
        """Compiles every program (each prefill bucket, the decode chunk, release) on a scratch
        state, so that nothing compiles while requests are served.

        The programs are lowered from shapes one after another (Python), then compiled by up
        to `workers` threads at once (default: `default_compile_workers()`; XLA compiles
        without the GIL). jit keeps what they compiled, so the scratch run that follows
        compiles nothing: at real shapes warm-up takes about as long as its largest program,
        not the sum of all. `warm_up_all` does the same for several engines at once."""
        self._check_runnable()
        compile_concurrently(list(self.lower().values()), workers)
        self._scratch_run()

    def _scratch_run(self) -> None:
        """Every verb once on a scratch state (compiling what `lower` did not build: nothing
        after `compile_concurrently`, save small eager ops)."""
        state = self.init_state()
        for width in self.prefill_widths:
            state, out = self.prefill(state, self.pack_prefill([self._scratch_item()], width))
        state, chunk = self.decode_chunk(state)
        state = self.release(state, np.zeros((self.cfg.num_slots,), bool))
        if self._mark_prompts is not None:
            state = self._mark(state, np.zeros((self.cfg.num_slots,), bool), (), ())
        jax.block_until_ready((state.live_s, chunk.count_s, out.first_token_n))

    def compiled_programs(self) -> int:
        """How many programs the jitted verbs hold (for tests of 'no compilation after warm-up')."""
        verbs = (self._init, self._prefill, self._decode, self._release, self._mark_prompts)
        return sum(f._cache_size() for f in verbs if f is not None)


# Programs compiled at once by default (a positive integer; unset: one per usable core).
COMPILE_WORKERS_ENV = "DSPARK_JAX_COMPILE_WORKERS"


def compile_concurrently(lowered: Sequence[jax.stages.Lowered], workers: int | None = None) -> None:
    """Compiles `lowered` programs on up to `workers` threads (default: $DSPARK_JAX_COMPILE_WORKERS,
    else one per usable CPU core).

    Each `Lowered` keeps its executable, and a later call of the jitted function with arguments
    of the shapes and placements it was lowered for finds that executable instead of
    compiling again."""
    workers = min(len(lowered), workers or default_compile_workers())
    if workers <= 1:
        for program in lowered:
            program.compile()
        return
    with concurrent.futures.ThreadPoolExecutor(workers, "dspark-compile") as pool:
        for future in [pool.submit(program.compile) for program in lowered]:
            future.result()


def default_compile_workers() -> int:
    """$DSPARK_JAX_COMPILE_WORKERS, else the CPU cores this process may run on (its affinity
    mask, not the machine's count)."""
    setting = os.environ.get(COMPILE_WORKERS_ENV, "").strip()
    if setting:
        try:
            workers = int(setting)
        except ValueError:
            workers = 0
        if workers < 1:
            raise EngineError(
                f"{COMPILE_WORKERS_ENV}={setting!r}: give a positive number of programs to "
                "compile at once"
            )
        return workers
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity masks (macOS)
        return os.cpu_count() or 1


def compile_engines(
    engines: Sequence[Engine],
    workers: int | None = None,
    extra: Sequence[jax.stages.Lowered] = (),
) -> None:
    """Every program of `engines`, and the `extra` lowered programs, compiled at once
    (`compile_concurrently`), nothing run: into the persistent compilation cache, or ahead of
    a warm-up."""
    compile_concurrently([*extra, *(p for e in engines for p in e.lower().values())], workers)


def warm_up_all(
    engines: Sequence[Engine],
    workers: int | None = None,
    extra: Sequence[jax.stages.Lowered] = (),
) -> None:
    """`Engine.warm_up` of every engine, their programs all compiled at once: benchmarks that
    build an engine per batch size or policy wait for the largest program, not for each.
    `extra`: other lowered programs to compile on the same threads (a profiler's own)."""
    for engine in engines:
        engine._check_runnable()
    compile_engines(engines, workers, extra)
    for engine in engines:
        engine._scratch_run()


@contextlib.contextmanager
def absent_gpu_target(platforms: tuple[str, ...] | None, gpu_kind: str):
    """Names the GPU to lower for while `platforms` asks for one this process does not have.
    jax >= 0.11's Pallas Triton lowering reads the target's compute capability from the
    device, or from an abstract mesh's `AbstractDevice` when there is no device (jax 0.10
    assumed compute capability 9.0); without one it raises "No supported GPU devices found".
    The cache-free forwards' attention (`layers.causal_attention_impl`) takes cuDNN's there."""
    wants_gpu = platforms is not None and bool({"cuda", "rocm", "gpu"} & set(platforms))
    if not wants_gpu or jax.default_backend() == "gpu":
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind=gpu_kind, num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        yield


def _place(params, mesh: Mesh, what: str | None = None):
    """`params` in their rules-table shardings on `mesh`: arrays are moved (a no-op where they
    already are), abstract leaves (`nnx.eval_shape` models) just carry the sharding."""

    def one(x, sharding):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.device_put(x, sharding)

    return jax.tree.map(one, params, state_shardings(params, mesh, strict=True, what=what))


def batch_to_device(batch: PrefillBatch) -> dict[str, Any]:
    """The batch's arrays moved by one explicit transfer (an implicit one per call would hide
    real leaks from jax.transfer_guard). Uncommitted, as the host arrays were: on a mesh the
    program still places them itself."""
    return jax.device_put(
        {
            f.name: getattr(batch, f.name)
            for f in dataclasses.fields(PrefillBatch)
            if f.name not in ("prompt_slot_m", "prompt_ids_m")
        }
    )


def slot_state_shardings(state: SlotState, layouts) -> SlotState:
    """Shardings of a (possibly abstract) `SlotState` on the mesh in `layouts`.

    Slot rows split over `slots` (data); the page pools by KV head over `tensor`, their page axis
    whole (any slot may own any page); the policy carry, a few numbers per slot whose layout is
    the policy's own, is replicated.
    """
    target_layout, draft_layout, mesh = layouts

    def rows(x):
        return logical_sharding(("slots",) + (None,) * (x.ndim - 1), x.shape, mesh, strict=True)

    def pool(layout):
        axes = paged.pages_logical_axes(layout)
        return lambda x: logical_sharding(axes, x.shape, mesh, strict=True)

    replicated = NamedSharding(mesh, PartitionSpec())
    per_slot = {
        f.name: jax.tree.map(rows, getattr(state, f.name))
        for f in dataclasses.fields(SlotState)
        if f.name not in ("target_pages", "draft_pages", "policy_carry")
    }
    return SlotState(
        target_pages=jax.tree.map(pool(target_layout), state.target_pages),
        draft_pages=None
        if state.draft_pages is None
        else jax.tree.map(pool(draft_layout), state.draft_pages),
        policy_carry=jax.tree.map(lambda _: replicated, state.policy_carry),
        **per_slot,
    )


# -- programs ------------------------------------------------------------------------------------
def _caches(state: SlotState, layouts) -> tuple[PagedCache, PagedCache | None]:
    target_layout, draft_layout, mesh = layouts
    target = PagedCache(state.target_pages, state.page_table_sp, target_layout, mesh)
    if state.draft_pages is None:
        return target, None
    return target, PagedCache(state.draft_pages, state.page_table_sp, draft_layout, mesh)


def _prefill(
    target: Qwen3,
    drafter: DSparkDrafter | None,
    taps: tuple[int, ...],
    policy: Policy,
    layouts,
    state: SlotState,
    host: dict[str, Any],
) -> tuple[SlotState, PrefillOutput]:
    num_slots = state.live_s.shape[0]
    batch: TokenBatch = host["batch"]
    seq_slot_n = batch.seq_slot_n
    n = seq_slot_n.shape[0]
    in_call_n = jnp.arange(n) < batch.num_seqs
    # Sequences starting their prompt install the request in its slot (other rows write nowhere).
    install_n = jnp.where(in_call_n & host["first_n"], seq_slot_n, num_slots)
    put = lambda a, v: a.at[install_n].set(v, mode="drop")  # noqa: E731
    keys_n = jax.vmap(jax.random.key)(host["seed_n"])
    sampling = state.sampling_s
    sampling = RowSampling(
        put(sampling.temperature, host["temperature_n"]),
        put(sampling.top_k, host["top_k_n"]),
        put(sampling.top_p, host["top_p_n"]),
        put(sampling.min_p, host["min_p_n"]),
    )
    installed_s = jnp.zeros((num_slots,), bool).at[install_n].set(True, mode="drop")
    state = state.replace(
        page_table_sp=put(state.page_table_sp, host["page_rows_np"]),
        key_data_s=put(state.key_data_s, jax.random.key_data(keys_n)),
        sampling_s=sampling,
        max_new_s=put(state.max_new_s, host["max_new_n"]),
        min_new_s=put(state.min_new_s, host["min_new_n"]),
        stop_sk=put(state.stop_sk, host["stop_nk"]),
        num_generated_s=put(state.num_generated_s, 0),
        live_s=put(state.live_s, False),
        rounds_s=put(state.rounds_s, 0),
        logprobs_s=put(state.logprobs_s, host["logprobs_n"]),
        policy_carry=policy.reset_slots(state.policy_carry, installed_s),
    )
    if state.counts_sv is not None:
        state = state.replace(
            penalties_s=put(state.penalties_s, host["penalties_n3"]),
            counts_sv=put(state.counts_sv, 0),
        )
    if state.bias_sk is not None:
        state = state.replace(
            bias_ids_sk=put(state.bias_ids_sk, host["bias_ids_nk"]),
            bias_sk=put(state.bias_sk, host["bias_nk"]),
            allowed_s=put(state.allowed_s, host["allowed_n"]),
        )
    target_cache, draft_cache = _caches(state, layouts)

    def forward(_):
        out = target.paged_forward(host["tokens_t"], batch, target_cache, taps)
        context_kv = None if drafter is None else drafter.packed_context_kv(out.taps, batch)
        return out.hidden, out.kv, context_kv

    # Reads of the pools inside a conditional, writes after it: see `_switch_on_count`.
    hidden_td, target_kv, context_kv = _switch_on_count(
        (batch.slot_t.shape[0],), batch.num_seqs, lambda width: forward
    )
    target_cache = paged.write(target_cache, target_kv, batch, after=hidden_td)
    if drafter is not None:
        draft_cache = paged.write(draft_cache, context_kv, batch, after=hidden_td)

    # Prompts completed by this call sample their first token at position prompt_len.
    last_row_n = host["last_row_n"]
    final_n = in_call_n & (last_row_n >= 0)
    hidden_nd = hidden_td[jnp.maximum(last_row_n, 0)]
    slot_rows = state.sampling_s.take(seq_slot_n).only(final_n)
    prompt_len_n = host["prompt_len_n"]
    first_keys = position_keys(state.keys_s[seq_slot_n], prompt_len_n, STREAM_RESIDUAL)
    first_n, first_scores = _sample_scored(
        first_keys,
        target.logits(hidden_nd),
        slot_rows,
        jnp.max(jnp.where(final_n, host["logprobs_n"], -1)),
        # A logit bias and min_tokens apply from the first token on (no penalty does: nothing
        # is counted yet).
        (state, seq_slot_n, final_n),
    )
    stopped_n = _is_stop(first_n, state.stop_sk[seq_slot_n])
    finished_n = stopped_n | (state.max_new_s[seq_slot_n] <= 1)
    final_slot_n = jnp.where(final_n, seq_slot_n, num_slots)
    put = lambda a, v: a.at[final_slot_n].set(v, mode="drop")  # noqa: E731
    if state.counts_sv is not None:  # the first token counts from the first round on
        counts_sv = state.counts_sv.at[final_slot_n, first_n].add(1, mode="drop")
        state = state.replace(counts_sv=counts_sv)
    state = state.replace(
        target_pages=target_cache.pages,
        draft_pages=None if draft_cache is None else draft_cache.pages,
        anchor_s=put(state.anchor_s, first_n),
        lengths_s=put(state.lengths_s, prompt_len_n),
        num_generated_s=put(state.num_generated_s, 1),
        live_s=put(state.live_s, ~finished_n),
    )
    # The prompt's own log-probabilities: the logits of every row, only in calls that asked.
    prompt_level = jnp.max(jnp.where(in_call_n, host["prompt_logprobs_n"], -1))
    width = hidden_td.shape[0]

    def prompt_scores():
        logits_tv = target.logits(hidden_td)
        argmax_t = jnp.argmax(logits_tv, axis=-1).astype(jnp.int32)
        rows_t = jnp.arange(width)
        return _scores(prompt_level, logits_tv, rows_t, host["next_tokens_t"], argmax_t)

    def no_scores():
        return (
            jnp.zeros((width,), jnp.float32),
            jnp.zeros((width, TOP_LOGPROBS), jnp.int32),
            jnp.zeros((width, TOP_LOGPROBS), jnp.float32),
        )

    prompt_scores_t = jax.lax.cond(prompt_level >= 0, prompt_scores, no_scores)
    return state, PrefillOutput(
        first_n, *first_scores, finished_n & final_n, stopped_n & final_n, *prompt_scores_t
    )


def log_normalizer(logits_tv: jax.Array, argmax_t: jax.Array) -> jax.Array:
    """Each row's log-sum-exp of the target's float32 logits: the model's own distribution,
    before temperature, top-k and top-p. `argmax_t` (each row's argmax, which the sampling has
    found: `logprobs_and_argmax`) gives the shift, so this is one pass over the rows, a sum of
    exponentials."""
    top_t = jnp.take_along_axis(logits_tv, argmax_t[:, None], axis=-1)
    return top_t[:, 0] + jnp.log(jnp.sum(jnp.exp(logits_tv - top_t), axis=-1))


def token_logprobs(logits_tv: jax.Array, rows, tokens, lse_t: jax.Array) -> jax.Array:
    """The log-probabilities of `tokens` at packed `rows` (same shapes) of the target's logits
    whose `log_normalizer` is `lse_t`, as OpenAI's and vLLM's `logprobs` report them: a
    gather; padding rows and tokens read row 0 / token 0."""
    num_rows, vocab = logits_tv.shape
    rows = jnp.clip(rows, 0, num_rows - 1)
    return logits_tv[rows, jnp.clip(tokens, 0, vocab - 1)] - lse_t[rows]


def _top_k(x_tv: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` of each row (the larger of equal values first, then the lower id): XLA's GPU
    compiler runs a top-k of at most FAST_TOP_K as one kernel over each row, and any larger
    one as a sort of the whole [rows, V] array. So past FAST_TOP_K each further entry is the
    largest of the row's entries after the last one taken (smaller, or equal at a higher id):
    two reductions over the rows that read them and write nothing of their size (masking the
    taken ids out of a copy for a second top-k wrote two [rows, V] arrays)."""
    values_tk, ids_tk = jax.lax.top_k(x_tv, min(k, FAST_TOP_K))
    values, ids = [values_tk], [ids_tk]
    last_v, last_i = values_tk[:, -1:], ids_tk[:, -1:]
    col_v = jnp.arange(x_tv.shape[-1], dtype=ids_tk.dtype)[None, :]
    for _ in range(k - values_tk.shape[-1]):
        after_tv = (x_tv < last_v) | ((x_tv == last_v) & (col_v > last_i))
        last_v = jnp.max(jnp.where(after_tv, x_tv, -jnp.inf), axis=-1, keepdims=True)
        # The lowest id after the last one that holds that value (argmax: the first True).
        last_i = jnp.argmax(after_tv & (x_tv == last_v), axis=-1, keepdims=True)
        last_i = last_i.astype(ids_tk.dtype)
        values.append(last_v)
        ids.append(last_i)
    return jnp.concatenate(values, axis=-1), jnp.concatenate(ids, axis=-1)


def top_logprobs(logits_tv: jax.Array, rows, lse_t: jax.Array, k: int = TOP_LOGPROBS):
    """The `k` likeliest tokens at packed `rows` of the target's logits and their
    log-probabilities (as `token_logprobs`): ids [*rows, TOP_LOGPROBS] int32 and
    log-probabilities, likeliest first, zeros past `k` (and past the vocabulary)."""
    values_tk, ids_tk = _top_k(logits_tv, min(k, logits_tv.shape[-1]))
    rows = jnp.clip(rows, 0, logits_tv.shape[0] - 1)
    values_tk = values_tk - lse_t[:, None]
    pad = ((0, 0), (0, TOP_LOGPROBS - values_tk.shape[-1]))
    ids_tk, values_tk = jnp.pad(ids_tk, pad), jnp.pad(values_tk, pad)
    return ids_tk[rows].astype(jnp.int32), values_tk[rows]


def _scores(level, logits_tv: jax.Array, rows, tokens, argmax_t):
    """(`token_logprobs`, `top_logprobs` ids, their log-probabilities) of `tokens` at `rows`
    for the live requests' largest logprobs `level` (SlotState.logprobs_s): zeros where it is
    -1, no alternatives (zeros) where it is 0. A switch, so that rounds where no live request
    asked skip the passes over the logits, and only rounds where one asked for alternatives
    run a top-k over the vocabulary: of FAST_TOP_K, or (past it) of TOP_LOGPROBS in two
    pieces."""
    shape = jnp.shape(tokens)
    no_ids = jnp.zeros(shape + (TOP_LOGPROBS,), jnp.int32)
    no_values = jnp.zeros(shape + (TOP_LOGPROBS,), jnp.float32)

    def nothing():
        return jnp.zeros(shape, jnp.float32), no_ids, no_values

    def chosen():
        lse_t = log_normalizer(logits_tv, argmax_t)
        return token_logprobs(logits_tv, rows, tokens, lse_t), no_ids, no_values

    def with_top(k):
        def run():
            lse_t = log_normalizer(logits_tv, argmax_t)
            chosen_logprobs = token_logprobs(logits_tv, rows, tokens, lse_t)
            return (chosen_logprobs,) + top_logprobs(logits_tv, rows, lse_t, k)

        return run

    index = jnp.where(level > FAST_TOP_K, 3, jnp.clip(level + 1, 0, 2))
    return jax.lax.switch(
        index, [nothing, chosen, with_top(FAST_TOP_K), with_top(TOP_LOGPROBS)]
    )


def _sample_scored(keys_t, logits_tv: jax.Array, rows: RowSampling, level, adjusted=None):
    """`sample_tokens` of each row and the tokens' `_scores` at logprobs `level`. `adjusted`:
    (state, slot_t, valid_t) of the rows, whose requests' penalties and logit bias apply
    (`_adjusted_logprobs`); None: the logits as they are."""
    if adjusted is None:
        logp_tv, argmax_t = logprobs_and_argmax(logits_tv, rows)
        raw_argmax_t = argmax_t
    else:
        state, slot_t, valid_t = adjusted
        logp_tv, argmax_t, raw_argmax_t = _adjusted_logprobs(
            state, logits_tv, rows, slot_t, valid_t
        )
    tokens_t = sample_from_logprobs(keys_t, logp_tv, rows.greedy, argmax_t)
    index_t = jnp.arange(tokens_t.shape[0])
    return tokens_t, _scores(level, logits_tv, index_t, tokens_t, raw_argmax_t)


def _biases_s(state: SlotState) -> jax.Array | None:
    """[slots] bool: the slot's request has a penalty, a logit bias or allowed tokens (None: the
    engine takes none of them)."""
    parts = []
    if state.penalties_s is not None:
        parts.append(state.penalties_s != jnp.asarray(NO_PENALTIES, jnp.float32))
    if state.bias_sk is not None:
        parts += [state.bias_sk != 0.0, state.allowed_s[:, None]]
    if not parts:
        return None
    return jnp.any(jnp.concatenate(parts, axis=1), axis=1)


def _adjusts_s(state: SlotState) -> jax.Array:
    """[slots] bool: the target's logits for the slot's next token are not the model's own: its
    request has a penalty or a logit bias (`_biases_s`), or it has stop tokens it may not
    generate yet (min_tokens)."""
    early_s = (state.num_generated_s < state.min_new_s) & jnp.any(state.stop_sk >= 0, axis=1)
    biases_s = _biases_s(state)
    return early_s if biases_s is None else early_s | biases_s


def _adjusted_logprobs(
    state: SlotState, logits_tv, rows: RowSampling, slot_t, valid_t, drafts_tk=None, j_t=None
):
    """(`logprobs_and_argmax` of the rows, each row's argmax of the logits as they came) with
    each row's penalties (`SlotState.penalties_s`) and logit bias (`SlotState.bias_sk`) applied
    to its logits first, and its request's stop tokens banned at places before its min_tokens
    (`SlotState.min_new_s`).

    Row t is slot slot_t's distribution after its request's counted tokens and, in a round that
    verifies drafts, the first j_t of its drafts `drafts_tk` (the tokens between its anchor and
    the row's place), which the target's distribution there follows as the plain step's would;
    it draws the request's token number num_generated + j_t (0-based). A conditional runs the
    adjusted sampling only when some valid row's request adjusts its logits, the sampling as
    without otherwise (both branches read the logits in place: no copy)."""

    def plain():
        logp_tv, argmax_t = logprobs_and_argmax(logits_tv, rows)
        return logp_tv, argmax_t, argmax_t

    adjusts_s = _adjusts_s(state)

    def adjusted():
        adjusted_tv = logits_tv.astype(jnp.float32)
        if state.counts_sv is not None:
            counts_tv = state.counts_sv[slot_t]
            if drafts_tk is not None:
                k_k = jnp.arange(drafts_tk.shape[1])
                before_tk = (k_k[None, :] < j_t[:, None]) & valid_t[:, None]
                t_t1 = jnp.arange(counts_tv.shape[0])[:, None]
                counts_tv = counts_tv.at[t_t1, drafts_tk].add(before_tk.astype(counts_tv.dtype))
            no_penalty = jnp.asarray(NO_PENALTIES, jnp.float32)
            penalty_t3 = jnp.where(valid_t[:, None], state.penalties_s[slot_t], no_penalty)
            # Repetition first (vLLM's order), over the prompt's tokens and those counted.
            seen_tv = state.prompt_sv[slot_t] | (counts_tv > 0)
            adjusted_tv = apply_repetition_penalty(adjusted_tv, seen_tv, penalty_t3[:, 2])
            adjusted_tv = apply_penalties(
                adjusted_tv, counts_tv, penalty_t3[:, 0], penalty_t3[:, 1]
            )
        if state.bias_sk is not None:
            bias_tk = jnp.where(valid_t[:, None], state.bias_sk[slot_t], 0.0)
            ids_tk = state.bias_ids_sk[slot_t]
            adjusted_tv = apply_logit_bias(adjusted_tv, ids_tk, bias_tk)
            only_t = valid_t & state.allowed_s[slot_t]
            adjusted_tv = apply_allowed_tokens(adjusted_tv, ids_tk, only_t)
        index_t = state.num_generated_s[slot_t] + (0 if j_t is None else j_t)
        early_t = valid_t & (index_t < state.min_new_s[slot_t])
        adjusted_tv = ban_tokens(adjusted_tv, state.stop_sk[slot_t], early_t)
        logp_tv, argmax_t = logprobs_and_argmax(adjusted_tv, rows)
        return logp_tv, argmax_t, jnp.argmax(logits_tv, axis=-1).astype(jnp.int32)

    return jax.lax.cond(jnp.any(valid_t & adjusts_s[slot_t]), adjusted, plain)


def _draft_adjustments(state: SlotState, vocab: int):
    """None without penalties and logit bias (or allowed tokens) in the engine; otherwise a
    function of drafted slots `rows_r` ([R] slot ids, None: every slot in order) giving a
    function of their logits [R, V]: the float32 logits with each request's penalties over its
    prompt and the tokens counted before the round, its logit bias and -inf off its allowed
    tokens, applied as the target's are, so that its
    drafts follow the adjusted target more closely (any draft distribution keeps the target's
    exactly; this one is accepted more often). What it applies is computed once a round, by a
    conditional that gives nothing to apply (the logits bitwise, in float32) in rounds where no
    live request adjusts its logits; only the drafted rows are computed, so the cost follows the
    live slots' bucket, not the engine's slots.

    min_tokens does not reach the drafter: a stop token it drafts too early is rejected (the
    target gives it no mass there), and the residual draw then excludes it too."""
    adjusts_s = _biases_s(state)
    if adjusts_s is None:
        return None

    def of_rows(rows_r):
        def take(x_s):
            return x_s if rows_r is None else x_s[rows_r]

        live_r = take(state.live_s)
        shape = (live_r.shape[0], vocab)

        repeats = state.counts_sv is not None
        # (what comes off the logits [R, V], the marked tokens [R, V], the repetition penalty
        # [R]); the last two only with penalties.
        nothing = (
            jnp.zeros(shape, jnp.float32),
            *((jnp.zeros(shape, bool), jnp.ones(shape[:1], jnp.float32)) if repeats else ()),
        )

        def compute():
            live_r1 = live_r[:, None]
            out_rv = jnp.zeros(shape, jnp.float32)
            marks = ()
            if repeats:
                no_penalty = jnp.asarray(NO_PENALTIES, jnp.float32)
                penalty_r3 = jnp.where(live_r1, take(state.penalties_s), no_penalty)
                counts_rv = take(state.counts_sv)
                out_rv = penalties(counts_rv, penalty_r3[:, 0], penalty_r3[:, 1])
                marks = (take(state.prompt_sv) | (counts_rv > 0), penalty_r3[:, 2])
            if state.bias_sk is not None:
                bias_rk = jnp.where(live_r1, take(state.bias_sk), 0.0)
                ids_rk = take(state.bias_ids_sk)
                out_rv = apply_logit_bias(out_rv, ids_rk, -bias_rk)
                # Tokens a request may not draw come off entirely.
                allowed_rv = allowed_rows(ids_rk, live_r & take(state.allowed_s), vocab)
                out_rv = jnp.where(allowed_rv, out_rv, jnp.inf)
            return (out_rv, *marks)

        off_rv, *marks = jax.lax.cond(jnp.any(live_r & take(adjusts_s)), compute, lambda: nothing)

        def adjust(logits_rv):
            if marks:
                logits_rv = apply_repetition_penalty(logits_rv, *marks)
            return logits_rv.astype(jnp.float32) - off_rv

        return adjust

    return of_rows


def _empty_output(num_slots: int, rounds: int, width: int, conf_k: int) -> ChunkOutput:
    return ChunkOutput(
        tokens_sc=jnp.full((num_slots, rounds * width), PAD_TOKEN, jnp.int32),
        logprobs_sc=jnp.zeros((num_slots, rounds * width), jnp.float32),
        top_ids_sck=jnp.zeros((num_slots, rounds * width, TOP_LOGPROBS), jnp.int32),
        top_logprobs_sck=jnp.zeros((num_slots, rounds * width, TOP_LOGPROBS), jnp.float32),
        count_s=jnp.zeros((num_slots,), jnp.int32),
        verified_sr=jnp.full((num_slots, rounds), -1, jnp.int32),
        accepted_sr=jnp.full((num_slots, rounds), -1, jnp.int32),
        committed_sr=jnp.full((num_slots, rounds), -1, jnp.int32),
        conf_logits_srk=jnp.zeros((num_slots, rounds, conf_k), jnp.float32),
        step_tokens_r=jnp.zeros((rounds,), jnp.int32),
        finished_s=jnp.zeros((num_slots,), bool),
        stopped_s=jnp.zeros((num_slots,), bool),
    )


def _run_chunk(round_fn, rounds: int, gamma: int, state: SlotState, yield_on_finish):
    num_slots = state.live_s.shape[0]
    out = _empty_output(num_slots, rounds, gamma + 1, max(gamma, 1))

    def cond(carry):
        r, s, o = carry
        yielding = yield_on_finish & jnp.any(o.finished_s)
        return (r < rounds) & jnp.any(s.live_s) & ~yielding

    def body(carry):
        r, s, o = carry
        s, o = round_fn(s, o, r)
        return r + 1, s, o

    _, state, out = jax.lax.while_loop(cond, body, (jnp.int32(0), state, out))
    return state, out


def _commit(
    state: SlotState,
    out: ChunkOutput,
    r,
    live_s,
    tokens_sj,
    scores,
    num_committed_s,
    stopped_s,
    next_anchor_s,
    new_len_s,
    verified_s,
    accepted_s,
    conf_sk,
    step_tokens,
) -> tuple[SlotState, ChunkOutput]:
    """Books one round: output tokens (cut at max new tokens), counters, finished slots."""
    remaining_s = state.max_new_s - state.num_generated_s
    kept_s = jnp.where(live_s, jnp.minimum(num_committed_s, remaining_s), 0)
    stopped_s = live_s & stopped_s & (num_committed_s <= remaining_s)
    num_generated_s = state.num_generated_s + kept_s
    done_s = live_s & (stopped_s | (num_generated_s >= state.max_new_s))

    num_slots, width = tokens_sj.shape
    rows = jnp.arange(num_slots)[:, None]
    j = jnp.arange(width)[None, :]
    cols = jnp.where(j < kept_s[:, None], out.count_s[:, None] + j, out.tokens_sc.shape[1])
    record = lambda buf, v: buf.at[:, r].set(jnp.where(live_s, v, buf[:, r]))  # noqa: E731
    out = ChunkOutput(
        tokens_sc=out.tokens_sc.at[rows, cols].set(tokens_sj, mode="drop"),
        logprobs_sc=out.logprobs_sc.at[rows, cols].set(scores[0], mode="drop"),
        top_ids_sck=out.top_ids_sck.at[rows, cols].set(scores[1], mode="drop"),
        top_logprobs_sck=out.top_logprobs_sck.at[rows, cols].set(scores[2], mode="drop"),
        count_s=out.count_s + kept_s,
        verified_sr=record(out.verified_sr, verified_s),
        accepted_sr=record(out.accepted_sr, accepted_s),
        committed_sr=record(out.committed_sr, num_committed_s),
        conf_logits_srk=out.conf_logits_srk.at[:, r].set(
            jnp.where(live_s[:, None], conf_sk, out.conf_logits_srk[:, r])
        ),
        step_tokens_r=out.step_tokens_r.at[r].set(step_tokens),
        finished_s=out.finished_s | done_s,
        stopped_s=out.stopped_s | stopped_s,
    )
    if state.counts_sv is not None:  # the tokens the request keeps count from the next round on
        vocab = state.counts_sv.shape[1]
        kept_sj = jnp.where(j < kept_s[:, None], tokens_sj, vocab)
        state = state.replace(counts_sv=state.counts_sv.at[rows, kept_sj].add(1, mode="drop"))
    state = state.replace(
        lengths_s=jnp.where(live_s, new_len_s, state.lengths_s),
        anchor_s=jnp.where(live_s, next_anchor_s, state.anchor_s),
        num_generated_s=num_generated_s,
        live_s=state.live_s & ~done_s,
        rounds_s=state.rounds_s + live_s.astype(jnp.int32),
    )
    return state, out


def _switch_on_count(buckets: tuple[int, ...], total, make_branch, operands=None):
    """Runs `make_branch(width)` for the smallest bucket >= total (one compiled `lax.switch`;
    only the chosen branch runs): token buckets, or the drafter's slot buckets.

    The forward inside reads the page pools and the caller writes them after: a conditional
    around the reads lets XLA update the pools in place, where the same reads in straight-line
    code (their inner `while` loops carrying the pools) make it copy every pool each step. So
    even a single bucket goes through a conditional, whose second branch never runs: it returns
    zeros of the outputs' shapes rather than the forward again, which XLA would compile twice."""
    branches = [make_branch(w) for w in buckets]
    if len(branches) == 1:
        shapes = jax.eval_shape(branches[0], operands)

        def never(_):
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        return jax.lax.cond(total >= 0, branches[0], never, operands)
    index = jnp.minimum(jnp.sum(jnp.asarray(buckets) < total), len(buckets) - 1)
    return jax.lax.switch(index, branches, operands)


def _draft_live(
    drafter, buckets, anchor_s, start_s, live_s, cache, keys_sk, sampling_s, adjustments=None
):
    """The drafter's block for the live slots: drafts [S, K], the log-probabilities they were
    sampled from [S, K, V] and the confidence logits [S, K] (None without a confidence head).
    `adjustments` (`_draft_adjustments`), where given, gives how the drafted rows' logits are
    adjusted.

    The drafter runs over the smallest slot bucket that holds the live slots, gathered live
    first in slot order (a `lax.switch` over the buckets: only the chosen branch runs), and its
    results are scattered back to their slots; slots outside the rows get zeros, which nothing
    reads (they are not live: they verify nothing and sample greedily). The largest bucket is
    every slot in place, with no gather. A row's drafts depend only on its own slot's context,
    anchor, keys and settings, so gathering changes which rows run, not what they draw.
    """
    num_slots = live_s.shape[0]

    def run(rows_r):  # the slots drafted, row by row (None: every slot in order)
        if rows_r is None:
            h = drafter.draft_hidden(anchor_s, start_s, live_s, cache)
            adjust = None if adjustments is None else adjustments(None)
            block = drafter.sample_block(h, anchor_s, keys_sk, sampling_s, adjust=adjust)
            return block.tokens_bk, block.logprobs_bkv, block.conf_logits_bk
        anchor_r = anchor_s[rows_r]
        h = drafter.draft_hidden(anchor_r, start_s[rows_r], live_s[rows_r], cache, rows_r)
        block = drafter.sample_block(
            h,
            anchor_r,
            keys_sk[rows_r],
            sampling_s.take(rows_r),
            adjust=None if adjustments is None else adjustments(rows_r),
        )

        def to_slots(x_r):
            if x_r is None:
                return None
            zeros = jnp.zeros((num_slots,) + x_r.shape[1:], x_r.dtype)
            return zeros.at[rows_r].set(x_r, unique_indices=True)

        return tuple(map(to_slots, (block.tokens_bk, block.logprobs_bkv, block.conf_logits_bk)))

    if len(buckets) == 1:
        return run(None)
    # Live slots first, in slot order, then the others: a permutation of the slots.
    num_live = jnp.sum(live_s, dtype=jnp.int32)
    rank_s = jnp.where(
        live_s,
        jnp.cumsum(live_s, dtype=jnp.int32) - 1,
        num_live + jnp.cumsum(~live_s, dtype=jnp.int32) - 1,
    )
    order_s = jnp.zeros((num_slots,), jnp.int32).at[rank_s].set(
        jnp.arange(num_slots, dtype=jnp.int32), unique_indices=True
    )

    def branch(rows):
        return lambda _: run(None if rows == num_slots else order_s[:rows])

    return _switch_on_count(buckets, num_live, branch)


def _spec_round(
    target: Qwen3,
    drafter: DSparkDrafter,
    policy: Policy,
    sts: StsArtifact | None,
    buckets: tuple[int, ...],
    draft_buckets: tuple[int, ...],
    layouts,
    state: SlotState,
    out: ChunkOutput,
    r,
) -> tuple[SlotState, ChunkOutput]:
    gamma = drafter.cfg.block_size
    live_s = state.live_s
    start_s = state.lengths_s  # position of the anchor
    target_cache, draft_cache = _caches(state, layouts)
    # Drafts past a rejection are drafted again next round at the same positions. Fresh noise per
    # round keeps a policy carry that holds earlier rounds' confidences (hence their drafts)
    # independent of this round's drafts, which losslessness of history-based policies needs.
    round_keys_s = jax.vmap(jax.random.fold_in)(state.keys_s, state.rounds_s)
    slot_positions_sk = start_s[:, None] + 1 + jnp.arange(gamma)[None, :]
    draft_keys_sk = position_keys(round_keys_s, slot_positions_sk, STREAM_DRAFT)
    # A finished request's settings stay in its slot: its row samples greedily (no filter search,
    # no draw) until the next request is installed.
    sampling_s = state.sampling_s.only(live_s)
    drafts_sk, draft_logprobs_skv, conf_logits_sk = _draft_live(
        drafter, draft_buckets, state.anchor_s, start_s, live_s, draft_cache, draft_keys_sk,
        sampling_s, _draft_adjustments(state, target.cfg.vocab_size),
    )
    conf_sk = (
        conf_logits_sk
        if conf_logits_sk is not None
        else jnp.zeros((state.anchor_s.shape[0], gamma), jnp.float32)
    )
    policy_logits_sk = conf_logits_sk
    if sts is not None:
        # The artifact is calibrated for one sampling temperature: it applies to the slots
        # sampling at that temperature; the others see their raw confidences.
        calibrated_s = jnp.isclose(
            state.sampling_s.temperature, sts.sampling_temperature, rtol=STS_TEMP_RTOL, atol=1e-9
        )
        scaled_sk = sts.calibrated_logits(conf_logits_sk)
        policy_logits_sk = jnp.where(calibrated_s[:, None], scaled_sk, conf_logits_sk)
    lengths_s, policy_carry = policy.step(policy_logits_sk, live_s, state.policy_carry)
    lengths_s = jnp.where(live_s, jnp.clip(lengths_s, 0, gamma), 0).astype(jnp.int32)
    count_s = jnp.where(live_s, lengths_s + 1, 0)
    verify_in_sj = jnp.concatenate([state.anchor_s[:, None], drafts_sk], axis=1)
    # Built at the widest bucket (which holds every slot's count, see `token_buckets`); each
    # branch takes its first `width` tokens (the packing of the first tokens does not depend on
    # the width).
    top = buckets[-1]
    full = TokenBatch.per_slot(start_s, count_s, top, gamma + 1)
    tokens_t = verify_in_sj[full.slot_t, jnp.clip(full.pos_t - start_s[full.slot_t], 0, gamma)]
    taps = drafter.cfg.target_layer_ids

    def branch(width):
        def run(_):
            batch = full.head(width)
            fwd = target.paged_forward(tokens_t[:width], batch, target_cache, taps)
            logits_tv = target.logits(fwd.hidden)
            # Row t of a slot is its distribution after its anchor and its first j_t drafts.
            j_t = jnp.clip(batch.pos_t - start_s[batch.slot_t], 0, gamma)
            logp_tv, argmax_t, raw_argmax_t = _adjusted_logprobs(
                state,
                logits_tv,
                sampling_s.take(batch.slot_t).only(batch.valid_t),
                batch.slot_t,
                batch.valid_t,
                drafts_sk[batch.slot_t],
                j_t,
            )
            rows_sj = batch.cu_q_lens_n1[:-1, None] + jnp.arange(gamma + 1)[None, :]
            result = verify_packed(
                drafts_sk,
                draft_logprobs_skv,
                logp_tv,
                rows_sj,
                lengths_s,
                state.keys_s,
                start_s + 1,
                sampling_s,
                state.stop_sk,
            )
            # Token j of a slot's round (accepted draft, or the last) is sampled at its row j.
            level = jnp.max(jnp.where(live_s, state.logprobs_s, -1))
            scores = _scores(level, logits_tv, rows_sj, result.tokens_bj, raw_argmax_t)
            # Keys, values and the drafter's context of every verified token leave the branch
            # to be written after it (writing the pool inside a conditional copies it). Those of
            # rejected drafts land past the new length, where they are masked and overwritten.
            context_kv = drafter.packed_context_kv(fwd.taps, batch)
            return paged.pad_kv(fwd.kv, top), paged.pad_kv(context_kv, top), result, scores

        return run

    step_tokens = jnp.sum(count_s)
    target_kv, context_kv, result, scores = _switch_on_count(
        buckets, step_tokens, branch, None
    )
    target_cache = paged.write(target_cache, target_kv, full, after=result)
    draft_cache = paged.write(draft_cache, context_kv, full, after=result)
    state = state.replace(
        target_pages=target_cache.pages, draft_pages=draft_cache.pages, policy_carry=policy_carry
    )
    return _commit(
        state,
        out,
        r,
        live_s,
        result.tokens_bj,
        scores,
        result.num_committed_b,
        result.stopped_b,
        result.next_token_b,
        start_s + 1 + result.num_accepted_b,
        lengths_s,
        result.num_accepted_b,
        conf_sk,
        step_tokens,
    )


def _plain_round(
    target: Qwen3, buckets: tuple[int, ...], layouts, state: SlotState, out: ChunkOutput, r
) -> tuple[SlotState, ChunkOutput]:
    """One target step per live slot, packed: the baseline speculative decoding is measured
    against."""
    live_s = state.live_s
    start_s = state.lengths_s
    count_s = live_s.astype(jnp.int32)

    top = count_s.shape[0]
    full = TokenBatch.per_slot(start_s, count_s, top, 1)
    target_cache = _caches(state, layouts)[0]

    def branch(width):
        def run(_):
            batch = full.head(width)
            fwd = target.paged_forward(state.anchor_s[batch.slot_t], batch, target_cache)
            # One token per live slot, packed first: the lm head and the sampling run over the
            # bucket's rows (at most one per slot), not over every slot, live or not.
            rows = min(width, top)
            slot_t, valid_t = batch.slot_t[:rows], batch.valid_t[:rows]
            logits_tv = target.logits(fwd.hidden[:rows])
            keys_t = position_keys(state.keys_s[slot_t], start_s[slot_t] + 1, STREAM_RESIDUAL)
            rows_t = state.sampling_s.take(slot_t).only(valid_t)
            level = jnp.max(jnp.where(live_s, state.logprobs_s, -1))
            next_t, scores_t = _sample_scored(
                keys_t, logits_tv, rows_t, level, (state, slot_t, valid_t)
            )
            to_s = jnp.where(valid_t, slot_t, top)  # padding rows write nowhere
            next_s = jnp.zeros((top,), next_t.dtype).at[to_s].set(next_t, mode="drop")
            # Each slot's scores as a round of one token: [slots, 1(, k)].
            scores_s = tuple(
                jnp.zeros((top, 1) + x.shape[1:], x.dtype).at[to_s, 0].set(x, mode="drop")
                for x in scores_t
            )
            return paged.pad_kv(fwd.kv, top), next_s, scores_s

        return run

    step_tokens = jnp.sum(count_s)
    target_kv, next_s, scores_s = _switch_on_count(buckets, step_tokens, branch, None)
    target_cache = paged.write(target_cache, target_kv, full, after=next_s)
    state = state.replace(target_pages=target_cache.pages)
    ones_s = jnp.ones_like(next_s)
    return _commit(
        state,
        out,
        r,
        live_s,
        next_s[:, None],
        scores_s,
        ones_s,
        _is_stop(next_s, state.stop_sk),
        next_s,
        start_s + 1,
        jnp.zeros_like(next_s),
        jnp.zeros_like(next_s),
        jnp.zeros((next_s.shape[0], 1), jnp.float32),
        step_tokens,
    )
