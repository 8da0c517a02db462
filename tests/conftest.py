import os
import shutil
import tempfile

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


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


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
