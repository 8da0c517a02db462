"""The engine's programs lower for a GPU on a machine without one.

JAX lowers for another platform from shapes alone (`Engine.lower(platforms=("cuda",))`): the
Pallas GPU attention goes through its Triton lowering rules (block shapes, the dot operands,
the kernels' signatures), so a change that would break the GPU path fails here rather than in
the first minutes of a lent GPU. What only the device shows (Triton compiling to PTX, timings)
is benchmarks/gpu_session.sh's job.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
import types

import jax
import jax.numpy as jnp
import pytest
from fixture_models import load_pair
from flax import nnx

from dspark_jax.decoding.engine import Engine, EngineConfig, absent_gpu_target
from dspark_jax.models import attention as attn
from dspark_jax.models import layers, qwen3
from dspark_jax.models.layers import GRAPH_LOOPS_ENV
from dspark_jax.models.qwen3 import Qwen3

CFG = EngineConfig(
    num_slots=4,
    max_model_len=256,
    page_size=16,
    rounds_per_chunk=2,
    prefill_chunk=32,
    prefill_buckets=(16, 32),
    attention_impl="pallas_gpu",
)
TRITON = "__gpu$xla.gpu.triton"


def _custom_calls(lowered) -> list[str]:
    return re.findall(r"custom_call @([\w$.]+)", lowered.as_text())


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("page_size", [16, 8])
def test_engine_programs_lower_for_cuda_with_the_triton_kernels(speculative, page_size):
    target, drafter = load_pair("vanilla")
    cfg = EngineConfig(**{**CFG.__dict__, "page_size": page_size})
    engine = Engine(target, drafter if speculative else None, cfg)
    lowered = engine.lower(platforms=("cuda",))
    assert set(lowered) == {"init", "decode_chunk", "release", "prefill_16", "prefill_32"}
    state_leaves = len(jax.tree.leaves(jax.eval_shape(engine._init, engine.target_params,
                                                      engine.drafter_params)))
    for name, program in lowered.items():
        text = program.as_text()
        calls = _custom_calls(program)
        # Nothing leaves the device inside a program: no Python callbacks, no host transfers.
        assert not [c for c in calls if "callback" in c], (name, calls)
        assert not re.search(r"stablehlo\.(send|recv|infeed|outfeed)\b", text), name
        if name.startswith(("decode", "prefill")):
            # Attention is the Triton kernels (one call per layer and part), not a fallback.
            assert calls and set(calls) == {TRITON}, (name, sorted(set(calls)))
        if name != "init":
            # The slot state is donated: every leaf's buffer is reused for its output.
            assert text.count("tf.aliasing_output") == state_leaves, name


def test_where_loops_stay_out_of_cuda_graphs_a_program_holds_only_the_rounds_loop(monkeypatch):
    """With DSPARK_JAX_GRAPH_LOOPS=0 XLA's CUDA graphs take no loop: each trip of one is then a
    round trip to the host, and a loop inside a conditional keeps that conditional out of the
    graphs too (benchmarks/host_syncs.py). Lowered for a GPU, no program holds a loop but the
    decode program's rounds: the sampling filters' searches are written out."""
    monkeypatch.setenv(GRAPH_LOOPS_ENV, "0")
    target, drafter = load_pair("vanilla")
    for speculative in (False, True):
        engine = Engine(target, drafter if speculative else None, CFG)
        for name, program in engine.lower(platforms=("cuda",)).items():
            loops = program.as_text().count("stablehlo.while")
            assert loops == (name == "decode_chunk"), (speculative, name, loops)


def test_an_nvidia_gpus_programs_take_loops_into_cuda_graphs(monkeypatch):
    """The engine compiles its programs for an NVIDIA GPU with loops and conditionals recorded
    into CUDA graphs (the driver decides them: a decode chunk is one launch); XLA's defaults
    elsewhere, and where DSPARK_JAX_GRAPH_LOOPS=0. Lowered for such a GPU, the sampling filters'
    searches stay loops (written out, they doubled a speculative program's compile time)."""

    monkeypatch.delenv(GRAPH_LOOPS_ENV, raising=False)

    def device(platform, kind):
        return types.SimpleNamespace(platform=platform, device_kind=kind)

    h200 = device("gpu", "NVIDIA H200")
    options = layers.compiler_options(h200)
    kinds = options["xla_gpu_enable_command_buffer"].split(",")
    assert {"WHILE", "CONDITIONAL", "FUSION", "CUBLAS", "CUDNN", "CUSTOM_CALL"} <= set(kinds)
    assert layers.compiler_options(device("gpu", "AMD Instinct MI300X")) is None
    assert layers.compiler_options(device("cpu", "cpu")) is None
    assert layers.compiler_options(device("tpu", "TPU v5 lite")) is None
    target, drafter = load_pair("vanilla")
    engine = Engine(target, drafter, CFG)
    if jax.default_backend() == "cpu":
        assert engine.compiler_options is None
    else:  # the tests on a lent GPU (benchmarks/gpu_session.sh)
        assert "WHILE" in engine.compiler_options["xla_gpu_enable_command_buffer"]
    decode = engine.lower(platforms=("cuda",))["decode_chunk"]
    assert decode.as_text().count("stablehlo.while") > 1
    monkeypatch.setenv(GRAPH_LOOPS_ENV, "0")
    assert layers.compiler_options(h200) is None
    monkeypatch.setenv(GRAPH_LOOPS_ENV, "yes")
    with pytest.raises(ValueError, match="DSPARK_JAX_GRAPH_LOOPS='yes'"):
        layers.compiler_options(h200)


@pytest.mark.parametrize(
    ("table_pages", "page_size", "dtype"),
    [(1, 4, "float32"), (41, 16, "float32"), (257, 16, "bfloat16"), (37, 128, "bfloat16")],
)
def test_paged_kernel_lowers_for_any_table_length(table_pages, page_size, dtype):
    """The Triton paged kernel over page tables whose length is not a power of two (the
    engine's table is max_model_len / page_size, whatever that is): Pallas' Triton lowering
    refuses loads whose size is not a power of two, so the blocking must keep every block a
    power of two however the table is split (test_attention.py checks the blocking itself)."""
    kv_heads, queries, head_dim, num_pages = 2, 5, 128, 300
    args = (
        jax.ShapeDtypeStruct((kv_heads, queries, head_dim), dtype),
        jax.ShapeDtypeStruct((2, kv_heads, num_pages, page_size, head_dim), dtype),
        jax.ShapeDtypeStruct((table_pages,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    kernel = jax.jit(functools.partial(attn._gpu_paged_partials, interpret=False))
    with absent_gpu_target(("cuda",), "NVIDIA H100"):
        lowered = kernel.trace(*args).lower(lowering_platforms=("cuda",))
    assert set(_custom_calls(lowered)) == {TRITON}


def _has_loop(fn, *args) -> bool:
    return "stablehlo.while" in jax.jit(fn).lower(*args).as_text()


def test_token_search_is_written_out_for_a_gpu_and_a_loop_here():
    """Which sequence a packed token belongs to (`attention.searchsorted_steps`, behind every
    packed batch's slot of each token): its binary search written out for a GPU target, where
    a while loop's trips are kernels and a predicate the host reads back, and a loop on a CPU,
    where XLA would run the written-out steps again for each element of every consumer."""
    from dspark_jax.models.paged import TokenBatch

    sorted_n, values_t = jnp.zeros(64, jnp.int32), jnp.arange(512, dtype=jnp.int32)
    count_s, start_s = jnp.arange(6, dtype=jnp.int32), jnp.zeros(6, jnp.int32)

    def per_slot(start_s, count_s):
        return TokenBatch.per_slot(start_s, count_s, 16).slot_t

    here = jax.default_backend() != "gpu"
    assert _has_loop(attn.searchsorted_steps, sorted_n, values_t) == here
    assert _has_loop(per_slot, start_s, count_s) == here
    with absent_gpu_target(("cuda",), "NVIDIA H100"):
        assert not _has_loop(attn.searchsorted_steps, sorted_n, values_t)
        assert not _has_loop(per_slot, start_s, count_s)
        # One entry (a 1-slot engine, a drafter bucket of one slot): jnp.searchsorted's
        # written-out search still made a loop of one trip.
        assert not _has_loop(attn.searchsorted_steps, sorted_n[:1], values_t)
        assert not _has_loop(per_slot, start_s[:1], count_s[:1])


def _layer_calls(text: str) -> int:
    """Calls of the shared layer program in a lowered program's text."""
    return len(re.findall(r"call @decoder_layer(_\d+)?\b", text))


def test_layers_lower_once_whatever_the_depth():
    """Every layer is a call of one jitted layer program (`qwen3.paged_layers`), so a deeper
    target adds calls, not layer bodies: the decode program of a target three times as deep
    holds as many attention kernels, and its lowering does not grow with the depth (the host
    time every engine spends before compiling: seconds, not minutes, at Qwen3-4B's 36 layers)."""
    target, _ = load_pair("vanilla")
    depth = target.cfg.num_hidden_layers
    deeper_cfg = dataclasses.replace(target.cfg, num_hidden_layers=3 * depth)
    deeper = nnx.eval_shape(lambda: Qwen3(deeper_cfg, rngs=nnx.Rngs(0)))
    engines = [Engine(t, None, CFG) for t in (target, deeper)]
    texts = [e.lower(platforms=("cuda",))["decode_chunk"].as_text() for e in engines]
    kernels = [len(re.findall(r"custom_call @" + re.escape(TRITON), t)) for t in texts]
    layer_calls = [_layer_calls(t) for t in texts]
    assert kernels[0] > 0 and kernels[1] == kernels[0], kernels
    # One call per layer in each token bucket's branch of the decode program.
    buckets = len(engines[0].token_buckets)
    assert layer_calls == [buckets * depth, buckets * 3 * depth], (layer_calls, buckets)


def test_a_single_bucket_program_holds_the_forward_once():
    """The target's forward sits in a conditional even where there is one token bucket (see
    `engine._switch_on_count`); its other branch, which never runs, fills the outputs with
    zeros instead of holding the forward again. A program of one bucket lowers half the layer
    calls and matmuls of the same engine's with two, and each prefill program (one bucket by
    construction) one call per layer. (With the forward in both branches, such programs took
    1.5-1.8x as long to compile for an H100: docs/benchmarks.md.)"""
    target, _ = load_pair("vanilla")
    depth = target.cfg.num_hidden_layers

    def lowered(buckets):
        cfg = dataclasses.replace(CFG, attention_impl=None, token_buckets=buckets)
        return {k: v.as_text() for k, v in Engine(target, None, cfg).lower().items()}

    one, two = lowered((4,)), lowered((2, 4))
    # Still in a conditional: reads of the pools outside one would make XLA copy them.
    assert "stablehlo.case" in one["decode_chunk"]

    def dots(text):
        return text.count("stablehlo.dot_general")

    assert _layer_calls(one["decode_chunk"]) == depth
    assert _layer_calls(two["decode_chunk"]) == 2 * depth
    assert 2 * dots(one["decode_chunk"]) == dots(two["decode_chunk"]) > 0
    for width in (16, 32):
        assert _layer_calls(one[f"prefill_{width}"]) == depth, width


def _compiled_opcodes(engine: Engine) -> collections.Counter:
    text = engine.lower()["decode_chunk"].compile().as_text()
    return collections.Counter(
        re.findall(r"^\s*(?:ROOT )?%?\S+ = .*? ([a-z][\w-]*)\(", text, re.M)
    )


def test_the_layer_program_compiles_to_the_layers_written_out(monkeypatch):
    """XLA inlines the layer calls: the plain engine's decode program compiled (for this
    backend) with the shared layer program has the calls, copies and (within 1%) the
    instructions and fusions of the same program with the layers written out one by one."""
    target, _ = load_pair("vanilla")
    cfg = EngineConfig(num_slots=2, max_model_len=64, prefill_chunk=16, prefill_buckets=(16,),
                       token_buckets=(2,))  # fmt: skip
    shared = _compiled_opcodes(Engine(target, None, cfg))

    def written_out(method, **options):
        def run(graphdef, state, *args):
            return getattr(nnx.merge(graphdef, state), method)(*args, **options)

        return run

    monkeypatch.setattr(qwen3, "_layer_program", written_out)
    inline = _compiled_opcodes(Engine(target, None, cfg))
    assert shared["call"] == inline["call"], (shared["call"], inline["call"])
    assert shared["copy"] == inline["copy"], (shared["copy"], inline["copy"])
    total_shared, total_inline = sum(shared.values()), sum(inline.values())
    assert abs(total_shared - total_inline) <= 0.01 * total_inline, (total_shared, total_inline)
    assert abs(shared["fusion"] - inline["fusion"]) <= 0.01 * inline["fusion"], shared["fusion"]


def _dots_by_rhs(text: str) -> collections.Counter:
    """dot_general ops of a lowered program by their right operand's type."""
    return collections.Counter(
        re.findall(r"stablehlo\.dot_general .*?: \(tensor<[^>]*>, (tensor<[^>]*>)\)", text)
    )


def test_a_gpu_decode_step_projects_query_key_value_in_one_gemm():
    """For a GPU the paged forward computes q, k and v as one GEMM over the three kernels side
    by side (`Attention.query_key_value`); apart, XLA's GPU compiler makes one token's small K
    and V projections a multiply written to memory and reduced back. Lowered for this
    machine's backend, the three projections stay apart, as before."""
    target, _ = load_pair("vanilla")
    cfg = target.cfg
    d, hd = cfg.hidden_size, cfg.head_dim
    q_width, kv_width = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    one_token = dataclasses.replace(CFG, num_slots=1, token_buckets=(1,))
    dtype = {"float32": "f32", "bfloat16": "bf16"}[cfg.dtype]
    fused = f"tensor<{d}x{q_width + 2 * kv_width}x{dtype}>"
    alone = f"tensor<{d}x{kv_width}x{dtype}>"
    for_gpu = Engine(target, None, one_token).lower(platforms=("cuda",))
    gpu = _dots_by_rhs(for_gpu["decode_chunk"].as_text())
    for_here = Engine(target, None, dataclasses.replace(one_token, attention_impl=None)).lower()
    here = _dots_by_rhs(for_here["decode_chunk"].as_text())
    assert gpu[fused] > 0 and gpu[alone] == 0, gpu
    assert here[fused] == 0 and here[alone] > 0, here


def test_a_gpu_decode_round_writes_keys_and_values_with_one_scatter_a_layer():
    """The Triton kernel's pool holds K and V stacked on a leading axis of 2 (`Pages`), so a
    round stores a layer's new keys and values with one scatter, not one for K and one for V
    (each a kernel on a GPU, 88 a round at Qwen3-4B's shapes): the speculative engine's decode
    program scatters into its pools once per target and drafter layer."""
    target, drafter = load_pair("vanilla")
    engine = Engine(target, drafter, CFG)
    text = engine.lower(platforms=("cuda",))["decode_chunk"].as_text()
    scattered = collections.Counter(
        re.findall(r'"stablehlo\.scatter"\(.*?\) -> (tensor<[^>]*>)', text, re.S)
    )
    cfg = target.cfg
    pool = (f"tensor<2x{cfg.num_key_value_heads}x{engine.target_layout.num_pages}x"
            f"{CFG.page_size}x{cfg.head_dim}xf32>")
    assert engine.draft_layout == engine.target_layout  # the fixtures' drafter: the same shapes
    layers = cfg.num_hidden_layers + drafter.cfg.model.num_hidden_layers
    assert scattered[pool] == layers, scattered
