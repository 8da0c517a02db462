"""Conversations in JSON lines: the record formats every program reads, parsed in one place.

A record is one conversation, either

    {"turns": [str, ...]}                               the DeepSpec benchmark prompts: user turns
    {"messages": [{"role": str, "content": str}, ...]}  chat format, explicit roles
    {"conversations": [{"role": ..., "content": ...}]}  the same, as DeepSpec's training data

Prompts (`dspark-jax generate --prompts-file`, `eval`, the benchmarks) take the user turns of
`turns` records and answer them one by one. Training needs to know which text is an answer, so it
reads `messages` / `conversations` as they are, and `turns` only as its caller declares them
(`TURNS_AS`): "prompts" (user turns only, the benchmark format: nothing to train on) or "dialogue"
(alternating user and assistant messages).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark_jax.errors import UserError

_ROLES = ("user", "assistant")
# How `turns` records are read as chat messages: the benchmark prompt format, or dialogues.
TURNS_AS = ("prompts", "dialogue")
# Keys of records with explicit roles: ours, and DeepSpec's regenerated training data.
_MESSAGE_KEYS = ("messages", "conversations")


class ConversationError(UserError):
    """A record, line or prompts file that does not hold a conversation."""


def parse_line(line: str | bytes) -> Any:
    """The JSON value of one line."""
    try:
        return json.loads(line)
    except UnicodeDecodeError as e:
        raise ConversationError(f"not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ConversationError(f"malformed JSON ({e})") from None


def _check_object(record: Any) -> Mapping[str, Any]:
    if not isinstance(record, Mapping):
        raise ConversationError(f"record is a {type(record).__name__}, not an object")
    return record


def _check_text(text: str, what: str) -> None:
    """Refuses a string that is not text: JSON can escape a lone UTF-16 surrogate ("\\ud800"),
    which `json.loads` accepts but no tokenizer can encode (UTF-8 has no such character)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConversationError(
            f"{what} holds a lone UTF-16 surrogate {text[e.start]!r} at character {e.start} "
            "(an unpaired \\uXXXX escape in the JSON), which is not text and cannot be encoded"
        ) from None


def _turns(record: Mapping[str, Any]) -> list[str]:
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ConversationError("'turns' must be a non-empty list of strings")
    for i, t in enumerate(turns):
        _check_text(t, f"turns[{i}]")
    return list(turns)


def record_turns(record: Any) -> list[str]:
    """The turns of a `{"turns": [str, ...]}` record."""
    if "turns" not in _check_object(record):
        raise ConversationError(f"record has no 'turns' (keys: {sorted(record)})")
    return _turns(record)


def is_turns_record(record: Any) -> bool:
    """Whether `record` is a `{"turns": [...]}` record (roles not stated)."""
    return (
        isinstance(record, Mapping)
        and "turns" in record
        and not any(k in record for k in _MESSAGE_KEYS)
    )


def record_messages(record: Any, *, turns: str = "prompts") -> list[dict[str, str]]:
    """The chat messages of a record: its `messages` (or `conversations`) as they are, or its
    `turns` read as `turns` says ("prompts": every turn a user message; "dialogue": alternating
    user and assistant messages)."""
    if turns not in TURNS_AS:
        raise ConversationError(f"turns must be one of {TURNS_AS}, got {turns!r}")
    record = _check_object(record)
    for key in _MESSAGE_KEYS:
        if key not in record:
            continue
        messages = record[key]
        if not isinstance(messages, list) or not messages:
            raise ConversationError(f"'{key}' must be a non-empty list")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, Mapping)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise ConversationError(f"{key}[{i}] needs string 'role' and 'content': {m!r:.200}")
            _check_text(m["role"], f"{key}[{i}] 'role'")
            _check_text(m["content"], f"{key}[{i}] 'content'")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if "turns" in record:
        if turns == "prompts":
            return [{"role": "user", "content": t} for t in _turns(record)]
        return [{"role": _ROLES[i % 2], "content": t} for i, t in enumerate(_turns(record))]
    raise ConversationError(
        f"record has none of 'messages', 'conversations', 'turns' (keys: {sorted(record)})"
    )


def read_turns(
    path: str | Path, limit: int | None = None, *, plain_lines: bool = False
) -> list[list[str]]:
    """The turns of each conversation in a JSONL file of `{"turns": [...]}` records.

    Blank lines are skipped; `limit` keeps the first conversations only. With `plain_lines`, a
    line that does not start with "{" is a one-turn prompt as it stands (a plain prompts file).
    A UTF-8 byte order mark (which some editors write) is not part of the first line.
    """
    path = Path(path)
    if path.is_dir():
        raise ConversationError(f"{path}: is a folder, not a prompts file")
    if not path.is_file():
        raise ConversationError(f"{path}: no such prompts file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConversationError(f"{path}: cannot read ({e.strerror})") from None
    lines = data.removeprefix(codecs.BOM_UTF8).splitlines()
    conversations = []
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConversationError(f"{path}:{number}: not UTF-8 text ({e.reason})") from None
        if not line.strip():
            continue
        if plain_lines and not line.lstrip().startswith("{"):
            conversations.append([line])
        else:
            try:
                conversations.append(record_turns(parse_line(line)))
            except ConversationError as e:
                raise ConversationError(f"{path}:{number}: {e}") from None
        if limit is not None and len(conversations) >= limit:
            break
    if not conversations:
        raise ConversationError(f"{path}: holds no conversations")
    return conversations
