"""Incremental detokenization: token ids arriving chunk by chunk -> text deltas.

Used wherever tokens are shown as they are generated: the server's event stream and the
`dspark-jax generate` console stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dspark_jax.tokenizer import decode_text


class TextStream:
    """Turns streamed token ids into text deltas that never split a multi-byte character.

    The whole text is decoded again each time, so pieces that only make sense together come out
    right; a tail of U+FFFD (an incomplete UTF-8 sequence so far) is held back until a later chunk
    completes it or the stream ends, and so is any text while decoding more tokens rewrites what
    was already sent. `stop_tokens` are left out of the text.
    """

    def __init__(self, tokenizer: Any, stop_tokens: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._stop_tokens = tuple(stop_tokens)
        self._ids: list[int] = []
        self._sent = ""

    def push(self, ids: Sequence[int]) -> str:
        """The text the new `ids` complete (possibly empty)."""
        self._ids += ids
        stable = decode_text(self._tokenizer, self._ids, self._stop_tokens).rstrip("\ufffd")
        if not stable.startswith(self._sent):
            return ""
        delta = stable[len(self._sent) :]
        self._sent = stable
        return delta

    def flush(self) -> str:
        """The rest of the text, incomplete characters included: the stream has ended."""
        text = decode_text(self._tokenizer, self._ids, self._stop_tokens)
        delta = text[len(self._sent) :]
        self._sent = text
        return delta
