"""The tiny recipes end to end: `dspark-jax train` on the fixture target, export, and (slow) a
DSpark and a DFlash drafter trained from scratch with the same budget, measured before and after
on held-out data (training metric) and through the decode engine (greedy tau)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dspark_jax.checkpoints.converted import load_drafter, load_target
from dspark_jax.cli import main
from dspark_jax.cli.train import load_train_config, train_config_names
from dspark_jax.config import ConfigError
from dspark_jax.configs.train_tiny import TINY_RECIPE, TINY_TARGET, TRAIN_CONFIGS
from dspark_jax.errors import UserError
from dspark_jax.tokenizer import encode_conversation, load_tokenizer
from dspark_jax.training.corpus import write_python_stdlib_corpus
from dspark_jax.training.trainer import TrainConfig, train


def test_named_configs_and_errors():
    names = train_config_names()
    assert {"tiny-dspark", "tiny-dflash", "dspark-qwen3-4b", "dflash-qwen3-14b"} <= set(names)
    released = load_train_config("dspark-qwen3-8b")
    r, d = released.recipe, released.drafter
    assert (d.block_size, d.model.num_hidden_layers, d.num_anchors, r.learning_rate) == (
        7,
        5,
        512,
        6e-4,
    )
    assert (r.warmup_ratio, r.global_batch_size) == (0.04, 512)
    assert released.drafter.markov_rank == 256 and released.drafter.enable_confidence_head
    dflash = load_train_config("dflash-qwen3-4b")
    assert dflash.drafter.markov_rank == 0 and not dflash.drafter.enable_confidence_head
    assert (dflash.recipe.ce_weight, dflash.recipe.l1_weight, dflash.recipe.confidence_weight) == (
        1.0,
        0.0,
        0.0,
    )
    with pytest.raises(ConfigError, match="unknown train config"):
        load_train_config("nope")
    # The drafter alone holds its shape; the loss chunks are checked against its anchors.
    with pytest.raises(UserError, match="must divide num_anchors \\(100\\)"):
        dataclasses.replace(released, drafter=dataclasses.replace(d, num_anchors=100))
    with pytest.raises(ConfigError, match="confidence head"):
        dataclasses.replace(
            dflash,
            recipe=released.recipe,
            drafter=dataclasses.replace(dflash.drafter, num_anchors=512),
        )


def test_tiny_recipe_truncates_nothing(tmp_path):
    """Every conversation of the built-in corpus fits the tiny recipe's max_length with its
    end-of-turn token, so the drafter trains on the end of every answer (pieces with multi-byte
    characters included)."""
    tokenizer = load_tokenizer(TINY_TARGET)
    lengths = [
        len(encode_conversation(tokenizer, json.loads(line)["messages"])[0])
        for path in write_python_stdlib_corpus(tmp_path)
        for line in path.read_text().splitlines()
    ]
    assert max(lengths) == TINY_RECIPE.max_length


def test_cli_trains_and_exports(tmp_path, capsys):
    """Two steps of the tiny DSpark recipe through the console entry point, then the export."""
    rc = main(
        [
            "train",
            "--config",
            "tiny-dspark",
            "--steps",
            "2",
            "--output",
            str(tmp_path),
            "--no-progress",
            "--mesh",
            "2,2,2",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 2 and summary["export"] == str(tmp_path / "drafter")
    assert np.isfinite(summary["eval_start"]["loss"]) and np.isfinite(summary["eval_end"]["loss"])
    cfg, drafter, _ = load_drafter(tmp_path / "drafter")
    assert cfg.markov_rank == 32 and cfg.num_anchors == 32
    _, target, _ = load_target(TINY_TARGET)
    # the exported drafter carries the target's (frozen) embedding and head
    np.testing.assert_array_equal(
        drafter.lm_head.embedding[...], target.embed_tokens.embedding[...]
    )
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["split"] for x in lines] == ["eval", "train", "eval"]
    bad_mesh = ["--mesh", "3,1,1", "--output", str(tmp_path / "bad")]
    assert main(["train", "--config", "tiny-dspark", *bad_mesh]) == 2
    assert not (tmp_path / "bad").exists()


def _engine_tau(target, drafter, prompts: list[list[int]]) -> tuple[float, np.ndarray]:
    """Greedy speculative decoding of held-out prompts: mean tau and per-position acceptance."""
    from dspark_jax.decoding.batching import Request, generate
    from dspark_jax.decoding.engine import Engine, EngineConfig

    engine = Engine(
        target,
        drafter,
        EngineConfig(
            num_slots=8,
            max_model_len=256,
            prefill_chunk=64,
            prefill_buckets=(64,),
            token_buckets=(8 * (drafter.cfg.block_size + 1),),
        ),
    )
    results, _ = generate(engine, [Request(p, max_new_tokens=96) for p in prompts])
    committed = np.concatenate([r.committed for r in results])
    accepted = np.concatenate([r.accepted for r in results])
    gamma = drafter.cfg.block_size
    # per-position acceptance: P(draft k accepted | drafts before it accepted), k = 0..gamma-1
    reached = np.array([(accepted >= k).sum() for k in range(gamma)])
    passed = np.array([(accepted >= k + 1).sum() for k in range(gamma)])
    return float(committed.mean()), passed / np.maximum(reached, 1)


@pytest.mark.slow
def test_tiny_dspark_and_dflash_beat_their_untrained_start(tmp_path):
    """Same budget (400 steps of 8 x 256 tokens, 32 anchors) for both. Evaluation: 4 held-out
    batches (32 sequences, up to 1024 blocks) with fixed anchors; engine: 16 held-out prompts,
    greedy. Deterministic (seeded data order, init and anchors)."""
    from dspark_jax.training.step import new_drafter

    _, target, _ = load_target(TINY_TARGET)
    prompts = []
    report = {}
    for name in ("tiny-dspark", "tiny-dflash"):
        config: TrainConfig = TRAIN_CONFIGS[name]
        result = train(config, tmp_path / name, progress=False)
        start, end = result.eval_start, result.eval_end
        if not prompts:
            eval_file = tmp_path / name / "data" / "python-stdlib-eval.jsonl"
            records = [json.loads(x) for x in eval_file.read_text().splitlines()[::97][:16]]
            prompts = [list(r["messages"][0]["content"].encode()) for r in records]
        _, trained, _ = load_drafter(result.export_dir)
        untrained = new_drafter(trained.cfg, target, seed=config.recipe.seed)
        tau_untrained, acc_untrained = _engine_tau(target, untrained, prompts)
        tau_trained, acc_trained = _engine_tau(target, trained, prompts)
        report[name] = {
            "eval_tau": (start["tau"], end["tau"]),
            "eval_accept_rate_k": (start["accept_rate_k"], end["accept_rate_k"]),
            "engine_tau": (tau_untrained, tau_trained),
            "engine_accept_k": (acc_untrained.tolist(), acc_trained.tolist()),
        }
        assert end["tau"] > start["tau"] + 0.5, report[name]
        assert tau_trained > tau_untrained + 0.3, report[name]
    print(json.dumps(report, indent=1))


def test_a_run_without_loss_tokens_is_stopped(tmp_path, capsys, compile_cache):
    """Every prompt longer than max_length (48): truncation cuts every answer off, no step has a
    loss token. The run stops with one line saying why -- after NO_LOSS_STEPS steps, or at the
    end of a shorter call, never on one batch alone -- exports nothing, and the truncation
    warning says the answers are gone, not only their ends."""
    from train_helpers import write_train_config

    data = tmp_path / "long.jsonl"
    with open(data, "w") as f:
        for i in range(12):
            messages = [
                {"role": "user", "content": "x" * 60 + str(i)},
                {"role": "assistant", "content": f"answer {i}"},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    config = write_train_config(
        tmp_path / "long.py", name="long", data=(str(data),), num_steps=6
    )
    out = tmp_path / "run"
    args = ["--config", str(config), "--output", str(out), "--eval-data", "--no-progress"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "4 of them keep no answer token at all" in err
    assert err.strip().splitlines()[-1].startswith(
        "dspark-jax train: error: steps 1..6 carried no loss token (num_tokens 0 in every one): "
        "24 of the 24 sequences this process read are longer than max_length 48"
    )
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6] and not (out / "drafter").exists()
    # A longer call stops after NO_LOSS_STEPS steps (10), not at its first logged step.
    longer = tmp_path / "longer"
    config = write_train_config(
        tmp_path / "longer.py", name="longer", data=(str(data),), num_steps=40
    )
    args = ["--config", str(config), "--output", str(longer), "--eval-data", "--no-progress"]
    assert main(["train", *args]) == 2
    assert "steps 1..10 carried no loss token" in capsys.readouterr().err
