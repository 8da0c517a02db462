"""Small truths of the command line: --version, and output folders that are not overwritten
without --overwrite (named as the flag, not as a Python argument)."""

from __future__ import annotations

import json
from importlib.metadata import version

from dspark_jax.cli import main
from dspark_jax.embedded import EMBEDDED_DRAFT


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dspark-jax {version('dspark-jax')}"


def test_eval_refuses_a_non_empty_output_folder(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["x"]}) + "\n")
    out = tmp_path / "results"
    out.mkdir()
    (out / "eval.json").write_text("{}")
    assert main(["eval", str(prompts), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err
    assert (out / "eval.json").read_text() == "{}"


def test_existing_export_names_the_flag(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert main(["export", "--draft", str(EMBEDDED_DRAFT), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "use --overwrite" in err and "overwrite=True" not in err
