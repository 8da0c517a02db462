"""Every command line the README and docs/ show -- `dspark-jax ...` and `python
benchmarks/....py ...`, the commands behind the recorded numbers among them -- is one the command
still takes: parsed by its own parser, nothing run. A renamed or dropped option fails here
instead of in a reader's terminal.

Those in fenced code blocks all count; optional parts written `[--flag value]` are checked both
left out and given, and shell variables (`$i`) stand for a value. Code spans in the prose count
where they give options and no placeholder (`--slots S`, `<folder>`)."""

from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import shlex
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from dspark_jax.cli import COMMANDS, _parser

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"dspark-jax\s.*|python3? benchmarks/\S+\.py.*")
# What may stand before a command: environment assignments, `time`, a subshell's parenthesis.
PREFIX = re.compile(r"(?:\(\s*|time\s+|[A-Za-z_]\w*=(?:\"[^\"]*\"|'[^']*'|\S*)\s+)*")
# Placeholders a reader fills in: `--slots S`, `<folder>`, `a_1,...,a_7`, `{0,1}`, `[options]`.
PLACEHOLDER = re.compile(r"\s[A-Z_]+\b|<|\.\.\.|\{|\[options")


def _commands_in(text: str) -> list[str]:
    """The command lines `text` runs: each piece between `&&`, `;`, `|` and `&` that starts
    with one (after environment assignments), up to any redirection or comment."""
    found = []
    for piece in re.split(r"\s(?:&&|;|\||&)(?:\s|$)|\s#", text):
        match = COMMAND.match(PREFIX.sub("", piece.strip(), count=1))
        if match:
            found.append(re.split(r"\s\d?>", match.group(0))[0].strip())
    return found


def _documented_commands() -> list[tuple[str, str]]:
    """(where, command line) of each command the docs show: in fenced code blocks (continuation
    lines joined), and in the prose's code spans that give options without placeholders; a
    span naming a command alone (`dspark-jax train`) is a name, not a command line, and
    docs/errors.md's spans are wrong on purpose."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                found += [(doc.name, command) for command in _commands_in(line)]
        if doc.name == "errors.md":
            continue
        prose = re.sub(r"\s+", " ", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
        for span in re.findall(r"`([^`]+)`", prose):
            found += [
                (doc.name, command)
                for command in _commands_in(span)
                if " -" in command and not PLACEHOLDER.search(command)
            ]
    return found


def _variants(command: str) -> list[list[str]]:
    """The argument lists `command` stands for: its `[...]` parts all left out, and all given;
    a shell variable as a value, and a closing `...` (more options) left out."""
    command = re.sub(r"\$\{?\w+\}?", "1", command)
    command = re.sub(r"\s\.\.\.$", "", command)
    left_out = re.sub(r"\s*\[[^\]]*\]", "", command)
    given = re.sub(r"\[([^\]]*)\]", r"\1", command)
    return [shlex.split(v) for v in dict.fromkeys([left_out, given])]


COMMANDS_SHOWN = _documented_commands()


def test_the_docs_show_commands_of_both_kinds():
    """The collection itself works: both kinds are found where the docs are known to have them
    (the README's quick start, docs/benchmarks.md's GPU session)."""
    shown = {(where, command.split()[0]) for where, command in COMMANDS_SHOWN}
    assert ("README.md", "dspark-jax") in shown and ("benchmarks.md", "python") in shown
    assert len(COMMANDS_SHOWN) > 20


class _Parsed(Exception):
    """Raised by the stand-in parse: the command line parsed; the script's work never starts."""


def _parse_benchmark(monkeypatch, argv: list[str]) -> None:
    """Runs the benchmark script's `main` as `python argv...` would, up to its parse (a
    script may look at some arguments first with `parse_known_args`, as lowering_time.py does
    for the platform, before its whole parse)."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise _Parsed

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = importlib.import_module(Path(argv[0]).stem)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "argv", argv)
    environ = dict(os.environ)
    try:
        with pytest.raises(_Parsed):
            module.main()
    finally:  # what a script sets for its own run (a log level) stays out of the other tests
        os.environ.clear()
        os.environ.update(environ)


@pytest.mark.parametrize(
    "where, command", COMMANDS_SHOWN, ids=[f"{w}:{c[:60]}" for w, c in COMMANDS_SHOWN]
)
def test_a_documented_command_line_parses(monkeypatch, where, command):
    for argv in _variants(command):
        err = io.StringIO()
        try:
            with redirect_stderr(err), redirect_stdout(io.StringIO()):
                if argv[0] == "dspark-jax":
                    name = argv[1] if argv[1] in COMMANDS else None
                    assert name or argv[1].startswith("-"), f"{where}: no command {argv[1]!r}"
                    _parser(name).parse_args(argv[1:])
                else:
                    _parse_benchmark(monkeypatch, argv[1:])
        except SystemExit as refused:
            if refused.code:  # --help ends with status 0
                pytest.fail(f"{where}: {' '.join(argv)}\n{err.getvalue().strip()}")
