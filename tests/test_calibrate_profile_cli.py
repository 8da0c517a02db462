"""`dspark-jax calibrate` and `dspark-jax profile` end to end, and the shared policy options."""

import argparse
import dataclasses
import json

import numpy as np
import pytest
from fixture_models import fixture_dir

from dspark_jax import cli
from dspark_jax.calibration.sts import CalibrationRecords, StsArtifact, StsArtifactMismatchError
from dspark_jax.checkpoints.converted import load_decoding_models, load_drafter
from dspark_jax.cli import args as cli_args
from dspark_jax.config import DrafterConfig, Qwen3Config, read_config_json
from dspark_jax.decoding import policies
from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET

DRAFTER = fixture_dir("vanilla") / "draft"


def _overconfident_records(n, seed):
    """Blocks of 7 whose true conditional acceptance is sigmoid(z / 3): logits 3x too sharp."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.5, 2.5, size=(n, 7))
    success = rng.uniform(size=(n, 7)) < 1.0 / (1.0 + np.exp(-z / 3.0))
    accepted = np.sum(np.cumprod(success, axis=1), axis=1)
    return CalibrationRecords(z, np.full(n, 7), accepted)


def test_calibrate_one_file_and_two_files(tmp_path, capsys):
    _overconfident_records(3000, 0).save(tmp_path / "a.npz")
    _overconfident_records(1500, 1).save(tmp_path / "b.npz")
    _, _, fingerprint = load_drafter(DRAFTER, progress=False)
    for records in (["a.npz"], ["a.npz", "b.npz"]):
        # Folders that do not exist yet: the command creates them when it writes.
        out, plot = tmp_path / "sts" / "sts.json", tmp_path / "plots" / "rel.png"
        argv = [
            "calibrate",
            "--records",
            *[str(tmp_path / r) for r in records],
            "--drafter",
            str(DRAFTER),
            "--temperature",
            "0.7",
            "--out",
            str(out),
            "--plot",
            str(plot),
        ]
        assert cli.main(argv) == 0
        printed = capsys.readouterr().out
        assert "held-out split" in printed and "mean ECE over positions" in printed
        artifact = StsArtifact.load(out)
        artifact.check(fingerprint, 0.7, block_size=7)
        # The fitted temperatures undo the 3x sharpening at the first position.
        assert 2.0 < artifact.temperatures[0] < 4.5
        held = artifact.metrics["holdout"]
        assert np.mean(held["ece_after"]) < 0.5 * np.mean(held["ece_before"])
        assert plot.stat().st_size > 0
        # A loaded artifact's refusals name its file.
        with pytest.raises(StsArtifactMismatchError, match=f"the STS artifact {out} was calibra"):
            artifact.check("0" * 64, 0.7)
        with pytest.raises(StsArtifactMismatchError, match=f"{out} was calibrated at sampling"):
            artifact.check(fingerprint, 1.0)
        assert artifact == dataclasses.replace(artifact, source=None)  # not part of its identity


def test_calibrate_refuses_records_of_another_block_size(tmp_path, capsys):
    CalibrationRecords(np.zeros((10, 5)), np.full(10, 5), np.zeros(10)).save(tmp_path / "r.npz")
    argv = [
        "calibrate",
        "--records",
        str(tmp_path / "r.npz"),
        "--drafter",
        str(DRAFTER),
        "--temperature",
        "0",
        "--out",
        str(tmp_path / "sts.json"),
    ]
    assert cli.main(argv) == 2
    assert "block size is 7" in capsys.readouterr().err


def test_profile_tiny_and_load_as_policy(tmp_path, capsys):
    out, plot = tmp_path / "sps" / "sps.json", tmp_path / "plots" / "sps.png"
    quick = ["--context-len", "16", "--steps", "2", "--repeats", "1"]
    argv = ["profile", "--mode", "verify", "--max-num-seqs", "4", "--buckets", "4,32", *quick]
    assert cli.main([*argv, "--out", str(out), "--plot", str(plot)]) == 0
    body = json.loads(out.read_text())
    assert {"device", "date", "buckets", "sps", "num_slots", "context_len"} <= set(body)
    profile = policies.SpsProfile.load(out)
    assert profile.buckets == (4, 32) and profile.meta["num_slots"] == 4
    assert profile.meta["mode"] == "verify" and np.all(profile.sps > 0)
    assert "draft_buckets" not in profile.meta
    # The embedded pair's shapes; verify mode times no drafter, so records none.
    embedded = load_decoding_models(EMBEDDED_TARGET, EMBEDDED_DRAFT, progress=False)
    assert profile.meta["model"] == policies.sps_model(embedded.target.cfg)
    assert plot.stat().st_size > 0

    parser = argparse.ArgumentParser()
    cli_args.add_policy_arguments(parser)
    args = parser.parse_args(["--policy", "async-scheduler", "--sps-table", str(out)])
    policy = cli_args.build_policy(args, block_size=7)
    assert isinstance(policy, policies.AsyncSchedulePolicy)
    assert policy.sps.buckets == (4, 32)
    assert cli_args.load_sts(args) is None
    args = parser.parse_args(["--gamma", "9"])
    with pytest.raises(ValueError, match="--gamma"):
        cli_args.build_policy(args, block_size=7)

    # Round mode on its default buckets (the run above shows --buckets is taken as given; each
    # bucket set is a program of its own to compile, so one round-mode run checks both).
    argv = ["profile", "--config", "tiny", "--temperature", "1", "--max-num-seqs", "2"]
    assert cli.main([*argv, *quick, "--out", str(out)]) == 0
    profile = policies.SpsProfile.load(out)
    # The default buckets follow the slots and the drafter's block: 2 x (7 + 1) tokens at most.
    assert profile.buckets[0] == 2 and profile.buckets[-1] == 16
    assert profile.meta["mode"] == "round" and profile.sps.shape == (len(profile.buckets),)
    assert np.all(profile.sps > 0)
    assert profile.meta["model"]["drafter"]["block_size"] == 7
    assert profile.meta["draft_buckets"] == [2]  # two slots: one drafter branch of both
    assert cli.main([*argv, "--buckets", "2,8", "--out", str(out)]) == 2
    assert "below num_slots x (drafts + 1)" in capsys.readouterr().err

    assert cli.main(["profile", "--config", "no-such-model", "--out", str(out)]) == 2
    assert "unknown config" in capsys.readouterr().err


@pytest.mark.parametrize("bins", ["0", "-3"])
def test_calibrate_refuses_a_bin_count_below_one(tmp_path, capsys, bins):
    """Real records, so the count is what fails (it raised a traceback from the ECE binning)."""
    _overconfident_records(200, 0).save(tmp_path / "r.npz")
    argv = ["calibrate", "--records", str(tmp_path / "r.npz"), "--drafter", str(DRAFTER)]
    argv += ["--temperature", "1", "--bins", bins, "--out", str(tmp_path / "sts.json")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"dspark-jax calibrate: error: --bins must be >= 1, got {bins}\n"
    assert not (tmp_path / "sts.json").exists()
    from dspark_jax.calibration.sts import fit_sts

    with pytest.raises(ValueError, match="n_bins must be an int >= 1"):
        fit_sts(_overconfident_records(50, 0), n_bins=0)


def _calibrate_argv(tmp_path, records, temperature="0.7"):
    return [
        "calibrate",
        "--records",
        str(records),
        "--drafter",
        str(DRAFTER),
        "--temperature",
        temperature,
        "--out",
        str(tmp_path / "sts.json"),
    ]


def test_calibrate_checks_the_drafter_and_temperature_eval_recorded(tmp_path, capsys):
    _, _, fingerprint = load_drafter(DRAFTER, progress=False)
    plain = _overconfident_records(300, 0)
    stamped = tmp_path / "stamped.npz"
    CalibrationRecords(
        plain.conf_logits_nk,
        plain.verified_n,
        plain.accepted_n,
        drafter_fingerprint=fingerprint,
        sampling_temperature=0.7,
    ).save(stamped)
    assert cli.main(_calibrate_argv(tmp_path, stamped)) == 0
    assert "does not record" not in capsys.readouterr().err

    assert cli.main(_calibrate_argv(tmp_path, stamped, temperature="1")) == 2
    err = capsys.readouterr().err
    assert "recorded at sampling temperature 0.7, not --temperature 1" in err
    assert err.count("\n") == 1

    other = tmp_path / "other.npz"
    CalibrationRecords(
        plain.conf_logits_nk,
        plain.verified_n,
        plain.accepted_n,
        drafter_fingerprint="0" * 64,
        sampling_temperature=0.7,
    ).save(other)
    (tmp_path / "sts.json").unlink()
    assert cli.main(_calibrate_argv(tmp_path, other)) == 2
    assert f"recorded with drafter 000000000000..., but --drafter {DRAFTER}" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "sts.json").exists()

    # Records from before eval stamped them: used, with a warning.
    unstamped = tmp_path / "old.npz"
    plain.save(unstamped)
    assert cli.main(_calibrate_argv(tmp_path, unstamped)) == 0
    assert "does not record its drafter and sampling temperature" in capsys.readouterr().err


def test_calibrate_names_a_file_that_is_not_records(tmp_path, capsys):
    """eval.json sits beside the records; numpy's advice about allow_pickle is no answer."""
    eval_json = tmp_path / "eval.json"
    eval_json.write_text('{"settings": {}}\n')
    assert cli.main(_calibrate_argv(tmp_path, eval_json)) == 2
    err = capsys.readouterr().err
    assert "not a calibration records file (expected the calibration_records.npz" in err
    assert "pickle" not in err


def _sps_table(path, num_slots, model=None):
    meta = {"mode": "round", "num_slots": num_slots}
    if model is not None:
        meta["model"] = model
    policies.SpsProfile((2, 8, 16), np.array([300.0, 250.0, 200.0]), meta).save(path)
    return path


def test_an_sps_table_belongs_to_its_slot_count_and_model(tmp_path, capsys):
    target_cfg = Qwen3Config.from_hf(read_config_json(DRAFTER.parent / "target"))
    drafter_cfg = DrafterConfig.from_hf(read_config_json(DRAFTER))
    ours = policies.sps_model(target_cfg, drafter_cfg)
    parser = argparse.ArgumentParser()
    cli_args.add_policy_arguments(parser)

    def build(table, num_slots):
        args = parser.parse_args(["--policy", "scheduler", "--sps-table", str(table)])
        models = {"target_cfg": target_cfg, "drafter_cfg": drafter_cfg}
        return cli_args.build_policy(args, 7, num_slots=num_slots, **models)

    table = _sps_table(tmp_path / "two.json", 2, ours)
    assert isinstance(build(table, 2), policies.PrefixSchedulePolicy)
    assert capsys.readouterr().err == ""
    mismatch = r"profiled for 2 slots, but the engine has 1:"
    with pytest.raises(policies.PolicyError, match=mismatch):
        build(table, 1)
    with pytest.raises(policies.PolicyError, match=r"profile --max-num-seqs 3"):
        build(table, 3)

    other = {**ours, "target": {**ours["target"], "hidden_size": 2560}}
    table = _sps_table(tmp_path / "other.json", 2, other)
    diff = r"another model \(target hidden_size: 2560 in the table, 96 here"
    with pytest.raises(policies.PolicyError, match=diff):
        build(table, 2)
    # A verify-mode table timed no drafter: only the target is compared.
    table = _sps_table(tmp_path / "verify.json", 2, {"target": ours["target"]})
    build(table, 2)

    # A table from before profile recorded its model: taken, with a warning naming it.
    table = _sps_table(tmp_path / "old.json", 2)
    build(table, 2)
    assert "old.json does not record the model it was profiled on" in capsys.readouterr().err


def test_generate_refuses_an_sps_table_of_another_slot_count(tmp_path, capsys):
    """One prompt runs one slot; the table names itself and the profile flag to fix it."""
    table = _sps_table(tmp_path / "sps.json", 2)
    argv = ["generate", "--policy", "scheduler", "--sps-table", str(table), "--prompt", "hi"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"dspark-jax generate: error: --sps-table {table} was profiled")
    assert "dspark-jax profile --max-num-seqs 1" in err[-1]


def test_sps_table_auto_profiles_the_engine_the_command_builds(monkeypatch, capsys):
    """`speculative_parts` with `--sps-table auto` times rounds of an engine of the command's
    own config (slots, buckets) on its models and mesh, at half its positions of context (at
    most 1024), progress on stderr; the scheduler takes that table. (profile_engine itself is
    stubbed here: the slow test below runs it through generate.)"""
    from dspark_jax.decoding import profiling
    from dspark_jax.decoding.engine import EngineConfig

    models = load_decoding_models(EMBEDDED_TARGET, EMBEDDED_DRAFT, progress=False)
    cfg = EngineConfig(num_slots=3, max_model_len=640, token_buckets=(8, 24))
    table = policies.SpsProfile((8, 24), np.array([200.0, 210.0]), {"num_slots": 3})
    seen = {}

    def profile_engine(target, drafter, cfg_, **kwargs):
        seen.update(target=target, drafter=drafter, cfg=cfg_, **kwargs)
        kwargs["log"]("    24 tokens: ...")
        return table

    monkeypatch.setattr(profiling, "profile_engine", profile_engine)
    monkeypatch.setenv("DSPARK_JAX_COMPILE_WORKERS", "4")  # cores to spare for two compiles
    parser = argparse.ArgumentParser()
    cli_args.add_policy_arguments(parser)
    args = parser.parse_args(["--policy", "scheduler", "--sps-table", "auto"])
    policy, sts = cli_args.speculative_parts(args, models, cfg, 0.7)
    assert policy.sps is table and sts is None
    assert seen["target"] is models.target and seen["drafter"] is models.drafter
    assert seen["cfg"] is cfg and seen["mesh"] is models.mesh
    assert (seen["mode"], seen["temperature"], seen["context_len"]) == ("round", 0.7, 320)
    # The engine the command builds next compiles beside the profiled round (the tests run
    # with a persistent compilation cache), on a stand-in table of the buckets profiled.
    (stand_in,) = seen["compile_with"]
    assert stand_in.cfg is cfg and stand_in.token_buckets == (8, 24)
    assert isinstance(stand_in.policy, policies.PrefixSchedulePolicy)
    assert stand_in.policy.sps.buckets == (8, 24) and stand_in.policy.sps is not table
    monkeypatch.setenv("DSPARK_JAX_COMPILE_WORKERS", "2")  # two cores: one compile, then the other
    cli_args.speculative_parts(args, models, cfg, 0.7)
    assert seen["compile_with"] == []
    err = capsys.readouterr().err
    assert "--sps-table auto: profiling rounds of 3 slots at context 320" in err
    assert "24 tokens: ..." in err and "--max-num-seqs 3 --out FILE" in err
    assert "not monotonic" in err  # 24 tokens measured faster than 8

    # What the run records (generate --json, eval.json): the table measured, beside "auto".
    from types import SimpleNamespace

    from dspark_jax.cli.run_settings import decoding_settings
    from dspark_jax.sampling import SamplingConfig

    run = SimpleNamespace(**vars(args), dtype=None, seed=0, max_new_tokens=8, thinking=False,
                          max_num_seqs=3, ignore_eos=False, min_tokens=0)  # fmt: skip
    settings = decoding_settings(run, models, cfg, SamplingConfig(temperature=0.7), policy)
    assert settings["sps_table"] == "auto"
    assert settings["sps_profiled"] == {"buckets": [8, 24], "sps": [200.0, 210.0]}
    run.sps_table = "sps.json"  # a table given as a file is recorded by its path alone
    assert decoding_settings(run, models, cfg, SamplingConfig(), policy)["sps_profiled"] is None


@pytest.mark.slow
def test_generate_profiles_its_own_engine_with_sps_table_auto(tmp_path, capsys):
    """`--sps-table auto` end to end: the scheduler's table is measured on the engine generate
    builds (one prompt: one slot), its progress on stderr, and the run decodes with it. About
    40 s (two compiles)."""
    argv = ["generate", "--policy", "scheduler", "--sps-table", "auto", "--prompt", "hi",
            "--max-new-tokens", "8", "--temperature", "0",
            "--json", str(tmp_path / "g.json")]  # fmt: skip
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "--sps-table auto: profiling rounds of 1 slot at context" in err
    assert "--sps-table auto: profiled in" in err and "--max-num-seqs 1 --out FILE" in err
    assert "tokens:" in err  # a line per token bucket
    assert out.strip()
    profiled = json.loads((tmp_path / "g.json").read_text())["settings"]["sps_profiled"]
    assert len(profiled["buckets"]) == len(profiled["sps"]) > 0 and min(profiled["sps"]) > 0


def test_the_sps_slot_advice_is_what_the_command_can_do(tmp_path, capsys):
    """generate and eval run no more slots than they have prompts: "run 2 slots" was no advice
    for one prompt, whatever --max-num-seqs says; fewer slots take --max-num-seqs alone."""
    table = _sps_table(tmp_path / "sps.json", 2)
    scheduled = ["--policy", "scheduler", "--sps-table", str(table)]

    def advice(argv):
        assert cli.main([*argv, *scheduled]) == 2
        return capsys.readouterr().err.splitlines()[-1].split("another batch. ")[1]

    for given, flag in ([], "--max-num-seqs 2 and "), (["--max-num-seqs", "2"], ""):
        assert advice(["generate", "--prompt", "hi", *given]) == (
            "Profile this run's slot count with dspark-jax profile --max-num-seqs 1, or give "
            f"{flag}at least 2 prompts (a run has no more slots than prompts)"
        )
    three = ["--prompt", "a", "--prompt", "b", "--prompt", "c"]
    assert advice(["generate", *three]) == (
        "Profile this run's slot count with dspark-jax profile --max-num-seqs 3, or give "
        "--max-num-seqs 2"
    )
    data = tmp_path / "one.jsonl"
    data.write_text('{"turns": ["hi"]}\n')
    assert advice(["eval", str(data), "--out", str(tmp_path / "ev")]).endswith(
        "or give --max-num-seqs 2 and at least 2 conversations (a run has no more slots than "
        "conversations)"
    )


def _calibrate(tmp_path, records, *more):
    """The exit status of calibrate at 0.7 with the fixture drafter."""
    argv = ["calibrate", "--records", *map(str, records), "--drafter", str(DRAFTER)]
    return cli.main([*argv, "--temperature", "0.7", *map(str, more)])


def test_calibrate_refuses_to_write_over_its_records(tmp_path, capsys, monkeypatch):
    """--out (or --plot) naming a --records file, however spelt, would replace the records by
    the artifact: refused in one line, the records left as they were."""
    records = tmp_path / "rec.npz"
    _overconfident_records(300, 0).save(records)
    before = records.read_bytes()
    monkeypatch.chdir(tmp_path)
    for option, path in [
        ("--out", records),
        ("--out", "./rec.npz"),
        ("--out", tmp_path / "sub" / ".." / "rec.npz"),
        ("--plot", "rec.npz"),
    ]:
        other = ["--out", "sts.json"] if option == "--plot" else []
        assert _calibrate(tmp_path, ["rec.npz"], option, path, *other) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"{option} {path} is the --records file" in err
        assert "would replace the records" in err
        assert records.read_bytes() == before
        assert not (tmp_path / "sts.json").exists()


def test_calibrate_refuses_the_same_records_file_as_fit_and_held_out(tmp_path, capsys, monkeypatch):
    """Two records files are the fit and the held-out split: one file twice would report
    in-sample numbers as held-out ones."""
    _overconfident_records(300, 0).save(tmp_path / "rec.npz")
    (tmp_path / "link.npz").symlink_to(tmp_path / "rec.npz")
    monkeypatch.chdir(tmp_path)
    for second in ("rec.npz", tmp_path / "rec.npz", "link.npz"):
        pair = ["rec.npz", second]
        assert _calibrate(tmp_path, pair, "--out", "sts.json") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"--records rec.npz {second}: both name the same file" in err
        assert "held-out split" in err
        assert not (tmp_path / "sts.json").exists()


def test_out_and_plot_must_be_different_files(tmp_path, capsys, monkeypatch):
    """The plot written over --out would leave a PNG where the STS artifact or SPS table was."""
    _overconfident_records(300, 0).save(tmp_path / "rec.npz")
    monkeypatch.chdir(tmp_path)
    assert _calibrate(tmp_path, ["rec.npz"], "--out", "same.png", "--plot", "./same.png") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--plot ./same.png is the --out file same.png: the diagram would" in err
    argv = ["profile", "--mode", "verify", "--out", "p.png", "--plot", "p.png"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--plot p.png is the --out file: the plot would replace the SPS table" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.npz"]


def test_the_plot_format_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
    """A --plot suffix matplotlib cannot write failed with a traceback after --out was written;
    it is refused in one line, naming the formats there are, before anything runs."""
    _overconfident_records(300, 0).save(tmp_path / "rec.npz")
    monkeypatch.chdir(tmp_path)
    for plot in ("rel.txt", "rel"):
        assert _calibrate(tmp_path, ["rec.npz"], "--out", "sts.json", "--plot", plot) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"--plot {plot}: has " in err and ".png, " in err and ".svg" in err
        argv = ["profile", "--mode", "verify", "--out", "p.json", "--plot", plot]
        assert cli.main(argv) == 2
        assert f"--plot {plot}: has " in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.npz"]
    # Any format matplotlib writes is taken, in upper case too.
    assert _calibrate(tmp_path, ["rec.npz"], "--out", "sts.json", "--plot", "rel.SVG") == 0
    assert (tmp_path / "rel.SVG").read_text().lstrip().startswith("<?xml")


def test_calibrate_refuses_records_in_which_nothing_was_verified(tmp_path, capsys):
    """Rounds that verified no draft (gamma 0, from Python: eval writes no records for such a
    run) observe no outcome: the fit kept T = 1
    everywhere with a warning per position and wrote an artifact that changes nothing."""
    _, _, fingerprint = load_drafter(DRAFTER, progress=False)
    z = np.random.default_rng(0).normal(size=(200, 7))
    CalibrationRecords(
        z, np.zeros(200), np.zeros(200), drafter_fingerprint=fingerprint, sampling_temperature=0.7
    ).save(tmp_path / "g0.npz")
    _overconfident_records(300, 0).save(tmp_path / "ok.npz")
    for records in (["g0.npz"], ["ok.npz", "g0.npz"]):
        paths = [tmp_path / r for r in records]
        assert _calibrate(tmp_path, paths, "--out", tmp_path / "sts.json") == 2
        err = capsys.readouterr().err.splitlines()
        assert err[-1] == (
            f"dspark-jax calibrate: error: none of the 200 rounds of {tmp_path / 'g0.npz'} "
            "verified a draft (every round verified 0 drafts, as with gamma 0), so no draft was "
            "accepted or rejected and there is nothing to calibrate: record rounds that verify "
            "drafts"
        )
        assert not any("no observations" in line for line in err)
        assert not (tmp_path / "sts.json").exists()
    # The library refuses them too.
    from dspark_jax.calibration import sts

    with pytest.raises(sts.CalibrationInputError, match="none of the 140 rounds of the fit"):
        sts.calibrate(
            CalibrationRecords.load(tmp_path / "g0.npz"),
            0.3,
            0,
            drafter_fingerprint=fingerprint,
            sampling_temperature=0.7,
        )


def test_profile_verify_mode_refuses_a_temperature(tmp_path, capsys):
    """Verify mode samples nothing: a --temperature was accepted and recorded in the table."""
    for value in ("1", "0"):
        argv = ["profile", "--mode", "verify", "--temperature", value]
        assert cli.main([*argv, "--out", str(tmp_path / "p.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "--temperature is read by --mode round only" in err
        assert not (tmp_path / "p.json").exists()
    embedded = load_decoding_models(EMBEDDED_TARGET, EMBEDDED_DRAFT, progress=False)
    from dspark_jax.decoding.engine import EngineConfig
    from dspark_jax.decoding.profiling import ProfileError, profile_engine

    with pytest.raises(ProfileError, match="verify mode .* samples nothing"):
        profile_engine(
            embedded.target, embedded.drafter, EngineConfig(num_slots=1), mode="verify",
            temperature=1.0,
        )
