"""The embedded default pair: what a new user sees from `dspark-jax generate` with no arguments."""

from __future__ import annotations

import json
import re

from dspark_jax.cli import main

MIN_WORDS = 30
MIN_DISTINCT_WORDS = 10
MIN_WORDY_CHUNKS = 0.6


def readability_problems(text: str) -> list[str]:
    """Why `text` is not "mostly printable words" (empty when it is).

    A cheap check, not a judge of quality: no undecodable bytes; every character printable or
    whitespace; at least MIN_WORDS words of two or more letters, MIN_DISTINCT_WORDS of them
    different (a loop of one token fails); and at least MIN_WORDY_CHUNKS of the
    whitespace-separated chunks contain such a word (symbol soup fails).
    """
    problems = []
    if "\ufffd" in text:
        problems.append("holds undecodable bytes (U+FFFD)")
    unprintable = sorted({c for c in text if not (c.isprintable() or c.isspace())})
    if unprintable:
        problems.append(f"unprintable characters {unprintable!r}")
    words = re.findall(r"[A-Za-z]{2,}", text)
    if len(words) < MIN_WORDS:
        problems.append(f"{len(words)} words < {MIN_WORDS}")
    if len({w.lower() for w in words}) < MIN_DISTINCT_WORDS:
        problems.append(f"fewer than {MIN_DISTINCT_WORDS} distinct words")
    chunks = text.split()
    wordy = sum(bool(re.search(r"[A-Za-z]{2}", c)) for c in chunks) / max(len(chunks), 1)
    if wordy < MIN_WORDY_CHUNKS:
        problems.append(f"only {wordy:.0%} of the chunks hold a word")
    return problems


READABLE = '''def fibonacci(n):
    """Return the n-th Fibonacci number, counting from zero.

    The sequence starts with zero and one; every later number is the sum of the two numbers
    before it, so the loop below keeps only the last two of them.
    """
    previous, current = 0, 1
    for _ in range(n):
        previous, current = current, previous + current
    return previous
'''


def test_readability_check_passes_code_and_rejects_soup_and_loops():
    assert readability_problems(READABLE) == []
    soup = " ".join(["#$%", "{}", "==", "a1", "(())"] * 20)
    assert any("chunks" in p for p in readability_problems(soup))
    assert any("distinct" in p for p in readability_problems("self self self " * 20))
    assert any("U+FFFD" in p for p in readability_problems("caf\ufffd " + "word " * 40))


def test_default_generate_writes_readable_text_with_speculation_paying(tmp_path, capsys):
    out = tmp_path / "generate.json"
    assert main(["generate", "--temperature", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert report["acceptance"]["tau"] >= 2.5, report["acceptance"]
    assert readability_problems(result["text"]) == [], result["text"]
    assert result["text"] in capsys.readouterr().out


def test_the_shipped_drafter_is_marked_as_one_trained_here(tmp_path):
    """Like every drafter trained here (docs/export-formats.md), the embedded one says
    model_type "dspark", so transformers' AutoModel refuses it instead of loading a plain Qwen3
    without its heads -- in the package and in what `dspark-jax export` writes of it."""
    from dspark_jax.config import DRAFTER_MODEL_TYPE
    from dspark_jax.embedded import EMBEDDED_DRAFT

    shipped = json.loads((EMBEDDED_DRAFT / "config.json").read_text())
    assert shipped["model_type"] == DRAFTER_MODEL_TYPE
    assert main(["export", "--draft", str(EMBEDDED_DRAFT), "--out", str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["model_type"] == DRAFTER_MODEL_TYPE
