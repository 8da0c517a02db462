"""`pytest --compile-report PATH`: where the test run's time goes, per test and per file.

On the CPU most of a test's time is XLA compiling the engine's programs, not running them. This
plugin (registered by conftest.py when the option is given) listens to JAX's monitoring events
in each test process and writes one JSON line per test to PATH: its wall seconds, XLA's
backend-compile seconds (several compile threads may add up to more than the wall time), tracing
and lowering seconds, the persistent cache's hits and misses, and each program XLA compiled
rather than loaded from that cache (its name and seconds). At the end it prints the totals, the
files that compile the most, and the programs whose compiles cost the most, with how many files
compiled each: a name many files compile is an engine each file builds for a configuration of
its own. Programs compiled by child processes a test starts (the README example, the notebooks,
commands run as scripts) are not seen: those tests show wall time only.

Each process that runs tests writes its rows as it goes into a folder of parts private to this
run (xdist workers learn it from the main process through `workerinput`, not the environment,
so a pytest that a test starts cannot write into or clear this run's report); at the end the
main process writes PATH from them and removes the folder.
"""

import collections
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

# JAX's event names (jax/_src/compiler.py, compilation_cache.py, dispatch.py) -> our keys.
DURATIONS = {
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
}
EVENTS = {
    "/jax/compilation_cache/cache_hits": "cache_hits",
    "/jax/compilation_cache/cache_misses": "cache_misses",
}
FIELDS = ("wall_s", *DURATIONS.values(), *EVENTS.values())
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class CompileReport:
    def __init__(self, path: Path, parts: Path, worker: str | None):
        self.path = path
        self.parts = parts  # this run's folder of per-process rows
        self.worker = worker  # None in the main process
        self.current: collections.Counter | None = None
        self.compiled: list | None = None  # the current test's [program, seconds]
        self.local = threading.local()  # a compile thread's cache hit, seen before its end
        self.lock = threading.Lock()
        self.listening = False

    # -- in each process that runs tests ---------------------------------------------------

    def _listen(self):
        import jax  # not before: conftest.py sets the environment JAX reads on import

        def on_duration(name, seconds, **kwargs):
            key = DURATIONS.get(name)
            # A backend compile that read the persistent cache (its hit event fires on the same
            # thread, inside the compile's span) loaded a program; any other one compiled it.
            loaded = name == BACKEND_COMPILE and getattr(self.local, "hit", False)
            if name == BACKEND_COMPILE:
                self.local.hit = False
            with self.lock:
                if key is not None and self.current is not None:
                    self.current[key] += seconds
                if name == BACKEND_COMPILE and not loaded and self.compiled is not None:
                    self.compiled.append([kwargs.get("fun_name", "?"), round(seconds, 3)])

        def on_event(name, **kwargs):
            key = EVENTS.get(name)
            if key == "cache_hits":
                self.local.hit = True
            with self.lock:
                if key is not None and self.current is not None:
                    self.current[key] += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)
        self.listening = True

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if not self.listening:
            self._listen()
        counts, compiled = collections.Counter(), []
        with self.lock:
            self.current, self.compiled = counts, compiled
        start = time.perf_counter()
        yield
        counts["wall_s"] = time.perf_counter() - start
        with self.lock:
            self.current = self.compiled = None
        row = {"test": item.nodeid, **{k: round(counts[k], 3) for k in FIELDS}}
        row["compiled"] = compiled
        with (self.parts / f"{self.worker or 'main'}.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    # -- in the main process ---------------------------------------------------------------

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):
        """xdist, in the main process: tell a worker where this run's parts go."""
        node.workerinput["compile_report_parts"] = str(self.parts)

    def pytest_sessionfinish(self, session):
        if self.worker is not None:
            return
        rows = "".join(p.read_text(encoding="utf-8") for p in sorted(self.parts.glob("*.jsonl")))
        self.path.write_text(rows, encoding="utf-8")
        shutil.rmtree(self.parts, ignore_errors=True)

    def pytest_terminal_summary(self, terminalreporter):
        if self.worker is not None or not self.path.is_file():
            return
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line]
        write = terminalreporter.write_line
        terminalreporter.section("compile report")
        totals = {k: sum(r[k] for r in rows) for k in FIELDS}
        write(
            f"{len(rows)} tests, {totals['wall_s']:.0f} s in tests: XLA compiling "
            f"{totals['compile_s']:.0f} s, tracing and lowering "
            f"{totals['trace_s'] + totals['lower_s']:.0f} s; persistent cache "
            f"{totals['cache_hits']:.0f} hits, {totals['cache_misses']:.0f} misses "
            f"(compiles of child processes not counted)"
        )
        files = collections.defaultdict(collections.Counter)
        for r in rows:
            files[r["test"].split("::", 1)[0]].update({k: r[k] for k in ("wall_s", "compile_s")})
        write(f"{'wall s':>8} {'compile s':>9}  file (the {min(15, len(files))} slowest)")
        for name, c in sorted(files.items(), key=lambda kv: -kv[1]["wall_s"])[:15]:
            write(f"{c['wall_s']:8.0f} {c['compile_s']:9.0f}  {name}")
        programs = collections.defaultdict(lambda: [0, 0.0, set()])  # compiles, s, files
        for r in rows:
            for name, seconds in r.get("compiled", ()):
                entry = programs[name]
                entry[0] += 1
                entry[1] += seconds
                entry[2].add(r["test"].split("::", 1)[0])
        if programs:
            write(f"{'compiles':>8} {'files':>5} {'compile s':>9}  program (the 10 costliest)")
            costliest = sorted(programs.items(), key=lambda kv: -kv[1][1])[:10]
            for name, (n, seconds, where) in costliest:
                write(f"{n:8d} {len(where):5d} {seconds:9.0f}  {name}")
        write(f"per test: {self.path}")


def register(config):
    """Called by conftest.py's pytest_configure."""
    path = config.getoption("compile_report")
    if path is None:
        return
    path = Path(path).resolve()
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:  # the main process (or the only one, with -n 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        parts, worker = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)), None
    else:
        parts, worker = Path(workerinput["compile_report_parts"]), workerinput["workerid"]
    config.pluginmanager.register(CompileReport(path, parts, worker), "compile-report")
