"""`dspark-jax generate`: speculative (or plain) decoding of text or token-id prompts.

Text prompts are rendered with the target's chat template (raw bytes for the byte-level tiny
models); JSONL `{"turns": [...]}` prompts are answered turn by turn, each answer going into the
next turn's context. One prompt streams its text as chunks of rounds finish; several print each
answer when it is done, with a progress bar on stderr. A summary (tau, decode tokens/s, rounds,
per-position acceptance) goes to stderr, so stdout carries only the generated text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark_jax.errors import UserError

DEFAULT_PROMPT = "Write a Python function that replaces tabs with spaces in a string."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dspark_jax.cli.args import (
        add_engine_arguments,
        add_model_arguments,
        add_sampling_arguments,
    )

    group = parser.add_argument_group("prompts (default: one built-in prompt)")
    group.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    group.add_argument(
        "--prompts-file",
        help='one prompt per line, or JSON lines {"turns": [...]} answered turn by turn',
    )
    group.add_argument(
        "--token-ids",
        action="append",
        default=[],
        metavar="IDS",
        help="a raw prompt of comma- or space-separated token ids (repeatable; no template)",
    )
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--json", metavar="OUT", help="write prompts, outputs and stats here")
    parser.add_argument(
        "--logprobs",
        action="store_true",
        help="record each generated token's log-probability under the target (before "
        "temperature and top-p) in --json",
    )


def _parse_ids(text: str) -> list[int]:
    parts = text.replace(",", " ").split()
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise UserError(f"--token-ids {text!r}: expected integers separated by commas") from None
    if not ids or min(ids) < 0:
        raise UserError(f"--token-ids {text!r}: expected one or more non-negative ids")
    return ids


class _Stream:
    """Prints the text of one answer as tokens arrive, a header between turns."""

    def __init__(self, tokenizer, stop_tokens):
        self.tokenizer, self.stop_tokens, self.out = tokenizer, stop_tokens, sys.stdout
        self.key = None
        self.text = None

    def __call__(self, conversation: int, turn: int, new_tokens: list[int]) -> None:
        from dspark_jax.serving.text_stream import TextStream

        if (conversation, turn) != self.key:
            if self.key is not None:
                self.out.write(f"\n\n--- turn {turn + 1} ---\n")
            self.key = (conversation, turn)
            self.text = TextStream(self.tokenizer, self.stop_tokens)
        delta = self.text.push(new_tokens)
        if delta:
            self.out.write(delta)
            self.out.flush()


def run(args: argparse.Namespace) -> int:
    import time

    from dspark_jax.cli import SPS_AUTO
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
    from dspark_jax.cli.paths import check_not_same_file, check_output_file
    from dspark_jax.cli.report import generation_summary, print_answer, scheduler_note
    from dspark_jax.conversations import read_turns
    from dspark_jax.decoding.batching import Request, generate
    from dspark_jax.decoding.evaluate import answer_conversations
    from dspark_jax.decoding.stats import acceptance_stats
    from dspark_jax.tokenizer import decode_text

    check_sizes(args)
    check_policy_arguments(args)
    if args.logprobs and not args.json:
        raise UserError("--logprobs records them in --json: give --json OUT too")
    if args.json:
        inputs = {
            "--prompts-file": (args.prompts_file, "prompts"),
            "--sts": (args.sts, "STS artifact"),
            "--sps-table": (args.sps_table, "SPS table"),
        }
        for option, (path, what) in inputs.items():
            if path and path != SPS_AUTO:
                consequence = f"the results would replace the {what} read from it"
                check_not_same_file(args.json, "--json", path, option, consequence)
        check_output_file(args.json, "--json")
    sampling = sampling_from_args(args)
    id_prompts = [_parse_ids(t) for t in args.token_ids]
    conversations = [[p] for p in args.prompt]
    if args.prompts_file:
        conversations += read_turns(args.prompts_file, plain_lines=True)
    if id_prompts and conversations:
        raise UserError("give either text prompts (--prompt, --prompts-file) or --token-ids")
    if not id_prompts and not conversations:
        conversations = [[DEFAULT_PROMPT]]
    if id_prompts:
        check_seed_span(args.seed, range(len(id_prompts)))
    else:
        check_seed_span(args.seed, conversation_seed_offsets(conversations))

    models = load_models(
        args, len(id_prompts) or len(conversations), with_drafter=not args.no_draft
    )
    positions = request_positions(args, models, conversations, id_prompts)
    cfg = engine_config(args, positions, models.target.cfg.max_position_embeddings, models.mesh)
    if max(positions) > cfg.max_model_len:
        bound = (
            "--max-model-len"
            if args.max_model_len is not None
            else "the model's context (max_position_embeddings)"
        )
        raise UserError(
            f"the longest prompt with --max-new-tokens {args.max_new_tokens} needs "
            f"{max(positions)} positions (prompt, new tokens and {models.gamma + 1} for "
            f"verification); {bound} is {cfg.max_model_len}: lower --max-new-tokens"
            + (
                ", shorten the prompt or raise --max-model-len"
                if args.max_model_len is not None
                else " or shorten the prompt"
            )
        )
    check_kv_pages(args, cfg, positions)
    engine = build_engine(models, args, cfg)
    engine.check_sampling(sampling)  # a bias outside the vocabulary: refused before compiling
    for i, ids in enumerate(id_prompts):
        try:
            engine.check_request(ids, args.max_new_tokens, args.seed + i)
        except UserError as e:
            raise UserError(f"--token-ids {' '.join(map(str, ids[:8]))}: {e}") from None
    start = time.perf_counter()
    engine.warm_up()
    compile_s = time.perf_counter() - start
    single = len(id_prompts or conversations) == 1
    stream = _Stream(models.tokenizer, models.stop_tokens) if single else None
    records = []

    if id_prompts:
        requests = [
            Request(
                ids,
                args.max_new_tokens,
                seed=args.seed + i,
                sampling=sampling,
                logprobs=args.logprobs,
                ignore_eos=args.ignore_eos,
                min_tokens=args.min_tokens,
            )
            for i, ids in enumerate(id_prompts)
        ]
        results, timing = generate(
            engine,
            requests,
            on_tokens=(lambda i, new: stream(i, 0, new)) if single else None,
            progress=not single,
        )
        for i, (ids, result) in enumerate(zip(id_prompts, results, strict=True)):
            text = decode_text(models.tokenizer, result.tokens, models.stop_tokens)
            if not single:
                print_answer(f"[{i + 1}]", " ".join(map(str, ids)), text)
            records.append({"prompt_ids": ids, "turn": 0, "text": text, **_result_json(result)})
    else:

        def on_turn(t) -> None:
            turns = conversations[t.conversation]
            label = f"[{t.conversation + 1}]" + (f" turn {t.turn + 1}" if len(turns) > 1 else "")
            print_answer(label, turns[t.turn], t.text)

        run_ = answer_conversations(
            engine,
            models.tokenizer,
            conversations,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=args.seed,
            enable_thinking=args.thinking,
            on_tokens=stream,
            on_turn=None if single else on_turn,
            progress=not single,
            logprobs=args.logprobs,
            ignore_eos=args.ignore_eos,
            min_tokens=args.min_tokens,
        )
        results, timing = run_.results(), run_.timing
        for t in run_.turns:
            records.append(
                {
                    "prompt": conversations[t.conversation][t.turn],
                    "conversation": t.conversation,
                    "turn": t.turn,
                    "prompt_ids": list(t.request.prompt_ids),
                    "text": t.text,
                    **_result_json(t.result),
                }
            )
    if single:
        print(flush=True)
    stats = acceptance_stats(results, engine.gamma) if engine.gamma else None
    print("\n".join(generation_summary(results, timing, stats, compile_s)), file=sys.stderr)
    note = scheduler_note(args.policy, args.sps_table, stats)
    if note:
        print(note, file=sys.stderr)
    if args.json:
        _write_json(args, sampling, cfg, models, records, timing, stats, compile_s, engine.policy)
    return 0


def _result_json(result) -> dict:
    return {
        "tokens": result.tokens,
        "finish_reason": result.finish_reason,
        "cached_tokens": result.cached_tokens,
        "tau": result.tau,
        "rounds": result.rounds,
        "verified": result.verified.tolist(),
        "accepted": result.accepted.tolist(),
        "committed": result.committed.tolist(),
        **({} if result.logprobs is None else {"logprobs": result.logprobs}),
    }


def _write_json(args, sampling, cfg, models, records, timing, stats, compile_s, policy) -> None:
    from dspark_jax.cli.run_settings import decoding_settings

    out = {
        "settings": {
            **decoding_settings(args, models, cfg, sampling, policy),
            "logprobs": args.logprobs,
        },
        "timing": {
            "compile_s": compile_s,
            "prefill_s": timing.prefill_s,
            "decode_s": timing.decode_s,
            "decoded_tokens": timing.decoded_tokens,
            "device_rounds": timing.rounds,
            "decode_tokens_per_s": timing.decode_rate,  # null: no decode round ran
        },
        "acceptance": None if stats is None else stats.to_json(),
        "results": records,
    }
    from dspark_jax.cli.paths import atomic_file

    path = Path(args.json)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")
    print(f"wrote {path}", file=sys.stderr)
