"""Command-line options shared by the commands: models, sampling, verification policy, STS.

`generate` and `eval` take every group; the benchmarks reuse the policy group
(`add_policy_arguments(parser)` then `build_policy(args, gamma)` and `load_sts(args)`).
Model options default to the small target/drafter pair embedded in the package (a BPE tokenizer
with Qwen3's chat tokens; `dspark_jax.embedded`), so the commands run
offline on a laptop; `--target` / `--draft` take any form `load_target` / `load_drafter` read.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dspark_jax.calibration.sts import StsArtifact
from dspark_jax.checkpoints.locate import DRAFT, TARGET
from dspark_jax.cli import SPS_AUTO
from dspark_jax.cli.argtypes import logit_bias, token_ids, unit_interval
from dspark_jax.config import DrafterConfig, Qwen3Config
from dspark_jax.decoding.engine import Engine, EngineConfig
from dspark_jax.decoding.policies import (
    POLICY_NAMES,
    UNCHECKED,
    Policy,
    PolicyError,
    SpsProfile,
    check_sps_profile,
    make_policy,
)
from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_NAME, EMBEDDED_TARGET
from dspark_jax.errors import UserError
from dspark_jax.sampling import SamplingConfig, bias_entries
from dspark_jax.sharding import mesh_sizes

if TYPE_CHECKING:
    from dspark_jax.checkpoints.converted import DecodingModels

# Room the chat template adds around each turn when sizing the cache for multi-turn prompts.
TURN_OVERHEAD_TOKENS = 32
# Request seeds are uint32.
SEED_LIMIT = 2**32


def add_model_arguments(parser: argparse.ArgumentParser, allow_no_draft: bool = True) -> None:
    group = parser.add_argument_group("models")
    group.add_argument(
        "--target",
        default=None,
        help=f"target: converted folder, safetensors folder or hub id (default: the embedded "
        f"{EMBEDDED_NAME} model)",
    )
    group.add_argument(
        "--draft",
        default=None,
        help=f"drafter, same forms, or a training run (its final drafter/) (default: the "
        f"embedded {EMBEDDED_NAME} drafter)",
    )
    if allow_no_draft:
        group.add_argument(
            "--no-draft",
            action="store_true",
            help="plain autoregressive decoding with the target alone",
        )
    group.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="compute / parameter dtype (default: as stored)",
    )
    add_mesh_argument(group)
    add_policy_arguments(parser)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="0 = greedy (default 1.0, as in the paper's evaluation)",
    )
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1 = off)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0 = off)")
    group.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="keep tokens at least this fraction as likely as the likeliest (0 = off)",
    )
    group.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="lower each token the answer already holds by this (-2 to 2; 0 = off)",
    )
    group.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="lower each token by this per time the answer holds it (-2 to 2; 0 = off)",
    )
    group.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide the positive logits (multiply the negative ones) of each token in the "
        "prompt or the answer by this (> 0; 1 = off; Hugging Face's and vLLM's)",
    )
    group.add_argument(
        "--logit-bias",
        type=logit_bias,
        default=None,
        metavar="JSON",
        help='add to chosen tokens\' logits, as the OpenAI API\'s logit_bias: a JSON object of '
        'token ids to biases in [-100, 100] (\'{"1024": -100}\' all but bans token 1024)',
    )
    group.add_argument(
        "--allowed-token-ids",
        type=token_ids,
        default=None,
        metavar="IDS",
        help="draw only these tokens (comma-separated ids; vLLM's allowed_token_ids); the logit "
        "bias still applies to them",
    )
    group.add_argument("--seed", type=int, default=0, help="base seed of the requests (default 0)")
    group.add_argument("--max-new-tokens", type=int, default=256, help="per answer (default 256)")
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at the model's end-of-turn tokens: every answer runs to "
        "--max-new-tokens (fixed-length runs for measurements)",
    )
    group.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="no end-of-turn token ends an answer before this many new tokens (0 to "
        "--max-new-tokens; vLLM's min_tokens)",
    )
    group.add_argument(
        "--thinking",
        action="store_true",
        help="render prompts with enable_thinking (off by default, as the drafters were trained)",
    )


def add_engine_arguments(parser: argparse.ArgumentParser, max_model_len: int | None = None):
    """Slots, cache sizing and chunking of the slot engine (`EngineConfig`)."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--max-num-seqs",
        type=int,
        default=8,
        help="requests decoded at once: the engine's slots (default 8)",
    )
    sized = "what the prompts need" if max_model_len is None else str(max_model_len)
    group.add_argument(
        "--max-model-len",
        type=int,
        default=max_model_len,
        help=f"most positions one request may use: prompt + new tokens + one block (default "
        f"{sized}; at most the model's max_position_embeddings)",
    )
    group.add_argument(
        "--kv-pages",
        type=int,
        help="KV pages in the pool shared by all slots (default: what the largest requests that "
        "can run at once reserve); fewer pages make requests wait for memory, never run out",
    )
    group.add_argument("--page-size", type=int, default=16, help="tokens per KV page (16)")
    group.add_argument(
        "--rounds-per-chunk",
        type=int,
        default=8,
        help="decode rounds between two reads of the results (default 8)",
    )
    group.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="most prompt tokens per prefill call; longer prompts interleave with decoding (256)",
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    return SamplingConfig(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=getattr(args, "logit_bias", None) or (),
        allowed_token_ids=getattr(args, "allowed_token_ids", None) or (),
    )


def check_sizes(args: argparse.Namespace) -> None:
    for name in ("max_num_seqs", "max_new_tokens", "page_size", "rounds_per_chunk"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("max_model_len", "kv_pages", "prefill_chunk"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    min_tokens = getattr(args, "min_tokens", 0)
    if not 0 <= min_tokens <= args.max_new_tokens:
        raise UserError(
            f"--min-tokens must lie in 0..{args.max_new_tokens} (--max-new-tokens), "
            f"got {min_tokens}"
        )
    check_seed(args.seed)


def check_seed(seed: int) -> None:
    if not 0 <= seed < SEED_LIMIT:
        raise UserError(f"--seed must lie in 0..{SEED_LIMIT - 1}, got {seed}")


def check_seed_span(seed: int, offsets: Sequence[int]) -> None:
    """Refuses a --seed whose requests would get seeds past uint32: request i samples with
    seed + offsets[i] (`conversation_seed_offsets` for prompts answered turn by turn)."""
    last = max(offsets, default=0)
    if seed + last >= SEED_LIMIT:
        raise UserError(
            f"--seed {seed} leaves no room for the run's {len(offsets)} requests: they sample "
            f"with seeds {seed}..{seed + last} (one per prompt and turn), past {SEED_LIMIT - 1}; "
            f"give --seed at most {SEED_LIMIT - 1 - last}"
        )


def conversation_seed_offsets(conversations: Sequence[Sequence[str]]) -> list[int]:
    """What `answer_conversations` adds to the seed for each turn of `conversations`."""
    most = max((len(turns) for turns in conversations), default=0)
    return [c * most + t for c, turns in enumerate(conversations) for t in range(len(turns))]


def engine_config(
    args: argparse.Namespace, positions: Sequence[int], limit: int, mesh=None
) -> EngineConfig:
    """The engine settings of an offline run (generate, eval) of requests needing `positions`
    cache positions each (prompt + new tokens + one block; see `request_positions`).

    Unless given, --max-model-len is what the longest request needs and the KV pool holds what the
    `--max-num-seqs` largest requests reserve together: the cache follows the tokens the run asks
    for, not slots x a preallocated length. No more slots than requests, and one prefill bucket,
    keep compilation to what the run uses. `limit` is the model's context. On a `mesh` the slot
    count is `offline_slots`'s."""
    page = args.page_size
    need = max(positions)
    slots = offline_slots(args.max_num_seqs, len(positions), mesh)
    prefill = min(args.prefill_chunk, -(-need // 64) * 64)
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = min(-(-need // 64) * 64, limit)
    pages = args.kv_pages
    if pages is None:
        # A request longer than max_model_len is refused, so it reserves no more than that.
        largest = sorted((-(-min(p, max_model_len) // page) for p in positions), reverse=True)
        largest = largest[:slots]
        pages = max(sum(largest), -(-min(need, max_model_len) // page))
    return EngineConfig(
        num_slots=slots,
        max_model_len=max_model_len,
        page_size=page,
        num_pages=pages,
        rounds_per_chunk=args.rounds_per_chunk,
        prefill_chunk=prefill,
        prefill_buckets=(prefill,),
        # Each slot's tokens are counted only where the run asks for penalties.
        penalties=any(getattr(args, f"{kind}_penalty", 0.0) for kind in ("presence", "frequency"))
        or getattr(args, "repetition_penalty", 1.0) != 1.0,
        # ... and holds the biases only where it asks for a logit bias (or allowed tokens).
        max_logit_bias=_bias_entries(args),
    )


def _bias_entries(args: argparse.Namespace) -> int:
    """How many (token, bias) entries each slot holds for the run's logit bias or allowed
    tokens (`SamplingConfig.bias_entries`)."""
    bias = getattr(args, "logit_bias", None) or {}
    return len(bias_entries(bias, getattr(args, "allowed_token_ids", None) or ()))


def slot_split(mesh) -> int:
    """How many shards the rules table splits the slots into on `mesh`: data x fsdp."""
    return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


def _slots_refusal(max_num_seqs: int, mesh, split: int) -> UserError:
    sizes = mesh_sizes(mesh.shape)
    below = max_num_seqs // split * split
    give = f"{below} or {below + split}" if below else f"{split}"
    return UserError(
        f"--max-num-seqs {max_num_seqs} must be a multiple of data x fsdp = {split} on mesh "
        f"{sizes} (the slots are split over those axes): give --max-num-seqs {give}, or a "
        "--mesh with data and fsdp 1 (e.g. 1,1,T: decoding gains nothing from data or fsdp)"
    )


def offline_slots(max_num_seqs: int, requests: int, mesh=None) -> int:
    """The slot count of an offline run (generate, eval) of `requests` requests: --max-num-seqs,
    but no more than the requests. On a `mesh` the slots are split over its data and fsdp axes,
    so the count is rounded up to a multiple of data x fsdp (an idle slot costs a row of small
    arrays; KV pages come from the shared pool only when used); where that would pass
    --max-num-seqs, down to the largest multiple within it. A --max-num-seqs below data x fsdp
    is refused (UserError naming it), which needs only the mesh: call this before loading."""
    slots = min(max_num_seqs, requests)
    split = slot_split(mesh)
    up = -(-slots // split) * split
    if up <= max_num_seqs:
        return up
    if max_num_seqs >= split:
        return max_num_seqs // split * split
    raise _slots_refusal(max_num_seqs, mesh, split)


def check_mesh_slots(max_num_seqs: int, mesh) -> None:
    """Refuses a --max-num-seqs that serve or profile (which run exactly that many slots) cannot
    split over `mesh`'s data and fsdp axes; call it before loading the models."""
    split = slot_split(mesh)
    if max_num_seqs % split:
        raise _slots_refusal(max_num_seqs, mesh, split)


def check_kv_pages(args: argparse.Namespace, cfg: EngineConfig, positions: Sequence[int]) -> None:
    """Refuses a --kv-pages pool that cannot hold the longest request (up to --max-model-len),
    before compiling: the engine would refuse that request only when it comes up."""
    if args.kv_pages is None:
        return
    need = min(max(positions), cfg.max_model_len)
    pages = -(-need // cfg.page_size)
    if cfg.pool_pages < pages:
        raise UserError(
            f"--kv-pages {args.kv_pages} holds {cfg.pool_pages * cfg.page_size} tokens, but the "
            f"longest request may need {need} positions ({pages} pages of {cfg.page_size}): give "
            f"--kv-pages {pages} or more, or lower --max-new-tokens"
        )


def request_positions(
    args: argparse.Namespace,
    models: DecodingModels,
    conversations: Sequence[Sequence[str]] = (),
    id_prompts: Sequence[Sequence[int]] = (),
) -> list[int]:
    """Cache positions each request (a conversation: every turn's prompt, earlier answers
    included) needs: prompt + new tokens + one block."""
    from dspark_jax.tokenizer import encode_chat

    if id_prompts:
        lengths = [len(ids) for ids in id_prompts]
    else:
        lengths = [
            sum(
                len(
                    encode_chat(
                        models.tokenizer,
                        [{"role": "user", "content": turn}],
                        enable_thinking=args.thinking,
                    )
                )
                + TURN_OVERHEAD_TOKENS * (len(turns) > 1)
                for turn in turns
            )
            + args.max_new_tokens * (len(turns) - 1)
            for turns in conversations
        ]
    return [n + args.max_new_tokens + models.gamma + 1 for n in lengths]


def parse_mesh(text: str):
    """`--mesh data,fsdp,tensor` (one size may be -1: the remaining devices), as `train` takes.

    Raises argparse.ArgumentTypeError, whose message argparse prints as it stands (a ValueError
    would reach the user as "invalid parse_mesh value", the reason lost)."""
    from dspark_jax.sharding import MeshConfig, ShardingError

    try:
        sizes = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected three integers data,fsdp,tensor like -1,1,1, got {text!r}"
        ) from None
    if len(sizes) != 3:
        raise argparse.ArgumentTypeError(
            f"expected three sizes data,fsdp,tensor like -1,1,1, got {text!r}"
        )
    try:
        return MeshConfig(*sizes)
    except ShardingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_mesh_argument(parser) -> None:
    """`--mesh` on a parser or an argument group."""
    parser.add_argument(
        "--mesh",
        type=parse_mesh,
        metavar="D,F,T",
        help="data,fsdp,tensor sizes as for train; -1 = the rest; sizes that multiply to fewer "
        "than the device count use the first that many devices. For decoding give the devices "
        "to tensor, e.g. --mesh 1,1,4 or --mesh=1,1,-1 (data and fsdp replicas repeat the "
        "work). Default: one device, or the largest tensor size the models divide when the "
        "parameters do not fit one; see docs/engine.md",
    )


def decoding_mesh_for(args: argparse.Namespace, target, draft):
    """The mesh of `--mesh`, or the default for these models (see `sharding.decoding_mesh`)."""
    from dspark_jax.checkpoints.converted import decoding_param_bytes, decoding_split_sizes
    from dspark_jax.sharding import decoding_mesh

    return decoding_mesh(
        args.mesh,
        lambda: decoding_param_bytes(target, draft, args.dtype),
        split_sizes=lambda: decoding_split_sizes(target, draft),
    )


def load_models(
    args: argparse.Namespace, requests: int, with_drafter: bool = True
) -> DecodingModels:
    """Target, tokenizer, stop tokens and (unless `with_drafter` is false) the drafter; both
    default to the embedded default pair. They load straight onto the `--mesh` (or default) mesh,
    after `offline_slots` has checked that --max-num-seqs fits it for `requests` requests."""
    from dspark_jax.checkpoints.converted import load_decoding_models

    target = args.target or EMBEDDED_TARGET
    draft = (args.draft or EMBEDDED_DRAFT) if with_drafter else None
    if with_drafter and (args.target is None) != (args.draft is None):
        _check_embedded_part_fits(args, target, draft)
    mesh = decoding_mesh_for(args, target, draft)
    offline_slots(args.max_num_seqs, requests, mesh)
    models = load_decoding_models(target, draft, dtype=args.dtype, mesh=mesh)
    if mesh is not None:  # after loading, so that a refusal stays one line
        from dspark_jax.sharding import describe_mesh

        print(f"decoding on {describe_mesh(mesh)}", file=sys.stderr)
    return models


def _check_embedded_part_fits(args: argparse.Namespace, target, draft) -> None:
    """A --target without --draft runs the embedded drafter, which was made for the embedded
    target, and a --draft without --target runs on the embedded target; if the two do not fit,
    say that the other half is the default, not the user's."""
    from dspark_jax.checkpoints.converted import read_part_config
    from dspark_jax.config import ConfigError

    target_cfg = Qwen3Config.from_hf(read_part_config(target, "target"))
    drafter_cfg = DrafterConfig.from_hf(read_part_config(draft, "draft"))
    try:
        drafter_cfg.check_target(target_cfg)
    except ConfigError as e:
        if args.draft is None:
            beside = _converted_beside(args.target, DRAFT)
            instead = f"--draft {beside}" if beside else "--draft (its own drafter)"
            if hasattr(args, "no_draft"):  # eval has no --no-draft
                instead += " or --no-draft"
            raise ConfigError(
                f"--target {args.target} came without --draft, so the drafter is the embedded "
                f"{EMBEDDED_NAME} one, made for the embedded target, and it does not fit this "
                f"one ({e}): give {instead}"
            ) from None
        recorded = _recorded_target_of(args.draft)
        raise ConfigError(
            f"--draft {args.draft} came without --target, so the target is the embedded "
            f"{EMBEDDED_NAME} one, and this drafter was not made for it ({e}): give --target "
            + (
                f"{recorded} (the target it records)"
                if recorded
                else "(the model the drafter was trained for)"
            )
        ) from None


def _converted_beside(path: str, part: str) -> str | None:
    """The converted folder holding model `path` and also `part` (its other half), if any."""
    from dspark_jax.checkpoints.converted import converted_beside
    from dspark_jax.checkpoints.locate import locate

    other = DRAFT if part == TARGET else TARGET
    try:
        return converted_beside(locate(path, other)[0], part)
    except (UserError, OSError):
        return None


def _recorded_target_of(draft: str) -> str | None:
    """The target a drafter records, for advice: the one converted beside it, or the one its
    training run's checkpoints name; None when neither can be read."""
    from dspark_jax.training.checkpointing import find_checkpoint
    from dspark_jax.training.trainer import checkpoint_drafter_config

    beside = _converted_beside(draft, TARGET)
    if beside is not None:
        return beside
    try:
        found = find_checkpoint(draft)
        return None if found is None else checkpoint_drafter_config(*found)[1].get("target")
    except (UserError, OSError):
        return None


def build_engine(
    models: DecodingModels,
    args: argparse.Namespace,
    cfg: EngineConfig,
    speculative: bool = True,
) -> Engine:
    """The speculative engine (policy and STS from the command line) or the plain one."""
    if not speculative or models.drafter is None:
        return models.engine(cfg, speculative=False)
    policy, sts = speculative_parts(args, models, cfg, args.temperature)
    return models.engine(cfg, policy=policy, sts=sts)


def speculative_parts(
    args: argparse.Namespace,
    models: DecodingModels,
    cfg: EngineConfig,
    temperature: float | None,
    slots_advice: Callable[[int, int], str] | None = None,
) -> tuple[Policy, StsArtifact | None]:
    """The policy and STS artifact the command line names for `models` (which have a drafter)
    and an engine built with `cfg`, checked against the drafter, the engine's slots and the
    sampling `temperature` (None: an engine serving many temperatures, which applies the
    artifact per request). `--sps-table auto` profiles that engine's rounds here.
    `slots_advice`: see `build_policy`."""
    sts = load_sts(args)
    if sts is not None:
        sts.check(models.drafter_fingerprint, temperature, models.gamma)
    policy = build_policy(
        args,
        models.gamma,
        num_slots=cfg.num_slots,
        target_cfg=models.target.cfg,
        drafter_cfg=models.drafter.cfg,
        slots_advice=slots_advice,
        mesh=models.mesh,
        profile=lambda: profile_at_start(
            models, cfg, temperature or 0.0, _stand_in_engines(args, models, cfg, sts)
        ),
    )
    return policy, sts


def _stand_in_engines(
    args: argparse.Namespace, models: DecodingModels, cfg: EngineConfig, sts: StsArtifact | None
) -> list[Engine]:
    """The engine a command builds after `--sps-table auto`, on a stand-in table of the buckets
    the profile times (`profiling.stand_in_profile`), to compile beside the profiled round
    rather than after it; none where that would not pay."""
    from dspark_jax.decoding.profiling import stand_in_profile

    stand_in = stand_in_profile(cfg, models.gamma)
    if stand_in is None:
        return []
    policy = make_policy(args.policy, models.gamma, threshold=args.threshold, sps=stand_in)
    return [models.engine(cfg, policy=policy, sts=sts)]


# The context the start-up profile times each verified token against (the profile command's
# default), at most half the engine's positions.
_AUTO_CONTEXT = 1024


def profile_at_start(
    models: DecodingModels,
    cfg: EngineConfig,
    temperature: float,
    compile_with: Sequence[Engine] = (),
) -> SpsProfile:
    """The SPS table of `--sps-table auto`: whole rounds of an engine with `cfg`'s slots and
    token buckets on `models` (their mesh), timed as `dspark-jax profile` times them, progress
    on stderr (stdout may carry a command's output). `compile_with`: engines compiled beside
    the profiled round (`profile_engine`)."""
    import time

    from dspark_jax.cli.profile import non_monotonic_warning
    from dspark_jax.decoding.profiling import profile_engine

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    context = max(1, min(_AUTO_CONTEXT, cfg.max_model_len // 2))
    say(
        f"--sps-table auto: profiling rounds of {cfg.num_slots} slot"
        f"{'' if cfg.num_slots == 1 else 's'} at context {context} for the scheduler"
    )
    start = time.perf_counter()
    sps = profile_engine(
        models.target,
        models.drafter,
        cfg,
        mode="round",
        temperature=temperature,
        context_len=context,
        log=lambda line: say(f"  {line}"),
        mesh=models.mesh,
        compile_with=compile_with,
        config="--sps-table auto",
    )
    say(
        f"--sps-table auto: profiled in {time.perf_counter() - start:.0f} s (`dspark-jax profile "
        f"--max-num-seqs {cfg.num_slots} --out FILE` saves a table to pass instead)"
    )
    warning = non_monotonic_warning(sps.buckets, sps.sps)
    if warning:
        say(warning)
    return sps


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("verification policy")
    group.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default="fixed",
        help="how many drafts each request verifies per round (default fixed)",
    )
    group.add_argument(
        "--gamma", type=int, help="drafts verified by the fixed policy (default: the block size)"
    )
    group.add_argument(
        "--threshold",
        type=unit_interval,
        help="confidence threshold of the (cumulative-)threshold policies",
    )
    group.add_argument(
        "--sps-table",
        help="SPS table JSON from dspark-jax profile, or 'auto': profile this engine's rounds "
        "before the run (schedulers)",
    )
    group.add_argument("--sts", help="STS artifact JSON from dspark-jax calibrate")


# The policies that read each option; every other policy would silently ignore it.
_THRESHOLD_POLICIES = ("threshold", "cumulative-threshold")
_SCHEDULERS = ("scheduler", "async-scheduler")
_READERS = {
    "gamma": ("fixed",),
    "threshold": _THRESHOLD_POLICIES,
    "sps_table": _SCHEDULERS,
    "sts": _THRESHOLD_POLICIES + _SCHEDULERS,
}


def check_policy_arguments(args: argparse.Namespace) -> None:
    """Refuses policy options that the run would ignore: a setting of another policy, or any
    policy option with --no-draft. Cheap, so commands call it before loading anything."""
    given = [name for name in _READERS if getattr(args, name, None) is not None]
    if getattr(args, "no_draft", False):
        if getattr(args, "draft", None) is not None:
            raise PolicyError(
                "--no-draft decodes with the target alone, so --draft would not be used: give "
                "one of them"
            )
        ignored = [f"--{name.replace('_', '-')}" for name in given]
        if args.policy != "fixed":
            ignored.insert(0, f"--policy {args.policy}")
        if ignored:
            raise PolicyError(
                f"--no-draft decodes with the target alone, which verifies no drafts: drop "
                f"{', '.join(ignored)} (or --no-draft)"
            )
        return
    if args.policy in _THRESHOLD_POLICIES and args.threshold is None:
        raise PolicyError(f"--policy {args.policy} needs --threshold (a confidence in [0, 1])")
    if args.policy in _SCHEDULERS and not args.sps_table:
        raise PolicyError(
            f"--policy {args.policy} needs --sps-table: a table from dspark-jax profile, or "
            f"{SPS_AUTO} (profile this engine before the run)"
        )
    if getattr(args, "sts", None) and args.policy == "fixed":
        raise PolicyError(
            "--sts calibrates the confidences that the threshold and scheduler policies read; "
            "--policy fixed reads none, so it would change nothing: drop --sts or choose "
            "another --policy"
        )
    if getattr(args, "sts", None) and args.policy == "threshold" and args.threshold == 0.5:
        # c_k = sigmoid(z_k / T_k) >= 0.5 exactly where z_k >= 0, whatever the temperature.
        raise PolicyError(
            "--sts rescales each confidence's logit, which keeps its sign, and --policy "
            "threshold at --threshold 0.5 compares exactly that sign: the artifact would change "
            "nothing; drop --sts or choose another --threshold (or cumulative-threshold)"
        )
    for name in given:
        readers = _READERS[name]
        if args.policy not in readers:
            flag = f"--{name.replace('_', '-')}"
            raise PolicyError(
                f"{flag} is read by --policy {' and '.join(readers)} only; --policy "
                f"{args.policy} would ignore it: drop {flag} or choose "
                + ("that policy" if len(readers) == 1 else "one of those policies")
            )


def build_policy(
    args: argparse.Namespace,
    block_size: int,
    *,
    num_slots: int | None = None,
    target_cfg: Qwen3Config | None = None,
    drafter_cfg: DrafterConfig | None = None,
    slots_advice: Callable[[int, int], str] | None = None,
    mesh=UNCHECKED,
    profile: Callable[[], SpsProfile] | None = None,
) -> Policy:
    """The policy named by --policy for a drafter with `block_size` drafts per block.

    `--sps-table auto` takes its table from `profile()` (the engine's own rounds, so nothing
    to check it against); where the caller has no engine to profile (None), it is refused.

    An --sps-table is checked against the engine's `num_slots` and the models' architecture
    (`target_cfg`, `drafter_cfg`) when they are given: its step times describe one batch of
    one model; against `mesh` (the engine's, None for one device) when given. `slots_advice`
    words the fix of a slot mismatch for the command (default: generate's and eval's,
    `offline_slots_advice`)."""
    check_policy_arguments(args)
    sps = None
    if args.sps_table == SPS_AUTO:
        if profile is None:
            raise PolicyError(
                f"--sps-table {SPS_AUTO} profiles the engine a command builds; here give a "
                "table from dspark-jax profile"
            )
        sps = profile()
    elif args.sps_table:
        sps = SpsProfile.load(args.sps_table)
        advice = slots_advice or offline_slots_advice(args)
        check_sps_table(args.sps_table, sps, num_slots, target_cfg, drafter_cfg, advice, mesh)
    gamma = block_size if args.gamma is None else args.gamma
    if not 0 <= gamma <= block_size:
        raise PolicyError(f"--gamma must lie in 0..{block_size} (the block size), got {gamma}")
    return make_policy(args.policy, gamma, threshold=args.threshold, sps=sps)


def check_sps_table(
    path: str,
    sps: SpsProfile,
    num_slots: int | None,
    target_cfg: Qwen3Config | None,
    drafter_cfg: DrafterConfig | None,
    slots_advice: Callable[[int, int], str],
    mesh=UNCHECKED,
) -> None:
    """`policies.check_sps_profile` (the engine's check) worded for --sps-table: refuses a table
    measured for another slot count, on another mesh (when `mesh` is given; None: one device) or
    for another model; one that does not record its model gets a warning.
    `slots_advice(profiled, num_slots)` says how the command can run the table's slots
    (`offline_slots_advice`, `served_slots_advice`)."""
    checked = check_sps_profile(
        sps,
        num_slots,
        target_cfg,
        drafter_cfg,
        mesh=mesh,
        name=f"--sps-table {path}",
        slots_advice=slots_advice,
        mesh_advice=_mesh_advice,
        model_advice="Profile this one with dspark-jax profile --target/--draft (or --config of "
        "its architecture)",
    )
    if target_cfg is not None and not checked:
        print(
            f"warning: --sps-table {path} does not record the model it was profiled on (an "
            "older dspark-jax profile wrote it), so it cannot be checked against this one; "
            "profile again to record it",
            file=sys.stderr,
        )


def _mesh_flag(record: dict[str, int] | None) -> str:
    if record is None:
        return "no --mesh"
    return f"--mesh {mesh_sizes(record)}"


def _mesh_advice(profiled: dict[str, int] | None, here: dict[str, int] | None) -> str:
    """How a command can match a table profiled on the mesh `profiled` (None: one device)."""
    return (
        f"Profile this layout with dspark-jax profile and {_mesh_flag(here)}, or run with "
        f"{_mesh_flag(profiled)} as the table was"
    )


def offline_slots_advice(args: argparse.Namespace) -> Callable[[int, int], str]:
    """How generate or eval can match a table of `profiled` slots when it runs `num_slots`: they
    run --max-num-seqs slots, but no more than they have requests (prompts or conversations)."""
    requests = "conversations" if getattr(args, "command", None) == "eval" else "prompts"

    def advice(profiled: int, num_slots: int) -> str:
        again = f"Profile this run's slot count with dspark-jax profile --max-num-seqs {num_slots}"
        if profiled < num_slots:
            return f"{again}, or give --max-num-seqs {profiled}"
        given = getattr(args, "max_num_seqs", None) == profiled
        flag = "" if given else f"--max-num-seqs {profiled} and "
        return (
            f"{again}, or give {flag}at least {profiled} {requests} (a run has no more slots "
            f"than {requests})"
        )

    return advice


def served_slots_advice(profiled: int, num_slots: int) -> str:
    """How serve, which runs --max-num-seqs slots, can match a table of `profiled` slots."""
    return (
        f"Profile again with dspark-jax profile --max-num-seqs {num_slots}, or serve with "
        f"--max-num-seqs {profiled}"
    )


def load_sts(args: argparse.Namespace) -> StsArtifact | None:
    """The --sts artifact (checked against the drafter and temperature by `build_engine`)."""
    return StsArtifact.load(args.sts) if args.sts else None
