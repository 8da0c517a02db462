"""Throughput against per-request speed at concurrency 1, 8, 32 and 64, by verification policy.

Policies: no speculation (target alone), fixed gamma (the whole block), the best static
threshold (a small grid on c_k and on the cumulative survival, best per concurrency), and the
hardware-aware scheduler (Algorithm 1, and the Section 5.2 variant) on an SPS table of whole
rounds profiled on this device (or `--sps-table`). Concurrency c runs batches of c requests;
throughput is decoded tokens / decode time over all requests, per-request speed is
throughput / c. Each cell is the median of `--repeats` timed runs after a warm-up run (which
compiles).

    python benchmarks/throughput.py            # tiny byte-level models, CPU
    python benchmarks/throughput.py --target T --draft D --sps-table sps.json

Prompts are byte strings cut from the Python standard library's source, for the byte-level
tiny models; with real checkpoints pass `--prompts FILE.jsonl` (eval_datasets format), encoded
as one-turn chats by the target folder's tokenizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import glob
import json
import os
from pathlib import Path

import jax
import numpy as np
from provenance import git_commit

from dspark_jax.calibration.sts import StsArtifact
from dspark_jax.checkpoints.converted import load_decoding_models
from dspark_jax.conversations import read_turns
from dspark_jax.decoding import policies
from dspark_jax.decoding.engine import Engine, EngineConfig
from dspark_jax.decoding.generate import Request, generate
from dspark_jax.decoding.profiling import profile_target
from dspark_jax.embedded import EMBEDDED_DIR
from dspark_jax.sampling import SamplingConfig
from dspark_jax.tokenizer import encode_chat

ASSETS = EMBEDDED_DIR
CONCURRENCY = (1, 8, 32, 64)
BUCKETS = (1, 2, 4, 8)
THRESHOLDS = (
    ("threshold", 0.5),
    ("threshold", 0.7),
    ("cumulative-threshold", 0.3),
    ("cumulative-threshold", 0.5),
)


def source_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` byte strings of `length` bytes from random offsets of the stdlib's *.py files."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    rng = np.random.default_rng(seed)
    prompts = []
    while len(prompts) < n:
        data = Path(files[rng.integers(len(files))]).read_bytes()
        if len(data) > length:
            start = int(rng.integers(len(data) - length))
            prompts.append(list(data[start : start + length]))
    return prompts


def jsonl_prompts(path: str, tokenizer, n: int) -> list[list[int]]:
    """The first turn of the first `n` conversations of an eval_datasets JSONL file, encoded."""
    return [
        encode_chat(tokenizer, [{"role": "user", "content": turns[0]}])
        for turns in read_turns(path, n)
    ]


def _run(engine: Engine, prompts, concurrency: int, new_tokens: int, repeats: int) -> dict:
    requests = [Request(p, new_tokens, seed=i) for i, p in enumerate(prompts)]
    generate(engine, requests[:concurrency], batch_size=concurrency)  # compile and warm up
    samples = []
    for _ in range(repeats):
        results, timing = generate(engine, requests, batch_size=concurrency)
        samples.append((timing.decode_tokens_per_s, results))
    throughput, results = sorted(samples, key=lambda s: s[0])[len(samples) // 2]
    committed = np.concatenate([r.committed for r in results])
    verified = np.concatenate([r.verified for r in results]) if engine.speculative else None
    return {
        "throughput": throughput,
        "per_request": throughput / concurrency,
        "tau": float(committed.mean()),
        "verified": None if verified is None else float(verified.mean()),
        "spread": [s[0] for s in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=str(ASSETS / "target"))
    parser.add_argument("--draft", default=str(ASSETS / "draft"))
    parser.add_argument("--prompts", help="eval_datasets-style JSONL (real tokenizers)")
    parser.add_argument("--sps-table", help="SPS table from dspark-jax profile (else measured)")
    parser.add_argument("--sts", help="STS artifact for the confidence policies")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-bytes", type=int, default=48)
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="throughput.json")
    parser.add_argument("--plot", default="throughput.png")
    args = parser.parse_args()
    levels = tuple(int(c) for c in args.concurrency.split(","))

    models = load_decoding_models(args.target, args.draft, progress=False)
    target, drafter, tokenizer, stops = (
        models.target,
        models.drafter,
        models.tokenizer,
        models.stop_tokens,
    )
    fingerprint, gamma = models.drafter_fingerprint, models.gamma
    sampling = SamplingConfig(temperature=args.temperature)
    sts = None
    if args.sts:
        sts = StsArtifact.load(args.sts)  # the engine checks it against the drafter
    n_prompts = 2 * max(levels)
    if args.prompts:
        prompts = jsonl_prompts(args.prompts, tokenizer, n_prompts)
    else:
        prompts = source_prompts(n_prompts, args.prompt_bytes)
    longest = max(len(p) for p in prompts)
    max_len = longest + args.new_tokens + gamma + 1
    cfg = EngineConfig(
        max_len=max_len,
        max_new_tokens=args.new_tokens,
        batch_buckets=tuple(sorted(set(levels))),
        prompt_buckets=(longest,),
    )
    if args.sps_table:
        profile = policies.SpsProfile.load(args.sps_table)
    else:
        print("profiling whole rounds (drafting included) ...", flush=True)
        profile = profile_target(
            target,
            levels,
            BUCKETS,
            drafter=drafter,
            sampling=sampling,
            context_len=longest + args.new_tokens // 2,
            steps=20,
            repeats=5,
            config=str(args.target),
        )
        profile.save(Path(args.out).with_suffix(".sps.json"))
    bucketed = dataclasses.replace(cfg, verify_buckets=profile.buckets)

    def engine(policy, bucketed_cfg=True):
        use_cfg = bucketed if bucketed_cfg else cfg
        return Engine(
            target,
            drafter,
            use_cfg,
            sampling,
            policy,
            stops,
            sts=sts,
            drafter_fingerprint=fingerprint if sts else None,
        )

    rows = []
    for c in levels:
        measure = functools.partial(
            _run,
            prompts=prompts[: max(2 * c, 8)],
            concurrency=c,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
        )
        cells = {"no speculation": measure(Engine(target, None, cfg, sampling, stop_tokens=stops))}
        cells["fixed gamma"] = measure(engine(None, bucketed_cfg=False))
        best = None
        for name, t in THRESHOLDS:
            cell = measure(engine(policies.make_policy(name, gamma, threshold=t)))
            cell["setting"] = f"{'a_k' if name.startswith('cumulative') else 'c_k'} >= {t}"
            if best is None or cell["throughput"] > best["throughput"]:
                best = cell
        cells["best threshold"] = best
        cells["scheduler (Alg. 1)"] = measure(engine(policies.PrefixSchedulePolicy(profile)))
        cells["scheduler (5.2)"] = measure(engine(policies.AsyncSchedulePolicy(profile)))
        for mode, cell in cells.items():
            rows.append({"concurrency": c, "mode": mode, **cell})
            print(_row(rows[-1]), flush=True)

    commit = git_commit()
    device = jax.devices()[0]
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "device": f"{device.platform}: {device.device_kind}",
        "target": args.target,
        "draft": args.draft,
        "temperature": args.temperature,
        "new_tokens": args.new_tokens,
        "sts": args.sts,
        "sps_table": profile.to_json(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{report['date']}  commit {commit}  {report['device']}  T={args.temperature}")
    print(markdown_table(rows))
    _plot(rows, args.plot, f"{report['device']}, T={args.temperature}, commit {commit}")
    print(f"wrote {args.out} and {args.plot}")


def _row(r: dict) -> str:
    verified = "-" if r["verified"] is None else f"{r['verified']:.2f}"
    return (
        f"c={r['concurrency']:>3} {r['mode']:<20} {r['throughput']:9.1f} tok/s "
        f"{r['per_request']:8.1f} tok/s/req  tau {r['tau']:.2f}  verified {verified}  "
        f"{r.get('setting', '')}"
    )


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| concurrency | policy | throughput (tok/s) | per request (tok/s) | tau | "
        "drafts verified / round | setting |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        verified = "-" if r["verified"] is None else f"{r['verified']:.2f}"
        lines.append(
            f"| {r['concurrency']} | {r['mode']} | {r['throughput']:.0f} | "
            f"{r['per_request']:.1f} | {r['tau']:.2f} | {verified} | "
            f"{r.get('setting', '')} |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict], path: str, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.5))
    ax = fig.subplots()
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = [r for r in rows if r["mode"] == mode]
        ax.plot(
            [r["per_request"] for r in pts], [r["throughput"] for r in pts], marker="o", label=mode
        )
        for r in pts:
            ax.annotate(str(r["concurrency"]), (r["per_request"], r["throughput"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-request speed (tokens/s)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
