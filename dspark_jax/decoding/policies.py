"""Verification-length policies: how many drafts each request sends to the target in a round.

A policy runs inside the engine's jitted round. Each round it sees the drafter's confidence
logits for the block (already divided by the STS temperatures when the engine holds an
artifact, so sigmoid(logit) is the calibrated conditional confidence c_k), the mask of active
rows and a carry of its own that lives in the slot state (`SlotState.policy_carry`); it returns
per-request draft lengths 0..gamma and the next carry. Lengths are counts, so what a request
verifies is always a prefix.

Lossless policies decide whether draft k is verified from information available before x_k
was sampled: fixed lengths, thresholds (c_k depends on x_{<k} only), Algorithm 1 with its early
stop, and the Section 5.2 variant (its capacity comes from confidences two rounds old).

SPS (steps per second of a decoding step: the engine's round, or the target's verification
forward alone, see `profiling`) enters the schedulers as a 1-D table over the total number of
verified tokens B, anchors included, exactly as the paper's packed engine defines it: our engine
packs every live slot's anchor and drafts into one token axis padded to a token bucket, so a
step's cost follows B. A measured `SpsProfile` holds SPS per token bucket; B between buckets
costs what the next bucket up costs.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from dspark_jax.config import SHAPE_FIELDS
from dspark_jax.decoding import scheduler
from dspark_jax.errors import UserError, as_integer, is_real
from dspark_jax.sharding import mesh_sizes

if TYPE_CHECKING:
    from dspark_jax.config import DrafterConfig, Qwen3Config

SPS_FORMAT = "dspark-jax/sps/v2"
_SPS_FORMAT_V1 = "dspark-jax/sps/v1"


class PolicyError(UserError):
    """A policy that cannot be built or used as asked (bad parameters, missing inputs)."""


@runtime_checkable
class Policy(Protocol):
    """A stateful, jittable verification-length policy (see the module docstring)."""

    needs_confidence: bool

    def init_carry(self, batch: int, gamma: int) -> Any:
        """The carry at the start of a batch (a pytree of numpy arrays, `()` when stateless):
        host values, so that building one runs no device program (`Engine.select_policy` puts
        it on the device with one explicit transfer after warm-up). What a policy reads every
        round without changing it (a scheduler's SPS table) belongs here too: data, not a
        constant of the decode program, so engines that differ only in it share the program."""
        ...

    def step(
        self, conf_logits_bk: jax.Array | None, active_b: jax.Array, carry: Any
    ) -> tuple[jax.Array, Any]:
        """(int32 draft lengths [B], next carry); inactive rows must get 0."""
        ...

    def reset_slots(self, carry: Any, mask_b: jax.Array) -> Any:
        """The carry with the rows in `mask_b` forgotten (a new request took those slots)."""
        ...


def _masked(lengths_b: jax.Array, active_b: jax.Array) -> jax.Array:
    return jnp.where(active_b, lengths_b, 0).astype(jnp.int32)


def _require_conf(conf_logits_bk: jax.Array | None, name: str) -> jax.Array:
    if conf_logits_bk is None:
        raise PolicyError(f"{name} needs confidence logits; this drafter has no confidence head")
    return jax.nn.sigmoid(conf_logits_bk.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class FixedPolicy:
    """Verify `gamma` drafts (clipped to the block) for every active request."""

    gamma: int
    needs_confidence: ClassVar[bool] = False

    def __post_init__(self) -> None:
        # A float (2.5) made fractional token buckets that failed only at warm_up.
        gamma = as_integer(self.gamma)
        if gamma is None or gamma < 0:
            raise PolicyError(f"gamma must be an integer >= 0, got {self.gamma!r}")
        object.__setattr__(self, "gamma", gamma)

    def init_carry(self, batch: int, gamma: int) -> tuple:
        return ()

    def reset_slots(self, carry: tuple, mask_b: jax.Array) -> tuple:
        return carry

    def step(self, conf_logits_bk, active_b, carry):
        return _masked(jnp.full(active_b.shape, self.gamma, jnp.int32), active_b), carry


@dataclasses.dataclass(frozen=True)
class ThresholdPolicy:
    """Stop at the first c_k below `threshold` (or the first survival a_k when `cumulative`)."""

    threshold: float
    cumulative: bool = False
    needs_confidence: ClassVar[bool] = True

    def __post_init__(self) -> None:
        t = self.threshold
        if not is_real(t):
            raise PolicyError(f"threshold must be a number in [0, 1], got {t!r}")
        if not 0.0 <= t <= 1.0:
            raise PolicyError(f"threshold must lie in [0, 1], got {t}")
        object.__setattr__(self, "threshold", float(t))

    def init_carry(self, batch: int, gamma: int) -> tuple:
        return ()

    def reset_slots(self, carry: tuple, mask_b: jax.Array) -> tuple:
        return carry

    def step(self, conf_logits_bk, active_b, carry):
        conf_bk = _require_conf(conf_logits_bk, "a threshold policy")
        lengths_b = scheduler.threshold_lengths(conf_bk, self.threshold, self.cumulative)
        return _masked(lengths_b, active_b), carry


# -- SPS profiles --------------------------------------------------------------------------------
def _numpy_json(value: Any) -> Any:
    """numpy scalars and arrays in a table's metadata as the JSON numbers and lists they hold."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON data")


class SpsProfileError(UserError):
    """A malformed SPS profile (file or arrays)."""


@dataclasses.dataclass(frozen=True, eq=False)
class SpsProfile:
    """Measured steps per second of the engine per token bucket.

    `sps[i]` is for a step verifying `buckets[i]` tokens in total (every live slot's anchor and
    drafts, packed and padded to that bucket). `meta` records where and how it was measured
    (device, date, mode, config, ...)."""

    buckets: tuple[int, ...]
    sps: np.ndarray
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # A table comes from a file a user may have edited: every part is checked here, so a
        # bad one is refused by name rather than by a TypeError deep in the scheduler.
        try:
            buckets = tuple(as_integer(w) for w in self.buckets)
        except TypeError:
            buckets = (None,)
        if (
            not buckets
            or None in buckets
            or min(buckets) < 1
            or list(buckets) != sorted(set(buckets))
        ):
            raise SpsProfileError(
                f"buckets must be strictly increasing positive integers, got {self.buckets!r}"
            )
        try:
            sps = np.asarray(self.sps, dtype=np.float64)
        except (TypeError, ValueError):
            raise SpsProfileError(f"sps must be numbers, got {self.sps!r}") from None
        if sps.shape != (len(buckets),):
            raise SpsProfileError(f"sps must be [buckets] = ({len(buckets)},), got {sps.shape}")
        if not np.all(np.isfinite(sps) & (sps > 0)):
            raise SpsProfileError("sps must be finite and positive")
        if not isinstance(self.meta, dict):
            raise SpsProfileError(f"meta must be a dict, got {self.meta!r}")
        reserved = sorted({"format", "buckets", "sps"} & set(self.meta))
        if reserved:
            raise SpsProfileError(f"meta may not hold the table's own fields {reserved}")
        slots = self.meta.get("num_slots")
        if slots is not None and (as_integer(slots) is None or slots < 1):
            raise SpsProfileError(f"num_slots must be an integer >= 1, got {slots!r}")
        object.__setattr__(self, "buckets", buckets)
        object.__setattr__(self, "sps", sps)

    def table(self, max_tokens: int) -> np.ndarray:
        """1-D SPS over total tokens 0..max_tokens: B costs what the smallest bucket >= B costs;
        0 past the largest bucket (never scheduled)."""
        n = np.arange(max_tokens + 1)
        idx = np.searchsorted(np.asarray(self.buckets), n, side="left")
        return np.where(
            idx < len(self.buckets), self.sps[np.minimum(idx, len(self.buckets) - 1)], 0.0
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SPS_FORMAT,
            **self.meta,
            "buckets": list(self.buckets),
            "sps": self.sps.tolist(),
        }

    def save(self, path: str | Path) -> None:
        try:  # before the file is opened: a table that cannot be written leaves none behind
            text = json.dumps(self.to_json(), indent=2, allow_nan=False, default=_numpy_json)
        except (TypeError, ValueError) as e:
            raise SpsProfileError(
                f"meta must be JSON data (numbers, text, lists, dicts): {e}"
            ) from None
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SpsProfile:
        try:
            body = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SpsProfileError(f"{path}: cannot read the SPS table ({e})") from e
        if isinstance(body, dict) and body.get("format") == _SPS_FORMAT_V1:
            raise SpsProfileError(
                f"{path}: measured for the earlier rectangular engine (per batch size x verify "
                "width); the engine now packs verification by token count: run dspark-jax "
                "profile again"
            )
        if not isinstance(body, dict) or body.get("format") != SPS_FORMAT:
            raise SpsProfileError(f"{path}: not an SPS table (format {SPS_FORMAT!r} expected)")
        missing = {"buckets", "sps"} - set(body)
        if missing:
            raise SpsProfileError(f"{path}: lacks {sorted(missing)}")
        meta = {k: v for k, v in body.items() if k not in ("format", "buckets", "sps")}
        try:
            return cls(body["buckets"], body["sps"], meta)
        except SpsProfileError as e:
            raise SpsProfileError(f"{path}: {e}") from None


def device_description() -> str:
    """The device a measurement runs on, as every result file names it ("gpu: NVIDIA H100 ...",
    "cpu: cpu"): SPS tables, eval.json and generate's JSON."""
    device = jax.devices()[0]
    return f"{device.platform}: {device.device_kind}"


def profile_meta(**extra: Any) -> dict[str, Any]:
    """Device and date of a measurement made now, plus `extra` fields."""
    return {
        "device": device_description(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **extra,
    }


def sps_model(target_cfg: Qwen3Config, drafter_cfg: DrafterConfig | None = None) -> dict:
    """What an SPS profile records of the models it timed (`meta["model"]`, written by
    `profiling.profile_engine`): the target's shape and, when the drafter ran (round mode), the
    drafter's. Step times depend on these, not on the weights or the dtype."""
    model: dict = {"target": {name: getattr(target_cfg, name) for name in SHAPE_FIELDS}}
    if drafter_cfg is not None:
        model["drafter"] = {
            **{name: getattr(drafter_cfg.model, name) for name in SHAPE_FIELDS},
            "block_size": drafter_cfg.block_size,
            "markov_rank": drafter_cfg.markov_rank,
            "markov_head_type": drafter_cfg.markov_head_type,
        }
    return model


def _default_slots_advice(profiled: int, num_slots: int) -> str:
    return (
        f"Profile again for {num_slots} slots (profile_engine with EngineConfig(num_slots="
        f"{num_slots}), or dspark-jax profile --max-num-seqs {num_slots}), or build the engine "
        f"with num_slots={profiled}"
    )


def _default_mesh_advice(profiled: dict[str, int] | None, here: dict[str, int] | None) -> str:
    return f"Profile again on {mesh_words(here)} (profile_engine with the engine's mesh=)"


UNCHECKED = object()


def mesh_record(mesh) -> dict[str, int] | None:
    """A mesh (or the `mesh` a profile's meta records) as {axis: size}; None for one device, as a
    mesh whose sizes are all 1 is."""
    shape = None if mesh is None else dict(getattr(mesh, "shape", mesh))
    if shape is None or all(int(v) == 1 for v in shape.values()):
        return None
    return {str(k): int(v) for k, v in shape.items()}


def mesh_words(record: dict[str, int] | None) -> str:
    """A mesh record as words: "one device (no mesh)" or "mesh 1,1,2 (data,fsdp,tensor)"."""
    if record is None:
        return "one device (no mesh)"
    return f"mesh {mesh_sizes(record)} (data,fsdp,tensor)"


def check_sps_profile(
    sps: SpsProfile,
    num_slots: int | None,
    target_cfg: Qwen3Config | None,
    drafter_cfg: DrafterConfig | None,
    *,
    mesh=UNCHECKED,
    name: str = "the SPS profile",
    slots_advice: Callable[[int, int], str] = _default_slots_advice,
    model_advice: str = "Profile this model (profile_engine with its target and drafter)",
    mesh_advice: Callable[[dict | None, dict | None], str] = _default_mesh_advice,
) -> bool:
    """Refuses a profile measured for another slot count than `num_slots` or on another model
    than `target_cfg` / `drafter_cfg`: its step times describe one batch of one model. What is
    not given, or not recorded in `sps.meta`, is not checked; a verify-mode profile timed no
    drafter, so only its target is compared. The engine checks every profile its policy holds;
    the commands check theirs first to word the advice for their flags: `name` names the
    profile, `slots_advice(profiled, num_slots)` and `model_advice` say how to fix a mismatch
    (each a sentence).

    `mesh` (a Mesh, or None for one device) is compared with the mesh the profile was measured
    on: step times on another layout differ in scale and shape. A profile that records no mesh
    was made before meshes were supported, so on one device; `mesh_advice(profiled, here)` (the
    two meshes as {axis: size}, None for one device) says how to fix a mismatch.

    Returns False when the profile does not record its model (one made before profiles did),
    so the caller may warn that it could not be checked, else True."""
    profiled = sps.meta.get("num_slots")
    if num_slots is not None and profiled is not None and profiled != num_slots:
        raise PolicyError(
            f"{name} was profiled for {profiled} slots, but the engine has {num_slots}: its "
            f"step times describe another batch. {slots_advice(profiled, num_slots)}"
        )
    if mesh is not UNCHECKED:
        theirs, ours = mesh_record(sps.meta.get("mesh")), mesh_record(mesh)
        if theirs != ours:
            raise PolicyError(
                f"{name} was profiled on {mesh_words(theirs)}, but the engine runs on "
                f"{mesh_words(ours)}: its step times describe another layout. "
                f"{mesh_advice(theirs, ours)}"
            )
    recorded = sps.meta.get("model")
    if not isinstance(recorded, dict):
        return False
    if target_cfg is None:
        return True
    mine = sps_model(target_cfg, drafter_cfg)
    diffs = []
    for part in ("target", "drafter"):
        theirs, ours = recorded.get(part), mine.get(part)
        if not isinstance(theirs, dict) or ours is None:  # verify mode times no drafter
            continue
        diffs += [
            f"{part} {field}: {theirs.get(field)!r} in the table, {value!r} here"
            for field, value in ours.items()
            if theirs.get(field) != value
        ]
    if diffs:
        raise PolicyError(
            f"{name} was profiled on another model ({'; '.join(diffs)}): step times belong to "
            f"the model measured. {model_advice}"
        )
    return True


def _carried_table(sps: SpsProfile | jax.Array, batch: int, gamma: int) -> np.ndarray:
    """The SPS table a scheduler carries: SPS over 0..batch x (gamma + 1) verified tokens.

    It travels in the policy carry, as data of the decode program rather than a constant
    compiled into it: engines that differ only in their measured step rates (a profile taken
    again, a placeholder compiled while the real one is measured) lower to the same decode
    program, which the persistent compilation cache then builds once."""
    if isinstance(sps, SpsProfile):
        return np.asarray(sps.table(batch * (gamma + 1)), np.float32)
    return np.asarray(sps, np.float32)


def _check_sps(sps: SpsProfile | ArrayLike) -> SpsProfile | jax.Array:
    if isinstance(sps, SpsProfile):
        return sps
    table = np.asarray(sps, dtype=np.float32)
    if table.ndim != 1 or table.size < 2:
        raise PolicyError(f"an SPS table must be 1-D over token counts, got shape {table.shape}")
    if not np.all(np.isfinite(table) & (table >= 0)):
        raise PolicyError("SPS table entries must be finite and >= 0")
    return jnp.asarray(table)


# -- schedulers ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class PrefixSchedulePolicy:
    """Paper Algorithm 1 (`scheduler.prefix_schedule`) on the round's confidences.

    `early_stop=False` is the retrospective global search of Appendix A: NOT lossless when the
    confidences depend on sampled drafts (the Markov feature); it exists to demonstrate that."""

    sps: SpsProfile | jax.Array
    early_stop: bool = True
    needs_confidence: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "sps", _check_sps(self.sps))

    def init_carry(self, batch: int, gamma: int) -> np.ndarray:
        """The SPS table (`_carried_table`): the policy's only state."""
        return _carried_table(self.sps, batch, gamma)

    def reset_slots(self, carry: jax.Array, mask_b: jax.Array) -> jax.Array:
        return carry

    def step(self, conf_logits_bk, active_b, carry):
        conf_bk = _require_conf(conf_logits_bk, "Algorithm 1")
        return scheduler.prefix_schedule(conf_bk, carry, self.early_stop, active_b), carry


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HistoryCarry:
    """Confidences and active masks of the last two rounds (index 0 is the older one), and the
    SPS table over verified tokens (`_carried_table`)."""

    conf_2bk: jax.Array
    active_2b: jax.Array
    rounds_seen: jax.Array
    sps_n: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class AsyncSchedulePolicy:
    """Section 5.2: capacity K from the confidences of two rounds before (global search, no
    early stop), then this round admits its top-K candidates by current survival. The first two
    rounds of the engine have no history and use Algorithm 1 with early stop.

    The history is the batch's, kept per slot: round t's capacity comes from the confidences
    every slot had at round t-2, whoever held it then, and a slot taken over by a new request
    drops its old occupant's entries (`reset_slots`). Why that keeps continuous batching
    lossless: a draft x_{s,j} of round t is verified iff fewer than K candidates outrank it.
    K is a function of round t-2's confidences only, which came from drafts drawn with that
    round's noise (the engine folds the round into every draft key) and from tokens committed
    before round t -- none of it depends on x_{s,j}. The candidates that can outrank (s, j) are
    other slots' (their drafts are independent of slot s's) and slot s's own earlier positions,
    whose survivals depend on x_{s,<j} only. So whether x_{s,j} is verified is decided without
    looking at x_{s,j}, which is all rejection sampling needs; joins and departures only change
    which independent draws feed K. A per-request history would be lossless too, but a request
    joining mid-batch would then wait two rounds for a capacity, and the batch's capacity is
    what the step cost (SPS over the batch's verified tokens) is about."""

    sps: SpsProfile | jax.Array
    needs_confidence: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "sps", _check_sps(self.sps))

    def init_carry(self, batch: int, gamma: int) -> HistoryCarry:
        return HistoryCarry(
            conf_2bk=np.zeros((2, batch, gamma), np.float32),
            active_2b=np.zeros((2, batch), bool),
            rounds_seen=np.zeros((), np.int32),
            sps_n=_carried_table(self.sps, batch, gamma),
        )

    def reset_slots(self, carry: HistoryCarry, mask_b: jax.Array) -> HistoryCarry:
        # The slot's old occupant no longer counts towards the capacity of the next two rounds.
        return dataclasses.replace(carry, active_2b=carry.active_2b & ~mask_b[None])

    def step(self, conf_logits_bk, active_b, carry: HistoryCarry):
        conf_bk = _require_conf(conf_logits_bk, "the asynchronous scheduler")
        old_active_b = carry.active_2b[0]
        capacity = scheduler.capacity_from_history(carry.conf_2bk[0], carry.sps_n, old_active_b)
        async_b = scheduler.top_k_schedule(conf_bk, capacity, active_b)
        warmup_b = scheduler.prefix_schedule(conf_bk, carry.sps_n, True, active_b)
        lengths_b = jnp.where(carry.rounds_seen >= 2, async_b, warmup_b)
        carry = HistoryCarry(
            conf_2bk=jnp.stack([carry.conf_2bk[1], conf_bk]),
            active_2b=jnp.stack([carry.active_2b[1], active_b.astype(bool)]),
            rounds_seen=carry.rounds_seen + 1,
            sps_n=carry.sps_n,
        )
        return lengths_b, carry


# -- several policies, one program --------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SwitchCarry:
    """Which policy of a `PolicySwitch` runs (an int32 scalar) and every member's own carry."""

    index: jax.Array
    carries: tuple


@dataclasses.dataclass(frozen=True, eq=False)
class PolicySwitch:
    """Several policies compiled into one engine program; the engine state says which one runs.

    A policy is part of the decode program (its thresholds are constants there; SPS tables
    travel in the carry), so an engine per policy compiles the target's and drafter's forwards
    once per policy. An engine built with a switch compiles them once:
    `Engine.select_policy(state, i)` makes member i decide the lengths from the next round on,
    with no new program. Every round runs all the members' length rules -- a few operations on
    [slots, gamma] arrays each -- and keeps the chosen one's lengths with a select, not a
    conditional (which XLA's GPU runtime may resolve by copying the branch index to the host).
    The members' carries advance only while they are chosen.

    Selecting a member is lossless whenever it happens between rounds: each member decides from
    information available before the drafts it judges were sampled, and which member runs is
    fixed before the round starts."""

    policies: tuple
    needs_confidence: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        members = tuple(self.policies)
        if not members:
            raise PolicyError("a policy switch needs at least one policy")
        for p in members:
            if isinstance(p, PolicySwitch):
                raise PolicyError("a policy switch cannot hold another switch; list its members")
            if not isinstance(p, Policy):
                raise PolicyError(f"a policy switch holds policies, got {type(p).__name__}")
        object.__setattr__(self, "policies", members)
        object.__setattr__(self, "needs_confidence", any(p.needs_confidence for p in members))

    def __len__(self) -> int:
        return len(self.policies)

    def init_carry(self, batch: int, gamma: int, index: int = 0) -> SwitchCarry:
        self.check_index(index)
        return SwitchCarry(
            np.asarray(index, np.int32), tuple(p.init_carry(batch, gamma) for p in self.policies)
        )

    def check_index(self, index: int) -> None:
        ok = isinstance(index, (int, np.integer)) and not isinstance(index, bool)
        if not ok or not 0 <= index < len(self.policies):
            raise PolicyError(
                f"policy index must be an integer in 0..{len(self.policies) - 1}, got {index!r}"
            )

    def reset_slots(self, carry: SwitchCarry, mask_b: jax.Array) -> SwitchCarry:
        carries = tuple(
            p.reset_slots(c, mask_b) for p, c in zip(self.policies, carry.carries, strict=True)
        )
        return SwitchCarry(carry.index, carries)

    def step(self, conf_logits_bk, active_b, carry: SwitchCarry):
        lengths, carries = [], []
        for i, (p, old) in enumerate(zip(self.policies, carry.carries, strict=True)):
            lengths_b, new = p.step(conf_logits_bk, active_b, old)
            chosen = carry.index == i
            lengths.append(_masked(lengths_b, active_b))
            carries.append(jax.tree.map(functools.partial(jnp.where, chosen), new, old))
        lengths_b = jnp.take(jnp.stack(lengths), carry.index, axis=0, mode="clip")
        return lengths_b, SwitchCarry(carry.index, tuple(carries))


def members(policy: Policy) -> tuple:
    """The policies a policy stands for: a switch's members, else the policy itself."""
    return policy.policies if isinstance(policy, PolicySwitch) else (policy,)


POLICY_NAMES = ("fixed", "threshold", "cumulative-threshold", "scheduler", "async-scheduler")


def make_policy(
    name: str,
    gamma: int,
    *,
    threshold: float | None = None,
    sps: SpsProfile | ArrayLike | None = None,
) -> Policy:
    """A policy by name (`POLICY_NAMES`): thresholds need `threshold`, schedulers `sps`."""
    if name == "fixed":
        return FixedPolicy(gamma)
    if name in ("threshold", "cumulative-threshold"):
        if threshold is None:
            raise PolicyError(f"policy {name!r} needs a threshold")
        return ThresholdPolicy(threshold, cumulative=name == "cumulative-threshold")
    if name in ("scheduler", "async-scheduler"):
        if sps is None:
            raise PolicyError(f"policy {name!r} needs an SPS table (dspark-jax profile)")
        return PrefixSchedulePolicy(sps) if name == "scheduler" else AsyncSchedulePolicy(sps)
    raise PolicyError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
