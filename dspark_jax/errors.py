"""The base class of the errors that mean bad input, as opposed to a bug in this package."""

from __future__ import annotations


class UserError(ValueError):
    """Input that cannot be used: a config, checkpoint, data file, argument or request.

    The message names the input and the problem. Programs report these in one line without a
    traceback; every other exception is a bug and keeps its traceback. A ValueError subclass, so
    callers that catch ValueError keep working.
    """
