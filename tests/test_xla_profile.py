"""benchmarks/xla_profile.py: the table the GPU session prints of where a decode chunk's time goes.

A real capture on this CPU checks the whole pipeline (profiler -> Perfetto JSON -> op table with
the compiled module's shapes); a trace laid out like a GPU's (an "XLA Ops" line beside the stream
lines that run the same ops, memcpy events) checks that ops are counted once, loops are not added
into the busy time, and transfers are reported.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import xla_profile  # noqa: E402


def test_cpu_capture_names_the_ops_of_the_module(tmp_path):
    @jax.jit
    def step(x, w):
        def body(_, h):
            return jnp.tanh(h @ w)

        return jnp.exp(jax.lax.fori_loop(0, 4, body, x)).sum()

    x = jnp.ones((64, 256), jnp.float32)
    w = jnp.asarray(np.random.default_rng(0).normal(size=(256, 256)) / 16, jnp.float32)
    step(x, w).block_until_ready()
    hlo = step.lower(x, w).compile().as_text()
    wall = xla_profile.capture(lambda: step(x, w).block_until_ready(), tmp_path)
    summary = xla_profile.summarize(tmp_path, "jit_step", wall, hlo_text=hlo)

    assert summary["wall_ms"] > 0 and summary["busy_ms"] > 0
    # The loop's ops are timed each of the four times the body ran, the loop itself once.
    body = [op for op in summary["top_ops"] if op["calls"] == 4 and "f32[64,256]" in op["hlo"]]
    assert body, summary["top_ops"]
    loops = [k for k in summary["by_kind"] if k["kind"] == "while"]
    assert len(loops) == 1 and loops[0]["calls"] == 1 and loops[0]["share"] is None
    assert all(op["hlo"] for op in summary["top_ops"]), "every top op is found in the HLO text"
    # Another module's ops are filtered out.
    assert xla_profile.summarize(tmp_path, "jit_no_such_module")["ops"] == 0
    assert "top ops" in xla_profile.format_summary(summary, "step")


def _gpu_like_trace():
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 10, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 11, "args": {"name": "Stream #7"}},
    ]

    def ev(pid, tid, name, dur, **args):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": 0, "dur": dur, "args": args}

    ops = [
        ev(2, 10, "while.3", 900.0, hlo_op="while.3", hlo_module="jit_decode"),
        ev(2, 10, "fusion.1", 500.0, hlo_op="fusion.1", hlo_module="jit_decode",
           long_name="%fusion.1 = bf16[64,151936] fusion(...)"),
        ev(2, 10, "fusion.1", 100.0, hlo_op="fusion.1", hlo_module="jit_decode"),
        ev(2, 10, "copy.2", 300.0, hlo_op="copy.2", hlo_module="jit_decode"),
        ev(2, 10, "fusion.9", 700.0, hlo_op="fusion.9", hlo_module="jit_prefill"),
        # The kernels of the same ops on the stream line: not counted again.
        ev(2, 11, "loop_fusion_kernel", 600.0, hlo_op="fusion.1", hlo_module="jit_decode"),
        ev(2, 11, "MemcpyD2H", 40.0),
        # Host-side events of the same names: not device time.
        ev(1, 5, "fusion.1", 999.0, hlo_op="fusion.1", hlo_module="jit_decode"),
    ]  # fmt: skip
    return meta + ops


def test_gpu_layout_counts_each_op_once():
    s = xla_profile.summarize_events(_gpu_like_trace(), "jit_decode", wall_s=0.002)
    assert s["ops"] == 3 and s["op_calls"] == 4
    assert np.isclose(s["busy_ms"], 0.9)  # fusion 0.6 + copy 0.3; the while loop holds them
    assert np.isclose(s["busy_share"], 0.45)
    top = s["top_ops"][0]
    assert top["op"] == "fusion.1" and np.isclose(top["ms"], 0.6) and "151936" in top["hlo"]
    assert [op["op"] for op in s["top_ops"]] == ["fusion.1", "copy.2"]
    by_kind = {k["kind"]: k for k in s["by_kind"]}
    assert by_kind["while"]["share"] is None and np.isclose(by_kind["copy"]["share"], 1 / 3)
    assert s["transfers"] == [{"name": "MemcpyD2H", "ms": 0.04}]
    text = xla_profile.format_summary(s, "decode")
    assert "45% busy" in text and "transfer MemcpyD2H" in text
