"""`dspark-jax generate` and `dspark-jax eval` on the byte-level fixture pair, run in-process."""

import json

import numpy as np
import pytest
from fixture_models import fixture_dir

from dspark_jax.calibration.sts import CalibrationRecords
from dspark_jax.cli import main
from dspark_jax.decoding.batching import Result
from dspark_jax.decoding.policies import device_description
from dspark_jax.decoding.stats import acceptance_stats

PROMPT = "def parse_args(argv=None):\n    parser = argparse."
# The byte-level pair: these tests read tokens as bytes and the text as their decoding.
FIXTURE = fixture_dir("vanilla")
MODELS = ["--target", str(FIXTURE / "target"), "--draft", str(FIXTURE / "draft")]


def _options(command: str) -> set[str]:
    """The option names (argparse dests) of a command."""
    import argparse
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(f"dspark_jax.cli.{command}").add_arguments(parser)
    return {action.dest for action in parser._actions} - {"help"}


def _generate(capsys, tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    # --no-draft runs the target alone, and refuses a --draft it would not use.
    models = MODELS[:2] if "--no-draft" in args else MODELS
    assert main(["generate", *models, *args, "--json", str(out)]) == 0
    captured = capsys.readouterr()
    return json.loads(out.read_text()), captured.out, captured.err


def test_greedy_speculative_equals_plain_and_streams(capsys, tmp_path):
    common = ["--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "60"]
    spec, spec_out, spec_err = _generate(capsys, tmp_path, "spec", *common)
    plain, plain_out, _ = _generate(capsys, tmp_path, "plain", *common, "--no-draft")
    (s,), (p,) = spec["results"], plain["results"]
    assert s["tokens"] == p["tokens"]
    assert len(s["tokens"]) == 60 or s["finish_reason"] == "stop"
    # One prompt streams exactly its text to stdout, nothing else.
    assert spec_out == s["text"] + "\n" == plain_out
    assert s["text"] == bytes(t for t in s["tokens"] if t < 256).decode("utf-8", "replace")

    committed = np.array(s["committed"])
    assert s["rounds"] == len(committed) > 0
    assert s["tau"] == pytest.approx(committed.mean())
    assert spec["acceptance"]["tau"] == pytest.approx(committed.mean())
    # Each round commits its accepted drafts plus one target token; the first comes from prefill.
    assert committed.tolist() == [a + 1 for a in s["accepted"]]
    assert 1 + committed[:-1].sum() < len(s["tokens"]) <= 1 + committed.sum()
    assert f"tau {committed.mean():.3f}" in spec_err
    assert "conditional acceptance by draft position" in spec_err
    assert set(p["committed"]) == {1} and plain["acceptance"] is None
    assert spec["timing"]["decode_tokens_per_s"] > 0
    # Every option that can change the numbers is recorded, the policy's included (null where
    # unset, or without a drafter); the prompts are in "results".
    prompts = {"prompt", "prompts_file", "token_ids", "json", "no_draft"}
    for data in (spec, plain):
        assert _options("generate") - prompts <= set(data["settings"])
    assert spec["settings"]["policy"] == "fixed" and plain["settings"]["policy"] is None
    assert spec["settings"]["gamma"] is None and spec["settings"]["block_size"] == 7
    assert plain["settings"]["draft"] is None and plain["settings"]["block_size"] is None
    assert spec["settings"]["device"] == device_description()


def test_several_prompts_and_turn_by_turn_context(capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "import os\n" + json.dumps({"turns": ["class Foo:\n", "    def bar(self):\n"]}) + "\n"
    )
    args = ["--prompts-file", str(prompts), "--prompt", "x = ", "--max-new-tokens", "12"]
    data, out, err = _generate(
        capsys, tmp_path, "several", *args, "--max-num-seqs", "2", "--logprobs"
    )
    by_key = {(r["conversation"], r["turn"]): r for r in data["results"]}
    # --prompt comes before the file's prompts.
    assert sorted(by_key) == [(0, 0), (1, 0), (2, 0), (2, 1)]
    for r in data["results"]:
        assert r["text"] in out
        assert len(r["tokens"]) == 12 or r["finish_reason"] == "stop"
        # --logprobs: one per token, the target's (tests/test_engine.py checks the values)
        assert len(r["logprobs"]) == len(r["tokens"]) and max(r["logprobs"]) <= 0
    assert out.count("=== [") == 4 and "turn 2" in out
    # The byte model's "template" is plain concatenation: turn 2 sees turn 1 and its answer.
    first, second = by_key[(2, 0)], by_key[(2, 1)]
    answer = [t for t in first["tokens"] if t < 256]
    assert second["prompt_ids"] == first["prompt_ids"] + answer + list(b"    def bar(self):\n")
    assert "requests 4" in err
    # The flag as given, and the slots the engine ran (no more than the 3 conversations).
    assert data["settings"]["max_num_seqs"] == 2 and data["settings"]["num_slots"] == 2


def test_token_id_prompts_and_bad_input(capsys, tmp_path):
    data, _, _ = _generate(
        capsys,
        tmp_path,
        "ids",
        "--token-ids",
        "100,101,102",
        "--max-new-tokens",
        "5",
        "--seed",
        "3",
    )
    (r,) = data["results"]
    assert r["prompt_ids"] == [100, 101, 102] and len(r["tokens"]) <= 5
    assert "logprobs" not in r  # not asked for
    assert main(["generate", *MODELS, "--token-ids", "1", "--logprobs"]) == 2
    assert "--logprobs records them in --json" in capsys.readouterr().err
    assert main(["generate", *MODELS, "--token-ids", "1,x"]) == 2
    assert "--token-ids '1,x'" in capsys.readouterr().err
    assert main(["generate", *MODELS, "--prompt", "a", "--token-ids", "1"]) == 2
    too_long = ["--prompt", "a", "--max-model-len", "16", "--max-new-tokens", "20"]
    assert main(["generate", *MODELS, *too_long]) == 2
    assert "--max-model-len is 16" in capsys.readouterr().err


def test_ignore_eos_and_min_tokens(capsys, tmp_path):
    """--ignore-eos runs every answer to --max-new-tokens; --min-tokens keeps the end-of-turn
    tokens out of the first that many. The fixture target, its generation_config.json naming
    the space an end-of-turn token too, ends its answers early."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(FIXTURE / "target", target)
    (target / "generation_config.json").write_text('{"eos_token_id": [256, 32]}')
    models = ["--target", str(target), "--draft", str(FIXTURE / "draft")]
    # The sizes of the first test's speculative run (its programs, from the persistent cache).
    common = ["--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "60"]

    def run(*args) -> dict:
        out = tmp_path / "run.json"
        assert main(["generate", *models, *common, *args, "--json", str(out)]) == 0
        capsys.readouterr()
        data = json.loads(out.read_text())
        return data["results"][0] | {"settings": data["settings"]}

    free = _generate(capsys, tmp_path, "free", *common)[0]["results"][0]
    spaces = [i for i, t in enumerate(free["tokens"]) if t == 32]
    assert spaces and spaces[0] < 58  # the free answer has a space to stop at
    stopped = run()
    first_stop = free["tokens"][: spaces[0] + 1]
    assert (stopped["tokens"], stopped["finish_reason"]) == (first_stop, "stop")
    ignoring = run("--ignore-eos")
    assert (ignoring["tokens"], ignoring["finish_reason"]) == (free["tokens"], "length")
    assert ignoring["settings"]["ignore_eos"] is True
    held = run("--min-tokens", str(spaces[0] + 2))
    tokens = held["tokens"]
    assert len(tokens) >= spaces[0] + 2 and 32 not in tokens[: spaces[0] + 2]
    assert tokens[: spaces[0]] == free["tokens"][: spaces[0]]
    assert held["settings"]["min_tokens"] == spaces[0] + 2
    assert main(["generate", *models, *common, "--min-tokens", "61"]) == 2
    assert "--min-tokens must lie in 0..60 (--max-new-tokens), got 61" in capsys.readouterr().err


def test_allowed_token_ids_are_all_an_answer_holds(capsys, tmp_path):
    args = ["--prompt", PROMPT, "--temperature", "1", "--max-new-tokens", "16"]
    data, out, _ = _generate(capsys, tmp_path, "allowed", *args, "--allowed-token-ids", "66, 67")
    (r,) = data["results"]
    assert set(r["tokens"]) == {66, 67} and len(r["tokens"]) == 16
    assert out == r["text"] + "\n" and set(r["text"]) == {"B", "C"}
    assert data["settings"]["allowed_token_ids"] == [66, 67]


def test_eval_writes_table_json_plot_and_records(capsys, tmp_path):
    data_dir = tmp_path / "datasets"
    data_dir.mkdir()
    (data_dir / "code.jsonl").write_text(
        "".join(json.dumps({"turns": [t]}) + "\n" for t in ("def f(x):\n", "import re\n", "z"))
    )
    (data_dir / "chat.jsonl").write_text(
        json.dumps({"turns": ["class A:\n", "    def b(self):\n"]})
        + "\n"
        + json.dumps({"turns": ["# A comment\n", "if x:\n"]})
        + "\n"
    )
    (data_dir / "unused.jsonl").write_text(json.dumps({"turns": ["x"]}) + "\n")
    out = tmp_path / "out"
    args = ["eval", "--datasets-dir", str(data_dir), "--datasets", "code", "chat", "--limit", "2"]
    args += [*MODELS, "--max-new-tokens", "24", "--max-num-seqs", "2", "--out", str(out)]
    assert main(args) == 0
    table, err = capsys.readouterr()
    # The plain-decoding baseline has its own bar after the speculative one's.
    assert "plain: 100%" in err and err.index("generate: 100%") < err.index("plain: 100%")
    for word in ("dataset", "tau", "speedup", "conditional acceptance", "prefix survival"):
        assert word in table

    report = json.loads((out / "eval.json").read_text())
    datasets = report["datasets"]
    assert sorted(datasets) == ["chat", "code"]
    assert datasets["code"]["conversations"] == 2 and datasets["code"]["turns"] == 2
    assert datasets["chat"]["conversations"] == 2 and datasets["chat"]["turns"] == 4
    settings = report["settings"]
    assert settings["max_num_seqs"] == 2 and settings["num_slots"] == 2
    # Every option that can change the numbers is recorded (the datasets as "files"), an
    # option left unset as null, the engine's sizes as they ran.
    datasets_options = {"files", "datasets_dir", "datasets", "out", "overwrite"}
    assert _options("eval") - datasets_options <= set(settings)
    assert settings["policy"] == "fixed" and settings["gamma"] is None
    assert settings["threshold"] is None and settings["sps_table"] is None
    assert settings["sps_profiled"] is None
    assert settings["sts"] is None and settings["dtype"] is None
    assert settings["target_dtype"] == settings["draft_dtype"] == "float32"
    assert settings["no_plain"] is False and settings["limit"] == 2
    assert settings["page_size"] == 16 and settings["rounds_per_chunk"] == 8
    assert settings["kv_pages"] >= 2 and settings["prefill_chunk"] <= 256
    assert settings["device"] == device_description()
    assert settings["files"] == [str(data_dir / "chat.jsonl"), str(data_dir / "code.jsonl")]
    records = CalibrationRecords.load(out / "calibration_records.npz")
    assert len(records) == sum(d["rounds"] for d in datasets.values())
    # What calibrate checks --drafter and --temperature against.
    assert records.drafter_fingerprint == report["settings"]["drafter_fingerprint"]
    assert records.sampling_temperature == report["settings"]["temperature"] == 1.0
    assert records.gamma == report["settings"]["block_size"] == 7
    for name, d in datasets.items():
        assert d["tau"] == pytest.approx(d["committed"] / d["rounds"])
        assert f"{d['tau']:.3f}" in table and name in table
        spec, plain = d["speculative"], d["plain"]
        assert d["speedup"] == pytest.approx(
            spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        )
        survival = [s for s in d["prefix_survival"] if s is not None]
        assert survival == sorted(survival, reverse=True)
        assert d["conditional_acceptance"][0] == pytest.approx(d["prefix_survival"][0])
    # The records hold the rounds of the datasets in order (chat.jsonl sorts first) and
    # reproduce each dataset's per-position statistics.
    start = 0
    for name in ("chat", "code"):
        d = datasets[name]
        part = records.subset(np.arange(start, start + d["rounds"]))
        start += d["rounds"]
        stats = acceptance_stats(
            [Result([], "length", 1, part.verified_n, part.accepted_n, [1], part.conf_logits_nk)],
            7,
        )
        for got, want in (
            (stats.conditional, "conditional_acceptance"),
            (stats.survival, "prefix_survival"),
        ):
            np.testing.assert_allclose(got, [np.nan if v is None else v for v in d[want]])
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_without_a_verified_draft_writes_no_records(capsys, tmp_path):
    """--gamma 0 verifies no draft: no confidence meets an outcome, so records would only give
    calibrate an artifact that changes nothing. eval writes none, says why, and gives no hint."""
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("def f(x):\n", "z")))
    out = tmp_path / "out"
    args = ["eval", str(data), *MODELS, "--gamma", "0", "--max-new-tokens", "8", "--no-plain"]
    assert main([*args, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "eval.png"]
    assert "no calibration records: no round verified a draft (--gamma 0)" in err
    assert "fit STS with" not in err
    report = json.loads((out / "eval.json").read_text())
    assert report["settings"]["gamma"] == 0 and report["settings"]["calibration_records"] is None
    assert report["datasets"]["code"]["rounds"] > 0
    assert report["datasets"]["code"]["mean_verified"] == 0


def test_eval_where_every_turn_is_skipped_is_refused_before_compiling(
    capsys, tmp_path, monkeypatch
):
    """Every conversation's first turn is longer than --max-model-len allows: nothing would be
    measured, which eval reported as a table of 0.0 tok/s and exit 0."""
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"turns": ["a long first question\n", "and more"]}) + "\n")

    def no_compiling(self):
        raise AssertionError("compiled for a run that measures nothing")

    monkeypatch.setattr("dspark_jax.decoding.engine.Engine.warm_up", no_compiling)
    out = tmp_path / "out"
    args = ["eval", str(data), *MODELS, "--max-model-len", "24", "--max-new-tokens", "8"]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "every turn would be skipped, so nothing would be measured" in err
    assert "chat conversation 1 turn 1: a prompt of" in err and "max_model_len is 24" in err
    assert "lower --max-new-tokens, use shorter prompts or raise --max-model-len" in err
    assert not out.exists()


def test_nothing_measured_reads_as_missing_not_zero():
    """A dataset whose turns were all skipped ran no decode round: its rates are "-" in the
    table and null in eval.json (strict JSON), not 0.0 tok/s."""
    from dspark_jax.cli.report import format_table, generation_summary
    from dspark_jax.decoding.batching import LoopTiming
    from dspark_jax.decoding.evaluate import DatasetReport

    skipped = ["conversation 1 turn 1: too long"]
    report = DatasetReport("chat", 1, 0, skipped, acceptance_stats([], 7), LoopTiming(), None)
    for plain in (None, LoopTiming()):
        report.plain_timing = plain
        row = format_table([report]).splitlines()[2].split()
        assert row == ["chat", "1", "0", "0", "-", "-", "-", "-"]
        body = json.loads(json.dumps(report.to_json(), allow_nan=False))
        assert body["speculative"]["decode_tokens_per_s"] is None and body["speedup"] is None
    assert body["plain"]["decode_tokens_per_s"] is None
    assert "n/a decode tokens/s" in generation_summary([], LoopTiming(), None)[1]


def test_eval_rejects_missing_datasets(capsys, tmp_path):
    assert main(["eval", *MODELS, "--out", str(tmp_path)]) == 2
    assert "no datasets" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    assert main(["eval", *MODELS, str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_acceptance_stats_definitions():
    """Position k counts rounds with drafts 1..k-1 accepted and k verified (paper, Figure 2)."""
    verified = np.array([3, 3, 3, 2])
    accepted = np.array([0, 2, 3, 2])
    result = Result([], "length", 1, verified, accepted, accepted + 1, np.zeros((4, 3)))
    stats = acceptance_stats([result], 3)
    assert stats.tau == pytest.approx(np.mean(accepted + 1))
    np.testing.assert_allclose(stats.conditional, [3 / 4, 3 / 3, 1 / 2])
    np.testing.assert_array_equal(stats.conditional_n, [4, 3, 2])
    np.testing.assert_allclose(stats.survival, [3 / 4, 3 / 4, 1 / 3])
    np.testing.assert_array_equal(stats.survival_n, [4, 4, 3])


def test_a_run_without_speculative_rounds_writes_valid_json(capsys, tmp_path):
    """One new token comes from the prompt's prefill, so no round runs and tau is undefined:
    null in the JSON (NaN is not JSON), "n/a" on the console."""
    data, _, err = _generate(capsys, tmp_path, "one", "--prompt", "x", "--max-new-tokens", "1")
    # --max-num-seqs 8 (the default) as given; one prompt needs one slot.
    assert data["settings"]["max_num_seqs"] == 8 and data["settings"]["num_slots"] == 1
    assert data["acceptance"]["rounds"] == 0
    assert data["acceptance"]["tau"] is None and data["acceptance"]["mean_verified"] is None
    assert "NaN" not in (tmp_path / "one.json").read_text()
    assert "tau n/a" in err and "nan" not in err
    # No decode round ran (the one token came from prefill): no rate was measured.
    assert data["timing"]["decode_tokens_per_s"] is None and "n/a decode tokens/s" in err

    stats = acceptance_stats([], 7)
    body = json.dumps(stats.to_json(), allow_nan=False)
    assert json.loads(body)["conditional_acceptance"] == [None] * 7


def test_the_plain_replay_answers_turn_by_turn_like_the_run(monkeypatch):
    """eval's baseline replays the run's prompts with the run's dependencies: a conversation's
    next turn joins only when its previous one is answered. Sent all at once, a 4-turn and a
    1-turn conversation let plain decoding batch all five turns in its first step, where the
    speculative run had two at most, and the speedup measured concurrency."""
    from dspark_jax.decoding import evaluate
    from dspark_jax.decoding.batching import LoopTiming, Request

    class StepBatcher:
        """Answers, at each step, every request waiting at its start."""

        def __init__(self, engine, max_waiting, timed):
            self.waiting, self.steps, self.timing = [], [], LoopTiming()

        def submit(self, request, on_event):
            self.waiting.append((request, on_event))

        def run_until_idle(self):
            while self.waiting:
                step, self.waiting = self.waiting, []
                self.steps.append([request.seed for request, _ in step])
                for _, on_event in step:
                    on_event("done", None)

    made = []
    monkeypatch.setattr(
        evaluate, "Batcher", lambda *a, **k: made.append(StepBatcher(*a, **k)) or made[-1]
    )
    turns = [
        evaluate.Turn(c, t, Request([1], 4, seed=10 * c + t), None, "")
        for c, n in ((0, 4), (1, 1))
        for t in range(n)
    ]
    run = evaluate.ConversationRun(turns=turns, timing=LoopTiming(), skipped=[])
    assert evaluate.replay(None, run) is made[0].timing
    assert made[0].steps == [[0, 10], [1], [2], [3]]


def test_the_summary_says_what_the_prefix_cache_reused():
    import numpy as np

    from dspark_jax.cli.report import generation_summary
    from dspark_jax.decoding.batching import LoopTiming, Result

    def result(prompt_len: int, cached: int) -> Result:
        empty = np.zeros((0,), np.int32)
        return Result([5], "length", prompt_len, empty, empty, empty, np.zeros((0, 7)),
                      cached_tokens=cached)  # fmt: skip

    lines = generation_summary([result(40, 0), result(40, 32)], LoopTiming(), None)
    assert "prefix cache: 32 of 80 prompt tokens reused, not prefilled" in lines
    assert not any("prefix cache" in line for line in generation_summary(
        [result(40, 0)], LoopTiming(), None))  # fmt: skip
