"""Export layouts: a drafter config that says what it is (transformers' Auto classes refuse it
instead of loading a plain Qwen3 without the DSpark tensors), and vLLM's `speculators` layout,
held to that library's DSpark config schema and, when the library is installed, read back by
its own loader."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dspark_jax.checkpoints.converted import (
    convert_checkpoints,
    load_drafter,
    load_target,
    write_drafter_torch,
)
from dspark_jax.checkpoints.safetensors_io import CheckpointError, SafetensorsFolder
from dspark_jax.checkpoints.speculators import (
    VERIFIER_TENSORS,
    check_speculators_config,
    expected_tensors,
    speculators_config,
)
from dspark_jax.cli import main
from dspark_jax.config import DRAFTER_MODEL_TYPE
from dspark_jax.configs.train_tiny import TINY_DSPARK_DRAFTER, TINY_TARGET
from dspark_jax.embedded import TINY_DRAFT
from dspark_jax.training.step import new_drafter


def _tensors(folder) -> dict[str, np.ndarray]:
    st = SafetensorsFolder(folder)
    return {k: st.get(k) for k in st.keys()}


@pytest.fixture(scope="module")
def fresh_drafter():
    """A drafter built here (as training builds it) on the embedded target."""
    _, target, _ = load_target(TINY_TARGET)
    return new_drafter(TINY_DSPARK_DRAFTER.with_dtype("float32"), target, seed=3)


def test_written_drafter_config_is_refused_by_auto_classes(fresh_drafter, tmp_path):
    import transformers

    out = write_drafter_torch(fresh_drafter, None, tmp_path / "drafter")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == DRAFTER_MODEL_TYPE
    assert config["architectures"] == ["Qwen3DSparkModel"]
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        with pytest.raises(ValueError, match=DRAFTER_MODEL_TYPE):
            auto.from_pretrained(out)
    # DeepSpec builds its drafter on a Qwen3Config read from the file: still readable that way.
    qwen3 = transformers.Qwen3Config.from_pretrained(out)
    assert (qwen3.block_size, qwen3.markov_rank) == (7, TINY_DSPARK_DRAFTER.markov_rank)
    assert qwen3.num_hidden_layers == TINY_DSPARK_DRAFTER.model.num_hidden_layers
    cfg, loaded, _ = load_drafter(out)
    assert cfg == fresh_drafter.cfg
    np.testing.assert_array_equal(loaded.fc.kernel[...], fresh_drafter.fc.kernel[...])


def test_speculators_export_matches_schema_and_reference_tensors(tmp_path, capsys):
    reference = _tensors(TINY_DRAFT)
    out = tmp_path / "spec"
    args = ["export", "--draft", str(TINY_DRAFT), "--format", "speculators"]
    assert main([*args, "--target", str(TINY_TARGET), "--out", str(out)]) == 0
    assert "speculators layout" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    check_speculators_config(config)
    assert config["speculators_model_type"] == "dspark"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(TINY_TARGET)
    assert config["aux_hidden_state_layer_ids"] == [1, 3]  # DeepSpec's [0, 2], plus one
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    cfg, _, _ = load_drafter(TINY_DRAFT)
    tensors = _tensors(out)
    shapes = {k: v.shape for k, v in tensors.items()}
    assert shapes == expected_tensors(cfg)
    assert set(tensors) == set(reference) - set(VERIFIER_TENSORS)
    for key, value in tensors.items():
        np.testing.assert_array_equal(value, reference[key], err_msg=key)


def test_speculators_export_refusals(fresh_drafter, tmp_path, capsys):
    # No verifier known for a plain drafter folder.
    args = ["export", "--draft", str(TINY_DRAFT), "--format", "speculators"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 2
    assert "--target" in capsys.readouterr().err
    # A drafter whose embedding is not the verifier's would be changed by the loader.
    other = tmp_path / "other-target"
    shutil.copytree(TINY_TARGET, other)
    st = _tensors(other)
    st["model.embed_tokens.weight"] = st["model.embed_tokens.weight"] + 1
    from dspark_jax.checkpoints.safetensors_io import save_safetensors

    save_safetensors(st, other / "model.safetensors", metadata={"format": "pt"})
    assert main([*args, "--target", str(other), "--out", str(tmp_path / "b")]) == 2
    assert "embed_tokens.weight differs from the verifier's" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_converted_folder_names_its_source_as_verifier(tmp_path):
    convert_checkpoints(tmp_path / "conv", draft=TINY_DRAFT, target=TINY_TARGET)
    out = tmp_path / "spec"
    args = ["export", "--draft", str(tmp_path / "conv"), "--format", "speculators"]
    assert main([*args, "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(TINY_TARGET)


def test_an_export_is_never_written_over_its_target(fresh_drafter, tmp_path, capsys, monkeypatch):
    """--out naming the drafter's target (given as --target, recorded by a conversion as the
    folder its target came from, or recorded by a training checkpoint) is refused like one naming
    the drafter: --overwrite replaced the target with the export, which named it its verifier."""
    target = tmp_path / "target"
    shutil.copytree(TINY_TARGET, target)
    files = sorted(p.name for p in target.iterdir())
    export = ["export", "--overwrite", "--out", str(target)]

    def refused(*args):
        assert main([*export, *args]) == 2
        assert f"overlaps the input {target}" in capsys.readouterr().err
        assert sorted(p.name for p in target.iterdir()) == files

    for fmt in ("speculators", "reference"):
        refused("--draft", str(TINY_DRAFT), "--target", str(target), "--format", fmt)
    convert_checkpoints(tmp_path / "conv", draft=TINY_DRAFT, target=target)
    refused("--draft", str(tmp_path / "conv"), "--format", "speculators")
    refused("--draft", str(tmp_path / "conv"), "--target", str(tmp_path / "conv"))
    # A training checkpoint, completed with its recorded target or with --target.
    import dspark_jax.training.checkpointing as checkpointing
    import dspark_jax.training.trainer as trainer

    run = tmp_path / "run" / "checkpoints"
    monkeypatch.setattr(checkpointing, "find_checkpoint", lambda path: (run, 2))
    read = []

    def drafter_from_checkpoint(path, given):
        read.append(given)
        return fresh_drafter, given or str(target)

    monkeypatch.setattr(trainer, "drafter_from_checkpoint", drafter_from_checkpoint)
    for fmt in ("reference", "speculators"):
        refused("--draft", str(run), "--format", fmt)
        refused("--draft", str(run), "--format", fmt, "--target", str(target))
    assert read == [None, None]  # a --target over the output is refused before any reading
    np.testing.assert_array_equal(
        _tensors(target)["model.norm.weight"], _tensors(TINY_TARGET)["model.norm.weight"]
    )


def test_a_released_drafter_without_num_target_layers_exports_with_its_target(tmp_path, capsys):
    """Released DSpark config.json files lack num_target_layers. Exporting such a folder was
    refused even with --target, in a message naming no folder: --target fills it in, as
    conversion does, and without one the refusal names the folder and what to give."""
    draft = tmp_path / "draft"
    shutil.copytree(TINY_DRAFT, draft)
    config = json.loads((draft / "config.json").read_text())
    depth = config.pop("num_target_layers")
    (draft / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    assert main(["export", "--draft", str(draft), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert f"{draft}: config.json lacks num_target_layers" in err and "--target" in err
    assert not (tmp_path / "a").exists()
    for fmt in ("reference", "speculators"):
        out = tmp_path / fmt
        args = ["--draft", str(draft), "--target", str(TINY_TARGET), "--format", fmt]
        assert main(["export", *args, "--out", str(out)]) == 0
    assert load_drafter(tmp_path / "reference")[0].num_target_layers == depth
    written = json.loads((tmp_path / "reference" / "config.json").read_text())
    assert written == {**config, "num_target_layers": depth}


def test_speculators_verifier_is_named_so_a_loader_elsewhere_finds_it(tmp_path, monkeypatch):
    """A verifier given as a relative folder (directly, or as the source of a conversion run in
    another folder) was written as that relative path, which means nothing to vLLM run
    elsewhere: it is the absolute path, and a snapshot of the hub cache is its hub id."""
    work = tmp_path / "work"
    shutil.copytree(TINY_TARGET, work / "target")
    monkeypatch.chdir(work)
    convert_checkpoints("conv", draft=TINY_DRAFT, target="target")

    def verifier(*args):
        out = tmp_path / f"spec{len(list(tmp_path.glob('spec*')))}"
        base = ["export", "--format", "speculators", "--out", str(out)]
        assert main([*base, *args]) == 0
        config = json.loads((out / "config.json").read_text())
        return config["speculators_config"]["verifier"]["name_or_path"]

    assert verifier("--draft", str(TINY_DRAFT), "--target", "target") == str(work / "target")
    monkeypatch.chdir(tmp_path)
    assert verifier("--draft", str(work / "conv")) == str(work / "target")
    snapshot = tmp_path / "hub" / "models--acme--tiny-qwen3" / "snapshots" / "0123abc"
    shutil.copytree(TINY_TARGET, snapshot)
    assert verifier("--draft", str(TINY_DRAFT), "--target", str(snapshot)) == "acme/tiny-qwen3"


def test_speculators_export_of_a_cast_conversion_names_the_cast(tmp_path, capsys):
    """A drafter converted with --dtype float16 holds its target's embedding cast (float32 ->
    float16 rounds nearly every value). The refusal blamed the target ("Name the drafter's own
    target"), which was the drafter's own: it names the cast and the way out."""
    convert_checkpoints(tmp_path / "c16", draft=TINY_DRAFT, target=TINY_TARGET, dtype="float16")
    args = ["export", "--draft", str(tmp_path / "c16"), "--format", "speculators"]
    assert main([*args, "--out", str(tmp_path / "spec")]) == 2
    err = capsys.readouterr().err
    assert "embed_tokens.weight is the verifier's" in err
    assert "cast from float32 to float16" in err and "(a conversion with --dtype float16)" in err
    assert "a conversion without --dtype (or with the checkpoint's own, --dtype float32)" in err
    assert "Name the drafter's own target" not in err
    assert not (tmp_path / "spec").exists()


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"speculators_model_type": "eagle3"}, "speculators_model_type"),
        ({"markov_head_type": "lstm"}, "markov_head_type"),
        ({"markov_rank": 0}, "confidence_head_with_markov needs markov_rank > 0"),
        ({"draft_vocab_size": 100}, "draft_vocab_size differs"),
        ({"block_size": "7"}, "block_size is a str"),
        ({"aux_hidden_state_layer_ids": []}, "aux_hidden_state_layer_ids"),
    ],
)
def test_schema_check_catches(change, problem):
    cfg, _, _ = load_drafter(TINY_DRAFT)
    config = speculators_config(cfg, "Qwen/Qwen3-4B", ["Qwen3ForCausalLM"])
    check_speculators_config(config)
    with pytest.raises(CheckpointError, match=problem):
        check_speculators_config({**config, **change})


def test_speculators_library_loads_every_tensor(tmp_path):
    """The speculators library's own loader (when installed: it pins torch and transformers
    versions of its own, so it is not a test dependency) reads the export, fills the embedding
    and head from the verifier, and holds every reference tensor unchanged."""
    pytest.importorskip("speculators")
    torch = pytest.importorskip("torch")
    from speculators import SpeculatorModel

    out = tmp_path / "spec"
    args = ["export", "--draft", str(TINY_DRAFT), "--format", "speculators"]
    assert main([*args, "--target", str(TINY_TARGET), "--out", str(out)]) == 0
    model = SpeculatorModel.from_pretrained(str(out))
    assert type(model).__name__ == "DSparkDraftModel"
    state = model.state_dict()
    for key, value in _tensors(TINY_DRAFT).items():
        assert key in state, key
        np.testing.assert_array_equal(state[key].to(torch.float32).numpy(), value, err_msg=key)
