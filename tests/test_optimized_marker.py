"""tests/conftest.py compiles the test run's programs without XLA's optimizations on the CPU
(compiling is most of a test's time there), except for tests marked `optimized`, whose time is
running them: in the test's own process and in the processes it starts."""

import os
import subprocess
import sys
from types import SimpleNamespace

import conftest
import jax
import pytest

SETTING = "jax_disable_most_optimizations"
# Elsewhere (benchmarks/gpu_session.sh) the tests compile as the product does.
pytestmark = pytest.mark.skipif(
    os.environ["JAX_PLATFORMS"] != "cpu", reason="the test run's setting for the CPU"
)


def _in_a_child() -> bool:
    code = f"import jax; print(jax.config.read({SETTING!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {"True": True, "False": False}[done.stdout.strip()]


def test_an_unmarked_test_compiles_unoptimized_and_so_do_its_children():
    assert jax.config.read(SETTING) is True
    assert _in_a_child() is True


@pytest.mark.optimized
def test_a_marked_test_compiles_optimized_and_so_do_its_children():
    assert jax.config.read(SETTING) is False
    assert _in_a_child() is False


def test_the_setting_comes_back_after_a_marked_test():
    # Runs after the marked test (one file's tests run in order, on one worker).
    assert jax.config.read(SETTING) is True
    assert _in_a_child() is True


def test_a_module_marked_as_a_whole_is_optimized_from_its_module_fixtures_on():
    # The module-scoped fixture's request: its node is the module, carrying `pytestmark`.
    marks = {"optimized": pytest.mark.optimized.mark}
    module = SimpleNamespace(node=SimpleNamespace(get_closest_marker=marks.get))
    with pytest.MonkeyPatch.context() as patch:
        steps = conftest._optimizations_on(module, patch)
        next(steps)
        assert jax.config.read(SETTING) is False
        assert _in_a_child() is False
        assert next(steps, "done") == "done"
    assert jax.config.read(SETTING) is True
    assert _in_a_child() is True
