"""`pytest --compile-report` (tests/compile_report.py) sees the compiles a test makes."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def _run(report, cache, *options):
    """Run one sampling test under `--compile-report report`, with its own persistent cache
    (`cache`, keeping every program however small): not this run's cache, options (a
    --compile-report of its own in PYTEST_ADDOPTS) or xdist worker variables."""
    one = "tests/test_sampling.py::test_sample_tokens_matches_filtered_distribution"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_COMPILATION_CACHE_DIR", "PYTEST_ADDOPTS")
        and not k.startswith("PYTEST_XDIST")
    }
    env["DSPARK_JAX_COMPILATION_CACHE"] = str(cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *options, one]
    done = subprocess.run(
        [*argv, "--compile-report", str(report)],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = [json.loads(line) for line in report.read_text().splitlines()]
    assert row["test"] == one
    return row, done.stdout


def test_the_report_counts_a_tests_compiles_and_names_them(tmp_path):
    report = tmp_path / "reports" / "run.jsonl"
    report.parent.mkdir()
    other = report.with_name("run.jsonl.gw0")  # a file of the old layout: not this run's
    other.write_text("another run\n")
    cache = tmp_path / "cache"
    row, out = _run(report, cache, "-n", "2")
    # It jits the sampler: XLA compiled, in less time than the test took (one compile thread),
    # each program after a miss of the new cache (a program the test jits twice is a hit the
    # second time, loaded in a moment), and the report names every one it compiled.
    assert 0 < row["compile_s"] < row["wall_s"] and row["lower_s"] > 0
    assert row["cache_misses"] == len(row["compiled"]) > row["cache_hits"]
    compiling = sum(s for _, s in row["compiled"])
    assert 0.9 * row["compile_s"] <= compiling <= row["compile_s"] + 0.01
    # (The sampler runs op by op: its programs are JAX's own, each named for what it jits.)
    names = {name for name, _ in row["compiled"]}
    assert all(name.startswith("jit(") and len(name) > 5 for name in names), names
    # The workers' parts were joined and their folder removed; nothing else was touched.
    assert sorted(p.name for p in report.parent.iterdir()) == ["run.jsonl", "run.jsonl.gw0"]
    assert other.read_text() == "another run\n"
    assert "1 tests," in out and "tests/test_sampling.py" in out
    costliest = max(row["compiled"], key=lambda c: c[1])[0]
    assert "program (the 10 costliest)" in out and f"  {costliest}\n" in out

    # Again on the same cache: every program is loaded, none compiled, and none is listed.
    again, out = _run(report, cache, "-n", "0")
    assert again["cache_misses"] == 0
    assert again["cache_hits"] == row["cache_hits"] + row["cache_misses"]
    assert again["compiled"] == [] and "costliest" not in out
