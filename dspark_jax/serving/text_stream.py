"""Streamed token ids to text: incremental detokenization and stop strings.

Used wherever tokens are shown as they are generated: the server's event streams and the
`dspark-jax generate` console stream.

`TextStream` decodes only a short window of recent tokens per step instead of the whole answer
(whose cost would grow with its length at every chunk): the text a step adds is the window's
text minus the text of the window's first part, which also keeps tokenizers right whose pieces
decode differently at the start of a string (a leading space). Text ending in U+FFFD is an
incomplete UTF-8 sequence so far and waits for the next step. `stop_tokens` are left out of the
text, and so are special tokens unless `skip_special_tokens` is false.

Tokens that add no text never stay in the window, or every later step would re-decode the whole
run of them (quadratic in it: EOS pushed while a request sets ignore_eos, skipped special tokens).
Ids the decoding always drops (`stop_tokens`, special tokens that decode to "") are not added to
it at all, which changes no text. Other tokens that add nothing after a window that already has
text (and leave no incomplete character) are dropped from it too.

`StopStrings` finds stop strings in that text as it grows and holds back the tail that could
still become one, so a streamed client never sees part of a stop string. Where the stop string
belongs to the text (`include`), nothing is held back: the text up to the end of the first stop
string completed is released, and only a lookback of the released text (one character short of
the longest stop string) is kept to find stop strings that span pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dspark_jax.tokenizer import ByteTokenizer, decode_text

_INCOMPLETE = "\ufffd"


def _dropped_ids(
    tokenizer: Any, stop_tokens: Sequence[int], skip_special_tokens: bool
) -> Callable[[int], bool]:
    """Whether `decode_text` always leaves an id out: a stop token, or a special token (skipped
    by the decoding) whose own text is empty."""
    stops = frozenset(int(i) for i in stop_tokens)
    if isinstance(tokenizer, ByteTokenizer):
        return lambda i: i in stops or i >= 256
    if not skip_special_tokens:
        return stops.__contains__
    specials = getattr(tokenizer, "all_special_ids", None) or ()
    skipped = stops | {int(i) for i in specials if decode_text(tokenizer, [int(i)]) == ""}
    return skipped.__contains__


class TextStream:
    def __init__(
        self, tokenizer: Any, stop_tokens: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._stop_tokens = tuple(stop_tokens)
        self._skip_special = skip_special_tokens
        self._dropped = _dropped_ids(tokenizer, self._stop_tokens, skip_special_tokens)
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text was already returned

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self._ids[start:end]
        return decode_text(self._tokenizer, ids, self._stop_tokens, self._skip_special)

    def push(self, ids: Sequence[int]) -> str:
        """The text `ids` add (possibly empty while a character is incomplete)."""
        kept = [int(i) for i in ids if not self._dropped(int(i))]
        if not kept:
            return ""
        self._ids.extend(kept)
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        if text == done and done and not text.endswith(_INCOMPLETE):
            del self._ids[len(self._ids) - len(kept) :]  # no text and no pending character
            return ""
        if len(text) <= len(done) or text.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Everything not yet returned, incomplete characters included (the stream ended)."""
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        self._prefix = self._read = len(self._ids)
        return text[len(done) :]


class StopStrings:
    def __init__(self, stops: Sequence[str], include: bool = False):
        self._stops = tuple(stops)
        self._include = include  # the stop string ends the released text
        self._held = ""  # text not released yet (a tail that may begin a stop string)
        self._seen = ""  # released text kept to find stop strings that span pieces (`include`)
        self.matched = False

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str, armed: bool = True) -> str:
        """The part of the text so far that can be released; after a match (`matched`), the
        text up to the stop string (through it, with `include`), and nothing ever again.
        Unless `armed` (min_tokens not yet reached), a stop string in the text does not end it,
        but a tail that may begin one is still held: a stop string that the next armed text
        completes ends it there."""
        if self.matched:
            return ""
        if not self._stops:
            return text
        if self._include:
            return self._feed_included(text, armed)
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0] if armed else []
        if hits:
            self.matched = True
            self._held = ""
            return buf[: min(hits)]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def _feed_included(self, text: str, armed: bool) -> str:
        """`feed` where the stop string stays in the text: all of it up to the end of the first
        stop string completed in it (a match must end in `text`; one wholly in the lookback was
        seen before min_tokens armed the stops)."""
        seen = self._seen
        buf = seen + text
        ends = []
        for stop in self._stops if armed else ():
            at = buf.find(stop, max(0, len(seen) - len(stop) + 1))
            if at >= 0:
                ends.append(at + len(stop))
        if ends:
            self.matched = True
            self._seen = ""
            return buf[len(seen) : min(ends)]
        keep = max(len(s) for s in self._stops) - 1
        self._seen = buf[max(0, len(buf) - keep) :] if keep else ""
        return text

    def finish(self) -> str:
        """The held-back tail, released when generation ends without a match."""
        held, self._held = self._held, ""
        return "" if self.matched else held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that a stop string starts with."""
        longest = max(len(s) for s in self._stops) - 1
        for size in range(min(longest, len(buf)), 0, -1):
            tail = buf[len(buf) - size :]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0
