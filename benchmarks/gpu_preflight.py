"""Before a GPU session spends its minutes: does the engine decode on this machine as configured?

The engine's GPU defaults have never run on the hardware before a first session: the Triton
attention kernels, and loops and conditionals recorded into CUDA graphs (`layers.graph_loops`).
Should either fail there (a crash aborts the process, a hang never returns), every test and
benchmark after it would fail the same way, and the session would show nothing else. So this
decodes a few chunks on the embedded pair in a child process -- greedy rows and top-p rows
(whose cutoff search is a loop inside the round), two calls, so each compiled program runs more
than once (whether the greedy rows repeat is reported, not required) -- first with the settings
as given, then, only if that fails, with the documented fallbacks one at a time
(DSPARK_JAX_GRAPH_LOOPS=0, DSPARK_JAX_ATTENTION=jax, both). It checks that a setting runs, not
that its tokens are right: the engine's tests judge that. The first setting that decodes is
written to --env as `export` lines for the session to source; the status is 0 when the settings
as given decode, 1 when only a fallback did (the session goes on with it, and the failure is the
finding), and 1 when none did.

    python benchmarks/gpu_preflight.py --env preflight.env --json preflight.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from provenance import Parser, git_commit, output_file, positive_float, run_main, write_json

from dspark_jax.cli.paths import atomic_file

GRAPH_LOOPS = "DSPARK_JAX_GRAPH_LOOPS"
ATTENTION = "DSPARK_JAX_ATTENTION"
# Tried in this order after the settings as given: the loops first (the newer path), then the
# kernels, then neither.
FALLBACKS = ({GRAPH_LOOPS: "0"}, {ATTENTION: "jax"}, {GRAPH_LOOPS: "0", ATTENTION: "jax"})


def decode_once() -> dict:
    """The child's work: the speculative engine of the embedded pair, 2 slots, four requests
    (two greedy, two at temperature 0.7 with top-p 0.9) decoded twice. Returns what it saw."""
    import jax

    from dspark_jax import EngineConfig, Request, SamplingConfig, generate, load_decoding_models
    from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET

    models = load_decoding_models(EMBEDDED_TARGET, EMBEDDED_DRAFT, progress=False)
    engine = models.engine(EngineConfig(num_slots=2, max_model_len=192))
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32], [38, 46, 26, 43, 38, 32], [79, 50, 28]]
    settings = [SamplingConfig(), SamplingConfig(temperature=0.7, top_p=0.9)]
    requests = [
        Request(p, max_new_tokens=24, seed=i, sampling=settings[i % 2], ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    runs = [generate(engine, requests)[0] for _ in range(2)]
    for results in runs:
        for r in results:
            if len(r.tokens) != 24:
                raise RuntimeError(f"a request ended after {len(r.tokens)} of 24 tokens")
    # Whether the greedy rows came out the same both times is reported, not required: this
    # checks that the settings run, and a difference (which the engine's tests would then
    # show) is no reason to measure a fallback instead.
    return {
        "device": jax.devices()[0].device_kind,
        "greedy_tokens": runs[0][0].tokens,
        "greedy_repeated": all(runs[0][i].tokens == runs[1][i].tokens for i in (0, 2)),
        "tau": [round(r.tau, 3) for r in runs[0]],
    }


def _child() -> None:
    print("PREFLIGHT " + json.dumps(decode_once()))


def _try(extra: dict[str, str], timeout: float) -> dict:
    """One child run with `extra` set over this process's environment."""
    env = {**os.environ, **extra}
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        output = f"no answer after {timeout:.0f} s (a hang?)\n" + (
            (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        )
    seen = None
    for line in output.splitlines():
        if line.startswith("PREFLIGHT "):
            seen = json.loads(line[len("PREFLIGHT ") :])
    ok = rc == 0 and seen is not None
    return {
        "env": extra,
        "ok": ok,
        "returncode": rc,
        "seconds": round(time.perf_counter() - start, 1),
        "seen": seen,
        "error": None if ok else output.strip()[-3000:],
    }


def _name(extra: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in extra.items()) or "the settings as given"


def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", help="write the setting that decodes here (required)")
    parser.add_argument("--json", help="write every setting tried and what it did here")
    parser.add_argument(
        "--timeout", type=positive_float, default=240.0,
        help="seconds a setting may take before it counts as hung (default 240)",
    )  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child()
        return 0
    if not args.env:
        parser.error("--env is required")
    env_file = output_file(args.env, "--env")
    if args.json:
        output_file(args.json, "--json")
    given = {k: os.environ[k] for k in (GRAPH_LOOPS, ATTENTION) if os.environ.get(k)}
    # The fallbacks that differ from what is given (one the user already set is not a fallback).
    candidates = [{}] + [f for f in FALLBACKS if any(given.get(k) != v for k, v in f.items())]
    tried, chosen = [], None
    for extra in candidates:
        result = _try(extra, args.timeout)
        tried.append(result)
        print(f"{_name(extra)}: {'decodes' if result['ok'] else 'FAILED'} ({result['seconds']} s)")
        if result["ok"]:
            chosen = extra
            print(f"  {result['seen']}")
            break
        print("  " + "\n  ".join(result["error"].splitlines()[-15:]))
    lines = [f"export {k}={v}" for k, v in (chosen or {}).items()]
    with atomic_file(env_file) as tmp:
        tmp.write_text("".join(line + "\n" for line in lines))
    if chosen is None:
        print("no setting decodes here: the session goes on as given, and its tests will show why")
    elif chosen:
        print(f"the session goes on with {_name(chosen)} ({env_file})")
    if args.json:
        write_json(args.json, {"commit": git_commit(), "given": given, "chosen": chosen,
                               "tried": tried})  # fmt: skip
    return 0 if chosen == {} else 1


if __name__ == "__main__":
    run_main(main)
