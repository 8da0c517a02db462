"""`dspark-jax` errors: bad input is one line and exit status 2, a bug keeps its traceback."""

import sys
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
