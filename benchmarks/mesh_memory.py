"""Per-device memory of the slot engine on a mesh, from XLA's own memory analysis.

Nothing is allocated: the target and drafter are built with `nnx.eval_shape` (random-weight
shapes of a named config), their parameters carry the rules table's shardings, and every engine
program is lowered from shapes and compiled; `memory_analysis()` of the compiled, SPMD-partitioned
program gives the bytes one device needs. So the Qwen3-8B target and its drafter can be sized on
a laptop:

    python benchmarks/mesh_memory.py --tpu v5e:2x2   # Qwen3-8B + DSpark, 1x1x4, bf16, TPU v5e
    python benchmarks/mesh_memory.py                 # the same on CPU devices made up by XLA
    python benchmarks/mesh_memory.py --mesh 1,1,8 --slots 64 --tpu v5e:2x4

`--tpu TOPOLOGY` compiles for TPU chips that are not there (`jax.experimental.topologies`; it
needs libtpu, `pip install "jax[tpu]"`, but no TPU) with the Pallas TPU attention: the numbers a
TPU would see. `--gpu h100` (or h200) does the same for one GPU with the Triton attention
(benchmarks/deviceless.py; `pip install "jax[cuda12]"`, no GPU), mesh 1x1x1. Without either
the programs compile for XLA:CPU with the plain-JAX attention, whose memory overstates an
accelerator's: where XLA:CPU would gather a 16-bit pool through a float32 copy of the whole pool
(jax 0.10), the engine stores the pools in float32 there (twice a chip's pool bytes; the header
says so), and the CPU temporaries are larger -- the CPU rows bound the memory from above, they
do not size a chip.

Columns per program: arguments (parameters + slot state + inputs), outputs, aliased (outputs
written into donated arguments: counted once), temporaries, and their total
args + outputs - aliased + temps: what the device holds while the program runs. The parameter
and KV-pool rows split the arguments by what they are.

The last line is the verdict, whether the peak fits a `--device-gb` device (`fits` in the
JSON). It is a measurement, not a check: the script exits 0 either way (status 2 for bad
arguments), since the CPU rows, which overstate, "do not fit" at the defaults by construction.
`--config` takes the targets that have a DSpark drafter config (`dspark-<config>`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path


def _parse_mesh(text: str) -> tuple[int, int, int]:
    sizes = tuple(int(v) for v in text.split(","))
    if len(sizes) != 3 or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--mesh wants three positive sizes, got {text!r}")
    return sizes


def _pairs() -> list[str]:
    """The named target configs that have a DSpark drafter config, `dspark-<target>`."""
    from dspark_jax.config import Qwen3Config
    from dspark_jax.configs import get, names

    known = set(names())
    return [n for n in names() if isinstance(get(n), Qwen3Config) and f"dspark-{n}" in known]


def main() -> int:
    from deviceless import GPU_MEMORY_GB, GPUS
    from provenance import Parser, output_file, positive_float, positive_int

    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config",
        default="qwen3-8b",
        choices=_pairs(),
        help="named target config, with its drafter dspark-<config> (qwen3-8b)",
    )
    parser.add_argument(
        "--mesh", type=_parse_mesh, help="data,fsdp,tensor (1,1,4; with --gpu 1,1,1)"
    )
    parser.add_argument("--slots", type=positive_int, default=32, help="engine slots (32)")
    parser.add_argument(
        "--max-model-len", type=positive_int, default=4096, help="positions per slot"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--device-gb",
        type=positive_float,
        help="budget per device (16; with --gpu that GPU's memory)",
    )
    parser.add_argument(
        "--tpu",
        metavar="TOPOLOGY",
        help="compile for this TPU topology without a TPU (e.g. v5e:2x2; needs libtpu)",
    )
    parser.add_argument(
        "--gpu",
        choices=sorted(GPUS),
        help="compile for one such GPU without it (mesh 1,1,1; needs jax[cuda12])",
    )
    parser.add_argument("--json", type=Path, help="write the table here too")
    args = parser.parse_args()
    if args.gpu is not None and args.tpu is not None:
        parser.error("--gpu and --tpu name two different machines: give one")
    if args.mesh is None:
        args.mesh = (1, 1, 1) if args.gpu is not None else (1, 1, 4)
    if args.gpu is not None and args.mesh != (1, 1, 1):
        parser.error(f"--gpu compiles for one GPU: --mesh 1,1,1, not {args.mesh}")
    if args.device_gb is None:
        args.device_gb = GPU_MEMORY_GB[args.gpu] if args.gpu is not None else 16.0
    if args.json:
        output_file(args.json, "--json")

    devices = args.mesh[0] * args.mesh[1] * args.mesh[2]
    # Virtual CPU devices stand in for the chips; XLA reads the flag when JAX starts.
    if "jax" in sys.modules:
        raise RuntimeError("run this script directly: JAX must not be imported before it")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if os.environ["JAX_PLATFORMS"] == "cpu" and args.tpu is None and args.gpu is None:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    return _measure(args)


def _measure(args) -> int:
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx
    from provenance import git_commit, write_json

    from dspark_jax.configs import get as named_config
    from dspark_jax.decoding.engine import Engine, EngineConfig
    from dspark_jax.errors import UserError
    from dspark_jax.models.drafter import DSparkDrafter
    from dspark_jax.models.qwen3 import Qwen3
    from dspark_jax.sharding import MeshConfig, make_mesh

    size = int(np.prod(args.mesh))
    devices = jax.devices()
    impl = None
    if args.tpu is not None:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(topology_name=args.tpu, platform="tpu")
        devices, impl = list(topology.devices), "pallas_tpu"
        platform_name = f"TPU {args.tpu} ({devices[0].device_kind}), compiled without the chips"
    elif args.gpu is not None:
        from deviceless import gpu_devices

        devices, impl = gpu_devices(args.gpu), "pallas_gpu"
        platform_name = f"{devices[0].device_kind}, compiled without the GPU"
    else:
        platform_name = f"{jax.default_backend()}, {len(devices)} devices made up by XLA"
    if size > len(devices):
        raise UserError(f"mesh {args.mesh} needs {size} devices; {platform_name} has fewer")
    mesh = make_mesh(MeshConfig(*args.mesh), devices[:size])
    target_cfg = dataclasses.replace(named_config(args.config), dtype=args.dtype)
    drafter_name = f"dspark-{args.config}"
    drafter_cfg = named_config(drafter_name)
    drafter_cfg = dataclasses.replace(
        drafter_cfg, model=dataclasses.replace(drafter_cfg.model, dtype=args.dtype)
    )
    target = nnx.eval_shape(lambda: Qwen3(target_cfg, rngs=nnx.Rngs(0)))
    drafter = nnx.eval_shape(lambda: DSparkDrafter(drafter_cfg, rngs=nnx.Rngs(0)))
    gamma = drafter_cfg.block_size
    # One token bucket and one prefill bucket: the largest of each, which set the peak.
    cfg = EngineConfig(
        attention_impl=impl,
        num_slots=args.slots,
        max_model_len=args.max_model_len,
        prefill_buckets=(256,),
        token_buckets=(args.slots * (gamma + 1),),
    )
    engine = Engine(target, drafter, cfg, mesh=mesh)

    def per_device(tree) -> int:
        return sum(
            int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
            for x in jax.tree.leaves(tree)
        )

    state = jax.eval_shape(engine._init, engine.target_params, engine.drafter_params)
    state = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        state,
        engine.state_shardings,
    )
    parts = {
        "target parameters": per_device(engine.target_params),
        "drafter parameters": per_device(engine.drafter_params),
        "target KV pool": per_device(state.target_pages),
        "drafter context KV pool": per_device(state.draft_pages),
    }
    rows = []
    for name, lowered in engine.lower().items():
        stats = lowered.compile().memory_analysis()
        row = dict(
            program=name,
            arguments=stats.argument_size_in_bytes,
            outputs=stats.output_size_in_bytes,
            aliased=stats.alias_size_in_bytes,
            temps=stats.temp_size_in_bytes,
        )
        row["total"] = row["arguments"] + row["outputs"] - row["aliased"] + row["temps"]
        rows.append(row)
    peak = max(r["total"] for r in rows)
    budget = args.device_gb * 1e9
    gib = 2.0**30
    print(
        f"{args.config} + {drafter_name}, {args.dtype}, mesh {'x'.join(map(str, args.mesh))} "
        f"(data x fsdp x tensor), {args.slots} slots x {args.max_model_len} positions, "
        f"{cfg.pool_pages} pages of {cfg.page_size}; commit {git_commit()}, "
        f"{datetime.date.today()}, {platform.node()}; {platform_name}"
    )
    wide = engine.target_layout.value_dtype
    pool_dtype = args.dtype if wide is None else "float32"
    if wide is not None:
        print(f"(page pools stored as float32 holding {wide} values on {jax.default_backend()})")
    print("per device:")
    for name, size in parts.items():
        print(f"  {name:<26}{size / gib:8.2f} GiB")
    print(f"{'program':<16}{'args':>9}{'outputs':>9}{'aliased':>9}{'temps':>9}{'total':>9}  GiB")
    for r in rows:
        print(
            f"{r['program']:<16}"
            + "".join(
                f"{r[k] / gib:9.2f}" for k in ("arguments", "outputs", "aliased", "temps", "total")
            )
        )
    fits = peak <= budget
    print(
        f"peak per device {peak / gib:.2f} GiB = {peak / 1e9:.2f} GB: "
        f"{'fits' if fits else 'does NOT fit'} a {args.device_gb:.4g} GB device"
    )
    if args.json:
        write_json(
            args.json,
            dict(
                benchmark="mesh_memory",
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                commit=git_commit(),
                machine=platform.node(),
                platform=platform_name,
                settings={k: v for k, v in vars(args).items() if k != "json"},
                pool_dtype=pool_dtype,
                parts=parts,
                rows=rows,
                peak_bytes=peak,
                fits=fits,
            ),
            indent=2,
        )
    return 0  # a measurement: the verdict is printed, not an exit status (see the module)


if __name__ == "__main__":
    from provenance import run_main

    run_main(main)
