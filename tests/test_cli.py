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

