"""Decoding on a mesh: parameters loaded straight into their shardings, the slot engine sharded by
the rules table, and the same tokens as on one device (greedy and seeded sampling), with no
compilation after warm-up. Eight CPU devices come from tests/conftest.py."""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import numpy as np
import pytest
from compile_events import compile_threads
from flax import nnx
from jax.sharding import PartitionSpec as P

from dspark_jax.checkpoints.converted import convert_checkpoints, load_decoding_models
from dspark_jax.cli import main
from dspark_jax.config import DrafterConfig, Qwen3Config, read_config_json
from dspark_jax.decoding import engine as engine_module
from dspark_jax.decoding import policies
from dspark_jax.decoding.batching import Request, generate
from dspark_jax.decoding.engine import Engine, EngineConfig, EngineError
from dspark_jax.embedded import TINY_DRAFT, TINY_TARGET
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sampling import SamplingConfig
from dspark_jax.sharding import MeshConfig, ShardingError, logical_to_spec, make_mesh

# Small static shapes keep each engine's compilation short: one prefill and one token bucket.
CFG = EngineConfig(
    num_slots=2,
    max_model_len=96,
    page_size=16,
    rounds_per_chunk=4,
    prefill_chunk=32,
    prefill_buckets=(32,),
    token_buckets=(16,),
    draft_buckets=(1, 2),  # the drafter's rows gathered across the data shards when one is live
)
TEXT = b"def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description="


def _mesh(data: int, fsdp: int, tensor: int):
    return make_mesh(MeshConfig(data, fsdp, tensor), jax.devices()[: data * fsdp * tensor])


def _requests():
    """Greedy and seeded sampled requests of different lengths, more than there are slots (so
    slots change hands); two ask for log-probabilities, one with alternatives, one for its
    prompt's (the vocabulary is split over `tensor`)."""
    samplings = (
        SamplingConfig(),
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.7, top_p=0.9),
    )
    return [
        Request(
            list(TEXT[: 11 + 7 * i]),
            18 + 3 * i,
            seed=100 + i,
            sampling=samplings[i % 3],
            logprobs=i in (1, 2),
            top_logprobs=4 if i == 2 else 0,
            prompt_logprobs=2 if i == 3 else None,
        )
        for i in range(5)
    ]


def _random_pair(num_heads: int = 8, num_kv_heads: int = 4, vocab_size: int = 288):
    """A random target/drafter pair like the tiny embedded one (vocabulary 288), but shallower
    (compiles faster) and with heads that tensor axes of 2 and 4 divide (the tiny pair has 6
    attention heads; the default pair 4 attention and 2 key/value heads)."""
    target_cfg = Qwen3Config.from_hf(read_config_json(TINY_TARGET))
    drafter_cfg = DrafterConfig.from_hf(read_config_json(TINY_DRAFT))
    heads = dict(
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=vocab_size,
        dtype="float32",
    )
    target_cfg = dataclasses.replace(target_cfg, num_hidden_layers=2, **heads)
    drafter_cfg = dataclasses.replace(
        drafter_cfg,
        model=dataclasses.replace(drafter_cfg.model, num_hidden_layers=1, **heads),
        target_layer_ids=(0,),
        num_target_layers=2,
    )
    return Qwen3(target_cfg, rngs=nnx.Rngs(1)), DSparkDrafter(drafter_cfg, rngs=nnx.Rngs(2))


def _generate(target, drafter, mesh):
    """(tokens per request, compiled programs) of one engine; asserts that warm-up builds each
    program once (what it lowers from shapes is what the calls on sharded arrays run) and none
    compiles after it."""
    engine = Engine(target, drafter, CFG, mesh=mesh)
    built = compile_threads(engine.warm_up)
    programs = engine.compiled_programs()
    assert programs <= len(built) <= programs + 1, "warm-up compiled a program twice"
    results, _ = generate(engine, _requests())
    assert engine.compiled_programs() == programs, "compiled after warm-up"
    assert all(r.tokens for r in results)
    _SCORES[mesh is None].append(
        [(r.logprobs, r.top_logprobs) for r in results]
        + [(r.prompt_logprobs[1:], r.prompt_top_logprobs[1:]) for r in results[3:4]]
    )
    return [r.tokens for r in results], programs


# Each engine's log-probabilities and alternatives per request: [single device?] -> runs.
_SCORES: dict[bool, list] = {True: [], False: []}


@pytest.fixture(scope="module")
def pair():
    return _random_pair()


@pytest.fixture(scope="module")
def single_device(pair):
    return _generate(*pair, None)


# A tensor axis of 2 alone (slow) is what 2x1x2 splits the heads and the vocabulary by, beside
# its data axis; 1x1x4 splits them the most.
@pytest.mark.parametrize(
    "shape",
    [pytest.param((1, 1, 2), marks=pytest.mark.slow), (2, 1, 2), (1, 1, 4)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_mesh_generates_the_single_device_tokens(pair, single_device, shape):
    mesh = _mesh(*shape)
    tokens, programs = _generate(*pair, mesh)
    expected, single_programs = single_device
    assert tokens == expected
    assert programs == single_programs
    # The same log-probabilities and alternatives, the vocabulary split or not.
    (single,), mesh_scores = _SCORES[True], _SCORES[False][-1]
    for (lp, top), (want_lp, want_top) in zip(mesh_scores, single, strict=True):
        assert (lp is None, top is None) == (want_lp is None, want_top is None)
        if lp is not None:
            np.testing.assert_allclose(lp, want_lp, atol=1e-5)
        if top is not None:
            assert [[i for i, _ in alts] for alts in top] == [[i for i, _ in a] for a in want_top]
    # the page pools really are split by KV head, the slot rows by data
    engine = Engine(*pair, CFG, mesh=mesh)
    pool_spec = engine.state_shardings.target_pages[0].kv.spec
    assert pool_spec == P(None, None, "tensor", None)
    assert engine.state_shardings.lengths_s.spec == P("data" if shape[0] > 1 else None)
    # the memory check counts one device's shard: the pools dominate, split tensor ways
    whole = Engine(*pair, CFG).state_bytes
    assert whole / shape[2] <= engine.state_bytes < whole / shape[2] * 1.1


def test_kernel_path_on_a_mesh_splits_the_stacked_pool_by_kv_head(pair, single_device):
    """The GPU kernels' pool (K and V stacked on a leading axis, `attention.Pages`) on a tensor
    mesh: split by KV head behind the stacking axis, each device's kernel (Pallas interpret
    mode here) over its own heads, the tokens those of one device on the pure-JAX path."""
    cfg = dataclasses.replace(CFG, attention_impl="pallas_gpu", attention_interpret=True)
    mesh = _mesh(1, 1, 2)
    engine = Engine(*pair, cfg, mesh=mesh)
    assert engine.state_shardings.target_pages[0].kv.spec == P(None, "tensor", None, None, None)
    results, _ = generate(engine, _requests())
    assert [r.tokens for r in results] == single_device[0]


def _generate_command(tmp_path, name, *flags):
    """(tokens per answer, mesh in the JSON settings) of one `dspark-jax generate` run."""
    out = tmp_path / f"{name}.json"
    argv = ["generate", "--max-new-tokens", "24", "--max-num-seqs", "4", "--json", str(out)]
    assert main([*argv, *flags]) == 0
    report = json.loads(out.read_text())
    return [r["tokens"] for r in report["results"]], report["settings"]["mesh"]


@pytest.mark.parametrize("temperature", ["0", "1"], ids=["greedy", "seeded-sampling"])
def test_generate_command_on_a_mesh_writes_the_single_device_tokens(tmp_path, temperature):
    # The user's command on the default pair (4 query / 2 KV heads: tensor 2 divides both) over
    # the eight test devices: the 4 slots over data, the heads over tensor.
    flags = ("--temperature", temperature, "--seed", "7")
    single, no_mesh = _generate_command(tmp_path, "single", *flags)
    sharded, mesh = _generate_command(tmp_path, "mesh", "--mesh=-1,1,2", *flags)
    assert no_mesh is None  # the default on CPU: the pair fits one device
    assert mesh == {"data": 4, "fsdp": 1, "tensor": 2}
    assert single[0] and sharded == single


def test_memory_check_weighs_one_device_share(pair, monkeypatch):
    """A device budget between one device's share of the slot state and the whole of it: the
    engine on a 1x1x4 mesh fits and is built, the one-device engine is refused. On host memory
    (CPU devices) the four shares come out of one budget, so the mesh engine is refused too."""
    mesh = _mesh(1, 1, 4)
    share = Engine(*pair, CFG, mesh=mesh).state_bytes
    whole = Engine(*pair, CFG).state_bytes
    assert share < whole
    budget = (share + whole) / 2 / engine_module.MEMORY_FRACTION
    asked = []

    def device_budget(devices):
        asked.append(list(devices))
        return budget, "TPU_0(process=0,(0,0,0,0))"

    monkeypatch.setattr(engine_module, "memory_budget", device_budget)
    Engine(*pair, CFG, mesh=mesh)
    assert asked[-1] == list(mesh.local_devices)
    with pytest.raises(EngineError, match=r"need \d+ KiB \(.* TPU_0.* has \d+ KiB free"):
        Engine(*pair, CFG)
    assert asked[-1] == jax.local_devices()[:1]
    monkeypatch.setattr(
        engine_module, "memory_budget", lambda devices: (budget, engine_module.HOST_MEMORY)
    )
    with pytest.raises(EngineError, match="host memory has"):
        Engine(*pair, CFG, mesh=mesh)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "pair"
    convert_checkpoints(out, draft=TINY_DRAFT, target=TINY_TARGET, progress=False)
    return out


@pytest.mark.parametrize("form", ["safetensors", "converted"])
def test_parameters_load_straight_into_their_shardings(form, request):
    """Safetensors go through make_array_from_callback, a converted folder through an Orbax
    restore with global shardings (whose checksum, recorded on one device, must still match)."""
    mesh = _mesh(1, 1, 2)
    if form == "safetensors":
        target, draft = TINY_TARGET, TINY_DRAFT
    else:
        target = draft = request.getfixturevalue("converted")
    models = load_decoding_models(target, draft, progress=False, mesh=mesh)
    q_kernel = models.target.layers[0].self_attn.q_proj.kernel[...]
    assert q_kernel.sharding.spec == P(None, "tensor")
    # each device holds half of the heads, none the whole weight
    shard_shapes = {s.data.shape for s in q_kernel.addressable_shards}
    assert shard_shapes == {(q_kernel.shape[0], q_kernel.shape[1] // 2)}
    embed = models.drafter.embed_tokens.embedding[...]
    assert embed.sharding.spec == P("tensor", None)
    single = load_decoding_models(TINY_TARGET, TINY_DRAFT, progress=False)
    np.testing.assert_array_equal(
        np.asarray(q_kernel), np.asarray(single.target.layers[0].self_attn.q_proj.kernel[...])
    )
    assert models.drafter_fingerprint == single.drafter_fingerprint


def test_axes_that_do_not_divide_the_mesh_are_named(capsys):
    mesh = _mesh(1, 1, 4)
    # the tensor size must divide the heads (not the other way round), the model is named,
    # and so is the flag to change, with the sizes that would fit
    with pytest.raises(
        ShardingError,
        match=r"^target .*: the mesh's tensor size 4 does not divide its 6 attention heads; "
        r"give a --mesh whose tensor size divides it \(for this model: 1, 2\)$",
    ):
        load_decoding_models(TINY_TARGET, TINY_DRAFT, progress=False, mesh=mesh)
    # the command refuses it in that one line
    assert main(["generate", "--target", str(TINY_TARGET), "--draft", str(TINY_DRAFT), "--mesh",
                 "1,1,4", "--max-new-tokens", "2"]) == 2  # fmt: skip
    assert capsys.readouterr().err.strip().count("\n") == 0
    # the vocabulary too: named with the model, checked before anything is placed
    with pytest.raises(ShardingError, match=r"^target: .*tensor size 4 does not divide its 290 "):
        Engine(*_random_pair(vocab_size=290), CFG, mesh=mesh)
    with pytest.raises(
        ShardingError, match=r"^the lm head: logical axis 'vocab' of size 290 .*tensor=4.*--mesh"
    ):
        logical_to_spec(("vocab", "embed"), (290, 96), mesh, strict=True, what="the lm head")
    # without strict (training's rules) the same dimension is replicated
    assert logical_to_spec(("vocab", "embed"), (290, 96), mesh) == P(None, None)
    three_slots = dataclasses.replace(CFG, num_slots=3, token_buckets=(24,), draft_buckets=None)
    with pytest.raises(ShardingError, match=r"'slots' of size 3 .*data=2"):
        Engine(*_random_pair(), three_slots, mesh=_mesh(2, 1, 2))


def test_sharded_decode_holds_no_copy_of_the_page_pools(pair):
    """The pools are read inside the token-bucket conditional (under `shard_map`) and written
    after it with a scatter XLA partitions by KV head: none of that may copy a pool. float32
    pools, because XLA:CPU gathers from bfloat16 arrays through a float32 copy of the whole
    array (see benchmarks/mesh_memory.py), which would hide the copies this test looks for.
    The drafter reads its pool inside the slot buckets' conditional (1 or 2 rows of 2 slots, 2
    or 4 of 4 slots over data 2, the slots gathered across the data shards)."""
    long_cfg = dataclasses.replace(CFG, max_model_len=4096)
    four_slots = dataclasses.replace(
        long_cfg, num_slots=4, token_buckets=(32,), draft_buckets=(2, 4)
    )
    for cfg, mesh in ((long_cfg, _mesh(1, 1, 2)), (four_slots, _mesh(2, 1, 2))):
        engine = Engine(*pair, cfg, mesh=mesh)
        assert len(engine.draft_buckets) == 2
        state = jax.eval_shape(engine._init, engine.target_params, engine.drafter_params)
        pool = state.target_pages[0].kv
        pool_sharding = engine.state_shardings.target_pages[0].kv
        shard_shape = pool_sharding.shard_shape(pool.shape)
        layer_shard_bytes = int(np.prod(shard_shape)) * pool.dtype.itemsize
        assert pool.dtype == np.float32
        stats = engine.lower()["decode_chunk"].compile().memory_analysis()
        # 2 target + 1 drafter layers of pools; one copy of one layer's shard would break this.
        assert stats.temp_size_in_bytes < layer_shard_bytes / 2


def test_policy_switch_on_a_mesh_selects_without_compiling(pair, single_device):
    """Selecting a member of a switch places its carry as the sharded state's (committed to the
    mesh): no program compiles, and member 0 (the whole block) gives the single-device tokens."""
    target, drafter = pair
    gamma = drafter.cfg.block_size
    switch = policies.PolicySwitch((policies.FixedPolicy(gamma), policies.FixedPolicy(1)))
    engine = Engine(target, drafter, CFG, policy=switch, mesh=_mesh(2, 1, 2))
    engine.warm_up()
    programs = engine.compiled_programs()
    whole, _ = generate(engine, _requests(), policy_index=0)
    one, _ = generate(engine, _requests(), policy_index=1)
    assert engine.compiled_programs() == programs, "selecting a policy compiled"
    assert [r.tokens for r in whole] == single_device[0]
    assert max(r.verified.max() for r in one) == 1 < max(r.verified.max() for r in whole)


def test_profiling_on_a_mesh_compiles_the_round_once(pair):
    """`profile_engine` on a mesh lays its state out where the engine keeps it. Host-made arrays
    mixed into the engine's sharded state called the round program with other input shardings
    than its own outputs have: it compiled once for the first bucket's state and again for the
    next (and once more after the round began compiling before timing)."""
    from dspark_jax.decoding.profiling import profile_engine

    built = []

    def listener(event, seconds, **kwargs):
        if event.endswith("backend_compile_duration"):
            built.append(kwargs.get("fun_name"))

    cfg = EngineConfig(
        num_slots=2,
        max_model_len=64,
        prefill_chunk=32,
        prefill_buckets=(32,),
        token_buckets=(8, 16),
    )
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        profile = profile_engine(*pair, cfg, context_len=8, steps=1, repeats=1, mesh=_mesh(1, 1, 2))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(profile.buckets) > 1  # the buckets after the first ran on the round's outputs
    assert built.count("jit(decode)") == 1, built
    assert profile.meta["mesh"] == {"data": 1, "fsdp": 1, "tensor": 2}


def _no_loading(monkeypatch):
    """Makes every model loader fail the test: a refusal must come before any loading."""

    def loaded(*args, **kwargs):
        raise AssertionError("loaded models before refusing")

    from dspark_jax.checkpoints import converted

    for name in ("load_decoding_models", "load_target", "load_drafter"):
        monkeypatch.setattr(converted, name, loaded)
    monkeypatch.setattr("dspark_jax.sharding.init_sharded", loaded)


IDS = ("--token-ids", "1,2,3", "--token-ids", "4,5,6", "--token-ids", "7,8,9")


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", *IDS, "--mesh=-1,1,2", "--max-num-seqs", "3"],
        ["generate", "--token-ids", "1,2,3", "--mesh", "8,1,1", "--max-num-seqs", "2"],
        ["serve", "--port", "0", "--mesh=-1,1,2", "--max-num-seqs", "3"],
        ["profile", "--mesh=-1,1,2", "--max-num-seqs", "3", "--out", "{tmp}/p.json"],
        ["profile", "--config", "tiny", "--mesh=2,2,2", "--max-num-seqs", "3", "--out", "{tmp}/p"],
    ],
    ids=["generate-3-on-4", "generate-2-on-8", "serve", "profile", "profile-config"],
)
def test_slots_the_mesh_cannot_split_are_refused_before_loading(
    argv, tmp_path, monkeypatch, capsys
):
    _no_loading(monkeypatch)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    split = 8 if "8,1,1" in argv else 4
    given = argv[argv.index("--max-num-seqs") + 1]
    assert f"--max-num-seqs {given} must be a multiple of data x fsdp = {split}" in err
    assert "\n" not in err
    # A refused serve leaves no log handler behind (bound to this test's stderr, closed after).
    served = logging.getLogger("dspark_jax.serving")
    assert not served.handlers and served.propagate


def test_offline_slots_round_down_where_rounding_up_passes_max_num_seqs():
    from argparse import Namespace

    from dspark_jax.cli.args import engine_config

    args = Namespace(
        max_num_seqs=6, page_size=16, prefill_chunk=64, max_model_len=None, kv_pages=None,
        rounds_per_chunk=4,
    )  # fmt: skip
    mesh = _mesh(4, 1, 2)
    # 5 requests, at most 6 slots, 4 data shards: 8 would pass the cap, so 4 (not 6)
    assert engine_config(args, [40] * 5, 4096, mesh).num_slots == 4
    # within the cap the count still rounds up: 3 requests -> 4 slots
    assert engine_config(args, [40] * 3, 4096, mesh).num_slots == 4
    assert engine_config(args, [40] * 5, 4096, None).num_slots == 5


def test_default_mesh_takes_the_largest_tensor_size_the_models_split_into(monkeypatch):
    from dspark_jax import sharding

    monkeypatch.setattr(sharding, "device_memory_bytes", lambda device=None: 10_000_000)
    # the default pair's sizes: 4 and 2 heads, vocab 4096, MLP 768: tensor 2 on 2 of 8 devices
    mesh = sharding.decoding_mesh(None, lambda: 10**9, split_sizes=lambda: [4, 2, 4096, 768])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 2}
    assert list(mesh.devices.flat) == jax.devices()[:2]
    assert sharding.describe_mesh(mesh) == "mesh data 1 x fsdp 1 x tensor 2 (2 of 8 devices)"
    # parameters that fit one device: no mesh
    assert sharding.decoding_mesh(None, lambda: 10, split_sizes=lambda: [4]) is None
    # nothing above 1 divides: the automatic choice says it failed and what --mesh to give
    with pytest.raises(
        ShardingError, match=r"automatic mesh .* no tensor size from 2 to 8 .*--mesh"
    ):
        sharding.decoding_mesh(None, lambda: 10**9, split_sizes=lambda: [3, 1, 4096, 768])


def test_generate_prints_the_default_mesh_it_chose(monkeypatch, capsys):
    from dspark_jax import sharding

    monkeypatch.setattr(sharding, "device_memory_bytes", lambda device=None: 10_000_000)
    argv = ["generate", "--token-ids", "1,2,3", "--max-new-tokens", "4", "--no-draft"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "decoding on mesh data 1 x fsdp 1 x tensor 2 (2 of 8 devices)" in err


def test_an_sps_table_profiled_on_another_mesh_is_refused(pair, capsys):
    from dspark_jax.cli import args as cli_args

    target, drafter = pair
    model = policies.sps_model(target.cfg, drafter.cfg)

    def table(**mesh):
        return policies.SpsProfile((8, 16), [100.0, 90.0], {"num_slots": 2, "model": model, **mesh})

    tensor2 = {"data": 1, "fsdp": 1, "tensor": 2}
    sharded = table(mesh=tensor2)
    single = table(mesh=None)
    older = table()  # written before profiles recorded a mesh: before meshes, one device
    mesh = _mesh(1, 1, 2)
    with pytest.raises(policies.PolicyError, match=r"mesh 1,1,2 \(data,fsdp,tensor\), but the en"):
        policies.check_sps_profile(sharded, 2, target.cfg, drafter.cfg, mesh=None)
    for on_one_device in (single, older):
        with pytest.raises(
            policies.PolicyError, match=r"one device \(no mesh\), but .* mesh 1,1,2"
        ):
            policies.check_sps_profile(on_one_device, 2, target.cfg, drafter.cfg, mesh=mesh)
        assert policies.check_sps_profile(on_one_device, 2, target.cfg, drafter.cfg, mesh=None)
    assert policies.check_sps_profile(sharded, 2, target.cfg, drafter.cfg, mesh=mesh)
    # the engine checks its own mesh
    with pytest.raises(policies.PolicyError, match="profiled on mesh 1,1,2"):
        Engine(target, drafter, CFG, policy=policies.PrefixSchedulePolicy(sharded))
    # the command line words the fix for its flags
    with pytest.raises(
        policies.PolicyError,
        match=r"^--sps-table p.json was profiled on one device .*layout\. Profile this layout with "
        r"dspark-jax profile and --mesh 1,1,2, or run with no --mesh as the table was$",
    ):
        cli_args.check_sps_table("p.json", single, 2, target.cfg, drafter.cfg, str, mesh)


@pytest.mark.parametrize("command", ["generate", "eval", "serve", "profile"])
def test_mesh_help_recommends_tensor_parallelism(command):
    # data replicas repeat the decoding work, so the example must not be all devices on data
    from dspark_jax import cli

    text = " ".join(cli._parser(command).commands[command].format_help().split())
    assert "give the devices to tensor, e.g. --mesh 1,1,4 or --mesh=1,1,-1" in text
    assert "-1,1,1" not in text


def test_a_decoding_mesh_may_use_fewer_devices_than_are_present(capsys):
    from dspark_jax import sharding

    mesh = sharding.decoding_mesh(MeshConfig(1, 1, 2), lambda: 0)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 2}
    assert list(mesh.devices.flat) == jax.devices()[:2]
    # -1 still takes every device, and training's make_mesh still wants them all
    assert sharding.decoding_mesh(MeshConfig(-1, 1, 2), lambda: 0).devices.size == 8
    with pytest.raises(ShardingError, match="has 2 devices but 8 are present"):
        make_mesh(MeshConfig(1, 1, 2))
    # the command says how many devices it uses, before loading
    argv = ["generate", "--mesh", "1,1,2", "--token-ids", "1,2,3", "--max-num-seqs", "4"]
    assert main([*argv, "--max-new-tokens", "4", "--no-draft"]) == 0
    assert "decoding on mesh data 1 x fsdp 1 x tensor 2 (2 of 8 devices)" in capsys.readouterr().err


def test_an_engine_of_shapes_alone_is_compiled_for_never_run(monkeypatch):
    """Models built with `nnx.eval_shape` (benchmarks/mesh_memory.py's CPU rows, lowering-time
    measurements) allocate nothing: their slot state is not weighed against free host memory
    (mesh_memory's default Qwen3-8B layout was refused on a 24 GB machine since CPU pools became
    float32), and running them is refused by name."""

    def weighed(devices):
        raise AssertionError("the slot state of shapes alone was weighed against free memory")

    monkeypatch.setattr(engine_module, "memory_budget", weighed)
    abstract = nnx.eval_shape(_random_pair)
    for mesh in (None, _mesh(1, 1, 2)):
        engine = Engine(*abstract, CFG, mesh=mesh)
        assert engine.compile_only
        assert "decode_chunk" in engine.lower()
        with pytest.raises(EngineError, match=r"parameters are shapes alone \(nnx.eval_shape\)"):
            engine.init_state()
    # Real parameters are weighed as before.
    with pytest.raises(AssertionError, match="shapes alone was weighed"):
        Engine(*_random_pair(), CFG)


def test_a_mesh_of_stand_in_devices_is_compiled_for_never_run(monkeypatch):
    """A mesh of a topology's stand-in devices (`jax.experimental.topologies`: a GPU or TPU
    compiled for without one, benchmarks/deviceless.py) holds nothing: the engine neither weighs
    its slot state against their memory nor puts anything on them, lowers and compiles every
    program, and refuses to run one. No CPU topology exists: CPU devices play the stand-ins."""
    assert not any(map(engine_module.is_compile_only, jax.devices()))
    monkeypatch.setattr(engine_module, "is_compile_only", lambda device: True)

    def weighed(devices):
        raise AssertionError("the slot state was weighed against a stand-in's memory")

    monkeypatch.setattr(engine_module, "memory_budget", weighed)
    put = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: put.append(a) or device_put(*a, **k))
    abstract = nnx.eval_shape(_random_pair)  # models as a GPU session's AOT script builds them
    engine = Engine(*abstract, CFG, mesh=_mesh(1, 1, 2))
    assert put == [], "put arrays on devices that are not there"
    assert engine.compile_only
    compiled = {name: lowered.compile() for name, lowered in engine.lower().items()}
    assert set(compiled) == {"init", "decode_chunk", "release", "prefill_32"}
    assert compiled["decode_chunk"].memory_analysis().argument_size_in_bytes > 0
    with pytest.raises(EngineError, match="stands in for devices that are not there"):
        engine.init_state()
