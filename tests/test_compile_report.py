"""`pytest --compile-report` (tests/compile_report.py) sees the compiles a test makes."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_the_report_counts_a_tests_compiles(tmp_path):
    report = tmp_path / "reports" / "run.jsonl"
    report.parent.mkdir()
    other = report.with_name("run.jsonl.gw0")  # a file of the old layout: not this run's
    other.write_text("another run\n")
    one = "tests/test_sampling.py::test_sample_tokens_matches_filtered_distribution"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2", one]
    # This run's persistent cache may hold the sampler already (a hit compiles nothing).
    # Nor may this run's own options (PYTEST_ADDOPTS: a --compile-report of its own) or xdist
    # worker variables reach it.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_COMPILATION_CACHE_DIR", "PYTEST_ADDOPTS")
        and not k.startswith("PYTEST_XDIST")
    }
    env["DSPARK_JAX_COMPILATION_CACHE"] = "off"
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
    # It jits the sampler: XLA compiled, in less time than the test took (one compile thread).
    assert 0 < row["compile_s"] < row["wall_s"] and row["lower_s"] > 0
    # The workers' parts were joined and their folder removed; nothing else was touched.
    assert sorted(p.name for p in report.parent.iterdir()) == ["run.jsonl", "run.jsonl.gw0"]
    assert other.read_text() == "another run\n"
    assert "1 tests," in done.stdout and "tests/test_sampling.py" in done.stdout
