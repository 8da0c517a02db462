"""Serving under load: throughput against per-user speed by verification policy and concurrency.

A closed loop of `c` clients (c = 1, 8, 32, 64 by default) drives the continuous-batching loop
(`dspark_jax.decoding.batching`) in-process over an engine of `c` slots: each client sends its
next request the moment its previous one finishes. The workload mixes lengths: every request asks
for a number of new tokens drawn from `--lengths` (default 16, 32, 64, 128 and 256 tokens,
equally likely), so short and long requests share the slots the way they do on a real server.

Policies: no speculation (target alone), fixed gamma (the whole block), the best static
threshold (a small grid on c_k and on the cumulative survival, best per concurrency), and the
hardware-aware scheduler (Algorithm 1, and the Section 5.2 variant) on an SPS table of whole
rounds per token bucket profiled on this device for each slot count (or `--sps-table DIR` with
`sps_c{c}.json` files).

Reported per cell: throughput (generated tokens / wall time while the shared request pool still
had work to hand out; `throughput_with_tail` in the JSON includes the drain at the end),
per-user speed (median over requests of decode tokens / decode time), time to first token and
inter-token latency percentiles, slot occupancy over the same loaded phase (the share of slot
turns in decode rounds that served a live request), tau and drafts verified per round.
Compilation happens before timing (`warm_up`). Beside the SPS profile's, each level builds two
engines: the plain one and one speculative engine holding every policy above
(`policies.PolicySwitch`), so the target's and drafter's forwards compile once per level, not
once per policy. The plain engine compiles alongside the profiled round (`profile_engine`'s
`compile_with`), and so does the speculative one where the persistent compilation cache is on:
its schedulers' SPS table is data of its programs, so it is compiled first on a stand-in table
of the profile's buckets, and the engine built on the measured table finds its programs in the
cache (`profiling.stand_in_profile`; without the cache, or with fewer than four compile
threads, it compiles after the profile).

    python benchmarks/throughput.py                 # the tiny byte-level pair, CPU
    python benchmarks/throughput.py --target T --draft D --prompts mt-bench.jsonl
    python benchmarks/throughput.py --synthetic qwen3-4b --acceptance 0.9,0.85,0.8,0.75,0.7,0.65,0.6
    python benchmarks/throughput.py --combine c1-32.json c64.json   # levels run separately

`--synthetic CONFIG` measures real shapes without real weights: random weights in `--dtype`, the
target muted and the drafter replaced by `KnownAcceptanceDrafter`
(dspark_jax/models/known_acceptance.py), so draft position k is accepted with probability
`--acceptance`[k] given the earlier ones were, with calibrated confidences. Prompts are random
token ids of `--prompt-tokens`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import glob
import os
import time
from pathlib import Path

import jax
import numpy as np
from decode_speed import CONFIGS, pair_configs, random_pair
from provenance import (
    CompileClock,
    Parser,
    compile_only_cache,
    existing_file,
    existing_folder,
    finite_or_none,
    fractions,
    git_commit,
    non_negative_float,
    output_file,
    plot_file,
    positive_int,
    positive_ints,
    read_json,
    run_main,
    write_json,
)

from dspark_jax.calibration.sts import StsArtifact
from dspark_jax.checkpoints.converted import DecodingModels, load_decoding_models
from dspark_jax.cli import use_compilation_cache
from dspark_jax.conversations import read_turns
from dspark_jax.decoding import policies
from dspark_jax.decoding.batching import Batcher, Observer, Request
from dspark_jax.decoding.engine import Engine, EngineConfig, compile_engines
from dspark_jax.decoding.profiling import profile_engine, stand_in_profile
from dspark_jax.embedded import TINY_DIR
from dspark_jax.errors import UserError
from dspark_jax.models.known_acceptance import KnownAcceptanceDrafter, mute_target
from dspark_jax.sampling import SamplingConfig
from dspark_jax.tokenizer import ByteTokenizer, encode_chat

CONCURRENCY = (1, 8, 32, 64)
# A stand-in for a trained drafter's per-position acceptance (tau about 4.4 at gamma 7), not a
# published curve: pass a measured one with --acceptance.
ACCEPTANCE = (0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
LENGTHS = (16, 32, 64, 128, 256)
# Most prompt tokens per prefill call of every engine here: --prefill-buckets must reach it.
PREFILL_CHUNK = 256
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


def chat_prompts(path: str, tokenizer, n: int) -> list[list[int]]:
    """The first turn of the first `n` conversations of an eval_datasets JSONL file, encoded."""
    return [
        encode_chat(tokenizer, [{"role": "user", "content": turns[0]}])
        for turns in read_turns(path, limit=n)
    ]


class _Latencies(Observer):
    def __init__(self):
        self.ttft: list[float] = []
        self.itl: list[tuple[float, int]] = []
        self.tokens = 0

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.append(ttft_s)
        self.tokens += 1

    def on_tokens(self, count: int, inter_token_s: float) -> None:
        self.itl.append((inter_token_s, count))
        self.tokens += count


def _weighted_percentiles(pairs, qs) -> list[float | None]:
    """Percentiles `qs` of the values of (value, weight) `pairs`; None each when there are none
    (no request decoded past its first token)."""
    if not pairs:
        return [None] * len(qs)
    values = np.array([v for v, _ in pairs])
    weights = np.array([w for _, w in pairs], np.float64)
    order = np.argsort(values)
    cum = np.cumsum(weights[order]) / weights.sum()
    return [float(values[order][np.searchsorted(cum, q / 100.0)]) for q in qs]


def run_cell(
    engine: Engine,
    prompts,
    lengths,
    requests_per_client: int,
    temperature: float,
    policy_index: int | None = None,
):
    """One closed-loop run with `engine.cfg.num_slots` clients; returns the cell's numbers.
    `policy_index`: the member of the engine's `PolicySwitch` that runs.

    The clients draw from one shared pool of `clients * requests_per_client` requests, each taking
    the next the moment its previous one finishes. Throughput and occupancy are measured over the
    loaded phase -- until the pool runs dry -- because after that slots empty for want of
    requests, not through the engine, and how long that tail lasts depends only on the last
    requests' lengths."""
    clients = engine.cfg.num_slots
    observer = _Latencies()
    batcher = Batcher(engine, observer=observer, policy_index=policy_index)
    rng = np.random.default_rng(0)
    pool = collections.deque(
        Request(
            prompts[i % len(prompts)],
            int(rng.choice(lengths)),
            seed=i,
            sampling=SamplingConfig(temperature=temperature),
            ignore_eos=True,
        )
        for i in range(clients * requests_per_client)
    )
    loaded: dict[str, float] = {}
    results = []

    def send() -> None:
        def on_event(kind, payload):
            if kind == "done":
                results.append(payload)
                if pool:
                    send()
                elif not loaded:
                    loaded.update(
                        wall=time.perf_counter() - start,
                        tokens=observer.tokens,
                        slot_rounds=batcher.slot_rounds,
                        device_rounds=batcher.device_rounds,
                    )

        batcher.submit(pool.popleft(), on_event)

    start = time.perf_counter()
    for _ in range(clients):
        send()
    batcher.run_until_idle()
    wall = time.perf_counter() - start
    tokens = sum(len(r.tokens) for r in results)
    speeds = [
        (len(r.tokens) - 1) / (r.latency_s - r.ttft_s)
        for r in results
        if len(r.tokens) > 1 and r.latency_s > r.ttft_s
    ]
    committed = np.concatenate([r.committed for r in results])
    verified = np.concatenate([r.verified for r in results])
    ttft = np.percentile(observer.ttft, [50, 90, 99])
    itl = _weighted_percentiles(observer.itl, [50, 90, 99])
    # Requests that end at their first token (--lengths 1) take no decode round: per-user
    # speed, inter-token latency, tau and drafts verified are undefined (null), not NaN.
    return {
        "throughput": loaded["tokens"] / loaded["wall"],
        "throughput_with_tail": tokens / wall,
        "per_user": float(np.median(speeds)) if speeds else None,
        "ttft_ms": [1e3 * float(x) for x in ttft],
        "itl_ms": [None if x is None else 1e3 * x for x in itl],
        "occupancy": loaded["slot_rounds"] / max(loaded["device_rounds"] * engine.cfg.num_slots, 1),
        "occupancy_with_tail": batcher.occupancy,
        "tau": float(committed.mean()) if committed.size else None,
        "verified": float(verified.mean()) if engine.speculative and verified.size else None,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
    }


def thresholds_arg(text: str) -> tuple[tuple[str, float], ...]:
    """argparse `type=` of --thresholds: `threshold=V,cumulative-threshold=V,...`."""
    grid = []
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            threshold = float(value)
        except ValueError:
            threshold = None
        if name not in ("threshold", "cumulative-threshold") or threshold is None:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not threshold=V or cumulative-threshold=V (V a number)"
            )
        grid.append((name, threshold))
    return tuple(grid)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: everything a run could fail on from its arguments alone is
    refused here, before a model is loaded or a program compiled."""
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help=f"target folder (default {TINY_DIR / 'target'})")
    parser.add_argument("--draft", help=f"drafter folder (default {TINY_DIR / 'draft'})")
    parser.add_argument("--prompts", help="eval_datasets-style JSONL (chat models)")
    parser.add_argument("--sps-table", help="folder of sps_c{c}.json tables (else profiled)")
    parser.add_argument("--sts", help="STS artifact (dspark-jax calibrate) for the drafter")
    parser.add_argument("--temperature", type=non_negative_float, default=1.0)
    parser.add_argument(
        "--lengths",
        type=positive_ints,
        default=LENGTHS,
        help="new tokens per request, drawn uniformly from this comma-separated list "
        f"(default {','.join(map(str, LENGTHS))}); with 1 no request decodes, and per-user "
        "speed, ITL and tau are null",
    )
    parser.add_argument(
        "--prompt-tokens", type=positive_int, default=48, help="byte-model prompt length"
    )
    parser.add_argument(
        "--concurrency",
        type=positive_ints,
        default=CONCURRENCY,
        help=f"comma-separated levels (default {','.join(map(str, CONCURRENCY))})",
    )
    parser.add_argument("--requests-per-client", type=positive_int, default=4)
    parser.add_argument(
        "--context-len", type=positive_int, default=128, help="profiling context"
    )
    parser.add_argument(
        "--prefill-buckets",
        type=positive_ints,
        help="prefill token buckets, comma-separated (default: the engine's, 16 doubling to "
        f"{PREFILL_CHUNK}); the largest must be at least {PREFILL_CHUNK}, the prefill chunk "
        "of every engine here; each is a program every engine compiles, so prompts of one "
        "length need few",
    )
    parser.add_argument(
        "--synthetic",
        choices=sorted(CONFIGS),
        help="random weights of these shapes and a "
        "known-acceptance drafter instead of --target/--draft",
    )
    parser.add_argument(
        "--acceptance",
        type=fractions,
        default=ACCEPTANCE,
        help="--synthetic: acceptance rate of each block position given the earlier ones",
    )
    parser.add_argument("--concentration", type=float, default=4.0, help="--synthetic: Beta c")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="--synthetic: parameter dtype",
    )
    parser.add_argument(
        "--thresholds",
        type=thresholds_arg,
        default=THRESHOLDS,
        help="the static-threshold grid, POLICY=VALUE,... (the best per concurrency is kept)",
    )
    parser.add_argument(
        "--separate-engines",
        action="store_true",
        help="one speculative engine per policy (compiles each) instead of one PolicySwitch "
        "engine for all: a check that the switch does not change the numbers",
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="measure nothing: compile what each level compiles before it times anything (the "
        "profiled round, the plain and the speculative engine) into the persistent compilation "
        "cache, for a later run with the same arguments to find (gpu_session.sh runs this "
        "beside the first tests)",
    )
    parser.add_argument(
        "--combine",
        nargs="+",
        metavar="JSON",
        help="measure nothing: join the rows of earlier --out files (concurrency levels run "
        "separately) into one --out, table and --plot",
    )
    parser.add_argument("--out", default="throughput.json")
    parser.add_argument("--plot", default="throughput.png", help="('' for none)")
    args = parser.parse_args(argv)
    if args.prefill_buckets and max(args.prefill_buckets) < PREFILL_CHUNK:
        parser.error(
            f"--prefill-buckets: the largest bucket ({max(args.prefill_buckets)}) must be at "
            f"least the prefill chunk, {PREFILL_CHUNK}"
        )
    if args.compile_only and (args.combine or args.separate_engines):
        parser.error(
            "--compile-only compiles the one speculative engine of each level: drop "
            + ("--combine" if args.combine else "--separate-engines")
        )
    if args.synthetic:
        given = [f"--{n}" for n in ("target", "draft", "sts", "prompts") if getattr(args, n)]
        if given:
            parser.error(f"--synthetic takes none of {', '.join(given)}")
    else:
        args.target = args.target or str(TINY_DIR / "target")
        args.draft = args.draft or str(TINY_DIR / "draft")
    return args


def check_paths(args: argparse.Namespace) -> None:
    """The files a run reads exist and its outputs can be written (UserError if not)."""
    if args.combine:
        for path in args.combine:
            existing_file(path, "--combine")
    else:
        if args.prompts:
            existing_file(args.prompts, "--prompts")
        if args.sts:
            existing_file(args.sts, "--sts")
        if args.sps_table:
            folder = existing_folder(args.sps_table, "--sps-table")
            missing = [f"sps_c{c}.json" for c in args.concurrency
                       if not (folder / f"sps_c{c}.json").is_file()]  # fmt: skip
            if missing:
                raise UserError(f"--sps-table {folder}: no {', '.join(missing)} in it")
        for option in () if args.synthetic else ("target", "draft"):
            path = Path(getattr(args, option))
            # A hub id (owner/name) need not exist here; a path that looks local must.
            local = path.is_absolute() or str(path).startswith(".") or len(path.parts) != 2
            if local and not path.exists():
                raise UserError(f"--{option} {path}: no such folder")
    output_file(args.out, "--out")
    if args.plot:
        plot_file(args.plot, "--plot", args.out)


def main() -> None:
    args = parse_args()
    check_paths(args)
    if args.combine:
        combine(args.combine, args.out, args.plot)
        return
    # The code measured is the code at the start: the tree may change during a long run.
    commit = git_commit()
    use_compilation_cache()
    if args.compile_only:
        compile_only_cache()

    levels = args.concurrency
    thresholds = args.thresholds
    lengths = args.lengths
    prefill_buckets = args.prefill_buckets
    # Read before the models load: a bad artifact fails in the first second.
    sts = StsArtifact.load(args.sts) if args.sts else None
    n_prompts = max(levels) * args.requests_per_client
    if args.synthetic:
        models = synthetic_models(args)
        rng = np.random.default_rng(0)
        vocab = models.target.cfg.vocab_size
        prompts = [rng.integers(2, vocab, args.prompt_tokens).tolist() for _ in range(n_prompts)]
    else:
        models = load_decoding_models(args.target, args.draft, progress=False)
        prompts = _prompts(args, models, n_prompts)
    target, drafter, gamma = models.target, models.drafter, models.gamma
    if sts is not None:
        sts.check(models.drafter_fingerprint, args.temperature, gamma)
    longest = max(len(p) for p in prompts)
    max_model_len = -(-(longest + max(lengths) + gamma + 1) // 16) * 16

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
        "temperature": args.temperature,
        "sts": args.sts,
        "speculative_engines": "one per policy" if args.separate_engines else "one PolicySwitch",
        "lengths": lengths,
        "requests_per_client": args.requests_per_client,
        "sps_tables": {},
        "rows": [],
        "thresholds": [],  # every static threshold tried; the rows keep the best per level
    }
    rows, tables = report["rows"], report["sps_tables"]
    for c in levels:
        cfg = EngineConfig(
            num_slots=c,
            max_model_len=max_model_len,
            prefill_chunk=PREFILL_CHUNK,
            prefill_seqs=8,
            prefill_buckets=prefill_buckets,
        )
        # Plain decoding packs at most one token per slot: one bucket of `c` serves every
        # round, where the profile's larger ones would be compiled and never run.
        plain = Engine(target, None, dataclasses.replace(cfg, token_buckets=(c,)))

        def spec(policy, cfg):
            return Engine(
                target,
                drafter,
                cfg,
                policy=policy,
                stop_tokens=models.stop_tokens,
                sts=sts,
                drafter_fingerprint=models.drafter_fingerprint,
            )

        def switch_on(profile: policies.SpsProfile, cfg=cfg) -> Engine:
            # Every speculative policy of the table on `profile`, at its buckets.
            policy = policies.PolicySwitch(speculative_policies(gamma, thresholds, profile))
            return spec(policy, dataclasses.replace(cfg, token_buckets=profile.buckets))

        def profile_level(compile_with, compile_only=False, cfg=cfg):
            # One call for --compile-only and the run alike: the programs must be the same.
            return profile_engine(
                target,
                drafter,
                cfg,
                context_len=args.context_len,
                steps=8,
                repeats=3,
                compile_with=compile_with,
                compile_only=compile_only,
            )

        if args.compile_only:
            # What the level compiles before it times anything, into the persistent cache; the
            # switch engine on a stand-in table whatever the compile threads (the level's own
            # switch, built on the measured table, finds it there either way).
            if args.sps_table:
                profile = policies.SpsProfile.load(Path(args.sps_table) / f"sps_c{c}.json")
            else:
                profile = stand_in_profile(cfg, gamma, threads=False)
            switch = switch_on(profile)
            with CompileClock() as clock:
                if args.sps_table:
                    compile_engines((plain, switch))
                else:
                    profile_level((plain, switch), compile_only=True)
            cache = jax.config.jax_compilation_cache_dir
            print(
                f"c={c:>3} compiled {clock.programs} programs in {clock.wall_s:.0f} s "
                f"({clock.compile_s:.0f} s of compiling) into {cache}",
                flush=True,
            )
            del plain, switch
            continue
        if args.sps_table:
            profile = policies.SpsProfile.load(Path(args.sps_table) / f"sps_c{c}.json")
        else:
            print(f"profiling rounds of {c} slots ...", flush=True)
            early = [plain]
            stand_in = None if args.separate_engines else stand_in_profile(cfg, gamma)
            if stand_in is not None:
                # The switch engine's programs do not depend on the step rates the profile
                # measures: built on a stand-in profile of the same buckets, they compile beside
                # the profiled round into the persistent cache, where the switch engine built on
                # the measured profile finds them.
                early.append(switch_on(stand_in))
            with CompileClock() as clock:
                profile = profile_level(early)
            also = " and the switch engine's" if len(early) > 1 else ""
            print(
                f"  profiled in {clock.wall_s:.0f} s ({clock.compile_s:.0f} s compiling, "
                f"the plain engine's programs{also} too)",
                flush=True,
            )
            del early
        tables[c] = profile.to_json()
        cfg = dataclasses.replace(cfg, token_buckets=profile.buckets)

        def measure(mode: str, engine: Engine, setting: str = "", index=None, c=c) -> dict:
            # Programs and seconds compiled for this cell: the switch engine's cells after its
            # first reuse its programs and show none.
            with CompileClock() as clock:
                engine.warm_up()
            cell = run_cell(
                engine, prompts, lengths, args.requests_per_client, args.temperature, index
            )
            cell.update(setting=setting, programs=clock.programs, compile_s=clock.compile_s)
            print(_row({"concurrency": c, "mode": mode, **cell}), flush=True)
            return cell

        def keep(mode: str, cell: dict, c=c) -> None:
            # Written cell by cell: a run cut off later still leaves what it measured.
            rows.append({"concurrency": c, "mode": mode, **cell})
            write_json(args.out, report, indent=2)

        keep("no speculation", measure("no speculation", plain))
        # Every speculative policy in one engine: the target's and drafter's forwards compile
        # once per level, not once per policy (`policies.PolicySwitch`). --separate-engines
        # builds one engine per policy instead, to check that the switch costs nothing.
        labels = [f"{'a_k' if n.startswith('cumulative') else 'c_k'} >= {t}" for n, t in thresholds]
        members = speculative_policies(gamma, thresholds, profile)

        switch = None if args.separate_engines else spec(policies.PolicySwitch(members), cfg)

        def member(mode: str, i: int, setting="", switch=switch, members=members, cfg=cfg):
            if switch is not None:
                return measure(mode, switch, setting, index=i)
            return measure(mode, spec(members[i], cfg), setting)

        keep("fixed gamma", member("fixed gamma", 0))
        best = None
        for i, label in enumerate(labels, start=1):
            cell = member("threshold", i, label)
            report["thresholds"].append({"concurrency": c, **cell})
            if best is None or cell["throughput"] > best["throughput"]:
                best = cell
        if best is not None:
            keep("best threshold", best)
        n = len(labels)
        keep("scheduler (Alg. 1)", member("scheduler (Alg. 1)", n + 1))
        keep("scheduler (5.2)", member("scheduler (5.2)", n + 2))
        del plain, switch

    if args.compile_only:
        return
    print(f"\n{report['date']}  commit {commit}  {report['device']}  T={args.temperature}")
    print(markdown_table(rows))
    if args.plot:
        _plot(rows, args.plot, f"{report['device']}, T={args.temperature}, commit {commit}")
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))


def speculative_policies(gamma: int, thresholds, profile: policies.SpsProfile) -> tuple:
    """The table's speculative policies in its row order: fixed gamma, each (name, threshold)
    of `thresholds`, Algorithm 1 and the Section 5.2 variant on `profile`."""
    return (
        policies.FixedPolicy(gamma),
        *(policies.make_policy(name, gamma, threshold=t) for name, t in thresholds),
        policies.PrefixSchedulePolicy(profile),
        policies.AsyncSchedulePolicy(profile),
    )


def combine(paths: list[str], out: str, plot: str) -> None:
    """One report from several runs of this script: their rows by concurrency, and each run's
    date, commit, device and models kept beside the rows it measured (they may differ).
    NaN that earlier versions wrote for undefined cells is read, and written, as null."""
    reports = [read_json(p, "--combine") for p in paths]
    for path, report in zip(paths, reports, strict=True):
        rows = report.get("rows") if isinstance(report, dict) else None
        if not isinstance(rows, list) or not all(
            isinstance(r, dict) and {"concurrency", "mode", "throughput"} <= r.keys()
            for r in rows
        ):
            raise UserError(f"--combine {path}: not a throughput.py --out file (no rows)")
    rows = sorted(
        (row for report in reports for row in report["rows"]), key=lambda r: r["concurrency"]
    )
    cells = collections.Counter((r["concurrency"], r["mode"]) for r in rows)
    repeated = sorted(cell for cell, n in cells.items() if n > 1)
    if repeated:
        raise SystemExit(f"--combine: {repeated} measured in more than one file")
    keep = (
        "date", "commit", "device", "target", "draft", "temperature", "sts", "speculative_engines"
    )
    parts = [
        {
            "file": p,
            "levels": sorted({r["concurrency"] for r in rep["rows"]}),
            **{k: rep.get(k) for k in keep},
        }
        for p, rep in zip(paths, reports, strict=True)
    ]
    # The runs' own fields once each where they agree (as one run's report has them), listed
    # where they differ; the parts say which run measured which levels.
    joined = {}
    for k in keep:
        values = list(dict.fromkeys(str(part[k]) for part in parts))
        joined[k] = parts[0][k] if len(values) == 1 else ", ".join(values)
    thresholds = [t for report in reports for t in report.get("thresholds", [])]
    joined_report = {**joined, "parts": parts, "rows": rows, "thresholds": thresholds}
    write_json(out, joined_report, indent=2)
    for part in parts:
        print(f"c={part['levels']}: {part['date']}  commit {part['commit']}  {part['device']}")
    print(markdown_table(rows))
    if plot:
        title = f"{joined['device']}, T={joined['temperature']}, commits {joined['commit']}"
        _plot(rows, plot, title)
    print(f"wrote {out}" + (f" and {plot}" if plot else ""))


def _prompts(args, models: DecodingModels, n: int) -> list[list[int]]:
    if args.prompts:
        return chat_prompts(args.prompts, models.tokenizer, n)
    if isinstance(models.tokenizer, ByteTokenizer):
        return source_prompts(n, args.prompt_tokens)
    return [
        encode_chat(models.tokenizer, [{"role": "user", "content": bytes(p).decode()}])
        for p in source_prompts(n, args.prompt_tokens)
    ]


def synthetic_models(args) -> DecodingModels:
    """Random weights at `args.synthetic`'s shapes: a muted target, a known-acceptance drafter."""
    target_cfg, drafter_cfg = pair_configs(args.synthetic, args.dtype)
    acceptance = list(args.acceptance)
    target, drafter = random_pair(
        target_cfg,
        drafter_cfg,
        args.dtype,
        make_drafter=functools.partial(
            KnownAcceptanceDrafter, acceptance=acceptance, concentration=args.concentration
        ),
    )
    mute_target(target)
    return DecodingModels(
        target=target,
        model_dir=Path(f"<random {args.synthetic}>"),
        drafter=drafter,
        drafter_path=None,
        drafter_fingerprint=None,
        tokenizer=None,  # prompts are token ids
        stop_tokens=(),
    )


def _fmt(value, spec: str) -> str:
    """`value` formatted, "-" where it is undefined (None: no decode step)."""
    return "-" if value is None else format(value, spec)


def _row(r: dict) -> str:
    verified = _fmt(r["verified"], ".2f")
    built = ""
    if "programs" in r:  # rows of earlier runs may lack it
        built = f"  (warm-up: {r['programs']} programs, {r['compile_s']:.0f} s)"
    return (
        f"c={r['concurrency']:>3} {r['mode']:<20} {r['throughput']:8.1f} tok/s "
        f"{_fmt(r['per_user'], '7.1f'):>7} tok/s/user  TTFT p50 {r['ttft_ms'][0]:7.1f} ms  "
        f"ITL p50 {_fmt(r['itl_ms'][0], '6.2f'):>6} ms  occupancy {r['occupancy']:.2f}  "
        f"tau {_fmt(r['tau'], '.2f')}  "
        f"verified {verified}  {r['setting']}" + built
    )


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| c | policy | throughput (tok/s) | per user (tok/s) | TTFT p50 / p99 (ms) | "
        "ITL p50 / p99 (ms) | occupancy | tau | verified / round | setting |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['mode']} | {r['throughput']:.0f} | "
            f"{_fmt(r['per_user'], '.1f')} | {r['ttft_ms'][0]:.0f} / {r['ttft_ms'][2]:.0f} | "
            f"{_fmt(r['itl_ms'][0], '.2f')} / {_fmt(r['itl_ms'][2], '.2f')} | "
            f"{r['occupancy']:.2f} | {_fmt(r['tau'], '.2f')} | {_fmt(r['verified'], '.2f')} | "
            f"{r['setting']} |"
        )
    return "\n".join(lines)


def _plottable(row: dict) -> bool:
    """Whether `row` has a point on the log-log plot: finite, positive speeds (a cell with no
    decode step has no per-user speed)."""
    x, y = finite_or_none(row.get("per_user")), finite_or_none(row.get("throughput"))
    return x is not None and y is not None and x > 0 and y > 0


def _plot(rows: list[dict], path: str, title: str) -> None:
    """Throughput against per-user speed, one line per policy, written atomically to `path`;
    cells without a per-user speed are left out (and said so in the title)."""
    from matplotlib.figure import Figure

    from dspark_jax.cli.paths import atomic_file

    fig = Figure(figsize=(6.5, 4.5))
    ax = fig.subplots()
    shown = [r for r in rows if _plottable(r)]
    if len(shown) < len(rows):
        title += f"\n({len(rows) - len(shown)} of {len(rows)} cells without a per-user speed)"
    for mode in dict.fromkeys(r["mode"] for r in shown):
        pts = [r for r in shown if r["mode"] == mode]
        xs, ys = [r["per_user"] for r in pts], [r["throughput"] for r in pts]
        ax.plot(xs, ys, marker="o", label=mode)
        for r in pts:
            ax.annotate(str(r["concurrency"]), (r["per_user"], r["throughput"]), fontsize=7)
    if shown:  # log axes need a positive point; with none the plot is an empty frame
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("per-user speed (tokens/s, median over requests)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    if shown:
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=110)


if __name__ == "__main__":
    run_main(main)
