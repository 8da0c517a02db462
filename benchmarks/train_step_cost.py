"""What one train step executes, without running it: matmul FLOPs and XLA's memory analysis.

The real step (`make_train_step`) at a named target + drafter pair's widths, traced with abstract
weights (nothing of the model is allocated), on one device:

    python benchmarks/train_step_cost.py --target-layers 36                # FLOPs only
    python benchmarks/train_step_cost.py --target-layers 2 --compile       # + memory analysis

FLOPs are counted from the jaxpr, every dot_general times the trip counts of the scans around it
(`compiled.cost_analysis()` counts a loop body once, so it undercounts the chunk and micro-batch
scans). `--target-layers` cuts the target's depth to keep the compile short; the drafter's taps
are then moved onto the layers that remain (five taps kept, so the context width is unchanged).
Memory is XLA's analysis of the compiled step on this backend: on CPU an upper bound for a GPU
(XLA:CPU converts bf16 weights to f32 for its matmuls). `--gpu h100` (or h200) compiles with
XLA's GPU compiler for that GPU without one (benchmarks/deviceless.py; `pip install
"jax[cuda12]"`): the memory and compile time the GPU itself would have.

    python benchmarks/train_step_cost.py --compile --gpu h100 --batch 4 --microbatches 4
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
from deviceless import GPUS, gpu_devices
from flax import nnx
from provenance import Parser, run_main
from train_throughput import xla_memory_bytes

from dspark_jax.configs import qwen3 as Q
from dspark_jax.decoding.engine import absent_gpu_target
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sharding import MeshConfig, make_mesh
from dspark_jax.training import step as S


def executed_matmul_flops(jaxpr, mult: int = 1) -> float:
    """Matmul FLOPs of `jaxpr` as executed: each scan body counted `length` times."""
    flops = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            flops += mult * 2.0 * math.prod(out) * math.prod(lhs[i] for i in contract)
        inner = mult * eqn.params["length"] if eqn.primitive.name == "scan" else mult
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    flops += executed_matmul_flops(sub.jaxpr, inner)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    flops += executed_matmul_flops(sub, inner)
    return flops


def build_step(args):
    """(jitted step, abstract state, frozen and batch, the device kind it is compiled for) at
    Qwen3-4B / DSpark-Qwen3-4B widths."""
    target_cfg = dataclasses.replace(
        Q.QWEN3_4B, num_hidden_layers=args.target_layers, dtype="bfloat16"
    )
    d = Q.DSPARK_QWEN3_4B
    if args.target_layers != Q.QWEN3_4B.num_hidden_layers:
        last = max(args.target_layers - 2, -1)
        taps = sorted({min(i, last) for i in d.target_layer_ids})
        taps = [-1] * (len(d.target_layer_ids) - len(taps)) + taps  # repeat the embedding tap
        d = dataclasses.replace(
            d, target_layer_ids=tuple(taps), num_target_layers=args.target_layers
        )
    d = dataclasses.replace(
        d, model=dataclasses.replace(d.model, dtype="bfloat16"), num_anchors=args.anchors
    )

    def make():
        target = Qwen3(target_cfg, rngs=nnx.Rngs(0), param_dtype="bfloat16")
        return target, S.new_drafter(d, target, seed=0)

    target, drafter = nnx.eval_shape(make)
    target_gd, target_state = nnx.split(target)
    drafter_gd, params, frozen_drafter = S.split_drafter(drafter)
    models = S.Models(target_gd, drafter_gd, d)
    cfg = S.StepConfig(args.anchors, args.chunk, args.microbatches)
    tx, schedule = S.make_optimizer(1e-4, 1000, 10, 0.0, 1.0)
    state = jax.eval_shape(lambda p: S.init_train_state(p, tx, 0), params)
    frozen = S.FrozenParams(target_state, frozen_drafter)
    if args.gpu is None:
        devices = jax.devices()[:1]
    else:
        devices = gpu_devices(args.gpu)
    mesh = make_mesh(MeshConfig(1, 1, 1), devices)
    shape = (args.batch, args.seq_len)
    batch = {
        "tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct(shape, jnp.bool_),
        "length": jax.ShapeDtypeStruct(shape[:1], jnp.int32),
    }
    step = S.make_train_step(models, cfg, tx, schedule, mesh, state, frozen, *shape)
    return step, state, frozen, batch, devices[0].device_kind


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-layers", type=int, default=36)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="also compile: memory analysis")
    parser.add_argument(
        "--gpu",
        choices=sorted(GPUS),
        help="with --compile: compile for one such GPU without it (needs jax[cuda12])",
    )
    args = parser.parse_args()
    if args.gpu is not None and not args.compile:
        parser.error("--gpu needs --compile (the FLOP count does not depend on the machine)")
    step, state, frozen, batch, device_kind = build_step(args)
    traced = step.trace(state, frozen, batch)
    print(
        f"target layers {args.target_layers}, batch {args.batch} x {args.seq_len}, "
        f"{args.anchors} anchors in chunks of {args.chunk}, {args.microbatches} micro-batch(es)"
    )
    flops = executed_matmul_flops(traced.jaxpr.jaxpr)
    print(f"executed matmul FLOPs per step: {flops / 1e12:.2f} TF")
    if args.compile:
        t0 = time.perf_counter()
        if args.gpu is not None:
            # Traced again as for the GPU: attention through cuDNN's flash attention, as a GPU
            # would run it (a custom call, which the FLOP count above would not see).
            with absent_gpu_target(("cuda",), device_kind):
                traced = step.trace(state, frozen, batch)
        memory = xla_memory_bytes(traced.lower().compile())
        gib = 2.0**30
        where = jax.default_backend() if args.gpu is None else f"{args.gpu}, compiled without it"
        print(
            f"compiled in {time.perf_counter() - t0:.0f} s; XLA memory ({where}): "
            f"arguments {memory['arguments'] / gib:.2f} GiB, "
            f"temporaries {memory['temporaries'] / gib:.2f} GiB, "
            f"held while it runs {memory['peak'] / gib:.2f} GiB"
        )


if __name__ == "__main__":
    run_main(main)
