"""`dspark-jax eval`: acceptance length and speedup of a drafter over prompt datasets.

Each dataset is a JSONL file of `{"turns": [...]}` conversations, answered turn by turn by
speculative decoding; plain decoding then runs the same prompts as the baseline. Writes to --out:
eval.json (settings and per-dataset statistics), eval.png (acceptance curves, tau and speedup)
and calibration_records.npz (one record per speculative round, for `dspark-jax calibrate`; none
when no draft was verified, as with --gamma 0: no confidence met an outcome).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from dspark_jax.cli import SPS_AUTO
from dspark_jax.errors import UserError

JSON_NAME = "eval.json"
PLOT_NAME = "eval.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dspark_jax.cli.args import (
        add_engine_arguments,
        add_model_arguments,
        add_sampling_arguments,
    )

    group = parser.add_argument_group("datasets")
    group.add_argument("files", nargs="*", help='JSONL files of {"turns": [...]} lines')
    group.add_argument(
        "--datasets-dir",
        help="every *.jsonl in this folder (e.g. eval_datasets/, fetched as docs/eval-datasets.md "
        "says)",
    )
    group.add_argument(
        "--datasets", nargs="+", metavar="NAME", help="only these datasets (file stems)"
    )
    group.add_argument("--limit", type=int, help="conversations per dataset (default: all)")
    add_model_arguments(parser, allow_no_draft=False)
    add_sampling_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument(
        "--no-plain", action="store_true", help="skip the plain-decoding baseline (no speedup)"
    )
    parser.add_argument(
        "--out", default="eval_results", help="output folder, written atomically (eval_results)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out (the whole folder)"
    )


def _dataset_files(args: argparse.Namespace) -> list[Path]:
    files = [Path(f) for f in args.files]
    for f in files:
        if f.is_dir():
            raise UserError(
                f"{f}: is a folder; give --datasets-dir {f} to evaluate every *.jsonl in it"
            )
    if args.datasets_dir:
        folder = Path(args.datasets_dir)
        if not folder.is_dir():
            raise UserError(f"--datasets-dir {folder}: not a folder")
        found = sorted(folder.glob("*.jsonl"))
        if not found:
            raise UserError(f"--datasets-dir {folder}: holds no *.jsonl files")
        files += found
    if args.datasets:
        unknown = set(args.datasets) - {f.stem for f in files}
        if unknown:
            raise UserError(
                f"--datasets {', '.join(sorted(unknown))} not among "
                f"{', '.join(f.stem for f in files) or 'no files'}"
            )
        files = [f for f in files if f.stem in args.datasets]
    if not files:
        raise UserError("no datasets: give JSONL files or --datasets-dir")
    stems = [f.stem for f in files]
    if len(set(stems)) != len(stems):
        raise UserError(f"two datasets share a name: {', '.join(stems)}")
    return files


def _inputs(args: argparse.Namespace, files: list[Path]) -> list[Path]:
    """What the run reads from disk: --out, which replaces its whole folder, must not hold (or
    be, or lie inside) any of it. The model folders are the local ones only (a hub id is read
    from the hub's cache)."""
    from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET

    inputs = list(files)
    if args.datasets_dir:
        inputs.append(Path(args.datasets_dir))
    for given in (args.sts, args.sps_table):
        if given and given != SPS_AUTO:
            inputs.append(Path(given))
    for model in (args.target or EMBEDDED_TARGET, args.draft or EMBEDDED_DRAFT):
        path = Path(model).expanduser()
        if path.exists():
            inputs.append(path)
    return inputs


def _check_something_fits(args: argparse.Namespace, datasets: dict, engine, tokenizer) -> None:
    """Refuses, before compiling, a run in which every turn would be skipped: a conversation
    whose first turn does not fit the engine is skipped whole, and with all of them skipped
    nothing would be measured (a table of zeros, exit 0)."""
    from dspark_jax.decoding.evaluate import unfit_conversations

    reasons = []
    for name, conversations in datasets.items():
        unfit = unfit_conversations(
            engine,
            tokenizer,
            conversations,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            enable_thinking=args.thinking,
        )
        if len(unfit) < len(conversations):
            return
        reasons.append(f"{name} {unfit[0]}")
    count = sum(len(c) for c in datasets.values())
    # A prompt longer than the context fits with no --max-new-tokens: name every way out.
    fix = "lower --max-new-tokens" + (
        ", use shorter prompts or raise --max-model-len"
        if args.max_model_len is not None
        else " or use shorter prompts"
    )
    raise UserError(
        f"every turn would be skipped, so nothing would be measured: the first turn of each of "
        f"the {count} conversations does not fit (e.g. {reasons[0]}): {fix}"
    )


def run(args: argparse.Namespace) -> int:
    import time

    from dspark_jax.calibration.records import records_from_results
    from dspark_jax.calibration.sts import RECORDS_NAME
    from dspark_jax.checkpoints.converted import check_no_overlap
    from dspark_jax.checkpoints.safetensors_io import atomic_output_dir
    from dspark_jax.cli.args import (
        build_engine,
        check_kv_pages,
        check_policy_arguments,
        check_seed_span,
        check_sizes,
        conversation_seed_offsets,
        engine_config,
        load_models,
        request_positions,
        sampling_from_args,
    )
    from dspark_jax.cli.paths import check_output_folder
    from dspark_jax.cli.report import format_table, plot_reports, speedup_note
    from dspark_jax.cli.run_settings import decoding_settings
    from dspark_jax.conversations import read_turns
    from dspark_jax.decoding.evaluate import evaluate_dataset

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    files = _dataset_files(args)
    # Before the non-empty check: its advice (--overwrite) would delete the inputs.
    check_no_overlap(out, _inputs(args, files), "--out")
    # An empty folder is as good as none; a non-empty one is replaced as a whole.
    replace = args.overwrite or (out.is_dir() and not any(out.iterdir()))
    if out.exists() and not replace:
        raise UserError(
            f"--out {out}: output folder exists and is not empty (use --overwrite to replace it)"
        )
    check_sizes(args)
    check_policy_arguments(args)
    check_output_folder(out, "--out", created=False)
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    datasets = {f.stem: read_turns(f, args.limit) for f in files}
    for conversations in datasets.values():  # each dataset starts again at --seed
        check_seed_span(args.seed, conversation_seed_offsets(conversations))
    sampling = sampling_from_args(args)
    every = [turns for conversations in datasets.values() for turns in conversations]
    models = load_models(args, len(every))
    # The same sizing as generate: what the longest conversation needs (turns that still do not
    # fit the model's context are skipped and counted).
    positions = request_positions(args, models, every)
    cfg = engine_config(args, positions, models.target.cfg.max_position_embeddings, models.mesh)
    check_kv_pages(args, cfg, positions)
    spec = build_engine(models, args, cfg)
    _check_something_fits(args, datasets, spec, models.tokenizer)
    plain = None if args.no_plain else build_engine(models, args, cfg, speculative=False)
    for engine in (spec, plain):  # refused before compiling, not at the first turn
        if engine is not None:
            engine.check_sampling(sampling)
    start = time.perf_counter()
    for engine in (spec, plain):
        if engine is not None:
            engine.warm_up()
    compile_s = time.perf_counter() - start
    print(f"compiled the engines in {compile_s:.1f} s", file=sys.stderr)

    reports, results = [], []
    for name, conversations in datasets.items():
        print(f"{name}: {len(conversations)} conversations", file=sys.stderr)
        report, run_ = evaluate_dataset(
            name,
            conversations,
            spec,
            plain,
            models.tokenizer,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=args.seed,
            enable_thinking=args.thinking,
            progress=True,
            ignore_eos=args.ignore_eos,
            min_tokens=args.min_tokens,
        )
        for reason in report.skipped:
            print(f"{name}: skipped {reason}", file=sys.stderr)
        reports.append(report)
        results += run_.results()

    print(format_table(reports))
    note = speedup_note(reports)
    if note:
        print(note)
    # Records pair each verified draft's confidence with its outcome: without one, calibrate
    # would fit nothing and write an artifact that changes nothing.
    records = no_records = None
    if models.drafter.confidence_head is None:
        no_records = "the drafter has no confidence head, so there is nothing to calibrate"
    elif not any(r.rounds for r in results):
        no_records = "no speculative round ran (every answer ended with its prompt's token)"
    elif not any(r.verified.any() for r in results):
        why = "--gamma 0" if args.gamma == 0 else f"--policy {args.policy}"
        no_records = (
            f"no round verified a draft ({why}), so no confidence met an outcome to fit STS on"
        )
    else:
        records = records_from_results(
            results,
            drafter_fingerprint=models.drafter_fingerprint,
            sampling_temperature=sampling.temperature,
        )
    records_path = None if records is None else out / RECORDS_NAME
    written = [out / JSON_NAME, out / PLOT_NAME] + ([records_path] if records_path else [])
    settings = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **decoding_settings(args, models, cfg, sampling, spec.policy),
        "compile_s": compile_s,
        "limit": args.limit,
        "no_plain": args.no_plain,
        "files": [str(f) for f in files],
        "calibration_records": None if records_path is None else str(records_path),
    }
    body = {"settings": settings, "datasets": {r.name: r.to_json() for r in reports}}
    # The folder is written whole and then renamed into place: a run never leaves another
    # run's files (a stale calibration_records.npz) beside its own, nor half of its own.
    with atomic_output_dir(out, overwrite=replace) as tmp:
        (tmp / JSON_NAME).write_text(json.dumps(body, indent=1, allow_nan=False) + "\n")
        plot_reports(reports, tmp / PLOT_NAME)
        if records is not None:
            records.save(tmp / RECORDS_NAME)
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    if records_path is not None:
        print(
            f"fit STS with: dspark-jax calibrate --records {records_path} --drafter "
            f"{models.drafter_path} --temperature {sampling.temperature:g} --out sts.json",
            file=sys.stderr,
        )
    else:
        print(f"no calibration records: {no_records}", file=sys.stderr)
    return 0
