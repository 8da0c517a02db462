"""What a `PolicySwitch` costs a round: each member under the switch against its own engine.

A switch runs every member's length rule each round and keeps the chosen one's (see
docs/engine.md, "Several policies, one program"). This measures decode time per round of the
same requests under member i of a seven-policy switch and under an engine built with member i
alone, alternating the two `--repeats` times, and prints the medians, their ratio and how much
the compiled decode program grew. The serving-load benchmark relies on the ratio being 1;
`throughput.py --separate-engines` is the same check at the level of a whole table.

    python benchmarks/policy_switch_cost.py                      # the tiny pair, CPU
    python benchmarks/policy_switch_cost.py --synthetic qwen3-4b  # real shapes (GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import jax
from decode_speed import CONFIGS
from provenance import git_commit
from throughput import THRESHOLDS, speculative_policies, synthetic_models

from dspark_jax.checkpoints.converted import load_decoding_models
from dspark_jax.cli import use_compilation_cache
from dspark_jax.decoding import policies
from dspark_jax.decoding.batching import Request, generate
from dspark_jax.decoding.engine import Engine, EngineConfig
from dspark_jax.decoding.profiling import profile_engine
from dspark_jax.embedded import TINY_DIR
from dspark_jax.sampling import SamplingConfig


def _instructions(engine: Engine) -> int:
    return len(engine.lower()["decode_chunk"].compile().as_text().splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=str(TINY_DIR / "target"))
    parser.add_argument("--draft", default=str(TINY_DIR / "draft"))
    parser.add_argument(
        "--synthetic", choices=sorted(CONFIGS), help="random weights, see throughput.py"
    )
    parser.add_argument("--dtype", default="bfloat16", help="--synthetic: parameter dtype")
    parser.add_argument("--acceptance", default="0.9,0.85,0.8,0.75,0.7,0.65,0.6")
    parser.add_argument("--concentration", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--members", default="1,5,6", help="switch members to time (0: fixed, 1-4: thresholds, "
        "5: Algorithm 1, 6: Section 5.2)"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
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
    switch.warm_up()
    device = jax.devices()[0]
    report = {
        "commit": git_commit(),
        "device": f"{device.platform}: {device.device_kind}",
        "concurrency": c,
        "switch_instructions": _instructions(switch),
        "members": [],
    }
    print(f"{report['device']}  commit {report['commit']}  {c} slots")
    print("| member | own engine (ms/round) | under the switch (ms/round) | ratio | program |")
    print("|---|---:|---:|---:|---:|")
    for i in (int(x) for x in args.members.split(",")):
        own = engine(members[i])
        own.warm_up()
        times = {"own": [], "switch": []}
        for _ in range(args.repeats):
            for name, e, index in (("own", own, None), ("switch", switch, i)):
                _, timing = generate(e, requests, policy_index=index)
                times[name].append(timing.decode_s / timing.rounds * 1e3)
        own_ms, switch_ms = (statistics.median(times[k]) for k in ("own", "switch"))
        growth = report["switch_instructions"] / _instructions(own) - 1
        row = {
            "member": type(members[i]).__name__,
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
