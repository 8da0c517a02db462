import os
import shutil
import tempfile

import compile_report
import pytest

from dspark_jax.cli import compilation_cache_off

# Tests run on CPU; eight host devices let sharding tests build real meshes on one machine.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# On a GPU (benchmarks/gpu_session.sh), XLA and the Triton kernels take float32 matmuls in TF32
# by default, a 10-bit mantissa: the float32 parity tests hold float32 math to the reference, so
# there they ask for full float32 products. (On CPU float32 products are exact already.)
if os.environ["JAX_PLATFORMS"] != "cpu":
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

# On the CPU most of the test run is XLA compiling programs, not running them, so there tests
# compile with JAX's `jax_disable_most_optimizations` (LLVM at -O0, none of its expensive
# passes): measured 2026-12-07 on the 2-core CI machine, the gated fixture engine's programs
# compiled in 21 s instead of 36 s and then ran 3x slower. Tests whose time is running their
# programs (the statistical ones above all) are marked `optimized` and compile with every
# optimization (the `_optimized` fixtures below). The setting travels in the environment, so
# the commands tests run as child processes compile the same way. `dspark-jax generate` in CI,
# and every test on a GPU, compile as users do (docs/benchmarks.md, "The default test run's
# time").
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# The servers tests start (in-process and as child processes) take no API key from the
# developer's environment: their clients send none, except where a test sets one itself.
os.environ.pop("DSPARK_JAX_API_KEY", None)

# Compiled programs go to a persistent cache private to this test session (both xdist workers
# and the processes tests start inherit it): commands run in-process use it through
# DSPARK_JAX_COMPILATION_CACHE, everything else through JAX's own setting. Many tests build an
# engine whose programs another test already compiled (the same fixture models, configuration
# and policy): on this CPU a decode program takes 8-20 s to compile and seconds to run.
# The process that makes the folder (pytest's main process; xdist workers inherit the variable)
# removes it when the run ends, so repeated runs do not pile up caches of ~80 MB in /tmp.
_OWN_CACHE = None
if "DSPARK_JAX_COMPILATION_CACHE" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="dspark-jax-test-xla-")
    os.environ["DSPARK_JAX_COMPILATION_CACHE"] = _OWN_CACHE
# DSPARK_JAX_COMPILATION_CACHE=off (the commands' way to turn the cache off) turns it off here
# too, rather than naming a folder "off". (dspark_jax.cli does not import JAX, which must read
# JAX_COMPILATION_CACHE_DIR when it is first imported.)
if not compilation_cache_off(os.environ["DSPARK_JAX_COMPILATION_CACHE"]):
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["DSPARK_JAX_COMPILATION_CACHE"])


# The gated fixture pair, an engine over it that adjusts logits (`ADJUSTED_CFG`: penalties and
# up to 3 logit-bias entries), the same without a drafter and without the adjustments, and three
# of its reference prompts, for the tests of those adjustments; loaded and built once per worker
# (building an engine traces and lowers its programs again, even where the persistent cache
# holds them compiled).
@pytest.fixture(scope="session")
def gated_pair():
    from fixture_models import load_pair

    return load_pair("gated")


@pytest.fixture(scope="session")
def adjusted_engine(gated_pair):
    from fixture_models import ADJUSTED_CFG

    from dspark_jax.decoding.engine import Engine

    return Engine(*gated_pair, ADJUSTED_CFG)


@pytest.fixture(scope="session")
def adjusted_plain_engine(gated_pair):
    """`adjusted_engine` without its drafter: plain decoding with the same adjustments."""
    from fixture_models import ADJUSTED_CFG

    from dspark_jax.decoding.engine import Engine

    return Engine(gated_pair[0], None, ADJUSTED_CFG)


@pytest.fixture(scope="session")
def unadjusted_engine(gated_pair):
    """`adjusted_engine` built without room for penalties or biases: what requests that ask
    for no adjustment must get beside the ones that do."""
    import dataclasses

    from fixture_models import ADJUSTED_CFG

    from dspark_jax.decoding.engine import Engine

    cfg = dataclasses.replace(ADJUSTED_CFG, penalties=False, max_logit_bias=0)
    return Engine(*gated_pair, cfg)


@pytest.fixture(scope="session")
def gated_prompts():
    from fixture_models import reference_traces

    return [t["prompt"] for t in reference_traces("gated")["traces"][:3]]


# Seconds the slowest test files take on the 2-core CI machine (sums of --durations in the
# fresh-clone CI of 403ffb6, 2026-12-07; the logit-adjustment files less the 14% they saved
# since), only to order them: the two xdist workers take whole files (--dist loadfile) in
# collection order (--no-loadscope-reorder), so the longest go first and the short ones fill in
# at the end (longest-first list scheduling), instead of a long file starting last while the
# other worker has nothing left. Files not named here follow, in their usual order; a stale
# number costs at most some idle time at the end of a run, never a test.
FILE_SECONDS = {
    "test_engine.py": 328,
    "test_mesh_decoding.py": 263,
    "test_scheduled_engine.py": 201,
    "test_train_resume.py": 199,
    "test_decode_commands.py": 145,
    "test_benchmark_tools.py": 131,
    "test_sampling.py": 128,
    "test_scheduled_lossless.py": 121,
    "test_attention.py": 117,
    "test_python_api.py": 115,
    "test_train_truth.py": 91,
    "test_serve_command.py": 82,
    "test_sts_engine.py": 80,
    "test_lossless.py": 79,
    "test_gpu_lowering.py": 77,
    "test_prefix_cache.py": 76,
    "test_notebook.py": 75,
    "test_penalties.py": 74,
    "test_verify.py": 66,
    "test_openai_server.py": 64,
    "test_layout.py": 61,
    "test_policy_switch.py": 60,
    "test_policies.py": 57,
    "test_heads.py": 56,
    "test_train_tiny.py": 47,
    "test_train_step.py": 45,
    "test_train_multihost.py": 44,
    "test_convert.py": 43,
    "test_mesh_serving.py": 42,
    "test_known_acceptance.py": 41,
    "test_logit_bias.py": 41,
    "test_transformers_parity.py": 41,
    "test_bad_input.py": 40,
    "test_calibrate_profile_cli.py": 39,
    "test_fixture_parity.py": 35,
}


def pytest_addoption(parser):
    parser.addoption(
        "--compile-report",
        metavar="PATH",
        help="write each test's wall, XLA compile and cache figures to PATH (JSON lines) and "
        "print the files that take longest (tests/compile_report.py)",
    )


def pytest_configure(config):
    compile_report.register(config)


def pytest_collection_modifyitems(config, items):
    # A stable sort: each file's tests keep their order, and so do the files not named.
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def _optimizations_on(request, monkeypatch):
    """Compiles with XLA's optimizations while the test or module that `request` is for runs, if
    it is marked `optimized`: in this process, and in the processes it starts."""
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    # Imported here: the module's top sets the environment jax reads when it is imported.
    import jax

    saved = jax.config.read("jax_disable_most_optimizations")
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", saved)


# Two scopes: a module marked as a whole (`pytestmark`) builds engines in module fixtures,
# which set up before any test's own fixtures.
@pytest.fixture(scope="module", autouse=True)
def _optimized_module(request):
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield from _optimizations_on(request, monkeypatch)


@pytest.fixture(autouse=True)
def _optimized(request, monkeypatch):
    yield from _optimizations_on(request, monkeypatch)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent compilation cache shared by the runs of one test module (a child process
    reaches it through `train_helpers.child_env`)."""
    # Imported here: the module's top sets the environment jax reads when it is imported.
    import jax

    cache = tmp_path_factory.mktemp("jax-cache")
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    saved = {n: getattr(jax.config, n) for n in names}
    for name, value in zip(names, (str(cache), 0, 0), strict=True):
        jax.config.update(name, value)
    yield cache
    for name, value in saved.items():
        jax.config.update(name, value)


@pytest.fixture
def transformers_log(caplog):
    """`caplog`, seeing transformers' records too: its library logger does not propagate to the
    root logger caplog listens on, so without this an assertion that transformers logged
    nothing cannot fail."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        yield caplog
    finally:
        hf_logging.disable_propagation()
