"""Built-in training corpora, written on demand: data that needs no download.

A train config names one as `builtin:<name>` among its data paths; `resolve_data_paths` writes it
under the run's `data/` folder the first time and returns the JSONL path in its place.

    builtin:python-stdlib        the Python standard library's own source, as conversations
    builtin:python-stdlib-eval   its held-out split (no file in common with the training split)
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

from dspark_jax.config import ConfigError

BUILTIN_PREFIX = "builtin:"


def write_python_stdlib_corpus(
    out_dir: Path, *, prompt_bytes: int = 64, answer_bytes: int = 191, eval_every: int = 10
) -> tuple[Path, Path]:
    """(train, eval) JSONL of the Python standard library's own top-level *.py files.

    Each file is cut into pieces of prompt_bytes + answer_bytes bytes of its UTF-8 text (a cut
    that falls inside a character moves back to its start, so a piece can be a few bytes
    shorter): the user message is the start of a piece and the assistant message the rest
    (`{"messages": [...]}` records). Measured in bytes, a piece is at most that many tokens for a
    byte-level tokenizer and fewer for a BPE one: with its end-of-turn token, a piece of 255
    bytes fills the tiny recipe's 256 tokens (configs/train_tiny.py) and is never truncated.
    Every `eval_every`-th file (sorted by name) goes to the eval split, so the two splits share
    no file. Deterministic for a given Python.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise ConfigError(f"no *.py files in the Python standard library folder {stdlib}")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = (out_dir / "python-stdlib-train.jsonl", out_dir / "python-stdlib-eval.jsonl")
    piece = prompt_bytes + answer_bytes
    # Several processes may build the corpus at once: each writes its own file, then renames.
    tmp = [p.with_suffix(f".jsonl.tmp{os.getpid()}") for p in paths]
    with open(tmp[0], "w") as train_f, open(tmp[1], "w") as eval_f:
        for i, path in enumerate(files):
            utf8 = path.read_text(encoding="utf-8", errors="replace").encode("utf-8")
            out = eval_f if i % eval_every == 0 else train_f
            start = 0
            while len(utf8) - start >= piece:
                middle = _character_start(utf8, start + prompt_bytes)
                end = _character_start(utf8, start + piece)
                messages = [
                    {"role": "user", "content": utf8[start:middle].decode("utf-8")},
                    {"role": "assistant", "content": utf8[middle:end].decode("utf-8")},
                ]
                out.write(json.dumps({"messages": messages}) + "\n")
                start = end
    for t, p in zip(tmp, paths, strict=True):
        os.replace(t, p)
    return paths


def _character_start(utf8: bytes, i: int) -> int:
    """`i`, or where the UTF-8 character that byte `i` continues begins."""
    while i < len(utf8) and utf8[i] & 0xC0 == 0x80:
        i -= 1
    return i


def _current_format(path: Path) -> bool:
    """Whether `path` exists in the current record format (earlier versions wrote `turns`)."""
    if not path.is_file():
        return False
    with open(path, encoding="utf-8") as f:
        return '"messages"' in f.readline()


_BUILTIN_SPLITS = {"python-stdlib": 0, "python-stdlib-eval": 1}


def resolve_data_paths(paths: tuple[str, ...], output_dir: Path) -> tuple[str, ...]:
    """JSONL paths, with `builtin:<name>` corpora written under output_dir/data when missing.

    Built-in corpora: `python-stdlib` and `python-stdlib-eval` (`write_python_stdlib_corpus`).
    """
    out = []
    for path in paths:
        if not path.startswith(BUILTIN_PREFIX):
            out.append(path)
            continue
        name = path[len(BUILTIN_PREFIX) :]
        if name not in _BUILTIN_SPLITS:
            raise ConfigError(
                f"unknown built-in corpus {name!r}; known: {', '.join(sorted(_BUILTIN_SPLITS))}"
            )
        data_dir = output_dir / "data"
        split_paths = (
            data_dir / "python-stdlib-train.jsonl",
            data_dir / "python-stdlib-eval.jsonl",
        )
        if not all(_current_format(p) for p in split_paths):
            write_python_stdlib_corpus(data_dir)
        out.append(str(split_paths[_BUILTIN_SPLITS[name]]))
    return tuple(out)
