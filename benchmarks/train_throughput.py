"""Train-step throughput on the devices present: tokens/s, and MFU on GPU/TPU.

Random weights and random tokens (speed does not depend on their values) at the shapes of a named
target + drafter pair; the step is the real one (`dspark_jax.training.step.make_train_step`):
frozen target forward, packed anchor blocks, chunked loss (each chunk's gradient taken right
after its forward), AdamW update.

    python benchmarks/train_throughput.py                        # tiny fixture shapes (CPU)
    python benchmarks/train_throughput.py --target qwen3-4b --drafter dspark-qwen3-4b \
        --batch 8 --seq-len 4096 --anchors 512 --chunk 64 --dtype bfloat16

Prints a table and writes JSON (--json). MFU is model FLOPs utilisation: the matmul FLOPs the step
must do (`model_flops`, counted from the shapes; masked attention and gradients nobody needs are
not counted, and the step recomputes no forward) over the step's time and the devices' dense bf16
peak (`PEAK_BF16_FLOPS`, looked up by the exact device kind; an unknown kind gives no MFU and says
so). Two MFUs are reported side by side: the total (one frozen target forward + the drafter's
training), which the project's aim is judged on, and the drafter's training FLOPs alone over the
same step time. Memory: XLA's analysis of the compiled step (arguments, temporaries, their peak)
beside the allocator's measured peak where the backend keeps one (GPU/TPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from provenance import (
    Parser,
    git_commit,
    non_negative_int,
    output_file,
    positive_int,
    run_main,
    write_json,
)

from dspark_jax import configs
from dspark_jax.config import DrafterConfig, Qwen3Config
from dspark_jax.decoding.engine import format_bytes
from dspark_jax.errors import UserError
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sharding import MeshConfig, make_mesh, shard_state, state_shardings
from dspark_jax.training import step as S

# Dense (no 2:4 sparsity) bf16 tensor-core peak FLOP/s per device, by jax's exact
# `device_kind`. An exact match, because one family spans parts of different peaks: the H100
# SXM ("NVIDIA H100 80GB HBM3") has 989e12, the H100 PCIe 756e12. NVIDIA's datasheets quote
# the with-sparsity figures, twice these: H100 SXM 1,979 and PCIe 1,513 TFLOP/s (checked against
# a reseller's copy of NVIDIA's H100 table, 2026-11-25). H100 NVL: 835e12 per GPU, the figure
# this table was given for the 94 GB part, not checked against an NVIDIA page (none was at
# hand). H200 (SXM): the H100 SXM's compute with more memory. A100, every form factor: 312e12.
# TPUs: Google's per-chip bf16 peaks (one jax device per chip from v4 on).
PEAK_BF16_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
}
# Bumped when `model_flops` changes what it counts, so gpu_targets.py can tell results counted
# the old way (no such field: dense attention, the Markov head's W1 counted as a matmul, the fc
# input gradient counted; about 14% more than version 2 at the released recipe's shapes).
MODEL_FLOPS_VERSION = 2


def _linear_params(cfg: Qwen3Config) -> int:
    """Weights of the decoder layers' matmuls (no embedding, no norms)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    mlp = 3 * d * cfg.intermediate_size
    return cfg.num_hidden_layers * (attn + mlp)


def _attention_flops(cfg: Qwen3Config, query_key_pairs: float) -> float:
    """QK^T and PV over the (query, key) pairs a mask lets through, all layers, one pass."""
    return 4.0 * query_key_pairs * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers


def mean_anchor(seq_len: int) -> float:
    """Expected position of an anchor in one benchmark sequence: `training.loss.sample_anchors`
    draws the anchors uniformly without replacement among the `anchor_positions` candidates
    (_prompt_len(seq_len) .. seq_len - 2), so each one's expectation is their mean."""
    return (_prompt_len(seq_len) + seq_len - 2) / 2


def model_flops(
    target: Qwen3Config, drafter: DrafterConfig, batch: int, seq_len: int, anchor: float
) -> dict[str, float]:
    """Useful matmul FLOPs of one train step over `batch` sequences of `seq_len` tokens whose
    anchors sit at mean position `anchor` (`mean_anchor`: the expectation under the step's
    uniform sampling, exact in expectation because every term is linear in the positions).

    target_forward: the frozen target once over the sequence (2 x decoder weights per token),
    causal attention (query q sees keys 0..q: seq_len (seq_len + 1) / 2 pairs), and its lm_head
    on the n * gamma block slots (p_t).

    drafter_train, forward x 3 (forward, input and weight gradients) except where a gradient is
    not needed:
      - fc over the taps: forward + weight gradient only (the taps are under stop_gradient);
      - the context K/V projections of every drafter layer over the whole sequence;
      - the block stream's decoder weights on the n * gamma slots, less layer 0's q/k/v input
        gradient (its input is the frozen embedding's output);
      - block attention over the keys a block's queries see: the p_i context keys j < p_i and
        the gamma keys of their own block, gamma * sum_i (p_i + gamma) pairs;
      - the frozen lm_head: forward + input gradient;
      - the Markov head: W2 [vocab, rank] once (W1 is a gather, no matmul), plus the gated or
        rnn kind's projection; the confidence head's projection.
    Not counted: attention over masked keys (computed or not), the embedding gathers, norms
    and other elementwise work.
    """
    m = drafter.model
    n, k = drafter.num_anchors, drafter.block_size
    slots = n * k
    d, v, r = m.hidden_size, m.vocab_size, drafter.markov_rank
    target_fwd = (
        2.0 * _linear_params(target) * seq_len
        + _attention_flops(target, seq_len * (seq_len + 1) / 2)
        + 2.0 * target.hidden_size * target.vocab_size * slots  # p_t on the block slots
    )
    fc = 2.0 * seq_len * drafter.num_context_features * d
    kv_width = 2 * m.num_key_value_heads * m.head_dim * m.num_hidden_layers
    context_kv = 2.0 * seq_len * d * kv_width
    blocks = 2.0 * _linear_params(m) * slots
    qkv_width = (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
    layer0_qkv = 2.0 * slots * d * qkv_width
    block_attention = _attention_flops(m, k * n * (anchor + k))
    lm_head = 2.0 * slots * v * d
    heads = 2.0 * slots * v * r  # Markov W2
    if r and drafter.markov_head_type == "gated":
        heads += 2.0 * slots * (d + r) * r
    elif r and drafter.markov_head_type == "rnn":
        heads += 2.0 * slots * (d + 2 * r) * 3 * r
    if drafter.enable_confidence_head:
        heads += 2.0 * slots * (d + (r if drafter.confidence_head_with_markov else 0))
    drafter_train = (
        2.0 * fc
        + 3.0 * (context_kv + blocks + block_attention + heads)
        - layer0_qkv
        + 2.0 * lm_head
    )
    return {
        "target_forward": batch * target_fwd,
        "drafter_train": batch * drafter_train,
        "total": batch * (target_fwd + drafter_train),
    }


def peak_flops(device_kind: str) -> tuple[float | None, str | None]:
    """(dense bf16 peak FLOP/s, None) for a known device kind, else (None, why not)."""
    peak = PEAK_BF16_FLOPS.get(device_kind)
    if peak is not None:
        return peak, None
    return None, (
        f"no dense bf16 peak known for device kind {device_kind!r} (known: "
        f"{', '.join(PEAK_BF16_FLOPS)}); add it to PEAK_BF16_FLOPS from the vendor's datasheet"
    )


def _prompt_len(seq_len: int) -> int:
    """Tokens of prompt (outside the loss) at the start of each benchmark sequence."""
    return seq_len // 8


def anchor_positions(seq_len: int) -> int:
    """Positions the training step may anchor a block at in one benchmark sequence
    (`training.loss.sample_anchors`: p and p + 1 both in the loss, p + 1 inside the sequence),
    so the most anchors that are real blocks: past that, the rest are padding at l - 1 that the
    step computes but that hold no label."""
    return max(seq_len - 1 - _prompt_len(seq_len), 0)


def _batch(batch: int, seq_len: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Random tokens; the first eighth of each sequence is prompt, the rest assistant."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, min(vocab, 256), (batch, seq_len)).astype(np.int32)
    prompt = _prompt_len(seq_len)
    loss_mask = np.broadcast_to(np.arange(seq_len) >= prompt, (batch, seq_len)).copy()
    return {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "length": np.full((batch,), seq_len, np.int32),
    }


def run(args: argparse.Namespace) -> dict:
    target_cfg = configs.get(args.target)
    drafter_cfg = configs.get(args.drafter)
    if not isinstance(target_cfg, Qwen3Config) or not isinstance(drafter_cfg, DrafterConfig):
        raise UserError(f"{args.target} must name a target and {args.drafter} a drafter config")
    target_cfg = dataclasses.replace(target_cfg, dtype=args.dtype)
    drafter_cfg = dataclasses.replace(
        drafter_cfg,
        model=dataclasses.replace(drafter_cfg.model, dtype=args.dtype),
        num_anchors=args.anchors,
    )
    mesh = make_mesh(MeshConfig(*args.mesh))
    # Random weights, created directly with their shardings.
    abstract = nnx.eval_shape(lambda: Qwen3(target_cfg, rngs=nnx.Rngs(0), param_dtype=args.dtype))
    target_gd, target_abstract = nnx.split(abstract)
    target_state = jax.jit(
        lambda: jax.tree.map(lambda x: jnp.full(x.shape, 0.01, x.dtype), target_abstract),
        out_shardings=state_shardings(target_abstract, mesh),
    )()
    target = nnx.merge(target_gd, target_state)
    drafter = S.new_drafter(drafter_cfg, target, seed=0)
    drafter_gd, params, frozen_drafter = S.split_drafter(drafter)
    models = S.Models(target_gd, drafter_gd, drafter_cfg)
    cfg = S.StepConfig(args.anchors, args.chunk, args.microbatches)
    tx, schedule = S.make_optimizer(1e-4, 1000, 10, 0.0, 1.0)
    state = shard_state(S.init_train_state(params, tx, 0), mesh)
    frozen = shard_state(S.FrozenParams(target_state, frozen_drafter), mesh)
    step = S.make_train_step(
        models, cfg, tx, schedule, mesh, state, frozen, args.batch, args.seq_len
    )
    batch = _batch(args.batch, args.seq_len, target_cfg.vocab_size, 0)

    # Compiled ahead of the first step so XLA's own account of its memory can be read; the
    # timed steps run this very executable.
    t0 = time.perf_counter()
    step = step.lower(state, frozen, batch).compile()
    compile_s = time.perf_counter() - t0
    xla_memory = xla_memory_bytes(step)
    for _ in range(args.warmup):
        state, metrics = step(state, frozen, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, frozen, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    # What the allocator saw at its peak (weights, optimizer state, batch and the step's
    # temporaries); backends without an allocator report (CPU) give None.
    stats = jax.devices()[0].memory_stats() or {}
    measured_peak = stats.get("peak_bytes_in_use")
    flops = model_flops(
        target_cfg, drafter_cfg, args.batch, args.seq_len, mean_anchor(args.seq_len)
    )
    kind = jax.devices()[0].device_kind
    peak, mfu_note = peak_flops(kind)
    if jax.default_backend() == "cpu":
        peak, mfu_note = None, "no MFU on CPU (no dense bf16 peak to divide by)"
    peak_all = None if peak is None else peak * jax.device_count()
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "platform": jax.default_backend(),
        "host": platform.node(),
        "target": args.target,
        "drafter": args.drafter,
        "dtype": args.dtype,
        "mesh": dict(mesh.shape),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "anchors": args.anchors,
        "chunk": args.chunk,
        "microbatches": args.microbatches,
        "compile_s": compile_s,
        "step_s_median": step_s,
        "step_s_min": min(times),
        "step_s_max": max(times),
        "seq_tokens_per_s": args.batch * args.seq_len / step_s,
        "block_tokens_per_s": args.batch * args.anchors * drafter_cfg.block_size / step_s,
        # What the FLOP counts below mean (see MODEL_FLOPS_VERSION); results without this
        # field were counted the old way.
        "model_flops_version": MODEL_FLOPS_VERSION,
        "model_tflop_per_step": flops["total"] / 1e12,
        "target_forward_tflop_per_step": flops["target_forward"] / 1e12,
        "drafter_train_tflop_per_step": flops["drafter_train"] / 1e12,
        "achieved_tflops": flops["total"] / step_s / 1e12,
        "peak_bf16_tflops_per_device": None if peak is None else peak / 1e12,
        # The aim's MFU: target forward + drafter training over the step time.
        "mfu": None if peak_all is None else flops["total"] / step_s / peak_all,
        # The drafter's training FLOPs alone over the same step time (the target forward's
        # share is mfu - drafter_mfu).
        "drafter_mfu": None if peak_all is None else flops["drafter_train"] / step_s / peak_all,
        "mfu_note": mfu_note,
        "loss": float(metrics["loss"]),
        "xla_memory": xla_memory,
        "measured_peak_bytes": None if measured_peak is None else int(measured_peak),
    }
    return result


def xla_memory_bytes(compiled) -> dict | None:
    """XLA's memory analysis of a compiled step, in bytes: arguments, outputs, aliased
    (outputs written into donated arguments), temporaries, and the peak they add up to
    (arguments + outputs - aliased + temporaries); None where the backend gives none."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    fields = {
        "arguments": analysis.argument_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
        "aliased": analysis.alias_size_in_bytes,
        "temporaries": analysis.temp_size_in_bytes,
    }
    fields = {k: int(v) for k, v in fields.items()}
    fields["peak"] = (
        fields["arguments"] + fields["outputs"] - fields["aliased"] + fields["temporaries"]
    )
    return fields


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _bytes(n: int | None) -> str:
    return "n/a" if n is None else format_bytes(n)


def _mesh(text: str) -> tuple[int, int, int]:
    """argparse `type=` of --mesh: three integers, data,fsdp,tensor."""
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) != 3:
        raise argparse.ArgumentTypeError(f"{text!r} is not three integers data,fsdp,tensor")
    return sizes


def main() -> None:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="tiny-vanilla-target")
    parser.add_argument("--drafter", default="tiny-vanilla-dspark")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--anchors", type=positive_int, default=32)
    parser.add_argument("--chunk", type=positive_int, default=16)
    parser.add_argument("--microbatches", type=positive_int, default=1)
    parser.add_argument(
        "--mesh",
        type=_mesh,
        default=(-1, 1, 1),
        help="data,fsdp,tensor sizes; -1 takes the devices left (default -1,1,1)",
    )
    parser.add_argument("--steps", type=positive_int, default=10)
    parser.add_argument("--warmup", type=non_negative_int, default=2)
    parser.add_argument("--json", default="train_throughput.json", help="where to write results")
    args = parser.parse_args()
    if args.anchors > anchor_positions(args.seq_len):
        parser.error(
            f"--anchors {args.anchors}: a sequence of --seq-len {args.seq_len} has "
            f"{anchor_positions(args.seq_len)} positions to anchor a block at (those in the "
            f"loss, past its {_prompt_len(args.seq_len)}-token prompt, with a next token); more "
            "anchors would count padding blocks as trained tokens"
        )
    if args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} does not split into {args.microbatches} microbatches")
    # The step's own checks (--chunk must divide --anchors), before any model is built.
    S.StepConfig(args.anchors, args.chunk, args.microbatches)
    output_file(args.json, "--json")
    result = run(args)
    rows = [
        ("device", result["device"]),
        ("shapes", f"{args.target} + {args.drafter}, {args.dtype}"),
        ("batch x seq_len", f"{args.batch} x {args.seq_len}"),
        ("anchors / chunk", f"{args.anchors} / {args.chunk}"),
        ("mesh", str(result["mesh"])),
        ("compile (s)", f"{result['compile_s']:.1f}"),
        ("step median (ms)", f"{1e3 * result['step_s_median']:.1f}"),
        ("seq tokens/s", f"{result['seq_tokens_per_s']:,.0f}"),
        ("block tokens/s", f"{result['block_tokens_per_s']:,.0f}"),
        ("model TFLOP/step", f"{result['model_tflop_per_step']:.4f}"),
        ("  target forward", f"{result['target_forward_tflop_per_step']:.4f}"),
        ("  drafter training", f"{result['drafter_train_tflop_per_step']:.4f}"),
        ("achieved TFLOP/s", f"{result['achieved_tflops']:.3f}"),
        ("MFU (target fwd + drafter)", _percent(result["mfu"])),
        ("drafter-only MFU", _percent(result["drafter_mfu"])),
    ]
    if result["mfu_note"]:
        rows.append(("MFU note", result["mfu_note"]))
    xla = result["xla_memory"] or {}
    rows += [
        ("XLA memory: args / temps", f"{_bytes(xla.get('arguments'))} / "
         f"{_bytes(xla.get('temporaries'))}"),
        ("XLA memory: peak", _bytes(xla.get("peak"))),
        ("measured peak", _bytes(result["measured_peak_bytes"])),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    write_json(args.json, result, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    run_main(main)
