"""`dspark-jax` errors: bad input is one line and exit status 2, a bug keeps its traceback."""

import gc
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from dspark_jax import cli
from dspark_jax.config import ConfigError
from dspark_jax.decoding.engine import EngineError
from dspark_jax.errors import UserError


@pytest.fixture
def command(monkeypatch):
    """Registers a command `fake` whose run raises the exception given to the returned setter."""
    module = types.ModuleType("_fake_command")
    module.add_arguments = lambda parser: None
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, "fake", (module.__name__, "raises what the test says"))

    def raising(error: BaseException) -> None:
        def run(args):
            raise error

        module.run = run

    return raising


@pytest.mark.parametrize(
    "error",
    [
        UserError("bad --flag"),
        ConfigError("bad config"),
        FileExistsError("out exists"),
        EngineError("prompt too long"),
    ],
)
def test_bad_input_is_one_line_with_status_2(command, capsys, error):
    command(error)
    assert cli.main(["fake"]) == 2
    assert capsys.readouterr().err == f"dspark-jax fake: error: {error}\n"


@pytest.mark.parametrize("error", [ValueError("a bug"), KeyError("a bug"), TypeError("a bug")])
def test_a_bug_keeps_its_traceback(command, error):
    command(error)
    with pytest.raises(type(error)):
        cli.main(["fake"])


def test_interrupt_is_status_130(command, capsys):
    command(KeyboardInterrupt())
    assert cli.main(["fake"]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_an_interrupted_import_is_an_interrupt(command, capsys):
    """numpy turns a KeyboardInterrupt inside its import into an ImportError."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise ImportError("numpy._core.multiarray failed to import") from e
    except ImportError as e:
        error = e
    command(error)
    assert cli.main(["fake"]) == 130
    assert capsys.readouterr().err == "dspark-jax fake: interrupted\n"


def test_an_interrupt_swallowed_by_a_gc_callback_is_delivered_again(monkeypatch, capsys):
    """A Ctrl-C that lands in a garbage-collection callback (JAX registers one) cannot propagate
    and is reported as unraisable; the command used to run on to its end and exit 0."""
    module = types.ModuleType("_slow_command")
    module.add_arguments = lambda parser: None
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, "slow", (module.__name__, "works for two seconds"))

    def interrupting_callback(phase, info):
        gc.callbacks.remove(interrupting_callback)
        raise KeyboardInterrupt

    def run(args):
        gc.callbacks.append(interrupting_callback)
        gc.collect()
        for _ in range(200):
            time.sleep(0.01)
        return 0

    module.run = run
    # Python's own Ctrl-C handler, as in a terminal: a shell starts background jobs (a CI
    # runner's, say) with SIGINT ignored, and then no interrupt can be delivered at all.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cli.main(["slow"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
        if interrupting_callback in gc.callbacks:
            gc.callbacks.remove(interrupting_callback)
    assert capsys.readouterr().err.endswith("dspark-jax slow: interrupted\n")


# A child of a background job inherits SIGINT ignored (a shell starts background jobs so, a CI
# runner's for one); the scripts below take Python's own handler, as in a terminal.
_AS_IN_A_TERMINAL = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"

_ANNOUNCE_COMPILING = _AS_IN_A_TERMINAL + """
import sys
from dspark_jax.decoding.engine import Engine
warm_up = Engine.warm_up
def announced(self, *args, **kwargs):
    print("compiling", file=sys.stderr, flush=True)
    return warm_up(self, *args, **kwargs)
Engine.warm_up = announced
from dspark_jax.cli import main
sys.argv = ["dspark-jax", "generate", "--max-new-tokens", "64"]
sys.exit(main())
"""


def test_ctrl_c_while_compiling_exits_130(tmp_path):
    """The console script, interrupted while XLA compiles the engine on its threads: leaving
    the interpreter the usual way crashed in teardown (SIGSEGV, status 139) in every try."""
    env = {**os.environ, "DSPARK_JAX_COMPILATION_CACHE": "off", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _ANNOUNCE_COMPILING],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
        cwd=tmp_path,
        text=True,
    )
    try:
        assert proc.stderr.readline() == "compiling\n"
        time.sleep(1.0)  # well into compilation (several seconds on a CPU, uncached)
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 130, err
    finally:
        proc.kill()
    assert err == "dspark-jax generate: interrupted\n"
    assert list(tmp_path.iterdir()) == []


_CTRL_C_IN_TEARDOWN = _AS_IN_A_TERMINAL + """
import atexit, os, signal, sys, time
def ctrl_c_in_teardown():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
atexit.register(ctrl_c_in_teardown)  # runs among JAX's exit handlers, if teardown runs at all
from dspark_jax.cli import main
sys.argv = ["dspark-jax", "export", "--draft", sys.argv[1], "--out", sys.argv[2]]
sys.exit(main())
"""


def test_ctrl_c_after_the_output_is_written_changes_nothing(tmp_path):
    """Once 'wrote OUT' is printed the command is done: a Ctrl-C in the interpreter's teardown
    printed a KeyboardInterrupt traceback (or ended the process by the signal, status 130)."""
    from dspark_jax.embedded import TINY_DRAFT

    argv = [sys.executable, "-c", _CTRL_C_IN_TEARDOWN, str(TINY_DRAFT), str(tmp_path / "x")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"wrote {tmp_path / 'x'} (reference layout)\n"


_TRAIN_INTERRUPTED = _AS_IN_A_TERMINAL + """
import atexit, os, signal, sys
atexit.register(lambda: print("teardown ran", file=sys.stderr, flush=True))
SIG, OUT = getattr(signal, sys.argv[1]), sys.argv[2]
from dspark_jax.training import trainer
make_train_step = trainer.make_train_step
def interrupted(*args, **kwargs):  # the signal comes as the first step is built
    os.kill(os.getpid(), SIG)
    return make_train_step(*args, **kwargs)
trainer.make_train_step = interrupted
from dspark_jax.cli import main
sys.argv = ["dspark-jax", "train", "--config", "tiny-dspark", "--output", OUT,
            "--steps", "2", "--no-progress", "--no-export"]
sys.exit(main())
"""


@pytest.mark.parametrize("sig, said", [("SIGINT", "interrupted"), ("SIGTERM", "terminated")])
def test_interrupted_train_ends_without_interpreter_teardown(sig, said, tmp_path):
    """train, stopped while it set up (XLA compiling on its threads), crashed in the
    interpreter's teardown (SIGSEGV) in one try of five; once its own handling is done (nothing
    trained: what it set up removed) the process ends at once, so no exit handler runs."""
    run = tmp_path / "run"
    env = {**os.environ, "DSPARK_JAX_COMPILATION_CACHE": "off"}
    argv = [sys.executable, "-c", _TRAIN_INTERRUPTED, sig, str(run)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    code = 128 + getattr(signal, sig)
    assert done.returncode == code, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == f"dspark-jax train: {said}", done.stderr[-3000:]
    assert "teardown ran" not in done.stderr
    assert not run.exists()


def test_unknown_option_is_blamed_on_its_command(capsys):
    """The message and the help it points at are the subcommand's, not the top level's."""
    assert cli.main(["generate", "--bogus"]) == 2
    assert capsys.readouterr().err == (
        "dspark-jax generate: error: unrecognized arguments: --bogus "
        "(see dspark-jax generate --help)\n"
    )


@pytest.mark.parametrize(
    "value, reason",
    [
        ("0,1,1", "mesh axis sizes must be positive or -1, got (0, 1, 1)"),
        ("-1,-1,1", "at most one mesh axis may be -1"),
        ("1,2", "expected three sizes data,fsdp,tensor like -1,1,1, got '1,2'"),
        ("x", "expected three integers"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "train"])
def test_a_bad_mesh_says_why(command, value, reason, capsys):
    assert cli.main([command, f"--mesh={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dspark-jax {command}: error: argument --mesh: {reason}"), err
    assert "invalid" not in err


def test_a_mesh_may_start_with_minus_one():
    """`--mesh -1,1,1` (a space, not `=`) is a value, not an unknown option."""
    from dspark_jax.sharding import MeshConfig

    args = cli._parser("generate").parse_args(["generate", "--mesh", "-1,1,1"])
    assert args.mesh == MeshConfig(-1, 1, 1)


def test_help_says_what_profile_times_and_points_at_shipped_docs(capsys):
    """profile's default --mode round times the drafter too, not only the target's
    verification; eval's --datasets-dir help named a path of a development machine."""
    assert cli.main(["--help"]) == 0
    assert "speculative rounds (or of verification alone)" in capsys.readouterr().out
    assert cli.main(["eval", "--help"]) == 0
    out = capsys.readouterr().out
    assert "../shared" not in out and "docs/eval-datasets.md" in out
