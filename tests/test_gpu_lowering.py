"""The engine's programs lower for a GPU on a machine without one.

JAX lowers for another platform from shapes alone (`Engine.lower(platforms=("cuda",))`): the
Pallas GPU attention goes through its Triton lowering rules (block shapes, the dot operands,
the kernels' signatures), so a change that would break the GPU path fails here rather than in
the first minutes of a lent GPU. What only the device shows (Triton compiling to PTX, timings)
is benchmarks/gpu_session.sh's job.
"""

from __future__ import annotations

import re

import jax
import pytest
from fixture_models import load_pair

from dspark_jax.decoding.engine import Engine, EngineConfig

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
