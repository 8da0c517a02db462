"""The base class of the errors that mean bad input, as opposed to a bug in this package, and the
integer test the checks of that input share."""

from __future__ import annotations

import numbers
import operator


class UserError(ValueError):
    """Input that cannot be used: a config, checkpoint, data file, argument or request.

    The message names the input and the problem. Programs report these in one line without a
    traceback; every other exception is a bug and keeps its traceback. A ValueError subclass, so
    callers that catch ValueError keep working.
    """


def as_integer(value: object) -> int | None:
    """`value` as an int when it is an integer: a Python int or a numpy integer scalar
    (`operator.index`). None for anything else, bool included (True would pass as 1) and floats
    included (2.0 usually means a division that was meant to be floor division, 2.5 a value
    that would be truncated)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def is_real(value: object) -> bool:
    """Whether `value` is a real number, a numpy scalar included; not a bool (True would pass as
    1), a string or None -- what a hand-edited JSON file or a Python caller may put instead."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class Terminated(KeyboardInterrupt):
    """An abort by SIGTERM (a scheduler's, `timeout`'s or a preemption's signal) rather than by
    Ctrl-C: raised where a KeyboardInterrupt would be, so code that cleans up after an interrupt
    does so after this too; the command line reports it with status 143 (128 + SIGTERM)."""
