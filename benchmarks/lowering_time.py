"""How long the engine's programs take to trace and lower at a named config's shapes: the host
work in Python that comes before XLA compiles anything, which no compile thread shares.

Nothing is allocated: the target and its drafter (as `decode_speed.py --config` names them) are
built with `nnx.eval_shape`, and each program is traced and lowered from shapes, by default for a
GPU with the Triton attention kernels (no GPU needed: `Engine.lower(platforms=("cuda",))`), else
for this machine's backend. One row per program: trace seconds, lower seconds, the lowered
module's size and its Triton kernel calls (none on the CPU's plain-JAX attention). So the cost
of a change to the model code is measured here, before a lent GPU's minutes are spent on it:

    python benchmarks/lowering_time.py                      # Qwen3-4B, 64 slots, speculative
    python benchmarks/lowering_time.py --plain --slots 8
    python benchmarks/lowering_time.py --platform here --json lowering.json
    python benchmarks/lowering_time.py --config tiny --slots 4 --platform here --compile

`--compile` compiles each program as well and counts what XLA made of it: instructions, fusions,
copies and calls in the optimised module, and its temporaries (`memory_analysis`). Layers run as
calls of one layer program (`dspark_jax.models.qwen3`), which XLA inlines, so the counts should
be (nearly) those of the layers written out: a call per layer left in, or many more copies,
would say not. `--platform h100` (or h200) compiles with XLA's GPU compiler for that GPU
without one (benchmarks/deviceless.py; needs `pip install "jax[cuda12]"`, no GPU): the compile
times and programs a GPU session would get, and the kernels ptxas had to spill registers for:

    python benchmarks/lowering_time.py --platform h100 --compile --json aot_h100.json
    python benchmarks/lowering_time.py --platform h100 --compile --programs decode_chunk \
        --hlo hlo/    # the optimised program, to read

`--target-layers N` sets the target's depth: the same programs at 18 and 36 layers say how much
of a compile the layers are (XLA compiles each inlined layer call anew). `--penalties` and
`--max-logit-bias N` build the engine as `dspark-jax serve` does with those options: their
conditional sampling is part of the decode program, and of its temporaries.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import time
from pathlib import Path

_LABELS = {"compile_s": "compile s", "temp_mib": "temp MiB"}


def main() -> int:
    from deviceless import GPUS, prepare_logging
    from provenance import Parser, non_negative_int, output_file, positive_int, positive_ints

    # ptxas' spill warnings are informational messages, let through only if asked for before
    # JAX starts (decode_speed imports it).
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--platform")
    if first.parse_known_args()[0].platform in GPUS:
        prepare_logging()
    parser = Parser(description=__doc__.split("\n")[0])
    from decode_speed import CONFIGS

    parser.add_argument(
        "--config",
        default="qwen3-4b",
        choices=sorted(CONFIGS),
        help="target and drafter shapes, as decode_speed.py names them (qwen3-4b)",
    )
    parser.add_argument("--slots", type=positive_int, default=64, help="engine slots (64)")
    parser.add_argument(
        "--max-model-len", type=positive_int, default=512, help="positions per slot (512)"
    )
    parser.add_argument(
        "--prefill-buckets",
        type=positive_ints,
        default=(64, 256),
        help="prefill token buckets (64,256)",
    )
    parser.add_argument(
        "--draft-buckets",
        type=positive_ints,
        help="slot counts the drafter's block runs over, ending at --slots (default: the "
        "engine's, EngineConfig.slot_buckets; e.g. the slot count alone: one drafter branch)",
    )
    parser.add_argument(
        "--token-buckets",
        type=positive_ints,
        help="token counts the packed verification is padded to, one compiled branch each "
        "(default: the engine's, derived from the slots and the policy)",
    )
    parser.add_argument(
        "--target-layers",
        type=positive_int,
        help="the target's depth (default: the config's): how compile time grows with the "
        "layers; the drafter keeps its tap layers where they fit, else they are spaced over "
        "the new depth as for the released drafters",
    )
    parser.add_argument(
        "--penalties",
        action="store_true",
        help="an engine that takes presence, frequency and repetition penalties "
        "(EngineConfig.penalties, `dspark-jax serve --penalties`)",
    )
    parser.add_argument(
        "--max-logit-bias",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="an engine that takes a logit_bias of up to N tokens (EngineConfig.max_logit_bias, "
        "`dspark-jax serve --max-logit-bias`; default 0: none)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--plain", action="store_true", help="no drafter: plain decoding")
    parser.add_argument(
        "--platform",
        default="cuda",
        choices=("cuda", "here", *sorted(GPUS)),
        help="lower for a GPU with the Triton kernels (cuda, the default), for this backend, "
        "or compile for that GPU without one (h100, h200)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --platform here, h100 or h200: compile each program too, and count the "
        "compiled instructions, fusions and copies (what XLA optimised)",
    )
    parser.add_argument(
        "--programs",
        help="comma-separated names of the programs to measure (default: every one; the "
        "names are the table's, e.g. decode_chunk)",
    )
    parser.add_argument(
        "--hlo",
        type=Path,
        help="with --compile: write each program's optimised HLO to HLO/<program>.txt",
    )
    parser.add_argument("--json", type=Path, help="write the table here too")
    args = parser.parse_args()
    if args.compile and args.platform == "cuda":
        parser.error(
            "--compile needs --platform here, h100 or h200 (cuda only lowers: no GPU compiler)"
        )
    if args.draft_buckets and args.plain:
        parser.error("--draft-buckets needs a drafter: drop --plain")
    if args.token_buckets and args.plain:
        parser.error("--token-buckets: plain decoding packs one token per slot (--slots)")
    if args.hlo and not args.compile:
        parser.error("--hlo needs --compile (it writes the compiled programs)")
    if args.json:
        output_file(args.json, "--json")
    return _measure(args, CONFIGS[args.config])


def _deepened(target_cfg, drafter_cfg, layers: int):
    """(target, drafter) configs with a `layers`-deep target: the drafter taps the same number
    of target layers, its own where they all lie before the new final layer, else spaced over it
    as the released drafters' are (`configs.qwen3.spaced_target_layers`). `drafter_cfg` None
    (plain decoding): the target alone, whatever depth."""
    import dataclasses

    from dspark_jax.config import ConfigError
    from dspark_jax.configs.qwen3 import spaced_target_layers
    from dspark_jax.errors import UserError

    target_cfg = dataclasses.replace(target_cfg, num_hidden_layers=layers)
    if drafter_cfg is None:
        return target_cfg, None
    taps = drafter_cfg.target_layer_ids
    if max(taps) > layers - 2:  # the final layer's hidden state is no tap (DrafterConfig)
        try:
            taps = spaced_target_layers(layers, len(taps))
        except ConfigError as err:
            raise UserError(f"--target-layers {layers}: {err}") from None
    drafter_cfg = dataclasses.replace(
        drafter_cfg, target_layer_ids=taps, num_target_layers=layers
    )
    return target_cfg, drafter_cfg


def _measure(args, pair: tuple[str, str]) -> int:
    import dataclasses

    import jax
    from deviceless import GPUS, captured_spills, gpu_devices
    from flax import nnx
    from provenance import git_commit, write_json

    from dspark_jax.configs import get as named_config
    from dspark_jax.decoding.engine import Engine, EngineConfig
    from dspark_jax.errors import UserError
    from dspark_jax.models.drafter import DSparkDrafter
    from dspark_jax.models.qwen3 import Qwen3

    target_name, drafter_name = pair
    prefill_buckets = args.prefill_buckets
    target_cfg = dataclasses.replace(named_config(target_name), dtype=args.dtype)
    drafter_cfg = named_config(drafter_name)
    drafter_cfg = dataclasses.replace(
        drafter_cfg, model=dataclasses.replace(drafter_cfg.model, dtype=args.dtype)
    )
    if args.target_layers:
        target_cfg, drafter_cfg = _deepened(
            target_cfg, None if args.plain else drafter_cfg, args.target_layers
        )
    target = nnx.eval_shape(lambda: Qwen3(target_cfg, rngs=nnx.Rngs(0)))
    drafter = (
        None if args.plain else nnx.eval_shape(lambda: DSparkDrafter(drafter_cfg, rngs=nnx.Rngs(0)))
    )
    platforms = ("cuda",) if args.platform == "cuda" else None
    mesh = None
    if args.platform in GPUS:
        from dspark_jax.sharding import MeshConfig, make_mesh

        mesh = make_mesh(MeshConfig(1, 1, 1), gpu_devices(args.platform))
    cfg = EngineConfig(
        num_slots=args.slots,
        max_model_len=args.max_model_len,
        prefill_chunk=max(prefill_buckets),
        prefill_seqs=8,
        prefill_buckets=prefill_buckets,
        # Plain decoding packs one token per slot: one bucket, as the benchmarks build it.
        token_buckets=(args.slots,) if args.plain else args.token_buckets,
        draft_buckets=args.draft_buckets,
        attention_impl="pallas_gpu" if platforms or mesh is not None else None,
        penalties=args.penalties,
        max_logit_bias=args.max_logit_bias,
    )
    engine = Engine(target, drafter, cfg, mesh=mesh)
    programs = engine.programs()
    if args.programs:
        wanted = [p.strip() for p in args.programs.split(",") if p.strip()]
        unknown = sorted(set(wanted) - set(programs))
        if unknown or not wanted:
            raise UserError(
                f"--programs: no program named {', '.join(unknown) or repr(args.programs)} "
                f"(this engine's: {', '.join(programs)})"
            )
        programs = {name: programs[name] for name in programs if name in wanted}
    if args.hlo:
        args.hlo.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (fn, fn_args) in programs.items():
        with engine.lowering_target(platforms):
            start = time.perf_counter()
            traced = fn.trace(*fn_args)
            traced_at = time.perf_counter()
            lowered = traced.lower(lowering_platforms=platforms)
            lowered_at = time.perf_counter()
        text = lowered.as_text()
        row = dict(
            program=name,
            trace_s=round(traced_at - start, 2),
            lower_s=round(lowered_at - traced_at, 2),
            mlir_mb=round(len(text) / 1e6, 2),
            kernel_calls=len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)),
        )
        if args.compile:
            start = time.perf_counter()
            with captured_spills() as spills:
                compiled = lowered.compile()
            row["compile_s"] = round(time.perf_counter() - start, 2)
            row["temp_mib"] = round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)
            row["spills"] = spills.kernels
            optimised = compiled.as_text()
            if args.hlo:
                (args.hlo / f"{name}.txt").write_text(optimised)
            # Instructions by opcode: `%name = shape opcode(operands)`, in every computation.
            ops = re.findall(r"^\s*(?:ROOT )?%?\S+ = .*? ([a-z][\w-]*)\(", optimised, re.M)
            row.update(
                instructions=len(ops),
                fusions=ops.count("fusion"),
                copies=ops.count("copy"),
                calls=ops.count("call"),
            )
        rows.append(row)
    if mesh is not None:
        kind = mesh.devices.flat[0].device_kind
        where = f"an {kind} without one (XLA's GPU compiler on this machine's CPU)"
    elif platforms:
        where = "a GPU (Triton kernels)"
    else:
        where = f"{jax.default_backend()} (this machine)"
    head = (
        f"{target_name}"
        + (f" ({target_cfg.num_hidden_layers} layers)" if args.target_layers else "")
        + ("" if args.plain else f" + {drafter_name}")
        + f", {args.dtype}, "
        f"{args.slots} slots, token buckets {engine.token_buckets}"
        + (", penalties" if args.penalties else "")
        + (f", logit bias of {args.max_logit_bias}" if args.max_logit_bias else "")
        + (f", drafter slot buckets {engine.draft_buckets}" if engine.draft_buckets else "")
        + ", prefill buckets "
        f"{engine.prefill_widths}; lowered for {where}; commit {git_commit()}, "
        f"{datetime.date.today()}, {platform.node()} ({platform.processor() or 'cpu'})"
    )
    print(head)
    compiled_cols = ("compile_s", "instructions", "fusions", "copies", "calls", "temp_mib")
    print(
        f"{'program':<16}{'trace s':>9}{'lower s':>9}{'MLIR MB':>9}{'Triton':>9}"
        + ("".join(f"{_LABELS.get(c, c):>13}" for c in compiled_cols) if args.compile else "")
    )
    for r in rows:
        print(
            f"{r['program']:<16}{r['trace_s']:9.2f}{r['lower_s']:9.2f}{r['mlir_mb']:9.2f}"
            f"{r['kernel_calls']:9d}"
            + ("".join(f"{r[c]:>13}" for c in compiled_cols) if args.compile else "")
        )
    total = sum(r["trace_s"] + r["lower_s"] for r in rows)
    print(f"total trace + lower: {total:.1f} s")
    if args.compile:
        print(f"total compile: {sum(r['compile_s'] for r in rows):.1f} s")
        spilled = {k: v for r in rows for k, v in r["spills"].items()}
        level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0")
        if mesh is not None and level != "0":  # ptxas' warnings are informational messages
            print(f"register spills: not seen (TF_CPP_MIN_LOG_LEVEL={level} hides them)")
        else:
            print(
                "register spills (ptxas; bytes stored/loaded): "
                + (", ".join(f"{k} {s}/{ld}" for k, (s, ld) in sorted(spilled.items())) or "none")
            )
    if args.json:
        write_json(
            args.json,
            dict(
                setting=head,
                commit=git_commit(),
                date=datetime.date.today().isoformat(),
                rows=rows,
                total_s=round(total, 2),
            ),
        )
    return 0


if __name__ == "__main__":
    from provenance import run_main

    run_main(main)
