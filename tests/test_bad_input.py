"""Bad input fails early and clearly; damaged weights and oversized requests never run (issue 8).

Every command is run in-process (`dspark_jax.cli.main`), so a case costs what the command does
before it refuses, not a process start. Each must exit non-zero with exactly one line on stderr
and no traceback; the table of inputs and messages is docs/errors.md.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import huggingface_hub.constants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.checkpoints import orbax_io
from dspark_jax.checkpoints.converted import (
    convert_checkpoints,
    load_decoding_models,
    load_drafter,
    load_target,
)
from dspark_jax.checkpoints.locate import resolve_model_dir
from dspark_jax.checkpoints.safetensors_io import (
    SINGLE_FILE,
    CheckpointError,
    SafetensorsFolder,
    save_safetensors,
)
from dspark_jax.cli import main
from dspark_jax.config import ConfigError, Qwen3Config
from dspark_jax.conversations import ConversationError, read_turns
from dspark_jax.decoding import policies
from dspark_jax.decoding.batching import Batcher, QueueFullError, Request
from dspark_jax.decoding.engine import Engine, EngineConfig, EngineError
from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET, TINY_DRAFT, TINY_TARGET


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "pair"
    convert_checkpoints(out, draft=TINY_DRAFT, target=TINY_TARGET, progress=False)
    return out


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    files = {}
    files["nonutf8"] = root / "prompts.jsonl"
    files["nonutf8"].write_bytes(b'{"turns": ["fine"]}\n\xff\xfe not text\n')
    files["notalist"] = root / "notalist.jsonl"
    files["notalist"].write_text('{"turns": ["ok"]}\n{"turns": "notalist"}\n')
    files["two_turns"] = root / "two_turns.jsonl"
    files["two_turns"].write_text('{"turns": ["hi", "and then?"]}\n')
    files["plain_file"] = root / "file.txt"
    files["plain_file"].write_text("")
    for name, key, value in (
        ("hidden_words", "hidden_size", "ninety-six"),
        ("zero_heads", "num_attention_heads", 0),
    ):
        folder = root / name
        shutil.copytree(TINY_TARGET, folder)
        config = json.loads((folder / "config.json").read_text())
        config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
        files[name] = folder
    files["npy"] = root / "records.npy"
    np.save(files["npy"], np.zeros(3))
    files["here"] = root  # the folder the table's commands run in
    return files


def _run(argv: list[str], capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.strip()]


# (argv with {placeholders}, fragment of the one stderr line)
CLI_CASES = [
    ("generate --token-ids 300,1000,99999 --max-new-tokens 4", "in 0..4095 (the vocabulary)"),
    ("generate --token-ids 5,x", "expected integers"),
    ("generate --token-ids 1 --prompt hi", "either text prompts"),
    ("generate --prompts-file {notalist}", "notalist.jsonl:2: 'turns' must be a non-empty list"),
    ("generate --prompts-file {nonutf8}", "prompts.jsonl:2: not UTF-8 text"),
    ("generate --prompts-file /no/such/prompts.txt", "no such prompts file"),
    ("eval {nonutf8}", "prompts.jsonl:2: not UTF-8 text"),
    ("eval {notalist}", "notalist.jsonl:2"),
    ("eval --out {tmp}/r {tmp}", "is a folder; give --datasets-dir"),
    ("generate --prompts-file {tmp}", "is a folder, not a prompts file"),
    ("generate --max-new-tokens 0", "--max-new-tokens must be >= 1"),
    ("generate --max-new-tokens 4 --min-tokens 5", "--min-tokens must lie in 0..4"),
    ("generate --max-new-tokens 6000", "lower --max-new-tokens"),
    ("generate --max-new-tokens 1000000000", "max_position_embeddings"),
    (
        "generate --max-model-len 64 --max-new-tokens 100",
        "--max-model-len is 64: lower --max-new-tokens, shorten the prompt or raise "
        "--max-model-len",
    ),
    ("generate --max-model-len 100000 --max-new-tokens 4", "max_position_embeddings 4096"),
    ("generate --kv-pages 100000000 --max-new-tokens 4", "lower --kv-pages"),
    (
        "generate --kv-pages 1 --max-new-tokens 64",
        "--kv-pages 1 holds 16 tokens, but the longest request may need",
    ),
    ("generate --seed 99999999999", "--seed must lie in 0..4294967295"),
    ("generate --seed -1", "--seed must lie in"),
    (
        "generate --seed 4294967295 --prompt a --prompt b",
        "seeds 4294967295..4294967296 (one per prompt and turn), past 4294967295; give --seed at "
        "most 4294967294",
    ),
    ("generate --seed 4294967294 --token-ids 1 --token-ids 2 --token-ids 3", "at most 4294967293"),
    ("eval --seed 4294967295 --out {tmp}/r {two_turns}", "seeds 4294967295..4294967296"),
    ("generate --rounds-per-chunk 0", "--rounds-per-chunk must be >= 1"),
    ("generate --temperature -1 --max-new-tokens 4", "temperature must be finite and >= 0"),
    ("generate --temperature inf --max-new-tokens 4", "temperature must be finite and >= 0"),
    ("profile --temperature -1 --out {tmp}/p.json", "temperature must be finite and >= 0"),
    ("profile --temperature nan --out {tmp}/p.json", "got nan"),
    (
        "calibrate --records {npy} --drafter {draft} --temperature inf --out {tmp}/s.json",
        "temperature must be finite and >= 0 (0 = greedy), got inf",
    ),
    ("generate --top-p 2 --max-new-tokens 4", "top_p must be in (0, 1]"),
    ("generate --min-p 1.5 --max-new-tokens 4", "min_p must be in [0, 1] (0 = off), got 1.5"),
    ("generate --presence-penalty 3 --max-new-tokens 4", "presence_penalty must be in [-2, 2]"),
    ("generate --repetition-penalty 0 --max-new-tokens 4", "repetition_penalty must be finite"),
    (
        'generate --logit-bias {{"5":101}} --max-new-tokens 4',
        "logit_bias[5] must be in [-100, 100], got 101.0",
    ),
    ("generate --logit-bias [5] --max-new-tokens 4", "--logit-bias: expected a JSON object"),
    ("generate --allowed-token-ids 5,x", "--allowed-token-ids: expected integers separated by"),
    ("generate --allowed-token-ids 99999 --max-new-tokens 4", "allowed token 99999 is outside"),
    ('generate --logit-bias {{"a":1}} --max-new-tokens 4', "keys are token ids (0, 1, 2, ...)"),
    ('generate --logit-bias {{"²":1}} --max-new-tokens 4', "keys are token ids (0, 1, 2, ...)"),
    ('generate --logit-bias {{"07":1}} --max-new-tokens 4', "keys are token ids (0, 1, 2, ...)"),
    (
        'generate --logit-bias {{"99999":1}} --max-new-tokens 4',
        "logit_bias token 99999 is outside the vocabulary",
    ),
    ("serve --max-logit-bias -1", "--max-logit-bias must be in 0..1024 (0: no logit_bias), got -1"),
    ("generate --policy dspark", "invalid choice: 'dspark'"),
    ("generate --policy fixed --threshold 0.5", "--policy fixed would ignore it"),
    # The flag is named, not the policy's parameter alone ("threshold must lie in [0, 1]").
    ("generate --policy threshold --threshold 1.5", "argument --threshold: must lie in [0, 1]"),
    ("generate --draft {tmp}/x --no-draft", "--draft would not be used"),
    ("generate --no-draft --sts {tmp}/x.json", "drop --sts (or --no-draft)"),
    ("generate --max-new-tokens many", "invalid int value"),
    ("generate --bogus", "unrecognized arguments: --bogus (see dspark-jax generate --help)"),
    ("generate --mesh 0,1,1", "argument --mesh: mesh axis sizes must be positive or -1"),
    # Decoding may use fewer devices than there are (8 here): not training's "-1" advice alone.
    ("generate --mesh 1,1,16 --max-new-tokens 4", "give sizes that multiply to at most 8"),
    (
        "generate --token-ids 1,2,3 --mesh=-1,1,2 --max-num-seqs 3",
        "--max-num-seqs 3 must be a multiple of data x fsdp = 4 on mesh 4,1,2",
    ),
    ("generate --target ./no/such/model", "no such folder"),
    ("generate --target {plain_file}", "is not a directory"),
    ("generate --target {hidden_words} --no-draft", "hidden_size must be an integer"),
    ("generate --target {zero_heads} --no-draft", "num_attention_heads must be an integer >= 1"),
    (
        "generate --policy threshold --threshold 0.6 --sts /no/such/sts.json --max-new-tokens 4",
        "cannot read the STS artifact",
    ),
    ("generate --sps-table /no/such/sps.json --policy scheduler", "cannot read the SPS table"),
    ("generate --json {plain_file}/out.json --max-new-tokens 4", "--json"),
    ("generate --json /proc/dspark-out.json --max-new-tokens 4", "cannot write there"),
    ("generate --json {tmp} --max-new-tokens 4", "is a folder"),
    ("generate --prompts-file {notalist} --json {notalist}", "is the --prompts-file file"),
    (
        "generate --policy threshold --threshold 0.6 --sts {npy} --json {npy}",
        "is the --sts file: the results would replace the STS artifact read from it",
    ),
    ("eval --out {plain_file}/results {notalist}", "--out"),
    ("eval --limit 0 {notalist}", "--limit must be >= 1"),
    ("eval {two_turns} --out {here} --overwrite", "overlaps the input"),
    (
        "calibrate --records /no/such.npz --drafter {draft} --temperature 1 --out {tmp}/s.json",
        "cannot read the records",
    ),
    (
        "calibrate --records {npy} --drafter {draft} --temperature 1 --out {tmp}/s.json",
        "not a calibration records file",
    ),
    (
        "calibrate --records {npy} --drafter {draft} --temperature 1 --out /proc/dspark/s.json",
        "cannot write there",
    ),
    (
        "calibrate --records {npy} --drafter {draft} --temperature 1 --bins 0 --out {tmp}/s.json",
        "--bins must be >= 1, got 0",
    ),
    (
        "calibrate --records {npy} --drafter {draft} --temperature 1 --bins -3 --out {tmp}/s.json",
        "--bins must be >= 1, got -3",
    ),
    (
        "calibrate --records {npy} --drafter {draft} --temperature 1 --holdout-fraction nan "
        "--out {tmp}/s.json",
        "--holdout-fraction must lie in (0, 1), got nan",
    ),
    ("profile --context-len 100000000 --out {tmp}/p.json", "the model has 4096"),
    ("profile --max-num-seqs 100000 --context-len 4000 --out {tmp}/p.json", "lower --kv-pages"),
    ("profile --seed 99999999999 --out {tmp}/p.json", "--seed must lie in 0..4294967295"),
    # every seed is taken, the drafter's random weights wrapping to 0: the context is refused
    ("profile --seed 4294967295 --context-len 100000000 --out {tmp}/p.json", "the model has"),
    ("profile --out /proc/dspark/p.json", "cannot write there"),
    ("generate --token-ids -3", "expected one or more non-negative ids"),
    ("generate --policy threshold", "--policy threshold needs --threshold"),
    ("generate --policy scheduler", "--policy scheduler needs --sps-table"),
    ("generate --policy fixed --sts {tmp}/sts.json", "--policy fixed reads none"),
    ("generate --draft {draft}", "came without --target, so the target is the embedded"),
    ("eval", "no datasets: give JSONL files or --datasets-dir"),
    ("eval --datasets-dir {plain_file}", "file.txt: not a folder"),
    ("eval --datasets-dir {hidden_words}", "holds no *.jsonl files"),
    ("eval {two_turns} --out {hidden_words}", "exists and is not empty (use --overwrite"),
    ("convert --out {tmp}/c", "give --draft, --target or both"),
    ("convert --draft {draft} --out /proc/dspark/c", "cannot write there"),
    ("convert --draft ckpt-typo/../draft --out {tmp}/c", "no such folder"),
    ("convert --target {draft} --out {tmp}/c", "looks like a drafter checkpoint"),
    ("generate --target {target} --draft {target}", "drafter (--draft; calibrate's --drafter)"),
    ("generate --target {target}", "came without --draft, so the drafter is the embedded"),
    ("export --draft {draft} --out {plain_file}/x", "--out"),
    ("export --draft {tmp}/nothing --out {tmp}/x", "no such folder"),
    ("export --draft {draft} --format speculators --out {tmp}/s", "give it with --target"),
    ("train --config nope", "unknown train config 'nope'"),
    ("train --config tiny-dspark --output {plain_file}/run", "is a file, not a folder"),
    ("serve --draft {draft}", "a drafter needs its target: give --target too"),
    ("serve --target {target} --gamma 3", "--gamma needs a drafter; this server decodes"),
    ("serve --rounds-per-chunk 0", "--rounds-per-chunk must be >= 1"),
    ("serve --max-model-len 0", "--max-model-len must be >= 1"),
    ("serve --max-num-seqs 1000000", "--max-num-seqs must be <="),
    ("serve --port {busy_port}", "already in use"),
    ("serve --port 70000", "--port must be in 0..65535"),
]


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("command, fragment", CLI_CASES, ids=[c for c, _ in CLI_CASES])
def test_bad_command_lines_fail_in_one_line(
    command, fragment, bad_files, tmp_path, busy_port, capsys
):
    names = {k: str(v) for k, v in bad_files.items()}
    argv = command.format(
        **names, tmp=tmp_path, draft=TINY_DRAFT, target=TINY_TARGET, busy_port=busy_port
    )
    rc, lines = _run(argv.split(), capsys)
    assert rc != 0
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    "command",
    [
        "eval --out {tmp}/new/results --limit 0 {notalist}",
        "generate --json {tmp}/new/deeper/out.json --token-ids 5,x",
        "profile --out {tmp}/new/p.json --config no-such-model",
    ],
)
def test_output_checks_leave_nothing_behind(command, bad_files, tmp_path, capsys):
    """The output location is probed before any work, and a command refused after the probe
    leaves no folder of it behind."""
    argv = command.format(notalist=bad_files["notalist"], tmp=tmp_path).split()
    assert _run(argv, capsys)[0] == 2
    assert not (tmp_path / "new").exists()


def test_one_half_of_a_converted_pair_names_the_other(converted, capsys):
    """A converted folder holds both models: given as --draft alone (or --target alone), the
    refusal of the embedded other half names the folder for the missing flag."""
    rc, lines = _run(["generate", "--draft", str(converted), "--max-new-tokens", "4"], capsys)
    assert rc == 2 and f"give --target {converted} (the target it records)" in lines[0], lines
    rc, lines = _run(["generate", "--target", str(converted), "--max-new-tokens", "4"], capsys)
    assert rc == 2 and f"give --draft {converted} or --no-draft" in lines[0], lines


# -- 1. a converted folder decodes like the safetensors it came from ---------------------------
def _leaf_properties(model) -> list[tuple]:
    return [
        (x.dtype, x.weak_type, x.committed, x.sharding) for x in jax.tree.leaves(nnx.state(model))
    ]


def test_converted_parameters_share_compiled_programs_with_safetensors(converted):
    """Committed-ness keys jit's cache: Orbax's device placement made every program compile a
    second time for parameters from a converted folder."""
    from_safetensors = load_decoding_models(TINY_TARGET, TINY_DRAFT, progress=False)
    from_converted = load_decoding_models(converted, converted, progress=False)
    for attr in ("target", "drafter"):
        a, b = getattr(from_safetensors, attr), getattr(from_converted, attr)
        assert _leaf_properties(a) == _leaf_properties(b)
        total = jax.jit(lambda params: sum(jnp.sum(x) for x in jax.tree.leaves(params)))
        total(nnx.state(a))
        total(nnx.state(b))
        assert total._cache_size() == 1


def test_converted_and_safetensors_compile_the_same_programs(converted):
    """The engine's programs, counted after warm-up and after serving a request, for the target
    from either form (plain decoding keeps the test fast; the drafter's parameters are held to
    the same properties above)."""
    cfg = EngineConfig(
        num_slots=2, max_model_len=64, rounds_per_chunk=2, prefill_chunk=32, prefill_buckets=(32,)
    )
    counts = []
    for target in (TINY_TARGET, converted):
        models = load_decoding_models(target, None, progress=False)
        engine = Engine(models.target, None, cfg, stop_tokens=models.stop_tokens)
        engine.warm_up()
        warm = engine.compiled_programs()
        batcher = Batcher(engine)
        batcher.submit(Request([1, 2, 3], 24), lambda kind, payload: None)
        batcher.run_until_idle()
        assert engine.compiled_programs() == warm
        counts.append(warm)
    assert counts[0] == counts[1]


@pytest.mark.slow
def test_converted_decode_speed_matches_safetensors(converted):
    """Interleaved repeats on one machine; the median ratio tolerates CPU noise, not a second
    compilation inside the timed loop (24x in the report that opened issue 8)."""
    cfg = EngineConfig(num_slots=1, max_model_len=320, rounds_per_chunk=8, prefill_chunk=64)
    engines = []
    for target, draft in ((TINY_TARGET, TINY_DRAFT), (converted, converted)):
        models = load_decoding_models(target, draft, progress=False)
        engine = Engine(models.target, models.drafter, cfg)
        engine.warm_up()
        engines.append(engine)
    times = [[], []]
    for _ in range(7):
        for i, engine in enumerate(engines):
            batcher = Batcher(engine, timed=True)
            request = Request([1, 2, 3], 250, ignore_eos=True)  # all 250 tokens, every time
            batcher.submit(request, lambda kind, payload: None)
            batcher.run_until_idle()
            times[i].append(batcher.timing.decode_s)
    ratio = np.median(times[0]) / np.median(times[1])
    assert ratio >= 0.8, (ratio, times)


# -- 2. one prompt validation for every entry point --------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair():
    """The tiny pair, loaded once; engines built on it here are rarely compiled."""
    return load_decoding_models(TINY_TARGET, TINY_DRAFT, progress=False)


def test_python_api_refuses_out_of_vocabulary_ids_and_bad_seeds(tiny_pair):
    models = tiny_pair
    engine = Engine(models.target, models.drafter, EngineConfig(num_slots=1, max_model_len=64))
    batcher = Batcher(engine)
    vocab = models.target.cfg.vocab_size
    for request, fragment in (
        (Request([1, vocab], 4), rf"0..{vocab - 1} \(the vocabulary\); got {vocab}"),
        (Request([1, -2], 4), "the vocabulary"),
        (Request([1, 2], 4, stop_token_ids=(vocab + 7,)), "stop token ids"),
        (Request([1, 2], 4, seed=2**32), "seed must lie in"),
        (Request([], 4), "empty prompt"),
        (Request([1] * 60, 4), "max_model_len is 64"),
    ):
        with pytest.raises(EngineError, match=fragment):
            batcher.submit(request, lambda kind, payload: None)


def test_too_many_stop_ids_are_counted_as_the_request_and_the_model_give_them(tiny_pair):
    """The limit covers the request's stop ids and the model's end-of-turn ids together; the
    message says how many are whose, so a request of 7 ids is not told it gave 9."""
    models = tiny_pair
    engine = Engine(models.target, None, EngineConfig(num_slots=1, max_model_len=64))
    model_ids = len(engine.stop_tokens)
    own = engine.cfg.max_stop_tokens - model_ids + 1
    request = Request([1, 2], 4, stop_token_ids=tuple(range(10, 10 + own)))
    with pytest.raises(EngineError) as refused:
        Batcher(engine).submit(request, lambda kind, payload: None)
    assert (
        f"({own} of the request's and {model_ids} of the model's end-of-turn ids) exceed the "
        f"limit of {engine.cfg.max_stop_tokens}" in str(refused.value)
    )
    assert f"give at most {own - 1}, or ignore_eos" in str(refused.value)
    Batcher(engine).submit(dataclasses.replace(request, ignore_eos=True), lambda k, p: None)


def test_engine_refuses_stop_tokens_a_request_could_not_give(tiny_pair):
    """The engine's stop tokens go by the rule of a request's stop ids: a string or an id past
    int32 used to be taken and fail at the first generate, one outside the vocabulary (or the
    no-stop sentinel -2) to be taken silently although it could never match."""
    models = tiny_pair
    cfg = EngineConfig(num_slots=1, max_model_len=64)
    vocab = models.target.cfg.vocab_size
    for stop_tokens, fragment in (
        (("a",), "stop_tokens must be a flat sequence of integers"),
        ((1.0,), "stop_tokens must be a flat sequence of integers"),
        (7, "stop_tokens must be a flat sequence of integers"),
        (
            (2**40,),
            rf"stop_tokens must lie in 0..{vocab - 1} \(the vocabulary\); got 1099511627776",
        ),
        ((5, 99999), rf"stop_tokens must lie in 0..{vocab - 1} \(the vocabulary\); got 99999"),
        ((-2,), "stop_tokens must lie in"),
    ):
        with pytest.raises(EngineError, match=fragment):
            Engine(models.target, None, cfg, stop_tokens=stop_tokens)
    engine = Engine(models.target, None, cfg, stop_tokens=[np.int64(vocab - 1), 3])
    assert engine.stop_tokens == (vocab - 1, 3)
    assert Engine(models.target, None, cfg, stop_tokens=models.stop_tokens).stop_tokens


def test_engine_refuses_a_policy_without_a_drafter(tiny_pair):
    """A plain engine verifies no drafts: a policy given to it used to be ignored in silence,
    while an STS artifact without a drafter was already refused."""
    models = tiny_pair
    cfg = EngineConfig(num_slots=1, max_model_len=64)
    with pytest.raises(EngineError, match=r"a policy \(ThresholdPolicy\) needs a drafter"):
        Engine(models.target, None, cfg, policy=policies.ThresholdPolicy(0.5))
    with pytest.raises(EngineError, match=r"a policy \(FixedPolicy\) needs a drafter"):
        Engine(models.target, None, cfg, policy=policies.FixedPolicy(3))
    assert Engine(models.target, None, cfg).gamma == 0
    spec = Engine(models.target, models.drafter, cfg, policy=policies.FixedPolicy(3))
    assert spec.policy == policies.FixedPolicy(3)


def test_python_api_refuses_requests_of_the_wrong_types_at_submit(tiny_pair):
    """Each of these used to pass `submit` and then raise inside `Batcher.step()` on every later
    step (a float max_new_tokens in the page allocator, a float for sampling when packing the
    prefill), stalling every request queued with it; a float seed was truncated silently."""
    models = tiny_pair
    engine = Engine(models.target, models.drafter, EngineConfig(num_slots=1, max_model_len=64))
    batcher = Batcher(engine)
    for request, fragment in (
        (Request([1, 2], 2.5), r"max_new_tokens must be an integer >= 1, got 2\.5"),
        (Request([1, 2], 5.0), r"max_new_tokens must be an integer >= 1, got 5\.0"),
        (Request([1, 2], None), "max_new_tokens must be an integer >= 1, got None"),
        (Request([1, 2], True), "max_new_tokens must be an integer >= 1, got True"),
        (Request([1, 2], 4, seed=1.7), r"seed must be an integer in 0\.\.4294967295, got 1\.7"),
        (Request([1, 2], 4, seed="7"), "seed must be an integer in .*, got .7."),
        (Request([1, 2], 4, sampling=0.7), "sampling must be a SamplingConfig .*, got 0.7"),
        (Request([1, 2], 4, sampling=None), "sampling must be a SamplingConfig .*, got None"),
    ):
        with pytest.raises(EngineError, match=fragment):
            batcher.submit(request, lambda kind, payload: None)
    assert batcher.num_waiting == 0
    # numpy integers are integers.
    batcher.submit(Request([1, 2], np.int64(4), seed=np.uint32(3)), lambda kind, payload: None)
    assert batcher.num_waiting == 1


def test_a_burst_into_free_slots_is_not_refused_as_a_full_queue(tiny_pair):
    """`max_waiting` bounds the requests waiting for a slot. Requests that arrive between two
    loop steps while slots are free are not waiting (the next step admits them): the server's
    `--max-waiting 2` answered 503 "queue is full" to a burst of 4 on an idle 4-slot engine."""
    engine = Engine(tiny_pair.target, None, EngineConfig(num_slots=4, max_model_len=64))
    batcher = Batcher(engine, max_waiting=2)
    for _ in range(4 + 2):  # every free slot, then the queue
        batcher.submit(Request([1, 2], 4), lambda kind, payload: None)
    with pytest.raises(QueueFullError, match=r"^2 requests are already waiting for a slot"):
        batcher.submit(Request([1, 2], 4), lambda kind, payload: None)
    assert batcher.num_waiting == 6


def test_free_slots_do_not_discount_the_queue_while_kv_pages_are_short(tiny_pair):
    """Free slots take nobody while the head of the queue waits for KV pages: a 4-slot server
    with room for one request's pages and `--max-waiting 2` took 1 running + 5 waiting (its
    three idle slots counted as takers) and said "2 requests are already waiting"."""
    engine = Engine(
        tiny_pair.target, None, EngineConfig(num_slots=4, max_model_len=64, num_pages=4)
    )
    assert engine.pages_needed(2, 40) > engine.cfg.pool_pages // 2  # one such request at a time
    batcher = Batcher(engine, max_waiting=2)

    def submit():
        return batcher.submit(Request([1, 2], 40), lambda kind, payload: None)

    running = submit()
    batcher._drain_inbox()
    batcher._admit()  # the loop's admission, without dispatching device work
    assert running.slot is not None and len(batcher.free_slots) == 3
    queued = [submit(), submit()]
    batcher._drain_inbox()
    batcher._admit()  # the head finds three free slots and too few pages
    assert all(h.slot is None for h in queued) and batcher.num_waiting == 2
    with pytest.raises(
        QueueFullError, match=r"^2 requests are already waiting for a slot and KV pages \(limit 2\)"
    ):
        submit()
    # Pages back (the running request ends): the head is admitted and the queue has room again.
    batcher.cancel(running)
    batcher._drain_inbox()
    batcher._admit()
    assert queued[0].slot is not None and batcher.num_waiting == 1
    submit()
    assert batcher.num_waiting == 2


def test_conversation_errors_count_from_one_like_the_answer_labels():
    """Answers print as [1], [2] ... turn 1, turn 2; an error about one names it the same way."""
    from dspark_jax.decoding.evaluate import answer_conversations

    models = load_decoding_models(TINY_TARGET, None, progress=False)
    engine = Engine(models.target, None, EngineConfig(num_slots=1, max_model_len=64))
    conversations = [["short"], ["x" * 80]]
    with pytest.raises(EngineError, match=r"^conversation 2 turn 1: a prompt of"):
        answer_conversations(engine, models.tokenizer, conversations, max_new_tokens=4)


def test_prompts_file_errors_name_file_and_line(bad_files):
    with pytest.raises(ConversationError, match=r"notalist.jsonl:2: 'turns' must be"):
        read_turns(bad_files["notalist"], plain_lines=True)
    with pytest.raises(ConversationError, match=r"prompts.jsonl:2: not UTF-8"):
        read_turns(bad_files["nonutf8"], plain_lines=True)


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
    """Editors on Windows start UTF-8 files with a BOM; it made the first JSON line a plain
    prompt ('\ufeff{"turns": ...}') for generate and malformed JSON for eval."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"turns": ["hi"]}\nplain\n')
    assert read_turns(path, plain_lines=True) == [["hi"], ["plain"]]
    path.write_bytes(b"\xef\xbb\xbf" + b'{"turns": ["hi", "again"]}\n')
    assert read_turns(path) == [["hi", "again"]]


@pytest.mark.parametrize(
    "command, fragment",
    [
        ("generate --token-ids 1,4096 --max-new-tokens 4", "--token-ids 1 4096: prompt ids"),
        ('generate --logit-bias {{"4096":1}} --max-new-tokens 4', "logit_bias token 4096 is"),
        # eval compiled both engines (and, on a GPU model, spent minutes) before its first turn
        # refused the bias.
        ('eval --logit-bias {{"4096":1}} --out {out} {two_turns}', "logit_bias token 4096 is"),
    ],
)
def test_out_of_vocabulary_ids_are_refused_before_compiling(
    command, fragment, bad_files, tmp_path, monkeypatch, capsys
):
    def compile_(self):
        raise AssertionError("compiled before refusing the request")

    monkeypatch.setattr(Engine, "warm_up", compile_)
    argv = command.format(out=tmp_path / "results", two_turns=bad_files["two_turns"]).split()
    rc, lines = _run(argv, capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert fragment in lines[0] and "0..4095" in lines[0], lines[0]
    assert not (tmp_path / "results").exists()


# -- 3. damaged weights never run --------------------------------------------------------------
def _nan_drafter(root: Path) -> Path:
    folder = root / "nan-draft"
    shutil.copytree(TINY_DRAFT, folder)
    source = SafetensorsFolder(folder)
    tensors = {key: np.array(source.get(key)) for key in source.keys()}
    tensors["fc.weight"][0, 0] = np.nan
    save_safetensors(tensors, folder / SINGLE_FILE, metadata={"format": "pt"})
    return folder


def test_non_finite_drafter_is_refused_at_convert_and_load(tmp_path, capsys):
    folder = _nan_drafter(tmp_path)
    with pytest.raises(CheckpointError, match=r"the drafter at .*NaN or infinite values \(fc\."):
        load_drafter(folder, progress=False)
    rc, lines = _run(["convert", "--draft", str(folder), "--out", str(tmp_path / "c")], capsys)
    assert rc == 2 and len(lines) == 1 and "NaN or infinite" in lines[0]
    assert not (tmp_path / "c").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["nan-draft"]  # no working folder left


def test_modified_target_of_a_converted_folder_is_refused(converted, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(converted, damaged)
    _, target, _ = load_target(damaged, progress=False)
    state = nnx.state(target)
    leaf = state["layers"][0]["mlp"]["down_proj"]["kernel"]
    leaf[...] = leaf[...].at[0, 0].add(1e-3)  # finite, plausible, and not what was converted
    nnx.update(target, state)
    shutil.rmtree(damaged / "target" / "params")
    orbax_io.save_params(target, damaged / "target" / "params")
    with pytest.raises(CheckpointError, match=r"target's parameters do not match the checksum"):
        load_target(damaged, progress=False)
    load_drafter(damaged, progress=False)  # the other part is intact
    manifest = json.loads((converted / "dspark_jax.json").read_text())
    assert manifest["target"]["checksum"] and manifest["draft"]["checksum"]


def test_a_truncated_orbax_file_fails_in_one_line(converted, tmp_path, capsys, monkeypatch):
    """Reads still in flight when the first one fails used to report to Orbax's closed event
    loop from tensorstore's threads, and Python printed each 'RuntimeError: Event loop is
    closed' (as an unraisable exception) after the one-line error, in most runs; the abandoned
    read coroutines, once garbage-collected, printed Orbax's own exception with the whole
    TensorStore spec. Five tries make a miss unlikely."""
    damaged = tmp_path / "damaged"
    shutil.copytree(converted, damaged)
    data = max((damaged / "draft" / "params").rglob("d/*"), key=lambda f: f.stat().st_size)
    os.truncate(data, 100)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))
    for _ in range(5):
        rc, lines = _run(["export", "--draft", str(damaged), "--out", str(tmp_path / "x")], capsys)
        time.sleep(0.2)  # the late reads finish within milliseconds
        assert rc == 2 and len(lines) == 1 and "cannot read the Orbax checkpoint" in lines[0]
    gc.collect()  # abandoned coroutines report when they are collected
    assert unraisable == []
    assert not (tmp_path / "x").exists()


def test_a_missing_orbax_manifest_is_one_error_without_absl_noise(
    converted, tmp_path, capsys, caplog
):
    """Orbax logs 'WARNING:absl:Failed to get item metadata ...' and returns no metadata, which
    then read as 'holds no floating-point parameters'."""
    damaged = tmp_path / "damaged"
    shutil.copytree(converted, damaged)
    (damaged / "draft" / "params" / "manifest.ocdbt").unlink()
    rc, lines = _run(["export", "--draft", str(damaged), "--out", str(tmp_path / "x")], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert "parameter metadata is missing or unreadable" in lines[0]
    assert not [r for r in caplog.records if "Failed to get item metadata" in r.getMessage()]


# -- 4. context and memory bounds before anything is allocated ---------------------------------
def test_engine_refuses_a_pool_larger_than_memory():
    models = load_decoding_models(TINY_TARGET, None, progress=False)
    cfg = EngineConfig(num_slots=1, max_model_len=64, num_pages=10**9)
    with pytest.raises(EngineError, match=r"need \d+\.\d\d GiB .* lower --kv-pages"):
        Engine(models.target, None, cfg)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"max_model_len": 64.5}, r"max_model_len must be an integer >= 1, got 64\.5"),
        ({"num_slots": 2.0}, r"num_slots must be an integer >= 1, got 2\.0"),
        ({"num_pages": 7.5}, r"num_pages must be an integer >= 1, got 7\.5"),
        ({"page_size": True}, "page_size must be an integer >= 1, got True"),
        ({"prefill_buckets": ()}, r"prefill_buckets must be a non-empty tuple .*, got \(\)"),
        ({"token_buckets": ()}, r"token_buckets must be a non-empty tuple .*, got \(\)"),
        ({"token_buckets": (8, 0)}, "token_buckets must be a non-empty tuple of integers >= 1"),
        ({"prefill_buckets": (64.0,)}, "prefill_buckets must be a non-empty tuple of integers"),
        ({"draft_buckets": ()}, r"draft_buckets must be a non-empty tuple .*, got \(\)"),
        ({"num_slots": 8, "draft_buckets": (2, 4)}, r"draft_buckets \(2, 4\) must end at"),
        ({"num_slots": 8, "draft_buckets": (4, 16)}, "must end at num_slots 8"),
    ],
)
def test_engine_config_refuses_fractional_sizes_and_empty_buckets(kwargs, fragment):
    """A float size used to fail deep inside JAX at the first compile, an empty bucket tuple with
    a bare IndexError when the engine was built."""
    with pytest.raises(EngineError, match=fragment):
        EngineConfig(**kwargs)


def test_engine_config_takes_numpy_integers():
    cfg = EngineConfig(num_slots=np.int64(2), max_model_len=np.int32(64), token_buckets=[4, 8])
    assert (cfg.num_slots, cfg.max_model_len, cfg.token_buckets) == (2, 64, (4, 8))
    assert type(cfg.num_slots) is int and hash(cfg) == hash(dataclasses.replace(cfg))


@pytest.mark.parametrize(
    "slots, given, buckets",
    [
        (1, None, (1,)),
        (2, None, (2,)),
        (4, None, (4,)),
        (8, None, (4, 8)),
        (12, None, (4, 8, 12)),
        (64, None, (8, 16, 32, 64)),
        (256, None, (32, 64, 128, 256)),
        (8, [8, np.int64(2), 2], (2, 8)),
    ],
)
def test_draft_buckets_default_to_at_most_four_doublings_from_four(slots, given, buckets):
    assert EngineConfig(num_slots=slots, draft_buckets=given).slot_buckets() == buckets


# -- 5. the hub only for hub ids ---------------------------------------------------------------
def test_hub_lookup_only_for_hub_ids(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    for name in ("ckpt/qwen3-4b", "./org/name", "../org/name", "a/b/c", "~/x/y"):
        with pytest.raises(CheckpointError, match="no such folder"):
            resolve_model_dir(name)
    assert "fetching from the hub" not in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match="Hugging Face hub could not provide it"):
        resolve_model_dir("dspark-test-org/no-such-model")
    assert "fetching from the hub: dspark-test-org/no-such-model" in capsys.readouterr().err


# -- 6. interrupted convert / export -----------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_working_folders_of_killed_runs_are_removed(tmp_path):
    host = socket.gethostname()
    hexes = iter(uuid.uuid4().hex[:12] for _ in range(4))
    dead = tmp_path / f".out.tmp-{host}-{_dead_pid()}-{next(hexes)}"
    alive = tmp_path / f".out.tmp-{host}-{os.getpid()}-{next(hexes)}"
    legacy_old = tmp_path / f".out.tmp-{next(hexes)}"
    legacy_new = tmp_path / f".out.tmp-{next(hexes)}"
    for folder in (dead, alive, legacy_old, legacy_new):
        folder.mkdir()
        (folder / "part").write_bytes(b"x" * 100)
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(legacy_old, (two_days_ago, two_days_ago))
    convert_checkpoints(tmp_path / "out", draft=TINY_DRAFT, progress=False)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["out", alive.name, legacy_new.name])


def _interrupt_self() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # the handler runs between bytecodes; give it a chance


def test_ctrl_c_during_orbax_save_exits_130_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    save = orbax_io.ocp.StandardCheckpointer.save

    def save_then_interrupt(self, *args, **kwargs):
        save(self, *args, **kwargs)  # the background writer is still going
        _interrupt_self()

    monkeypatch.setattr(orbax_io.ocp.StandardCheckpointer, "save", save_then_interrupt)
    handler = signal.getsignal(signal.SIGINT)
    rc, lines = _run(["convert", "--draft", str(TINY_DRAFT), "--out", f"{tmp_path}/c"], capsys)
    assert (rc, lines) == (130, ["dspark-jax convert: interrupted"])
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is handler


def test_ctrl_c_swallowed_by_a_library_still_stops_the_commit(tmp_path, monkeypatch, capsys):
    from dspark_jax.checkpoints import converted as converted_module

    check = converted_module.check_parameters

    def check_swallowing_interrupts(*args, **kwargs):
        try:
            _interrupt_self()
        except KeyboardInterrupt:
            pass
        return check(*args, **kwargs)

    monkeypatch.setattr(converted_module, "check_parameters", check_swallowing_interrupts)
    rc, lines = _run(["convert", "--draft", str(TINY_DRAFT), "--out", f"{tmp_path}/c"], capsys)
    assert (rc, lines) == (130, ["dspark-jax convert: interrupted"])
    assert list(tmp_path.iterdir()) == []


def _tiny_target_config() -> dict:
    return json.loads((Path(TINY_TARGET) / "config.json").read_text())


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        # transformers fills layer_types from max_window_layers: layers 1.. slide
        (
            {
                "use_sliding_window": True,
                "sliding_window": 4,
                "max_window_layers": 1,
                "layer_types": None,
            },
            "sliding-window attention (use_sliding_window with sliding_window 4, in layers 1..3)",
        ),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 4,
                "layer_types": ["full_attention", "sliding_attention"] * 2,
            },
            "in layers 1..3",
        ),
        ({"layer_types": ["linear_attention"] * 4}, "layer_types ['linear_attention']"),
    ],
)
def test_qwen3_variants_this_port_would_compute_differently_are_refused(
    change, fragment, tmp_path, capsys
):
    """transformers runs these with GELU or a sliding window; this port has neither, so it
    must refuse them rather than decode other tokens than the model's."""
    config = {**_tiny_target_config(), **change}
    with pytest.raises(ConfigError) as refused:
        Qwen3Config.from_hf(config)
    assert fragment in str(refused.value)
    folder = tmp_path / "variant"
    shutil.copytree(TINY_TARGET, folder)
    (folder / "config.json").write_text(json.dumps(config))
    rc, lines = _run(["convert", "--target", str(folder), "--out", str(tmp_path / "c")], capsys)
    assert rc != 0 and len(lines) == 1 and fragment in lines[0], lines
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "change",
    [
        {"hidden_act": "swish"},  # transformers' other name for SiLU
        {"hidden_act": None},
        # transformers: no window without use_sliding_window, whatever layer_types say
        {"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 0},
        {"use_sliding_window": False, "layer_types": ["sliding_attention"] * 4},
        {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
        # a window as long as the positions never slides (Qwen3's released files: 36 of 36)
        {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0},
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 4},
    ],
)
def test_qwen3_settings_that_change_nothing_are_accepted(change):
    reference = Qwen3Config.from_hf(_tiny_target_config())
    assert Qwen3Config.from_hf({**_tiny_target_config(), **change}) == reference


@pytest.mark.parametrize(
    "command, message",
    [
        (
            f"convert --target {EMBEDDED_TARGET} --out {{disk}}/c",
            "convert: error: [Errno 28] cannot write the parameters: No space left on device: "
            "'{disk}/c'",
        ),
        (
            f"export --draft {EMBEDDED_DRAFT} --target {EMBEDDED_TARGET} --out {{disk}}/x",
            "export: error: [Errno 28] No space left on device: '{disk}/x'",
        ),
    ],
    ids=["convert", "export"],
)
def test_a_full_disk_is_one_line_naming_the_output(command, message, tmp_path):
    """Orbax writes each array from a background thread; on a full file system every one of them
    failed at once, and convert printed hundreds of lines (each thread's log and traceback, the
    abandoned writes' "Event loop is closed") instead of one error naming --out; export's
    error named no folder. Run in a child under a 200 kB tmpfs mounted in a private mount
    namespace (`unshare -rm`, which needs no root where user namespaces are allowed)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    shell = (
        f"mount -t tmpfs -o size=200k none {disk} && exec {sys.executable} -m dspark_jax.cli "
        + command.format(disk=disk)
    )
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", shell], capture_output=True, text=True, timeout=300
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert lines == ["dspark-jax " + message.format(disk=disk)], done.stderr[-3000:]


def test_a_plain_engine_of_decoding_models_refuses_a_policy_it_would_drop():
    """DecodingModels.engine(speculative=False) built a plain engine and silently dropped the
    policy= and sts= it was given; Engine itself refuses them for plain decoding."""
    from dspark_jax.calibration.sts import StsArtifact
    from dspark_jax.decoding.policies import FixedPolicy

    models = load_decoding_models(TINY_TARGET, TINY_DRAFT, progress=False)
    cfg = EngineConfig(num_slots=1, max_model_len=64)
    with pytest.raises(EngineError, match=r"a policy \(FixedPolicy\) needs a drafter"):
        models.engine(cfg, policy=FixedPolicy(3), speculative=False)
    sts = StsArtifact((1.0,) * models.gamma, "sha256:x", 1.0, n_records=1)
    with pytest.raises(EngineError, match="an STS artifact needs a drafter"):
        models.engine(cfg, sts=sts, speculative=False)
    assert models.engine(cfg, speculative=False).gamma == 0


def test_submit_checks_what_the_loop_would_trip_on_later(tiny_pair):
    """Caught by Batcher.submit, before the loop thread reads them: a request that is not a
    Request, a callback that is not callable (a TypeError from step() later), ignore_eos "no"
    (counted as true), and a prompt list changed after submitting (an id outside the vocabulary
    reached the engine unchecked). A handle cancelled through another Batcher was skipped by its
    own without leaving its queue count."""
    engine = Engine(tiny_pair.target, None, EngineConfig(num_slots=2, max_model_len=64))
    batcher = Batcher(engine)

    def quiet(kind, payload):
        return None

    with pytest.raises(EngineError, match="submit takes a Request, got dict"):
        batcher.submit({"prompt_ids": [1, 2]}, quiet)
    with pytest.raises(EngineError, match="on_event must be a function"):
        batcher.submit(Request([1, 2], 4), None)
    with pytest.raises(EngineError, match="ignore_eos must be True or False, got 'no'"):
        batcher.submit(Request([1, 2], 4, ignore_eos="no"), quiet)
    assert batcher.num_waiting == 0
    prompt = [1, 2, 3]
    handle = batcher.submit(Request(prompt, 4), quiet)
    prompt[1] = 10**6  # after the check
    assert handle.request.prompt_ids == (1, 2, 3)
    other = Batcher(engine)
    with pytest.raises(EngineError, match=f"request {handle.id} was submitted to another Batcher"):
        other.cancel(handle)
    batcher.cancel(handle)
    batcher.step()
    assert batcher.num_waiting == 0 and handle.cancelled


def test_release_takes_one_flag_per_slot(tiny_pair):
    """A scalar True freed every slot (and compiled a program of its own after warm-up); a mask
    of another length failed inside jit with a broadcasting TypeError."""
    engine = Engine(tiny_pair.target, None, EngineConfig(num_slots=2, max_model_len=64))
    state = engine.init_state()
    for mask in (True, np.ones(3, bool)):
        with pytest.raises(EngineError, match=r"release takes one flag per slot, shape \(2,\)"):
            engine.release(state, mask)
    engine.release(state, np.array([True, False]))


def test_release_converts_an_integer_mask_on_the_host(tiny_pair):
    """A 0/1 integer mask was cast on the device: one more program, compiled after warm-up."""
    from compile_events import compile_threads

    # One prefill and one verification bucket: the fewest programs that warm-up compiles.
    cfg = EngineConfig(
        num_slots=2, max_model_len=64, prefill_chunk=16, prefill_buckets=(16,), token_buckets=(2,)
    )
    engine = Engine(tiny_pair.target, None, cfg)
    engine.warm_up()
    state = engine.init_state()
    freed = []
    compiled = compile_threads(
        lambda: freed.append(engine.release(state, np.array([0, 1], np.int64)))
    )
    assert compiled == []
    np.testing.assert_array_equal(np.asarray(freed[0].live_s), [False, False])
    for bad in (np.array([0.0, 1.0]), np.array([0, 2])):
        with pytest.raises(EngineError, match="release takes bools"):
            engine.release(state, bad)


def test_engine_settings_that_could_serve_nothing_or_mean_something_else(tiny_pair):
    """max_model_len of at most one verification block built and compiled an engine that
    refused every request (max_request_tokens -4); attention_interpret "no" counted as true."""
    with pytest.raises(EngineError, match="attention_interpret must be True or False, got 'no'"):
        EngineConfig(attention_interpret="no")
    gamma = tiny_pair.drafter.cfg.block_size
    with pytest.raises(EngineError, match=f"max_model_len {gamma + 1} leaves no room"):
        Engine(tiny_pair.target, tiny_pair.drafter, EngineConfig(max_model_len=gamma + 1))
    assert Engine(tiny_pair.target, None, EngineConfig(max_model_len=2)).max_request_tokens == 1


def test_an_empty_records_file_is_one_line(tmp_path):
    from dspark_jax.calibration.sts import CalibrationInputError, CalibrationRecords

    empty = tmp_path / "calibration_records.npz"
    empty.write_bytes(b"")
    with pytest.raises(CalibrationInputError, match="not a calibration records file .*is empty"):
        CalibrationRecords.load(empty)
