"""The benchmarks' shared pieces: provenance (commit, compile cost) and throughput's --combine,
which joins concurrency levels measured in separate GPU calls for gpu_targets.py to judge."""

import datetime
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from contextlib import chdir, redirect_stderr, redirect_stdout
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import deviceless  # noqa: E402
import gpu_targets  # noqa: E402
import provenance  # noqa: E402
import throughput  # noqa: E402


def test_compile_clock_counts_programs_built_inside_it():
    def fresh(x):  # a function no other test compiled
        return jnp.cos(x) * 3.25 + 1.0

    f = jax.jit(fresh)
    x = jnp.ones((7, 5))
    with provenance.CompileClock() as clock:
        f(x).block_until_ready()
    assert clock.programs == 1
    assert clock.compile_s > 0 and clock.wall_s >= clock.compile_s
    with provenance.CompileClock() as again:
        f(x).block_until_ready()  # jit's cache: nothing built
    assert again.programs == 0
    f(x + 1).block_until_ready()  # outside any clock: not counted anywhere
    assert clock.programs == 1


def test_git_commit_without_git_names_the_commit_it_was_given(monkeypatch):
    def no_git(*args, **kwargs):
        raise subprocess.CalledProcessError(128, "git", stderr="not a git repository")

    monkeypatch.setattr(provenance.subprocess, "run", no_git)
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    assert provenance.git_commit() == "unknown"
    monkeypatch.setenv(provenance.COMMIT_ENV, "abc1234")
    assert provenance.git_commit() == "abc1234"


def test_measured_names_when_at_which_commit_and_on_what(monkeypatch):
    monkeypatch.setattr(provenance, "git_commit", lambda: "abc1234")
    record = provenance.measured()
    assert list(record) == ["date", "commit", "device"]
    assert datetime.datetime.fromisoformat(record["date"]).utcoffset() == datetime.timedelta(0)
    assert record["commit"] == "abc1234"
    assert record["device"] == jax.devices()[0].device_kind
    assert provenance.measured(day=True)["date"] == datetime.date.today().isoformat()


def _part(folder: Path, name: str, level: int, commit: str, throughputs: dict) -> str:
    report = {
        "date": f"2026-11-24T1{level % 10}:00:00+00:00",
        "commit": commit,
        "device": "gpu: NVIDIA H100 80GB HBM3",
        "target": "synthetic qwen3-4b (bfloat16)",
        "draft": "known acceptance 0.9 (c=4.0)",
        "temperature": 1.0,
        "sts": None,
        "rows": [
            {"concurrency": level, "mode": mode, "throughput": t, "per_user": t / level,
             "ttft_ms": [1.0, 2.0, 3.0], "itl_ms": [1.0, 2.0, 3.0], "occupancy": 0.9,
             "tau": 4.0, "verified": 6.0, "setting": ""}
            for mode, t in throughputs.items()
        ],  # fmt: skip
        # Every threshold tried at the level (the rows keep the best).
        "thresholds": [{"concurrency": level, "throughput": throughputs["best threshold"]}]
        if "best threshold" in throughputs
        else [],
    }
    path = folder / name
    path.write_text(json.dumps(report))
    return str(path)


def test_combine_joins_levels_that_gpu_targets_then_judges(tmp_path):
    others = {"no speculation": 1000.0, "fixed gamma": 1500.0, "best threshold": 1600.0}
    c64 = _part(tmp_path, "c64.json", 64, "abc1234",
                {**others, "scheduler (Alg. 1)": 1900.0, "scheduler (5.2)": 1800.0})  # fmt: skip
    c1 = _part(tmp_path, "c1.json", 1, "def5678", {"no speculation": 90.0, "fixed gamma": 200.0})
    out = tmp_path / "joined" / "throughput.json"  # a folder that does not exist yet
    throughput.combine([c64, c1], str(out), plot="")
    joined = json.loads(out.read_text())
    assert [(r["concurrency"], r["mode"]) for r in joined["rows"]][:2] == [
        (1, "no speculation"),
        (1, "fixed gamma"),
    ]
    assert len(joined["rows"]) == 7
    # What the runs share is kept as one run has it; what differs is listed.
    assert joined["device"] == "gpu: NVIDIA H100 80GB HBM3"
    assert joined["temperature"] == 1.0 and joined["sts"] is None
    assert joined["commit"] == "abc1234, def5678"
    assert [p["levels"] for p in joined["parts"]] == [[64], [1]]
    assert joined["thresholds"] == [{"concurrency": 64, "throughput": 1600.0}]
    row = gpu_targets.scheduler_target(joined)
    assert row["met"] is True
    assert row["value"] == pytest.approx(1900.0 / 1600.0)
    assert "NVIDIA H100" in row["detail"]


def test_combine_refuses_a_cell_measured_twice(tmp_path):
    a = _part(tmp_path, "a.json", 8, "abc1234", {"fixed gamma": 10.0})
    b = _part(tmp_path, "b.json", 8, "abc1234", {"fixed gamma": 11.0})
    with pytest.raises(SystemExit, match="more than one file"):
        throughput.combine([a, b], str(tmp_path / "out.json"), plot="")


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"


def _session(tmp_path, **env):
    run_env = {**os.environ, "SIZE": "tiny", "JAX_PLATFORMS": "cpu",
               "RESULTS": str(tmp_path / "results"), **env}  # fmt: skip
    run_env.pop("OUT", None)
    # The script's python3 is the one running these tests (a venv's, activated or not).
    run_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{run_env.get('PATH', '')}"
    return subprocess.run(
        ["bash", str(SCRIPT)], env=run_env, capture_output=True, text=True, timeout=300
    )


def test_gpu_session_refuses_a_stage_it_does_not_have(tmp_path):
    done = _session(tmp_path, STAGES="tests bandwith")
    assert done.returncode == 2
    assert "no stage named bandwith" in done.stdout and "throughput_c8" in done.stdout


# What train_throughput.py writes on a CPU at its tiny defaults (fields gpu_targets reads).
_CPU_TRAINING = {
    "device": "1 x cpu", "target": "tiny-vanilla-target", "drafter": "tiny-vanilla-dspark",
    "dtype": "float32", "seq_len": 256, "anchors": 32, "achieved_tflops": 0.01,
    "step_s_median": 0.1, "mfu": None, "drafter_mfu": None, "model_flops_version": 2,
    "mfu_note": "no MFU on CPU (no dense bf16 peak to divide by)",
}  # fmt: skip


def test_gpu_session_runs_named_stages_and_ends_with_their_summary(tmp_path):
    """Only the stages named run (here the aims' judge, on a results folder holding one earlier
    stage's result: an empty one is an error), the commit comes from DSPARK_JAX_COMMIT where git
    cannot say, and with DEADLINE passed no stage starts: each is listed as not started and the
    run fails."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "train_throughput.json").write_text(json.dumps(_CPU_TRAINING))
    done = _session(tmp_path, STAGES="targets", GIT_DIR=str(tmp_path / "no-git"),
                    DSPARK_JAX_COMMIT="abc1234")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "commit abc1234, stages: targets" in done.stdout
    assert "=== targets:" in done.stdout and "=== bandwidth" not in done.stdout
    assert (tmp_path / "results" / "targets.json").exists()
    summary = done.stdout[done.stdout.index("== stages"):]
    assert "targets" in summary and "ok" in summary and "all stages passed" in summary

    late = _session(tmp_path, STAGES="bandwidth targets", DEADLINE="0")
    assert late.returncode == 1
    summary = late.stdout[late.stdout.index("== stages"):]
    assert summary.count("not started") == 2
    assert "FAILED stages: bandwidth targets" in summary


def test_gpu_session_compiles_the_aims_serving_level_beside_the_first_tests(tmp_path):
    """With tests_core and the aim's serving-load level named, that level's programs compile in
    the background while the tests run (`throughput.py --compile-only`, logged apart), and the
    session waits for it no longer than PRECOMPILE_S or its DEADLINE before the next stage:
    here both are seconds, so it is stopped, said so in the summary, and nothing after starts."""
    done = _session(tmp_path, STAGES="tests_core throughput_c8", TESTS_CORE_S="2",
                    PRECOMPILE_S="5", DEADLINE="9")  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    started = [line for line in done.stdout.splitlines() if "precompile (background)" in line]
    assert len(started) == 1, started  # decode_speed not named: only the serving level's
    assert "benchmarks/throughput.py --synthetic tiny" in started[0]
    assert "--concurrency 8" in started[0] and started[0].endswith("--compile-only")
    assert (tmp_path / "results" / "precompile_throughput.log").exists()
    summary = done.stdout[done.stdout.index("== stages"):]
    assert re.search(r"precompile +\d+ s  stopped at \d+ s \(its stage compiles the rest\)",
                     summary), summary  # fmt: skip
    assert re.search(r"throughput_c8 +- +not started", summary), summary


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


# A child that decodes only with the loops out of CUDA graphs, and fails as the engine does on
# an unreadable setting otherwise.
STAND_IN_CHILD = """
import json, os, sys
if os.environ.get("DSPARK_JAX_GRAPH_LOOPS") != "0":
    sys.exit("UserError: DSPARK_JAX_GRAPH_LOOPS='yes': expected 0 (off) or 1 (on)")
print("PREFLIGHT " + json.dumps({"greedy_tokens": [7] * 24}))
"""


def test_preflight_falls_back_to_the_first_setting_that_decodes(tmp_path, monkeypatch, capsys):
    """gpu_preflight.py runs a child process per setting: the settings as given, then the
    fallbacks in order until one decodes. Here the child is a stand-in that decodes only with
    DSPARK_JAX_GRAPH_LOOPS=0 (the real child, the embedded pair decoding, is the slow test
    below): the settings as given fail, the first fallback decodes, so it is what the session
    is told to export, the status is 1, and the JSON keeps the failing setting's error."""
    import gpu_preflight

    child = tmp_path / "child.py"
    child.write_text(STAND_IN_CHILD)
    monkeypatch.setattr(gpu_preflight, "__file__", str(child))
    monkeypatch.setenv("DSPARK_JAX_GRAPH_LOOPS", "yes")
    monkeypatch.delenv("DSPARK_JAX_ATTENTION", raising=False)
    env_file, report = tmp_path / "preflight.env", tmp_path / "preflight.json"
    monkeypatch.setattr(
        sys, "argv", ["gpu_preflight.py", "--env", str(env_file), "--json", str(report)]
    )
    assert gpu_preflight.main() == 1
    assert env_file.read_text() == "export DSPARK_JAX_GRAPH_LOOPS=0\n"
    result = json.loads(report.read_text())
    assert result["given"] == {"DSPARK_JAX_GRAPH_LOOPS": "yes"}
    assert result["chosen"] == {"DSPARK_JAX_GRAPH_LOOPS": "0"}
    tried = result["tried"]
    assert [(t["env"], t["ok"], t["returncode"]) for t in tried] == [
        ({}, False, 1),
        ({"DSPARK_JAX_GRAPH_LOOPS": "0"}, True, 0),
    ]
    assert "DSPARK_JAX_GRAPH_LOOPS='yes'" in tried[0]["error"] and tried[0]["seen"] is None
    assert tried[1]["seen"] == {"greedy_tokens": [7] * 24} and tried[1]["error"] is None
    out = capsys.readouterr().out
    assert "the settings as given: FAILED" in out
    assert "the session goes on with DSPARK_JAX_GRAPH_LOOPS=0" in out


@pytest.mark.slow
def test_preflight_decodes_the_embedded_pair_under_the_first_fallback(tmp_path):
    """The same run with the real child: the embedded pair decodes under the fallback. About
    30 s alone, 90 s beside another test worker on two cores."""
    env_file, report = tmp_path / "preflight.env", tmp_path / "preflight.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_preflight.py"), "--env", str(env_file),
         "--json", str(report)],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "DSPARK_JAX_GRAPH_LOOPS": "yes"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert env_file.read_text() == "export DSPARK_JAX_GRAPH_LOOPS=0\n"
    tried = json.loads(report.read_text())["tried"]
    assert [t["ok"] for t in tried] == [False, True]
    assert "DSPARK_JAX_GRAPH_LOOPS='yes'" in tried[0]["error"]
    assert len(tried[1]["seen"]["greedy_tokens"]) == 24
    assert "the session goes on with DSPARK_JAX_GRAPH_LOOPS=0" in done.stdout


def test_preflight_counts_a_setting_that_does_not_answer_as_failed(tmp_path):
    """A child that has not decoded within --timeout (a hang on a GPU; here a second is too
    short to load the models) is killed and counts as failed, its output so far kept; when no
    setting answers, nothing is exported and the session goes on as given."""
    env_file, report = tmp_path / "preflight.env", tmp_path / "preflight.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_preflight.py"), "--timeout", "1",
         "--env", str(env_file), "--json", str(report)],
        env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert env_file.read_text() == ""
    result = json.loads(report.read_text())
    assert result["chosen"] is None and len(result["tried"]) == 4
    assert all(t["returncode"] is None and t["error"].startswith("no answer after 1 s")
               for t in result["tried"])  # fmt: skip
    assert "no setting decodes here" in done.stdout


def _script(
    name: str, *args: str, cwd=None, timeout: int = 120, env=None
) -> subprocess.CompletedProcess:
    """A benchmark script run with bad arguments: it must fail fast, in one line. `env`: more
    environment variables."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _here(name: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    """The script's `main` run in this process as `python NAME ARGS` runs it (sys.argv, the
    status and the one-line errors of `provenance.run_main`), for input refused or answered
    (--help) before any work: each child process costs seconds of imports. Refusing means
    before anything is built or set, so the run must compile nothing and leave the environment
    and JAX's compilation cache as it found them. A traceback in the child is an exception
    here, which fails the test."""
    module = importlib.import_module(Path(name).stem)  # benchmarks/ is on sys.path (above)
    environ, cache = dict(os.environ), jax.config.jax_compilation_cache_dir
    argv = sys.argv
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [str(BENCHMARKS / name), *args]
    try:
        with chdir(cwd or "."), redirect_stdout(out), redirect_stderr(err):
            with provenance.CompileClock() as clock, pytest.raises(SystemExit) as end:
                provenance.run_main(module.main)
    finally:
        sys.argv = argv
    assert clock.programs == 0, f"{name} {args}: compiled {clock.programs} programs first"
    assert dict(os.environ) == environ and jax.config.jax_compilation_cache_dir == cache
    status = end.value.code
    status = 0 if status is None else status if isinstance(status, int) else 1
    return subprocess.CompletedProcess([name, *args], status, out.getvalue(), err.getvalue())


def _one_line_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def _undefined_cell(concurrency: int, mode: str) -> dict:
    """A cell of a run whose requests all ended at their first token (--lengths 1)."""
    return {"concurrency": concurrency, "mode": mode, "throughput": 500.0, "per_user": None,
            "ttft_ms": [1.0, 2.0, 3.0], "itl_ms": [None, None, None], "occupancy": 1.0,
            "tau": None, "verified": None, "setting": ""}  # fmt: skip


def test_cells_without_decode_steps_are_null_in_strict_json_and_left_out_of_the_plot(tmp_path):
    assert throughput._weighted_percentiles([], [50, 90, 99]) == [None, None, None]
    rows = [_undefined_cell(1, "no speculation"), _undefined_cell(1, "fixed gamma")]
    table = throughput.markdown_table(rows)
    assert "nan" not in table.lower() and "| - / - |" in table
    assert "nan" not in throughput._row(rows[0]).lower()
    plot = tmp_path / "plot.png"
    throughput._plot(rows, str(plot), "no decode steps")  # was: log-scale ValueError, no PNG
    assert plot.stat().st_size > 0
    mixed = [*rows, {**_undefined_cell(8, "fixed gamma"), "per_user": 40.0}]
    throughput._plot(mixed, str(plot), "one point")
    provenance.write_json(tmp_path / "ok.json", {"rows": rows})
    with pytest.raises(ValueError):  # a NaN left in a report is a bug, and nothing is written
        provenance.write_json(tmp_path / "bad.json", {"tau": float("nan")})
    assert not (tmp_path / "bad.json").exists()


def test_combine_reads_the_nan_of_earlier_files_as_null(tmp_path):
    old = Path(_part(tmp_path, "old.json", 1, "abc1234", {"fixed gamma": 10.0}))
    old.write_text(old.read_text().replace('"tau": 4.0', '"tau": NaN'))  # as written before
    out = tmp_path / "joined.json"
    throughput.combine([str(old)], str(out), plot=str(tmp_path / "joined.png"))
    text = out.read_text()
    joined = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert joined["rows"][0]["tau"] is None
    assert (tmp_path / "joined.png").exists()


def test_combine_refuses_files_that_are_not_throughput_reports(tmp_path):
    other = tmp_path / "bandwidth.json"
    other.write_text(json.dumps({"device": "cpu", "gbs": 10.0}))
    with pytest.raises(throughput.UserError, match="not a throughput.py --out file"):
        throughput.combine([str(other)], str(tmp_path / "out.json"), plot="")
    with pytest.raises(throughput.UserError, match="no such file"):
        throughput.combine([str(tmp_path / "none.json")], str(tmp_path / "out.json"), plot="")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--requests-per-client", "0"], "--requests-per-client"),
        (["--concurrency", "1,x"], "--concurrency"),
        (["--concurrency", "0"], "--concurrency"),
        (["--thresholds", "threshold=abc"], "threshold=abc"),
        (["--prefill-buckets", "64"], "prefill chunk, 256"),
        (["--synthetic", "tiny", "--target", "x"], "--target"),
        (["--compile-only", "--separate-engines"], "drop --separate-engines"),
        (["--compile-only", "--combine", "a.json"], "drop --combine"),
    ],
)
def test_throughput_refuses_bad_arguments_before_loading_anything(args, needle):
    done = _here("throughput.py", *args)
    _one_line_error(done, needle)


def test_throughput_compile_only_needs_the_compilation_cache(tmp_path):
    done = _script("throughput.py", "--compile-only", "--out", str(tmp_path / "t.json"),
                   env={"DSPARK_JAX_COMPILATION_CACHE": "off", "JAX_COMPILATION_CACHE_DIR": ""},
                   timeout=60)  # fmt: skip
    _one_line_error(done, "--compile-only fills the persistent compilation cache, which is off")


def test_decode_speed_compile_only_needs_the_compilation_cache():
    done = _script("decode_speed.py", "--config", "tiny", "--compile-only",
                   env={"DSPARK_JAX_COMPILATION_CACHE": "off", "JAX_COMPILATION_CACHE_DIR": ""},
                   timeout=60)  # fmt: skip
    _one_line_error(done, "--compile-only fills the persistent compilation cache, which is off")


# The persistent cache's entries of the random weights' fill (decode_speed._random_normalish).
WEIGHT_FILL = "jit__random_normalish-"


def test_decode_speed_compile_only_leaves_the_run_nothing_to_compile(tmp_path):
    """decode_speed.py --compile-only (run beside the GPU session's first tests) builds every
    engine's programs into the persistent cache and writes no table; the run with the same
    config, batch sizes, context and rounds then adds nothing there. About 20 s.

    Both runs fill the random weights with the same small program (`_random_normalish`, one per
    shape), which compiles in about a second: JAX keeps only programs that took at least 1 s,
    so one run or the other may keep it (a busier machine, a slower compile), and it is not
    what --compile-only is for. Everything else the run added would be a miss."""
    cache = tmp_path / "cache"
    env = {"DSPARK_JAX_COMPILATION_CACHE": str(cache), "JAX_COMPILATION_CACHE_DIR": str(cache)}
    args = ["--config", "tiny", "--dtype", "float32", "--batch-sizes", "1", "--rounds", "2",
            "--repeats", "1", "--json", str(tmp_path / "d.json")]  # fmt: skip
    done = _script("decode_speed.py", *args, "--compile-only", env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compiled" in done.stdout and not (tmp_path / "d.json").exists()
    ahead = {p.name for p in cache.iterdir()}
    assert len(ahead) >= 2, ahead  # at least the plain and the speculative decode programs
    done = _script("decode_speed.py", *args, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((tmp_path / "d.json").read_text())["rows"]
    added = {p.name for p in cache.iterdir()} - ahead
    assert not {name for name in added if not name.startswith(WEIGHT_FILL)}, added


@pytest.mark.slow
def test_throughput_compile_only_leaves_the_run_nothing_to_compile(tmp_path):
    """--compile-only (what gpu_session.sh runs beside the first tests) builds every program a
    level compiles before timing into the persistent cache; the run with the same arguments
    then adds nothing there but its switch engine's init program, the one that writes the
    measured SPS table into the state (and maybe the random weights' fill, kept by whichever
    run took a second or more to compile it: see the decode_speed test above). About four
    minutes on two cores (3.8 alone, 2026-12-02)."""
    cache = tmp_path / "cache"
    # JAX's own setting (which the test session sets for its processes) wins over ours.
    env = {"DSPARK_JAX_COMPILATION_CACHE": str(cache), "JAX_COMPILATION_CACHE_DIR": str(cache)}
    args = ["--synthetic", "tiny", "--dtype", "float32", "--concurrency", "2",
            "--thresholds", "threshold=0.5", "--requests-per-client", "1", "--plot", "",
            "--out", str(tmp_path / "t.json")]  # fmt: skip
    done = _script("throughput.py", *args, "--compile-only", env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "c=  2 compiled" in done.stdout and not (tmp_path / "t.json").exists()
    ahead = {p.name for p in cache.iterdir()}
    assert len(ahead) >= 3, ahead  # the profiled round, the decode and prefill programs
    done = _script("throughput.py", *args, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((tmp_path / "t.json").read_text())["rows"]
    added = {p.name for p in cache.iterdir()} - ahead
    assert len({name for name in added if not name.startswith(WEIGHT_FILL)}) <= 1, added


def test_throughput_checks_its_input_paths_before_loading_models(tmp_path):
    missing = str(tmp_path / "missing")
    for option in ("--sts", "--sps-table", "--prompts", "--target", "--combine"):
        done = _here("throughput.py", option, missing, cwd=tmp_path)
        _one_line_error(done, option, "no such")
    # --synthetic reads no model files: nothing of --target/--draft is checked.
    throughput.check_paths(throughput.parse_args(
        ["--synthetic", "tiny", "--out", str(tmp_path / "o.json"), "--plot", ""]
    ))  # fmt: skip
    # A plot matplotlib cannot write, or one over the results, is refused before any work (it
    # failed after the whole run, its JSON already written).
    done = _here("throughput.py", "--synthetic", "tiny", "--plot", "t.txt", cwd=tmp_path)
    _one_line_error(done, "--plot", ".png")
    done = _here(
        "throughput.py", "--synthetic", "tiny", "--out", "t.png", "--plot", "t.png", cwd=tmp_path
    )
    _one_line_error(done, "--plot", "would replace the results")
    table = tmp_path / "sps"
    table.mkdir()
    done = _here("throughput.py", "--sps-table", str(table), "--concurrency", "1,8")
    _one_line_error(done, "sps_c1.json, sps_c8.json")
    assert "must be at least 256" in " ".join(_here("throughput.py", "--help").stdout.split())


def test_sampling_filters_times_every_mix_against_temperature_sampling(tmp_path):
    out = tmp_path / "sampling.json"
    done = _script("sampling_filters.py", "--rows", "4", "--vocab", "512", "--repeats", "2",
                   "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    mixes = [r["mix"] for r in result["table"]]
    # Four rows: each filter by one row and by every row (the 8- and 64-row mixes need more).
    assert mixes == ["greedy", "temperature 1", "top-p 0.9, 1 row", "top-p 0.9, every row",
                     "top-k 50, 1 row", "top-k 50, every row", "top-k 50 + top-p 0.9, 1 row",
                     "top-k 50 + top-p 0.9, every row"]
    assert next(r for r in result["table"] if r["mix"] == "temperature 1")["ratio"] == 1.0
    assert all(r["ms"] > 0 for r in result["table"]) and result["sort_ms"] > 0
    assert "top-p 0.9, 1 row" in done.stdout and "(a sort of the same logits)" in done.stdout
    _one_line_error(_here("sampling_filters.py", "--rows", "0"), "--rows")


def test_library_errors_and_bad_numbers_are_one_line_errors(tmp_path):
    """Bad input the library or argparse refuses ends in `error: ...`, status 2, no traceback
    (and for bandwidth.py before measuring: a --json that cannot be written is found first)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    _one_line_error(_here("idle_slots.py", "--slots", "1"), "--slots must be at least 2")
    _one_line_error(_here("bandwidth.py", "--gib", "-1"), "--gib")
    _one_line_error(_here("bandwidth.py", "--repeats", "0"), "--repeats")
    done = _here("bandwidth.py", "--gib", "0.001", "--json", str(a_file / "x.json"))
    _one_line_error(done, "is a file, not a folder")
    assert "GB/s" not in done.stdout  # refused before the copy was timed
    done = _here("decode_speed.py", "--config", "tiny", "--bandwidth-json", str(tmp_path / "x"))
    _one_line_error(done, "--bandwidth-json", "no such file")
    _one_line_error(_here("train_throughput.py", "--target", "nope"), "unknown config 'nope'")
    _one_line_error(_here("train_throughput.py", "--chunk", "3"), "must divide")
    _one_line_error(_here("xla_profile.py", str(tmp_path / "none")), "no such folder")
    trace = tmp_path / "trace" / "plugins" / "profile" / "1"
    trace.mkdir(parents=True)
    (trace / "perfetto_trace.json.gz").write_bytes(b"not gzip")
    _one_line_error(_here("xla_profile.py", str(tmp_path / "trace")), "cannot read its trace")
    done = _here("xla_profile.py", str(tmp_path / "trace"), "--hlo", str(tmp_path / "none"))
    _one_line_error(done, "--hlo", "no such file")
    _one_line_error(_here("xla_profile.py", str(tmp_path), "--top", "-1"), "--top")
    assert "captures nothing" in _here("xla_profile.py", "--help").stdout


@pytest.mark.parametrize(
    ("script", "args", "needle"),
    [
        ("decode_speed.py", ["--context", "0"], "--context"),  # was: silently the default
        ("decode_speed.py", ["--context", "-5"], "--context"),
        ("decode_speed.py", ["--temperature", "-1"], "--temperature"),
        ("decode_speed.py", ["--profile", "p", "--batch-sizes", "1", "8", "--profile-batch", "1,4"],
         "--profile-batch 4: not among --batch-sizes"),
        ("cost_model.py", ["--repeats", "0"], "--repeats"),
        ("cost_model.py", ["--max-lens", "32"], "--max-lens 32"),
        ("attention_paths.py", ["--repeats", "0"], "--repeats"),
        ("attention_paths.py", ["--kv-lens", "1024", "--capacity", "256"], "--capacity 256"),
        ("attention_paths.py", ["--capacity", "100"], "multiple of --page-size"),
        ("attention_paths.py", ["--kv-lens", "64,abc"], "--kv-lens"),
        ("attention_paths.py", ["--dtype", "float17"], "float17"),
        ("attention_paths.py", ["--impls", "nope"], "--impls nope"),
    ],
)
def test_nonsense_sizes_are_refused_before_anything_is_built(script, args, needle):
    _one_line_error(_here(script, *args), needle)


def test_attention_kernel_paths_are_refused_off_their_backend():
    import attention_paths

    other = "pallas_tpu" if jax.default_backend() == "gpu" else "pallas_gpu"
    with pytest.raises(attention_paths.UserError, match=f"--impls {other}: runs on"):
        attention_paths.check_backend(["dense", other])
    attention_paths.check_backend(["dense", "jax"])


def test_gpu_targets_says_when_the_session_ran_on_a_fallback(tmp_path):
    """A preflight that had to fall back is stated under the aims' table (the numbers measure
    the fallback); one whose defaults decoded adds nothing, and a folder holding only the
    preflight's report is a session's folder."""
    failed = {"env": {}, "ok": False, "returncode": -6, "seconds": 9.0, "seen": None,
              "error": "Check failed"}  # fmt: skip
    fallback = {"env": {"DSPARK_JAX_GRAPH_LOOPS": "0"}, "ok": True, "returncode": 0,
                "seconds": 20.0, "seen": {}, "error": None}  # fmt: skip
    report = {"commit": "abc1234", "given": {}, "chosen": {"DSPARK_JAX_GRAPH_LOOPS": "0"},
              "tried": [failed, fallback]}  # fmt: skip
    (tmp_path / "preflight.json").write_text(json.dumps(report))
    note = gpu_targets.preflight_note(tmp_path)
    assert note.startswith("Measured with DSPARK_JAX_GRAPH_LOOPS=0: the settings as given")
    assert "as given (status -6)" in note
    done = _script("gpu_targets.py", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert note in done.stdout
    report.update(chosen=None, tried=[failed, {**fallback, "ok": False, "returncode": 1}])
    (tmp_path / "preflight.json").write_text(json.dumps(report))
    assert "No setting decoded" in gpu_targets.preflight_note(tmp_path)
    report.update(chosen={}, tried=[{**failed, "ok": True, "returncode": 0}])
    (tmp_path / "preflight.json").write_text(json.dumps(report))
    assert gpu_targets.preflight_note(tmp_path) is None


def test_gpu_targets_refuses_a_folder_that_is_not_a_session_results_folder(tmp_path):
    _one_line_error(_here("gpu_targets.py", str(tmp_path / "none")), "no such folder")
    a_file = tmp_path / "decode_speed.json"
    a_file.write_text("{}")
    _one_line_error(_here("gpu_targets.py", str(a_file)), "is a file, not a folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(_here("gpu_targets.py", str(empty)), "none of the JSON files")
    # A session whose aims' stages have not run yet is not an error: nothing is measured.
    (empty / "bandwidth.json").write_text(json.dumps({"device": "cpu", "gbs": 10.0}))
    rows = gpu_targets.targets(empty)
    assert [r["met"] for r in rows] == [None, None, None, None]


def test_gpu_targets_does_not_judge_results_at_other_shapes(tmp_path):
    """A tiny CPU run's ratios are shown, but not called met or not met at the aims' shapes."""
    decode = {"device": "cpu", "dtype": "float32", "context": 128, "gamma": 7, "config": "tiny",
              "rows": [{"batch": 1, "plain_ms": 1.0, "spec_ms": 3.0, "floor_ms": None,
                        "round_over_step": 3.0}]}  # fmt: skip
    (tmp_path / "decode_speed.json").write_text(json.dumps(decode))
    trained = {**_CPU_TRAINING, "mfu": 0.01}
    (tmp_path / "train_throughput.json").write_text(json.dumps(trained))
    rows = gpu_targets.targets(tmp_path)
    assert rows[1]["value"] == pytest.approx(3.0) and rows[1]["met"] is None
    assert "not at the aim's shapes" in rows[1]["detail"] and "config tiny" in rows[1]["detail"]
    assert rows[3]["met"] is None and "seq_len 256" in rows[3]["detail"]
    table = gpu_targets.markdown(rows)
    assert "not met" not in table and table.count("not judged") == 2
    # At the aims' shapes the same ratio is judged.
    (tmp_path / "decode_speed.json").write_text(json.dumps({**decode, "config": "qwen3-4b"}))
    assert gpu_targets.targets(tmp_path)[1]["met"] is False


def test_gpu_targets_says_what_the_bytes_alone_allow_a_round():
    """The round/step aim's detail names the ratio the bytes read fix (drafter weights and
    context on top of the target's) and how near the round runs to its own floor."""
    row = {"batch": 1, "plain_ms": 1.25, "spec_ms": 1.55, "floor_ms": 1.0,
           "round_over_step": 1.24, "target_step_bytes": 100, "spec_round_bytes": 124}  # fmt: skip
    decode = {"device": "H200", "dtype": "bfloat16", "context": 128, "gamma": 7,
              "config": "qwen3-4b", "rows": [row]}  # fmt: skip
    floor, round_row = gpu_targets.decode_targets(decode)
    assert floor["value"] == pytest.approx(0.8) and floor["met"] is True
    assert round_row["met"] is True
    assert "the bytes alone make a round 1.24x a step" in round_row["detail"]
    assert "this round runs at 80% of its own floor" in round_row["detail"]  # 1.24 / 1.55
    # A result without the byte counts keeps the plain detail.
    older = {**decode, "rows": [{k: v for k, v in row.items() if "bytes" not in k}]}
    assert "bytes alone" not in gpu_targets.decode_targets(older)[1]["detail"]


def test_mesh_memory_names_the_configs_it_takes_and_its_exit_status():
    done = _script("mesh_memory.py", "--config", "tiny-vanilla-target")
    _one_line_error(done, "--config", "qwen3-8b")
    usage = " ".join(_script("mesh_memory.py", "--help").stdout.split())
    assert "dspark-<config>" in usage
    import mesh_memory

    assert "exits 0 either way" in " ".join(mesh_memory.__doc__.split())
    both = _script("mesh_memory.py", "--gpu", "h100", "--tpu", "v5e:2x2")
    _one_line_error(both, "--gpu and --tpu name two different machines")
    _one_line_error(_script("mesh_memory.py", "--gpu", "h100", "--mesh", "1,1,2"), "one GPU")
    _one_line_error(_script("mesh_memory.py", "--gpu", "a100"), "--gpu", "'h100', 'h200'")
    _one_line_error(_here("train_step_cost.py", "--gpu", "h100"), "--gpu needs --compile")


def test_policy_switch_cost_names_each_member_it_times():
    import policy_switch_cost

    from dspark_jax.decoding import policies

    members = [policies.FixedPolicy(7)] + [
        policies.make_policy(name, 7, threshold=t) for name, t in throughput.THRESHOLDS
    ]
    labels = [policy_switch_cost.describe(m) for m in members]
    assert labels[:3] == ["fixed gamma 7", "threshold c_k >= 0.5", "threshold c_k >= 0.7"]
    assert labels[3] == "threshold a_k >= 0.3"
    assert len(set(labels)) == len(labels)  # two ThresholdPolicy rows are told apart
    _one_line_error(_here("policy_switch_cost.py", "--members", "1,9"), "--members")
    _one_line_error(_here("policy_switch_cost.py", "--repeats", "0"), "--repeats")


def test_train_throughput_refuses_more_anchors_than_a_sequence_has_blocks():
    import train_throughput

    # Positions 2..14 of a 16-token sequence (2 prompt tokens; the last has no next token).
    assert train_throughput.anchor_positions(16) == 13
    assert train_throughput.anchor_positions(4096) >= 512  # the released recipe's shapes
    done = _here("train_throughput.py", "--anchors", "64", "--seq-len", "16")
    _one_line_error(done, "--anchors 64", "13 positions")


def _small_pair():
    """A target and drafter small enough to count by hand (see the arithmetic below)."""
    import dataclasses

    from dspark_jax import configs

    target = dataclasses.replace(
        configs.get("tiny-vanilla-target"), vocab_size=32, hidden_size=8, intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
    )  # fmt: skip
    drafter = dataclasses.replace(
        configs.get("tiny-vanilla-dspark"),
        model=dataclasses.replace(target, num_hidden_layers=1, tie_word_embeddings=False),
        block_size=3, mask_token_id=31, target_layer_ids=(-1, 0), num_target_layers=2,
        markov_rank=4, num_anchors=2,
    )  # fmt: skip
    return target, drafter


def test_train_throughput_counts_useful_model_flops():
    """model_flops on a small pair, term by term by hand (per sequence, seq_len 16):

    target: D 8, I 16, 2 layers, 2 heads, 1 KV head, head_dim 4, vocab 32.
      decoder weights per layer: attention 8*4*(2*2 + 2*1) = 192, MLP 3*8*16 = 384 -> 576;
      x 2 layers = 1152; forward 2*1152*16 tokens = 36864
      causal attention: 16*17/2 = 136 (query, key) pairs; 4*136*2 heads*4*2 layers = 8704
      p_t head on n*gamma = 2*3 = 6 slots: 2*8*32*6 = 3072
      target_forward = 36864 + 8704 + 3072 = 48640
    drafter: the same layer shapes, 1 layer; taps (-1, 0) -> 2*8 = 16 context features;
    Markov rank 4 (vanilla), confidence head with the Markov feature. Anchors: the prompt is
    16 // 8 = 2 tokens, candidates 2..14 (13 of them), mean anchor (2 + 14) / 2 = 8.
      fc 2*16*16*8 = 4096, forward + weight gradient only: x 2 = 8192
      context K/V: width 2*1*4 = 8 per layer; 2*16*8*8 = 2048, x 3 = 6144
      blocks: 2*576*6 = 6912, x 3 = 20736, less layer 0's q/k/v input gradient
        2*6*8*((2 + 2*1)*4) = 1536
      block attention: gamma*n*(mean anchor + gamma) = 3*2*(8 + 3) = 66 pairs;
        4*66*2*4*1 = 2112, x 3 = 6336
      frozen lm_head 2*6*32*8 = 3072, forward + input gradient: x 2 = 6144
      Markov W2 2*6*32*4 = 1536 (W1 is a gather: 0), confidence 2*6*(8 + 4) = 144;
        (1536 + 144) x 3 = 5040
      drafter_train = 8192 + 6144 + 20736 - 1536 + 6336 + 6144 + 5040 = 51056
    Batch 2 doubles each. (Before model_flops_version 2 the same pair counted dense
    attention, both Markov matrices and the fc input gradient.)"""
    import train_throughput

    target, drafter = _small_pair()
    anchor = train_throughput.mean_anchor(16)
    assert anchor == 8.0 and train_throughput.anchor_positions(16) == 13
    flops = train_throughput.model_flops(target, drafter, 2, 16, anchor)
    assert flops == {
        "target_forward": 2 * 48640.0,
        "drafter_train": 2 * 51056.0,
        "total": 2 * (48640.0 + 51056.0),
    }
    # Attention is counted over visible keys: anchors one position later add gamma*n = 6 pairs
    # per drafter layer, 4*6*2*4 = 192 forward FLOPs, x 3 for training, x 2 sequences.
    later = train_throughput.model_flops(target, drafter, 2, 16, anchor + 1)
    assert later["drafter_train"] - flops["drafter_train"] == 2 * 3 * 192.0
    assert later["target_forward"] == flops["target_forward"]


def test_train_throughput_counts_the_markov_kinds_projections():
    """gated adds gate_proj [D + r -> r], rnn joint_proj [D + 2r -> 3r], each x 3 for training;
    rank 0 (DFlash shape) drops W2 and, with no confidence head, the confidence projection."""
    import dataclasses

    import train_throughput

    target, drafter = _small_pair()
    base = train_throughput.model_flops(target, drafter, 1, 16, 8.0)["drafter_train"]
    gated = dataclasses.replace(drafter, markov_head_type="gated")
    rnn = dataclasses.replace(drafter, markov_head_type="rnn")
    # gated: 2*6*(8 + 4)*4 = 576, x 3 = 1728; rnn: 2*6*(8 + 8)*12 = 2304, x 3 = 6912.
    assert train_throughput.model_flops(target, gated, 1, 16, 8.0)["drafter_train"] == base + 1728
    assert train_throughput.model_flops(target, rnn, 1, 16, 8.0)["drafter_train"] == base + 6912
    dflash = dataclasses.replace(
        drafter, markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False
    )
    # Less (W2 1536 + confidence 144) x 3 = 5040.
    assert train_throughput.model_flops(target, dflash, 1, 16, 8.0)["drafter_train"] == base - 5040


def test_train_throughput_released_recipe_counts():
    """At the released recipe's shapes (Qwen3-4B + its 5-layer drafter, one 4096-token sequence,
    512 anchors): 57.87 TFLOP per sequence (target forward 37.50, drafter training 20.37),
    against 66.00 counted before model_flops_version 2."""
    import dataclasses

    import train_throughput

    from dspark_jax import configs

    target = configs.get("qwen3-4b")
    drafter = dataclasses.replace(configs.get("dspark-qwen3-4b"), num_anchors=512)
    anchor = train_throughput.mean_anchor(4096)
    assert anchor == (512 + 4094) / 2
    flops = train_throughput.model_flops(target, drafter, 1, 4096, anchor)
    assert flops["target_forward"] / 1e12 == pytest.approx(37.5012, abs=1e-4)
    assert flops["drafter_train"] / 1e12 == pytest.approx(20.3671, abs=1e-4)
    assert flops["total"] / 1e12 == pytest.approx(57.8683, abs=1e-4)


def _dot_flops(jaxpr, times=1):
    """2 x M x N x K of every dot_general in a jaxpr, scan bodies times their length."""
    import math

    import jax.extend.core

    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), (lb, _) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            # batch x contracted x lhs free x rhs free = lhs size x rhs size / (batch x contr.)
            shared = math.prod(lhs[i] for i in (*lc, *lb))
            total += times * 2.0 * math.prod(lhs) * math.prod(rhs) / shared
        inner = times * eqn.params["length"] if eqn.primitive.name == "scan" else times
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    total += _dot_flops(sub.jaxpr, inner)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    total += _dot_flops(sub, inner)
    return total


def test_train_throughput_count_matches_the_steps_jaxpr():
    """The matmuls the real train step traces (tiny fixture pair; the step recomputes
    nothing) are exactly model_flops plus what it leaves out on purpose: the masked pairs of
    dense attention (the target's full 64 x 64 instead of causal; each drafter query against
    all 64 context keys and the chunk's 4 x 7 block keys instead of the visible ones, x 3 for
    training) and layer 0's q/k/v input gradient, traced though the frozen embedding needs it
    not. A matmul added to the model or a gradient dropped shows up here."""
    import dataclasses

    import train_throughput as tt
    from flax import nnx

    from dspark_jax import configs
    from dspark_jax.models.qwen3 import Qwen3
    from dspark_jax.sharding import MeshConfig, make_mesh
    from dspark_jax.training import step as S

    batch, seq_len, anchors, chunk = 2, 64, 8, 4
    target_cfg = configs.get("tiny-vanilla-target")
    drafter_cfg = dataclasses.replace(configs.get("tiny-vanilla-dspark"), num_anchors=anchors)
    target_gd, target_state = nnx.split(Qwen3(target_cfg, rngs=nnx.Rngs(0)))
    drafter = S.new_drafter(drafter_cfg, nnx.merge(target_gd, target_state), seed=0)
    drafter_gd, params, frozen_drafter = S.split_drafter(drafter)
    models = S.Models(target_gd, drafter_gd, drafter_cfg)
    cfg = S.StepConfig(anchors, chunk, 1)
    tx, schedule = S.make_optimizer(1e-4, 100, 10, 0.0, 1.0)
    state = S.init_train_state(params, tx, 0)
    frozen = S.FrozenParams(target_state, frozen_drafter)
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    step = S.make_train_step(models, cfg, tx, schedule, mesh, state, frozen, batch, seq_len)
    shapes = {
        "tokens": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct((batch, seq_len), jnp.bool_),
        "length": jax.ShapeDtypeStruct((batch,), jnp.int32),
    }
    traced = _dot_flops(step.trace(state, frozen, shapes).jaxpr.jaxpr)

    m, k = drafter_cfg.model, drafter_cfg.block_size
    slots, anchor = anchors * k, tt.mean_anchor(seq_len)
    useful = tt.model_flops(target_cfg, drafter_cfg, batch, seq_len, anchor)["total"]
    masked = tt._attention_flops(target_cfg, seq_len * seq_len - seq_len * (seq_len + 1) / 2)
    masked += 3 * tt._attention_flops(m, slots * (seq_len + chunk * k) - k * anchors * (anchor + k))
    layer0_qkv = 2.0 * slots * m.hidden_size * (m.num_attention_heads + 2 * m.num_key_value_heads)
    layer0_qkv *= m.head_dim
    assert traced == pytest.approx(useful + batch * (masked + layer0_qkv), rel=1e-12)


def test_train_throughput_peak_is_looked_up_by_the_exact_device_kind():
    import train_throughput

    assert train_throughput.peak_flops("NVIDIA H100 80GB HBM3") == (989e12, None)  # SXM
    assert train_throughput.peak_flops("NVIDIA H100 PCIe") == (756e12, None)
    assert train_throughput.peak_flops("NVIDIA H100 NVL") == (835e12, None)
    assert train_throughput.peak_flops("NVIDIA H200") == (989e12, None)
    # No substring guesses: an H200 NVL or an unknown H100 part gets no peak, and says why.
    for kind in ("NVIDIA H200 NVL", "NVIDIA H100", "H100", "cpu"):
        peak, note = train_throughput.peak_flops(kind)
        assert peak is None and repr(kind) in note and "NVIDIA H100 PCIe" in note
    # gpu_targets.py judges results of the formula version train_throughput.py writes.
    assert gpu_targets.MODEL_FLOPS_VERSION == train_throughput.MODEL_FLOPS_VERSION


def test_docstrings_say_what_the_scripts_do():
    import bandwidth

    doc = " ".join(bandwidth.__doc__.split())
    assert "x * 1.0000001" in doc and "jnp.copy" not in doc and "measured here" not in doc
    assert "not a script" in provenance.__doc__


def test_lowering_time_lowers_every_program_for_a_gpu(tmp_path):
    """lowering_time.py at the tiny pair's shapes, lowered for a GPU without one: every program
    gets a row, the decode chunk holds one Triton attention kernel per token bucket and model
    (the layers share one lowered body), and bad input is a one-line error."""
    out = tmp_path / "lowering.json"
    done = _script("lowering_time.py", "--config", "tiny", "--slots", "4", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    rows = {r["program"]: r for r in report["rows"]}
    assert set(rows) == {"init", "decode_chunk", "release", "prefill_64", "prefill_256"}
    built = [rows[p] for p in ("init", "decode_chunk", "prefill_64", "prefill_256")]
    assert all(r["trace_s"] >= 0 and r["lower_s"] > 0 and r["mlir_mb"] > 0 for r in built)
    assert rows["release"]["lower_s"] >= 0  # a few slot masks: rounds to 0.00 s and MB here
    # One lowered layer body per token bucket (8, 16, 32) and one for the drafter, which
    # drafts once per round: at most two attention kernels each (the paged partials, and the
    # new tokens' flash attention where a bucket uses it). Layers written out one by one would
    # make it at least 3 x 4 + 2 (the tiny target has 4 layers, its drafter 2).
    assert "token buckets (8, 16, 32)" in report["setting"]
    assert 4 <= rows["decode_chunk"]["kernel_calls"] <= 2 * (3 + 1), rows["decode_chunk"]
    assert "total trace + lower" in done.stdout
    _one_line_error(_here("lowering_time.py", "--prefill-buckets", "0"), "--prefill-buckets")
    _one_line_error(_here("lowering_time.py", "--config", "nope"), "--config")
    _one_line_error(
        _here("lowering_time.py", "--compile"), "--compile needs --platform here, h100 or h200"
    )
    _one_line_error(_here("lowering_time.py", "--hlo", str(tmp_path)), "--hlo needs --compile")
    _one_line_error(
        _here("lowering_time.py", "--config", "tiny", "--slots", "4", "--programs", "decode"),
        "--programs: no program named decode (this engine's: init, decode_chunk",
    )
    # The sampling features that add to the decode program, named in the setting.
    done = _script("lowering_time.py", "--config", "tiny", "--slots", "4", "--programs",
                   "decode_chunk", "--penalties", "--max-logit-bias", "4",
                   "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert [r["program"] for r in report["rows"]] == ["decode_chunk"]
    assert ", penalties, logit bias of 4, " in report["setting"], report["setting"]
    # Built with them: the penalised, biased sampling's conditional is in the lowered program.
    assert report["rows"][0]["mlir_mb"] > rows["decode_chunk"]["mlir_mb"], report["rows"]
    _one_line_error(_here("lowering_time.py", "--max-logit-bias", "-1"), "--max-logit-bias")
    # Two drafter slot buckets: the drafter's layer body is lowered once per branch.
    done = _script("lowering_time.py", "--config", "tiny", "--slots", "4", "--programs",
                   "decode_chunk", "--draft-buckets", "2,4", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert "drafter slot buckets (2, 4)" in report["setting"]
    assert report["rows"][0]["kernel_calls"] > rows["decode_chunk"]["kernel_calls"]
    _one_line_error(
        _here("lowering_time.py", "--config", "tiny", "--slots", "4", "--draft-buckets", "2"),
        "must end at num_slots",
    )
    _one_line_error(
        _here("lowering_time.py", "--plain", "--draft-buckets", "64"),
        "--draft-buckets needs a drafter",
    )
    # A deeper target: the same layer body (as many kernel calls), its taps kept where they fit;
    # one too shallow for the drafter's two taps is refused in one line.
    done = _script("lowering_time.py", "--config", "tiny", "--slots", "4", "--programs",
                   "decode_chunk", "--target-layers", "6", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["setting"].startswith("tiny-vanilla-target (6 layers) + "), report["setting"]
    assert report["rows"][0]["kernel_calls"] == rows["decode_chunk"]["kernel_calls"]
    _one_line_error(
        _here("lowering_time.py", "--config", "tiny", "--target-layers", "3"),
        "--target-layers 3: cannot space 2 tap layers over layers 1..0 of a 3-layer target",
    )
    # Without a drafter no tap limits the depth.
    done = _script("lowering_time.py", "--config", "tiny", "--slots", "4", "--plain",
                   "--programs", "decode_chunk", "--target-layers", "3")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tiny-vanilla-target (3 layers), " in done.stdout, done.stdout


def test_lowering_time_compile_counts_what_xla_made_of_each_program(tmp_path):
    """--compile: the plain tiny engine's programs compiled on this backend, with the counts of
    the optimised modules (test_gpu_lowering.py holds those counts to the layers written out)."""
    out = tmp_path / "lowering.json"
    done = _script("lowering_time.py", "--config", "tiny", "--slots", "2", "--plain",
                   "--platform", "here", "--compile", "--json", str(out),
                   "--hlo", str(tmp_path / "hlo"))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["program"]: r for r in json.loads(out.read_text())["rows"]}
    written = sorted(p.name for p in (tmp_path / "hlo").iterdir())
    assert written == sorted(f"{name}.txt" for name in rows), written
    assert "HloModule" in (tmp_path / "hlo" / "decode_chunk.txt").read_text()
    for r in rows.values():
        assert r["compile_s"] > 0 and r["instructions"] > r["fusions"] > 0, r
        assert r["copies"] >= 0 and r["calls"] >= 0 and r["kernel_calls"] == 0, r
        assert r["temp_mib"] >= 0 and r["spills"] == {}, r  # no ptxas on XLA:CPU
    assert rows["decode_chunk"]["temp_mib"] > 0
    assert "instructions" in done.stdout
    assert "register spills (ptxas; bytes stored/loaded): none" in done.stdout


def test_deviceless_keeps_ptxas_spills_and_passes_other_messages_on(capfd):
    """What XLA writes to file descriptor 2 while compiling: ptxas' spill warnings are kept
    (the largest of a kernel's variants), informational lines dropped, anything else written
    back to stderr."""
    capfd.readouterr()
    with deviceless.captured_spills() as spills:
        for line in (
            "I1128 02:04:10.7 1656 subprocess_compilation.cc:349] ptxas warning : Registers are "
            "spilled to local memory in function 'paged_partials', 488 bytes spill stores, "
            "484 bytes spill loads",
            "I1128 02:04:10.8 1656 subprocess_compilation.cc:349] ptxas warning : Registers are "
            "spilled to local memory in function 'paged_partials__1', 512 bytes spill stores, "
            "8 bytes spill loads",
            "I1128 02:04:10.9 1656 pjrt_client.cc:579] PjRt-IFRT device count: total=1",
            "W1128 02:04:11.0 1656 gpu_compiler.cc:1] a warning someone should see",
        ):
            os.write(2, (line + "\n").encode())
    assert spills.kernels == {"paged_partials": (512, 484)}
    err = capfd.readouterr().err
    assert "a warning someone should see" in err
    assert "PjRt-IFRT" not in err and "spilled" not in err


def test_deviceless_explains_what_compiling_for_a_gpu_needs(monkeypatch):
    """No GPU name outside the table, and a plugin that cannot describe a GPU (not installed,
    or too old) is a user error naming the install, not a traceback."""
    from jax.experimental import topologies

    with pytest.raises(deviceless.UserError, match="no GPU named 'a100': h100, h200"):
        deviceless.gpu_devices("a100")

    def no_plugin(**kwargs):
        assert kwargs["platform"] == "cuda"
        assert 'device_description_str: "NVIDIA H200"' in kwargs["target_config"]
        raise RuntimeError("Unknown backend cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
    needs = r'Unknown backend cuda\); .*pip install "jax\[cuda12\]"'
    with pytest.raises(deviceless.UserError, match=needs):
        deviceless.gpu_devices("h200")


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason='compiling for a GPU without one needs pip install "jax[cuda12]"',
)
def test_qwen3_4b_programs_compile_for_an_h100_without_one(tmp_path):
    """XLA's own GPU compiler at Qwen3-4B shapes (64 slots): every program compiles for an H100
    that is not there, with the Triton attention kernels, no copy of a page pool (119 small
    copies at f34a5eb, the largest an index vector) and no attention kernel spilling registers.
    About 3 minutes on two cores."""
    out = tmp_path / "aot.json"
    done = _script("lowering_time.py", "--platform", "h100", "--compile", "--json", str(out),
                   timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["program"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"init", "decode_chunk", "release", "prefill_64", "prefill_256"}
    assert rows["decode_chunk"]["kernel_calls"] > 0 and rows["decode_chunk"]["compile_s"] > 0
    spilled = {k for r in rows.values() for k in r["spills"]}
    assert not any("attention" in k or "mha" in k for k in spilled), spilled


def test_vocab_traffic_reads_the_arrays_a_round_moves_over_the_vocabulary(tmp_path):
    """vocab_traffic.py compiled on this backend at small shapes: the lm head's [rows, V] output
    is written every round, each block of filtering rows has its two 32-pass halving loops, and
    shapes of tuples and of other sizes are counted right."""
    import vocab_traffic

    assert vocab_traffic.vocab_bytes("(f32[8,1,4096]{2,1,0}, pred[8,4096]{1,0}, s32[8])", 4096) == (
        8 * 4096 * 4 + 8 * 4096
    )
    assert vocab_traffic.vocab_bytes("bf16[4096,64]", 4096) == 4096 * 64 * 2
    out = tmp_path / "traffic.json"
    done = _script("vocab_traffic.py", "--platform", "here", "--slots", "8", "--hidden", "64",
                   "--vocab", "4096", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["rows"] == 64 and report["dtype"] == "bfloat16"
    every = [w for w in report["writes"] if not w["branch"]]
    assert any(w["shape"].startswith("f32[64,4096]") for w in every), every
    searched = sorted({loop["rows"] for loop in report["loops"] if loop["passes"] == 32})
    assert searched == [8, 64], report["loops"]
    assert report["read_back_mb"] > 0
    assert "cutoff search" in done.stdout
    _one_line_error(_here("vocab_traffic.py", "--slots", "0"), "--slots")


@pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason='compiling for a GPU without one needs pip install "jax[cuda12]"',
)
def test_a_verification_compiled_for_an_h100_writes_its_logits_once(tmp_path, monkeypatch):
    """XLA's GPU compiler, 512 verified rows at Qwen3's vocabulary: the lm head's float32
    logits are the only [512, V] array a round writes (a copy divided by the temperature was
    written too before 2026-11-28: an operand of the cutoff search's conditional). The search
    is a loop of 32 halvings per filter and block of filtering rows (recorded into the CUDA
    graph), each reading the logits alone; where loops stay out of the graphs
    (DSPARK_JAX_GRAPH_LOOPS=0) it is written out, each block's halvings reductions of their
    own, and each of them reads the logits alone too: no [rows, V] keys or probabilities
    written once for all of them (XLA merged the written-out steps into such arrays until each
    step's values became an expression of its own), at most one [rows, V] mask beside them."""
    written = {}
    for loops in ("1", "0"):
        monkeypatch.setenv("DSPARK_JAX_GRAPH_LOOPS", loops)
        out = tmp_path / f"traffic_{loops}.json"
        done = _script("vocab_traffic.py", "--hidden", "256", "--json", str(out), timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(out.read_text())
        every = [w["shape"] for w in report["writes"] if not w["branch"]]
        assert [s for s in every if s.startswith(("f32[512,", "s32[512,", "bf16[512,"))] == [
            "f32[512,151936]{1,0}"
        ], every
        written[loops] = [w["shape"] for w in report["writes"] if w["branch"]]
        if loops == "1":
            searches = sorted((x["rows"], x["passes"], x["carried"]) for x in report["loops"])
            assert searches == [(rows, 32, f"f32[{rows},151936]") for rows in (8, 8, 64, 64)] + [
                (512, 32, "f32[512,151936]")] * 2, report["loops"]  # fmt: skip
            continue
        assert report["loops"] == []
        reductions = {r["rows"]: r for r in report["reductions"]}
        assert set(reductions) >= {8, 64, 512}, reductions
        for rows in (8, 64, 512):
            # Two filters' 32 halvings, the row's bounds and the top-p normaliser.
            assert reductions[rows]["count"] >= 2 * 32, reductions[rows]
        # The whole batch's steps read the float32 logits (311 MB), one of them a mask beside.
        assert reductions[512]["mb_each"] <= (512 * 151936 * (4 + 1)) / 1e6, reductions[512]
    for shapes in written.values():
        assert not [w for w in shapes if w.startswith(("s32[512,", "f32[512,"))], shapes


# A decode program's shape in miniature (written by hand, in XLA's text format): the rounds
# loop's body launches a fusion and a copy, and a token-bucket conditional whose larger branch
# is one layer (its attention kernel, a GEMM, and an inner loop of 4 trips launching one fusion
# each), the smaller branch a smaller bucket's layer of one fusion.
_ROUND_HLO = (Path(__file__).parent / "data" / "round_kernels_decode.hlo.txt").read_text()


def test_round_kernels_counts_what_one_round_launches():
    import round_kernels

    result = round_kernels.analyse(_ROUND_HLO)
    # Largest branch: fusion + the predicate's compare + copy + (attention + GEMM + 4 inner
    # trips x (fusion + the test's compare)), and the rounds loop's test: 3 + 2 + 8 + 1 = 14.
    assert result["kernels_per_round"] == 14
    assert result["by_kind"] == {"other fusion": 5, "unfused compare": 6, "copy": 1,
                                 "Triton (attention)": 1, "GEMM fusion": 1}  # fmt: skip
    assert result["in_inner_loops"] == 8
    assert result["conditionals_per_round"] == 1 and result["inner_loop_trips_per_round"] == 4
    # Smallest branch: fusion + compare + copy + the small branch's fusion + the rounds test.
    assert result["kernels_per_round_least"] == 5
    assert result["inner_loop_trips_per_round_least"] == 0
    # One layer (one attention kernel): its attention, its GEMM and the loop body's 4 fusions
    # (the loop's test carries no layer op_name).
    assert result["target_layers"] == 1 and result["kernels_per_layer"] == 6
    assert round_kernels.analyse(_ROUND_HLO, layers=2)["kernels_per_layer"] == 3
    report = round_kernels.format_report(result, "x.txt")
    assert "14 kernels a round" in report and "8 of them in inner loops" in report
    # A single bucket's conditional: its other branch runs no layer (it only fills the outputs'
    # shapes, and never runs), so the smallest-branch count is the forward's.
    single = round_kernels.analyse(_ROUND_HLO.replace("cond/jit(decoder_layer)/mul", "cond/mul"))
    assert single["kernels_per_round_least"] == 14
    assert single["inner_loop_trips_per_round_least"] == 4


def test_round_kernels_reads_a_compiled_decode_program_and_refuses_other_text(tmp_path):
    """On a program XLA compiled (here for this CPU: no attention kernels, so the layers are
    given) and, as a script, a clear error for a file that is not one."""
    import round_kernels
    from fixture_models import load_pair

    from dspark_jax.decoding.engine import Engine, EngineConfig

    target, _ = load_pair("vanilla")
    cfg = EngineConfig(num_slots=2, max_model_len=64, prefill_chunk=16, prefill_buckets=(16,),
                       token_buckets=(2,))  # fmt: skip
    text = Engine(target, None, cfg).lower()["decode_chunk"].compile().as_text()
    layers = target.cfg.num_hidden_layers
    result = round_kernels.analyse(text, layers=layers)
    assert result["kernels_per_round"] >= result["kernels_per_round_least"] > 0
    assert result["target_layers"] == layers and result["kernels_per_layer"] > 1
    # One bucket: the forward's conditional pairs it with a branch that never runs (zeros of
    # its outputs), and the smallest-branch count is still that of a round running the forward.
    assert result["kernels_per_round_least"] > result["kernels_per_layer"] * layers
    assert result["one_layer"]
    not_hlo = tmp_path / "notes.txt"
    not_hlo.write_text("hello\n")
    _one_line_error(_here("round_kernels.py", str(not_hlo)), "no ENTRY computation")
    _one_line_error(_here("round_kernels.py", str(tmp_path / "none.txt")), "none.txt")


def test_a_round_reads_the_markov_transition_once_per_draft_position():
    """decode_speed's round floor counts the drafter's weights once and its Markov head's
    transition (W2 over the vocabulary, and a gate where it has one; W1 is a lookup) again at
    every later block position, each of which depends on the token drawn before it. A DFlash
    drafter (no Markov head) reads nothing per position."""
    import decode_speed
    from flax import nnx

    from dspark_jax import configs
    from dspark_jax.models.drafter import DSparkDrafter

    for name in ("tiny-vanilla-dspark", "tiny-gated-dspark", "dflash-qwen3-4b"):
        cfg = configs.get(name)
        drafter = nnx.eval_shape(lambda cfg=cfg: DSparkDrafter(cfg, rngs=nnx.Rngs(0)))
        head = drafter.markov_head
        if head is None:
            assert decode_speed.draft_step_bytes(drafter) == 0, name
            continue
        w2 = jax.tree.leaves(nnx.state(head.markov_w2))[0]
        itemsize = w2.dtype.itemsize
        expected = sum(
            leaf.size * itemsize
            for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(head))[0]
            if "markov_w1" not in str(path)
        )
        assert expected >= w2.size * itemsize
        assert decode_speed.draft_step_bytes(drafter) == expected, name


# A decode program's thunks in miniature, in the layout XLA dumps them
# (*.thunk_sequence_after_thunk_passes.txt): a graph, then the rounds loop, whose body is a
# graph and a host-side conditional (its "condition:" label unindented, as XLA writes it); that
# conditional's larger branch holds a graph and a loop (a search's halvings, once host-side),
# its other branch a copy; the last conditional sits inside a graph, decided on the device.
_THUNKS = """\
000: kCommandBuffer [source       | next=008 (1)]
    001: kCopy         [source       | next=002 (1)] kCopy
008: kWhile         [prev=000 (1) | sink        ]
condition:
    009: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer [source       | next=781 (1)]
        010: kCustomKernel [source        | next=025 (15)] input_reduce_fusion_163
    781: kConditional   [prev=000 (1) | next=000 (1)]
      false_branch:
        000: kCommandBuffer [source       | next=711 (1)]
            030: kCustomKernel [source       | next=038 (8) ] input_reduce_fusion_159
        700: kWhile        [prev=699 (1) | next=709 (1)]
condition:
            701: kCustomKernel [source | sink] loop_compare_fusion
          body:
            000: kCommandBuffer [source | sink]
                702: kCustomKernel [source | sink] input_reduce_fusion_1
      true_branch:
        710: kCopy [source | sink] kCopy
    000: kCommandBuffer [prev=781 (1) | sink        ]
        743: kConditional  [prev=738 (1) | sink        ]
          false_branch:
            No thunks.              true_branch:
            744: kCustomKernel [source | sink] loop_select_fusion
"""


def test_host_syncs_counts_the_control_flow_left_to_the_host(tmp_path):
    import host_syncs

    counts = host_syncs.report(host_syncs.parse(_THUNKS))
    # Everywhere: the rounds loop and the search's loop; one conditional (the one in a graph
    # does not count); the graphs launched from the host: the first, and in the round its
    # first, the branch's, the search loop's body's and its last.
    assert counts["whole"] == {"conditionals": 1, "loops": 2, "graphs": 5}
    assert counts["round"] == {"conditionals": 1, "loops": 1, "graphs": 4}
    # The fewest: the conditional's copy branch, so no search loop and no graph in it.
    assert counts["round_fewest"] == {"conditionals": 1, "loops": 0, "graphs": 2}
    assert counts["whole_fewest"] == {"conditionals": 1, "loops": 1, "graphs": 3}

    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / f"module_0001.jit_decode{host_syncs.SUFFIX}").write_text(_THUNKS)
    out = tmp_path / "syncs.json"
    done = _script("host_syncs.py", str(dump), "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(out.read_text())["round"] == counts["round"]
    assert "one round, fewest" in done.stdout
    _one_line_error(_here("host_syncs.py", str(tmp_path)), "thunk_sequence_after_thunk_passes")


@pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason='compiling for a GPU without one needs pip install "jax[cuda12]"',
)
@pytest.mark.parametrize("graph_loops", ["1", "0"])
def test_a_decode_chunk_compiled_for_an_h200_is_one_cuda_graph(tmp_path, monkeypatch, graph_loops):
    """XLA's GPU compiler, the speculative engine at 1 slot (Qwen3-4B shapes, a CUDA 12.8
    driver described): nothing in a decode chunk is decided on the host. By default its loops
    (the rounds, the sampling filters' searches) and conditionals are recorded into one CUDA
    graph; with DSPARK_JAX_GRAPH_LOOPS=0 XLA's defaults keep loops out of graphs, and the
    engine's only loop is the rounds loop, the searches written out. About a minute."""
    import host_syncs

    monkeypatch.setenv("DSPARK_JAX_GRAPH_LOOPS", graph_loops)
    dump = tmp_path / "dump"
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to={dump} --xla_dump_hlo_pass_re=NONE")
    done = _script("lowering_time.py", "--platform", "h200", "--compile", "--slots", "1",
                   "--programs", "decode_chunk", timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = dump.glob(f"*jit_decode{host_syncs.SUFFIX}")
    counts = host_syncs.report(host_syncs.parse(path.read_text()))
    if graph_loops == "1":
        assert counts["whole"] == {"conditionals": 0, "loops": 0, "graphs": 1}, counts
    else:  # the rounds loop's test, and its body one graph
        assert counts["whole"] == {"conditionals": 0, "loops": 1, "graphs": 2}, counts
        assert counts["round"] == {"conditionals": 0, "loops": 0, "graphs": 1}, counts


# Slow (about a minute: the script builds and runs its engines in a process of its own): what
# the benchmark measures is held in the default run by tests/test_prefix_cache.py.
@pytest.mark.slow
def test_prefix_cache_benchmark_prefills_only_the_new_tokens(tmp_path):
    """Three requests of a 48-token prefix (three pages) + 4 tokens: after a carrier, with
    the cache each prefills its 4 own tokens, without it all 52; arriving together at two
    slots, the second copies the prefix the first is prefilling (one call of 512 tokens holds
    both; waiting would take two) and the third, admitted when a slot frees, maps it; sending a
    first turn (52 tokens, 40 answered) back with 4 tokens more, each maps the five full pages
    of the 91 tokens whose K/V were written and prefills 16; the same tokens either way."""
    out = tmp_path / "prefix.json"
    cache = str(tmp_path / "cache")
    done = _script(
        "prefix_cache.py",
        *("--prefix", "48", "--tail", "4", "--requests", "3", "--slots", "2"),
        *("--new-tokens", "4", "--answer", "40", "--repeats", "1", "--json", str(out)),
        timeout=600,
        env={"DSPARK_JAX_COMPILATION_CACHE": cache, "JAX_COMPILATION_CACHE_DIR": cache},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert rows["after a carrier, with"]["prefilled"] == 3 * 4
    assert rows["after a carrier, without"]["prefilled"] == 3 * 52
    assert rows["together, with"]["prefilled"] == 2 * 52 + 4
    assert rows["together, without"]["prefilled"] == 3 * 52
    assert rows["next turn, with"]["prefilled"] == 3 * (96 - 80)
    assert rows["next turn, without"]["prefilled"] == 3 * 96
    assert result["same_tokens"] is True
    assert "| after a carrier | with | 12 |" in done.stdout


# Slow (60 s: three engines compiled in a process of its own): the penalties and the logit bias
# themselves are held in the default run by tests/test_penalties.py and test_logit_bias.py.
@pytest.mark.slow
def test_penalties_cost_times_six_cells_and_compiles_nothing_while_timing(tmp_path):
    """benchmarks/penalties_cost.py on the tiny pair: off, penalties on but unused and used, a
    logit bias held but unused and used, allowed tokens used, each timed with nothing compiled
    while timing, the counts' bytes those of slots x vocabulary."""
    out = tmp_path / "penalties.json"
    done = _script(
        "penalties_cost.py",
        *("--config", "tiny", "--dtype", "float32", "--vocab", "512", "--slots", "2"),
        *("--context", "32", "--rounds", "2", "--repeats", "1", "--logit-bias", "3"),
        *("--json", str(out)),
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["counts_bytes"] == 2 * 512 * 4 and result["marks_bytes"] == 2 * 512
    assert result["logit_bias"] == 3
    cells = ("off", "on_unused", "on_used", "bias_unused", "bias_used", "allowed_used")
    for cell in cells:
        assert result[f"{cell}_ms"] > 0
        assert result[f"{cell}_compiles_while_timing"] == 0
    for cell in cells[1:]:
        assert result[f"{cell}_over_off"] == result[f"{cell}_ms"] / result["off_ms"]
        assert cell in done.stdout
    assert "x off" in done.stdout and "with a logit bias" in done.stdout
