"""A chat answer's text split into what the Chat Completions API returns apart: the model's
reasoning (`--reasoning-parser qwen3`) and its tool calls (`--tool-call-parser hermes`).

Both parsers take the answer's text as it streams, in pieces of any size (a marker may arrive
split across pieces), and give back at each piece what is certain by then, holding back only a
tail that could still become a marker. Fed the whole answer at once they give the same result,
so a streamed and a whole response agree.

Qwen3's reasoning sits between `<think>` and `</think>`: the answer opens with `<think>`, or the
prompt already opened it (the thinking-only models' templates end the generation prompt with
`<think>`). Text up to `</think>` is reasoning, the rest content; an answer cut short inside the
block is all reasoning. Whitespace around the markers (Qwen3 writes `<think>\\n ... \\n</think>
\\n\\n`) is layout, not text, and is left out of both.

Hermes-style tool calls (Qwen2.5's and Qwen3's chat templates, vLLM's `hermes` parser): each call
is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` in
the content. A block that does not hold such an object, or that the answer never closes, stays
in the content as the model wrote it.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
REASONING_PARSERS = ("qwen3",)
TOOL_CALL_PARSERS = ("hermes",)


def forced_call_start(name: str | None) -> str:
    """The start of a hermes call block that a tool_choice forcing a call writes for the model
    (at the end of the prompt): the block and its name's key, and the name itself and the
    arguments' key where the request names the function. The model writes the rest."""
    start = TOOL_START + '\n{"name": "'
    return start if name is None else f'{start}{name}", "arguments": '


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that `marker` starts with (short of all of it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[len(text) - size :]):
            return size
    return 0


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside a think block (its last `<think>` is not closed),
    so that the answer starts with reasoning."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


class ReasoningSplitter:
    """Qwen3's think block out of a streamed answer: `feed` and `finish` return (reasoning,
    content) released so far."""

    _BEGIN, _REASONING, _AFTER, _CONTENT = range(4)

    def __init__(self, open_at_start: bool = False):
        self._state = self._REASONING if open_at_start else self._BEGIN
        self._held = ""
        self._reasoning_started = False  # leading whitespace of the reasoning is dropped

    def feed(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        reasoning = content = ""
        while buf:
            if self._state == self._BEGIN:
                rest = buf.lstrip()
                if rest.startswith(THINK_START):
                    self._state, buf = self._REASONING, rest[len(THINK_START) :]
                elif THINK_START.startswith(rest):  # only whitespace, or part of the marker
                    self._held = buf
                    return reasoning, content
                else:
                    self._state = self._CONTENT
            elif self._state == self._REASONING:
                if not self._reasoning_started:
                    buf = buf.lstrip()
                    self._reasoning_started = bool(buf)
                    if not buf:
                        break
                end = buf.find(THINK_END)
                if end >= 0:
                    reasoning += buf[:end].rstrip()
                    self._state, buf = self._AFTER, buf[end + len(THINK_END) :]
                    continue
                # Hold back what could still become `</think>` and the whitespace before it.
                keep = _partial_tail(buf, THINK_END)
                body = buf[: len(buf) - keep]
                stripped = body.rstrip()
                self._held = body[len(stripped) :] + buf[len(buf) - keep :]
                reasoning += stripped
                break
            elif self._state == self._AFTER:
                buf = buf.lstrip()
                if buf:
                    self._state = self._CONTENT
            else:
                content += buf
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held: a cut-short marker is text of the part it sits in."""
        held, self._held = self._held, ""
        if self._state == self._REASONING:
            return held.rstrip(), ""
        if self._state == self._BEGIN:
            return "", held
        return "", held if self._state == self._CONTENT else ""

    @property
    def in_reasoning(self) -> bool:
        return self._state == self._REASONING


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the API carries it


def _parse_call(block: str) -> ToolCall | None:
    """The call a `<tool_call>` block holds, or None when it holds no `{"name": str,
    "arguments": object}` (arguments may also come as JSON text, or be left out)."""
    try:
        value = json.loads(block)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], arguments)


class ToolCallParser:
    """Hermes-style `<tool_call>` blocks out of streamed content: `feed` and `finish` return
    (content released, calls completed). With `single` (a request's `parallel_tool_calls:
    false`) the blocks after the first call are dropped."""

    def __init__(self, single: bool = False):
        self._single = single
        self._held = ""
        self._inside = False
        self._blank = ""  # whitespace after a call, released only if text follows it
        self.calls: list[ToolCall] = []

    def _text(self, text: str) -> str:
        """Content outside the blocks: between and after calls the model writes layout only,
        so whitespace there waits for text to come with."""
        if not self.calls:
            return text
        text, self._blank = self._blank + text, ""
        if text.strip():
            return text
        self._blank = text
        return ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        buf, self._held = self._held + text, ""
        content, calls = "", []
        while buf:
            if not self._inside:
                start = buf.find(TOOL_START)
                if start < 0:
                    keep = _partial_tail(buf, TOOL_START)
                    content += self._text(buf[: len(buf) - keep])
                    self._held = buf[len(buf) - keep :]
                    break
                content += self._text(buf[:start])
                self._inside, buf = True, buf[start:]
            else:
                end = buf.find(TOOL_END)
                if end < 0:
                    self._held = buf
                    break
                block = buf[: end + len(TOOL_END)]
                buf = buf[len(block) :]
                self._inside = False
                call = _parse_call(block[len(TOOL_START) : -len(TOOL_END)])
                if call is None:
                    content += self._text(block)
                elif not (self._single and self.calls):
                    self.calls.append(call)
                    calls.append(call)
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The held tail: part of a marker, or a block the answer never closed, is content."""
        held, self._held = self._held, ""
        self._inside = False
        return (self._text(held) if held else ""), []


@dataclasses.dataclass
class Piece:
    """What one piece of an answer adds to each part of the message."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = dataclasses.field(default_factory=list)
    first_call: int = 0  # the index of `calls[0]` among the answer's calls

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclasses.dataclass(frozen=True)
class Parts:
    """A whole answer's message parts; None where the answer has none of that part."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]


class ChatOutput:
    """One chat choice's text through the parsers its request uses (either may be off)."""

    def __init__(
        self,
        reasoning: bool = False,
        open_at_start: bool = False,
        tools: bool = False,
        single_call: bool = False,
    ):
        self._splitter = ReasoningSplitter(open_at_start) if reasoning else None
        self._tools = ToolCallParser(single_call) if tools else None
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []

    def _take(self, reasoning: str, content: str, finish: bool) -> Piece:
        calls: list[ToolCall] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if finish:
                tail, _ = self._tools.finish()
                content += tail
        self.reasoning.append(reasoning)
        self.content.append(content)
        self.calls += calls
        return Piece(reasoning, content, calls, len(self.calls) - len(calls))

    def feed(self, text: str) -> Piece:
        if self._splitter is None:
            return self._take("", text, False)
        return self._take(*self._splitter.feed(text), False)

    def finish(self) -> Piece:
        if self._splitter is None:
            return self._take("", "", True)
        return self._take(*self._splitter.finish(), True)

    def parts(self) -> Parts:
        """The answer's parts once it has been fed and finished. Content is null where the
        parsers took all of the text (an answer that only reasoned, or only called tools); the
        whitespace around calls is dropped."""
        reasoning = "".join(self.reasoning) or None
        content = "".join(self.content)
        if self.calls:
            content = content.strip()
        empty = not content and (reasoning is not None or self.calls)
        return Parts(reasoning, None if empty else content, list(self.calls))

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an answer that ended by itself after calling tools."""
        return "tool_calls" if self.calls and reason == "stop" else reason
