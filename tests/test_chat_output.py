"""The chat answer parsers: Qwen3's reasoning block and hermes-style tool calls, whole and streamed
in pieces of every size (markers split across pieces)."""

from __future__ import annotations

import json
import random

import pytest

from dspark_jax.serving.chat_output import (
    ChatOutput,
    ReasoningSplitter,
    ToolCallParser,
    opens_reasoning,
)


def _pieces(text: str, rng: random.Random) -> list[str]:
    """`text` cut at random places (pieces of 1 to 6 characters)."""
    cuts, i = [], 0
    while i < len(text):
        step = rng.randint(1, 6)
        cuts.append(text[i : i + step])
        i += step
    return cuts


def _split(text: str, pieces: list[str] | None = None, open_at_start: bool = False):
    splitter = ReasoningSplitter(open_at_start)
    reasoning = content = ""
    for piece in pieces if pieces is not None else [text]:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    "text, open_at_start, reasoning, content",
    [
        # Qwen3's layout: newlines around the markers are layout, not text.
        (
            "<think>\nLet me add.\n2 + 2 = 4.\n</think>\n\nIt is 4.",
            False,
            "Let me add.\n2 + 2 = 4.",
            "It is 4.",
        ),
        # The thinking-only templates open the block in the prompt.
        ("Let me add.\n</think>\n\nIt is 4.", True, "Let me add.", "It is 4."),
        # No block: all content, whitespace and all (thinking disabled, or a model that skips it).
        ("  It is 4.\n", False, "", "  It is 4.\n"),
        # Cut short inside the block: all reasoning.
        ("<think>\nStill thinking </thi", False, "Still thinking </thi", ""),
        ("Still thinking", True, "Still thinking", ""),
        # An empty block, and a `<think>` later in the text, which is content.
        ("<think>\n\n</think>\n\nHi <think> there", False, "", "Hi <think> there"),
        ("<thinking> is a word", False, "", "<thinking> is a word"),
        ("<thi", False, "", "<thi"),
        ("", False, "", ""),
    ],
)
def test_reasoning_split_whole_and_in_every_cut(text, open_at_start, reasoning, content):
    assert _split(text, open_at_start=open_at_start) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(200):
        assert _split(text, _pieces(text, rng), open_at_start) == (reasoning, content)
    # One character at a time: every marker arrives split.
    assert _split(text, list(text), open_at_start) == (reasoning, content)


def test_reasoning_is_released_as_it_streams_holding_only_a_possible_marker():
    splitter = ReasoningSplitter()
    assert splitter.feed("<think>\nStep one") == ("Step one", "")
    assert splitter.feed(".\n</th") == (".", "")  # the newline and "</th" wait
    assert splitter.in_reasoning
    assert splitter.feed("ink>\n\nDone") == ("", "Done")
    assert splitter.feed(" now") == ("", " now")
    assert splitter.finish() == ("", "")


def test_the_prompt_tail_says_whether_the_block_is_open():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n")


CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n'
    "</tool_call>"
)


def _tools(text: str, pieces: list[str] | None = None, single: bool = False):
    parser = ToolCallParser(single)
    content, calls = "", []
    for piece in pieces if pieces is not None else [text]:
        c, new = parser.feed(piece)
        content, calls = content + c, calls + new
    c, new = parser.finish()
    return content + c, [(call.name, json.loads(call.arguments)) for call in calls + new]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (CALL, "", [("get_weather", {"city": "Paris", "unit": "°C"})]),
        (
            "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"),
            "Let me look.\n",
            [
                ("get_weather", {"city": "Paris", "unit": "°C"}),
                ("get_weather", {"city": "Oslo", "unit": "°C"}),
            ],
        ),
        # Arguments as JSON text, or left out.
        (
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
            "",
            [("f", {"x": 1})],
        ),
        ('<tool_call>{"name": "now"}</tool_call>', "", [("now", {})]),
        # Not a call: the block stays in the content as written.
        ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),
        (
            '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
            '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
            [],
        ),
        # Never closed (cut short): content.
        ('Sure <tool_call>{"name": "f"', 'Sure <tool_call>{"name": "f"', []),
        ("a < b <tool", "a < b <tool", []),
    ],
)
def test_tool_calls_whole_and_in_every_cut(text, content, calls):
    assert _tools(text) == (content, calls)
    rng = random.Random(1)
    for _ in range(200):
        assert _tools(text, _pieces(text, rng)) == (content, calls)
    assert _tools(text, list(text)) == (content, calls)


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = CALL + "\n" + CALL.replace("Paris", "Oslo")
    assert _tools(text, single=True)[1] == [("get_weather", {"city": "Paris", "unit": "°C"})]


def test_calls_get_distinct_ids_and_their_index_among_the_answer():
    output = ChatOutput(tools=True)
    first = output.feed(CALL)
    second = output.feed("\n" + CALL)
    assert (first.first_call, second.first_call) == (0, 1)
    ids = [call.id for call in output.calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    output.finish()
    assert output.finish_reason("stop") == "tool_calls"
    assert output.finish_reason("length") == "length"  # cut short: the client must know
    parts = output.parts()
    assert parts.content is None and parts.reasoning is None and len(parts.calls) == 2


def test_reasoning_then_a_call_then_nothing_else():
    text = "<think>\nThe user wants the weather.\n</think>\n\n" + CALL + "\n"
    output = ChatOutput(reasoning=True, tools=True)
    rng = random.Random(2)
    for piece in _pieces(text, rng):
        output.feed(piece)
    output.finish()
    parts = output.parts()
    assert parts.reasoning == "The user wants the weather."
    assert parts.content is None
    assert [c.name for c in parts.calls] == ["get_weather"]


def test_without_a_block_the_reasoning_part_is_null_and_content_kept():
    output = ChatOutput(reasoning=True)
    output.feed("Just the answer.")
    output.finish()
    parts = output.parts()
    assert (parts.reasoning, parts.content, parts.calls) == (None, "Just the answer.", [])
    only_thought = ChatOutput(reasoning=True, open_at_start=True)
    only_thought.feed("hmm")
    only_thought.finish()
    assert (only_thought.parts().reasoning, only_thought.parts().content) == ("hmm", None)
