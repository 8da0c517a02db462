"""What a `PolicySwitch` costs a round: each member under the switch against its own engine.

A switch runs every member's length rule each round and keeps the chosen one's (see
docs/engine.md, "Several policies, one program"). This measures decode time per round of the
same requests under member i of a seven-policy switch and under an engine built with member i
alone, alternating the two `--repeats` times, and prints the medians, their ratio and how much
the compiled decode program grew. The serving-load benchmark relies on the ratio being 1;
`throughput.py --separate-engines` is the same check at the level of a whole table.

    python benchmarks/policy_switch_cost.py                      # the tiny pair, CPU
    python benchmarks/policy_switch_cost.py --synthetic qwen3-4b  # real shapes (GPU)

The JSON (--json) has a row per member timed: its index in the switch, a readable description
(`describe`: "threshold c_k >= 0.5", ...) and its repr, beside the date, commit and device.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics

import jax
from decode_speed import CONFIGS
from provenance import (
    Parser,
    fractions,
    git_commit,
    output_file,
    positive_int,
    run_main,
    write_json,
)
from throughput import ACCEPTANCE, THRESHOLDS, speculative_policies, synthetic_models

from dspark_jax.checkpoints.converted import load_decoding_models
from dspark_jax.cli import use_compilation_cache
from dspark_jax.decoding import policies
from dspark_jax.decoding.batching import Request, generate
from dspark_jax.decoding.engine import Engine, EngineConfig, warm_up_all
from dspark_jax.decoding.profiling import profile_engine
from dspark_jax.embedded import TINY_DIR
from dspark_jax.sampling import SamplingConfig


def _instructions(engine: Engine) -> int:
    return len(engine.lower()["decode_chunk"].compile().as_text().splitlines())


def describe(policy) -> str:
    """A member of the switch in words, as the serving-load table names its rows."""
    if isinstance(policy, policies.FixedPolicy):
        return f"fixed gamma {policy.gamma}"
    if isinstance(policy, policies.ThresholdPolicy):
        kind = "a_k" if policy.cumulative else "c_k"
        return f"threshold {kind} >= {policy.threshold:g}"
    if isinstance(policy, policies.PrefixSchedulePolicy):
        return "scheduler (Alg. 1)"
    if isinstance(policy, policies.AsyncSchedulePolicy):
        return "scheduler (5.2)"
    return repr(policy)


# Fixed gamma, the serving-load table's default thresholds, the two schedulers.
MEMBERS = 1 + len(THRESHOLDS) + 2


def members_arg(text: str) -> tuple[int, ...]:
    """argparse `type=` of --members: indices into the switch, 0..MEMBERS-1."""
    try:
        indices = tuple(int(item) for item in text.split(","))
    except ValueError:
        indices = ()
    if not indices or not all(0 <= i < MEMBERS for i in indices):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of members 0..{MEMBERS - 1}"
        )
    return indices


def main() -> None:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help=f"target folder (default {TINY_DIR / 'target'})")
    parser.add_argument("--draft", help=f"drafter folder (default {TINY_DIR / 'draft'})")
    parser.add_argument(
        "--synthetic", choices=sorted(CONFIGS), help="random weights, see throughput.py"
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="--synthetic: parameter dtype",
    )
    parser.add_argument("--acceptance", type=fractions, default=ACCEPTANCE)
    parser.add_argument("--concentration", type=float, default=4.0)
    parser.add_argument("--concurrency", type=positive_int, default=8)
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument(
        "--members",
        type=members_arg,
        default=(1, 5, 6),
        help="switch members to time (0: fixed, 1-4: thresholds, 5: Algorithm 1, "
        "6: Section 5.2; default 1,5,6)",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.synthetic and (args.target or args.draft):
        parser.error("--synthetic takes neither --target nor --draft")
    args.target = args.target or str(TINY_DIR / "target")
    args.draft = args.draft or str(TINY_DIR / "draft")
    if args.json:
        output_file(args.json, "--json")
    # The code measured is the code at the start: the tree may change during a long run.
    commit = git_commit()
    use_compilation_cache()
    models = (
        synthetic_models(args)
        if args.synthetic
        else load_decoding_models(args.target, args.draft, progress=False)
    )
    target, drafter, gamma = models.target, models.drafter, models.gamma
    c = args.concurrency
    cfg = EngineConfig(num_slots=c, max_model_len=256 + args.new_tokens, prefill_chunk=256)
    profile = profile_engine(target, drafter, cfg, context_len=64, steps=4, repeats=2)
    cfg = dataclasses.replace(cfg, token_buckets=profile.buckets)
    # The serving-load table's switch: fixed gamma, its default thresholds, the two schedulers.
    members = speculative_policies(gamma, THRESHOLDS, profile)
    vocab = target.cfg.vocab_size
    requests = [
        Request(
            [(7 + 31 * i + j) % (vocab - 2) + 2 for j in range(48)],
            args.new_tokens,
            seed=i,
            sampling=SamplingConfig(temperature=1.0),
            ignore_eos=True,
        )
        for i in range(2 * c)
    ]

    def engine(policy):
        return Engine(target, drafter, cfg, policy=policy, stop_tokens=models.stop_tokens)

    switch = engine(policies.PolicySwitch(members))
    owns = {i: engine(members[i]) for i in args.members}
    # Every engine's programs at once, one per CPU core.
    warm_up_all([switch, *owns.values()])
    device = jax.devices()[0]
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "device": f"{device.platform}: {device.device_kind}",
        "target": f"synthetic {args.synthetic} ({args.dtype})" if args.synthetic else args.target,
        "draft": f"known acceptance {','.join(map(str, args.acceptance))} "
        f"(c={args.concentration})"
        if args.synthetic
        else args.draft,
        "concurrency": c,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "switch_instructions": _instructions(switch),
        "members": [],
    }
    print(f"{report['device']}  commit {report['commit']}  {c} slots")
    print("| member | own engine (ms/round) | under the switch (ms/round) | ratio | program |")
    print("|---|---:|---:|---:|---:|")
    for i in args.members:
        own = owns[i]
        times = {"own": [], "switch": []}
        for _ in range(args.repeats):
            for name, e, index in (("own", own, None), ("switch", switch, i)):
                _, timing = generate(e, requests, policy_index=index)
                times[name].append(timing.decode_s / timing.rounds * 1e3)
        own_ms, switch_ms = (statistics.median(times[k]) for k in ("own", "switch"))
        growth = report["switch_instructions"] / _instructions(own) - 1
        row = {
            "index": i,
            "member": describe(members[i]),
            "policy": repr(members[i]),
            "own_ms_per_round": own_ms,
            "switch_ms_per_round": switch_ms,
            "ratio": switch_ms / own_ms,
            "program_growth": growth,
        }
        report["members"].append(row)
        print(
            f"| {i}: {row['member']} | {own_ms:.3f} | {switch_ms:.3f} | {row['ratio']:.3f} | "
            f"+{100 * growth:.1f}% instructions |",
            flush=True,
        )
        del own
        if args.json:  # what is measured so far survives a run cut off later
            write_json(args.json, report, indent=2)


if __name__ == "__main__":
    run_main(main)
