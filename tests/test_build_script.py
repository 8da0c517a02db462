"""scripts/build_default_pair.py, in miniature: CI never runs the 45-minute build, so the stages
that touch the project's own modules (tokenizer, target training and its Hugging Face export,
the transformers parity check, the drafters' train configs) run here at toy size. A rename in
the package then breaks this test rather than the next person who rebuilds the default pair."""

import dataclasses
import importlib.util
import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_default_pair.py"


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("build_default_pair", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses resolve their annotations through sys.modules while the class is built.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def corpus(build, tmp_path_factory):
    """train/eval.jsonl of function conversations from a slice of the standard library."""
    out = tmp_path_factory.mktemp("corpus")
    splits = {"train": [], "eval": []}
    for module, path in list(build.stdlib_files())[:120]:
        split = "eval" if build.held_out(module) else "train"
        text = path.read_text(encoding="utf-8", errors="replace")
        splits[split].extend(build.function_conversations(module, text))
    assert len(splits["train"]) > 200 and splits["eval"]
    for split, rows in splits.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def test_presets_fit_their_budgets(build):
    full = build.preset_budgets("full")
    quick = build.preset_budgets("quick")
    assert full == (build.PretrainConfig(), build.DraftBudget(), build.DistillBudget())
    for small, big in zip(quick, full, strict=True):
        assert small.steps <= big.steps
    assert quick[0].steps < full[0].steps
    # Explicit step counts override the preset; an unknown preset says which exist.
    pre, draft, _ = build.preset_budgets("quick", target_steps=7, draft_steps=3)
    assert (pre.steps, draft.steps) == (7, 3)
    with pytest.raises(SystemExit, match="full"):
        build.preset_budgets("day")


def test_tokenizer_target_and_parity_at_toy_size(build, corpus, tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    special = build.build_tokenizer(tokenizer_dir, corpus / "train.jsonl")
    assert special["<|im_end|>"] == 2 and special["<|mask|>"] == 3

    pre = build.PretrainConfig(seq_len=64, batch_size=2, steps=3, eval_rows=2, log_every=1)
    target_dir = tmp_path / "target"
    summary = build.pretrain_target(target_dir, tokenizer_dir, corpus, pre)
    assert summary["steps"] == 3 and summary["tokens_seen"] == 3 * 2 * 64
    assert np.isfinite(summary["held_out_loss"]["end"])
    for name in build.TARGET_FILES:
        assert (target_dir / name).is_file(), name
    assert len((target_dir / "pretrain_log.jsonl").read_text().splitlines()) == 3
    # The written folder reads back through transformers with our logits.
    assert build.check_transformers_parity(target_dir, corpus, num_tokens=32) < 1e-4

    # Both drafters' train configs, written as `dspark-jax train --config` files, load back.
    budget = dataclasses.replace(build.DraftBudget(), steps=4)
    configs = build.drafter_train_configs(target_dir, corpus, budget)
    assert set(configs) == {"dspark", "dflash"}
    for name, config in configs.items():
        path = tmp_path / f"{name}.py"
        path.write_text(build.config_file_text(config))
        assert runpy.run_path(str(path))["CONFIG"] == config, name
    assert configs["dspark"].drafter.markov_rank > 0 and configs["dflash"].drafter.markov_rank == 0


@pytest.mark.parametrize("jobs", ["0", "-1", "two"])
def test_jobs_below_one_is_refused_by_argparse(build, tmp_path, capsys, jobs):
    """--jobs 0 started no training process and waited for one forever."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        build.main(["--out", str(out), "--jobs", jobs])
    assert exc.value.code == 2
    assert "--jobs" in capsys.readouterr().err
    assert not out.exists()


def test_missing_docs_leaves_no_out_folder(build, tmp_path):
    """The inputs are checked before --out is created, so a typo leaves nothing behind."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="python3-doc"):
        build.main(["--out", str(out), "--docs", str(tmp_path / "nope")])
    assert not out.exists()
