"""`dspark-jax serve`: the OpenAI-compatible server on the slot engine.

Every setting is checked before anything heavy happens, in this order, each failure one line:
numbers and files first, then the listening socket (a port in use), then the models, the engine
(its shapes against the model) and the memory its KV pool will take. The server listens at
once; `/health` answers 503 while warm-up compiles every program and 200 once nothing is left
to compile. SIGTERM or Ctrl-C drains (see `http_server`) and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
from pathlib import Path

from dspark_jax.cli import SPS_AUTO
from dspark_jax.errors import UserError
from dspark_jax.serving.chat_output import REASONING_PARSERS, TOOL_CALL_PARSERS

DEFAULT_MAX_MODEL_LEN = 2048
# Where the API key is read from when --api-key is not given: an environment variable keeps it
# out of the process list and the shell history.
API_KEY_ENV = "DSPARK_JAX_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dspark_jax.cli.args import add_mesh_argument, add_policy_arguments

    models = parser.add_argument_group("models")
    models.add_argument(
        "--target", help="target folder or hub id (default: the embedded dspark-jax-default model)"
    )
    models.add_argument(
        "--draft",
        help="drafter folder or hub id (default: the embedded dspark-jax-default drafter when "
        "--target is not given either; a --target without --draft serves plain decoding)",
    )
    models.add_argument(
        "--no-draft", action="store_true", help="plain decoding with the target alone"
    )
    models.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="parameter / compute dtype (default: as stored)",
    )
    models.add_argument(
        "--served-model-name",
        help="the model id clients send and /v1/models lists (default: the target folder name; "
        "dspark-jax-default for the embedded pair)",
    )
    add_mesh_argument(models)
    models.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="return a chat answer's think block apart, as message.reasoning (vLLM's name); "
        "qwen3: the text between <think> and </think> (default: none, the markers stay in the "
        "content)",
    )
    models.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="let chat requests offer tools (tool_choice auto) and return the model's calls as "
        "message.tool_calls; hermes: Qwen3's <tool_call> JSON blocks; the model's chat template "
        "must render tools (default: none, requests with tools need tool_choice none)",
    )
    add_policy_arguments(parser)

    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--max-num-seqs", type=int, default=8, help="slots: requests decoded at once (default 8)"
    )
    engine.add_argument(
        "--max-model-len",
        type=int,
        help=f"most tokens per request, prompt + answer, as /v1/models advertises it (default: "
        f"{DEFAULT_MAX_MODEL_LEN}, or what the model's context leaves after one verification "
        "block)",
    )
    engine.add_argument(
        "--kv-pages",
        type=int,
        help="KV pages shared by all slots (default: every slot at --max-model-len)",
    )
    engine.add_argument("--page-size", type=int, default=16, help="tokens per KV page (16)")
    engine.add_argument(
        "--rounds-per-chunk",
        type=int,
        default=8,
        help="decode rounds between two host reads: fewer stream sooner, more keep the device "
        "busier (default 8)",
    )
    engine.add_argument(
        "--prefill-chunk", type=int, default=256, help="most prompt tokens per prefill call (256)"
    )
    engine.add_argument(
        "--prefill-buckets",
        help="comma-separated prefill widths (default: 16, 32, ... up to --prefill-chunk)",
    )
    engine.add_argument(
        "--token-buckets",
        help="comma-separated verification token buckets (default: derived from the slots and "
        "block size; an SPS table brings its own)",
    )
    engine.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the full KV pages of prompts and their answers for later requests that "
        "start with the same tokens (a shared system prompt, earlier turns of a chat), which "
        "then prefill only the rest; idle cached pages are evicted as the pool needs them "
        "(default: on)",
    )
    engine.add_argument(
        "--penalties",
        action="store_true",
        help="take requests' presence_penalty, frequency_penalty and repetition_penalty: the "
        "engine counts each slot's generated tokens (slots x vocabulary int32) and marks its "
        "prompt's (slots x vocabulary bool), and its decode program holds a penalised sampling "
        "too, run only in rounds where a live request has a penalty (off: penalties are a 400; "
        "on by itself when the model's generation_config.json sets a repetition_penalty)",
    )
    engine.add_argument(
        "--max-logit-bias",
        type=int,
        default=0,
        metavar="N",
        help="take requests' logit_bias of up to N tokens (and vLLM's allowed_token_ids, up to "
        "N): each slot holds N token ids and biases, added to its logits in a sampling branch "
        "run only in rounds where a live request has one (default 0: either is a 400)",
    )
    engine.add_argument(
        "--draft-buckets",
        help="comma-separated slot counts the drafter runs over, live slots first (default: "
        "doublings from an eighth of --max-num-seqs, at least 4, up to it; --max-num-seqs alone "
        "drafts every slot, live or not)",
    )

    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    http.add_argument(
        "--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)"
    )
    http.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests waiting for a busy slot before new ones get 503, each choice of a "
        "request with n > 1 counting as one (default 256)",
    )
    http.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="the order in which waiting requests get a slot: fcfs, first come first served "
        "(a request's priority other than 0 is a 400), or priority, by the requests' priority "
        "field (lower first, then first come; a running request is never preempted). vLLM's "
        "(default fcfs)",
    )
    http.add_argument(
        "--max-connections",
        type=int,
        default=2048,
        help="open connections before new requests get 503 (/health and /metrics still answer; "
        "default 2048)",
    )
    http.add_argument(
        "--api-key",
        help="require the header 'Authorization: Bearer KEY' (an OpenAI client's api_key) on "
        "every endpoint but /health and /metrics; others get 401 (default: "
        f"${API_KEY_ENV}, which keeps the key out of the process list; unset or empty: no key)",
    )
    http.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a request head, and then its body, may take to arrive (default 30)",
    )
    http.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM / Ctrl-C, seconds running requests get to finish before the server "
        "aborts them, each with a whole answer (default 30)",
    )
    http.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="log level; info includes one access-log line per request (default info)",
    )


def _buckets(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(p) for p in text.replace(",", " ").split())
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise UserError(f"{flag} {text!r}: expected one or more positive integers")
    return values


def api_key(args: argparse.Namespace) -> str | None:
    """The key requests must carry: --api-key, else $DSPARK_JAX_API_KEY; None: no key (an empty
    variable is unset). An empty --api-key is refused: it would let every request in."""
    if args.api_key is not None:
        key, source = args.api_key, "--api-key"
        if not key.strip():
            raise UserError(
                f"--api-key is empty; give a key, or leave it out (and ${API_KEY_ENV} unset) "
                "to serve without one"
            )
    else:
        key, source = os.environ.get(API_KEY_ENV) or None, f"${API_KEY_ENV}"
    # A header value carries printable ASCII; spaces at either end would never arrive.
    if key is not None and not (key.isascii() and key.isprintable() and key == key.strip()):
        raise UserError(
            f"{source} must be printable ASCII without spaces at either end (it travels as the "
            "HTTP header 'Authorization: Bearer KEY')"
        )
    return key


def check_arguments(args: argparse.Namespace) -> None:
    """Refuses out-of-range numbers and missing files before anything is loaded."""
    api_key(args)
    positive = {
        "--max-num-seqs": args.max_num_seqs,
        "--max-model-len": args.max_model_len,
        "--kv-pages": args.kv_pages,
        "--page-size": args.page_size,
        "--rounds-per-chunk": args.rounds_per_chunk,
        "--prefill-chunk": args.prefill_chunk,
        "--max-waiting": args.max_waiting,
        "--max-connections": args.max_connections,
    }
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    # Engine arrays are int32 and per-chunk outputs grow with rounds x slots: bound the knobs
    # far above any useful value, below what would overflow or exhaust the host.
    limits = {"--max-num-seqs": 65536, "--rounds-per-chunk": 4096, "--page-size": 65536}
    for flag, top in limits.items():
        value = positive[flag]
        if value > top:
            raise UserError(f"{flag} must be <= {top}, got {value}")
    from dspark_jax.serving.protocol import MAX_LOGIT_BIAS  # what one request body may carry

    if not 0 <= args.max_logit_bias <= MAX_LOGIT_BIAS:
        raise UserError(
            f"--max-logit-bias must be in 0..{MAX_LOGIT_BIAS} (0: no logit_bias), got "
            f"{args.max_logit_bias}"
        )
    if not (math.isfinite(args.read_timeout) and args.read_timeout > 0):
        raise UserError(f"--read-timeout must be > 0 seconds, got {args.read_timeout}")
    if not (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0):
        raise UserError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    sps_table = None if args.sps_table == SPS_AUTO else args.sps_table
    for flag, path in (("--sps-table", sps_table), ("--sts", args.sts)):
        if path is not None and not Path(path).is_file():
            raise UserError(f"{flag} {path}: no such file")
    if args.draft is not None and args.no_draft:
        raise UserError("--draft and --no-draft contradict each other")
    if args.draft is not None and args.target is None:
        raise UserError("a drafter needs its target: give --target too")
    speculation_only = {
        "--policy": args.policy != "fixed",
        "--gamma": args.gamma is not None,
        "--threshold": args.threshold is not None,
        "--sps-table": args.sps_table is not None,
        "--sts": args.sts is not None,
        "--draft-buckets": args.draft_buckets is not None,
    }
    given = [flag for flag, set_ in speculation_only.items() if set_]
    plain = args.no_draft or (args.target is not None and args.draft is None)
    if plain and given:
        verb = "needs" if len(given) == 1 else "need"
        raise UserError(f"{', '.join(given)} {verb} a drafter; this server decodes plainly")
    _buckets(args.prefill_buckets, "--prefill-buckets")
    _buckets(args.token_buckets, "--token-buckets")
    draft_buckets = _buckets(args.draft_buckets, "--draft-buckets")
    if draft_buckets is not None and max(draft_buckets) != args.max_num_seqs:
        raise UserError(
            f"--draft-buckets {args.draft_buckets!r} must end at --max-num-seqs "
            f"{args.max_num_seqs}: each is a number of slots the drafter runs over"
        )


def _model_paths(args: argparse.Namespace):
    from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_NAME, EMBEDDED_TARGET

    if args.target is None:
        target, draft = EMBEDDED_TARGET, EMBEDDED_DRAFT
        name = EMBEDDED_NAME
    else:
        target, draft = args.target, args.draft
        name = Path(str(args.target).rstrip("/")).name or str(args.target)
    # The served name, and the model it names (as /v1/models' root reports it).
    root = EMBEDDED_NAME if args.target is None else str(args.target)
    return target, (None if args.no_draft else draft), args.served_model_name or name, root


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    from dspark_jax.serving.http_server import bind_socket

    # Bound before loading, so a port in use fails in a second rather than after the models.
    sock = bind_socket(args.host, args.port)
    try:
        with _server_logging(args.log_level):
            return _serve(args, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock) -> int:
    from dspark_jax.checkpoints.converted import load_decoding_models
    from dspark_jax.cli.args import (
        check_mesh_slots,
        decoding_mesh_for,
        served_slots_advice,
        speculative_parts,
    )
    from dspark_jax.decoding.engine import EngineConfig, block_positions, format_bytes
    from dspark_jax.serving.app import HttpLimits, SamplingDefaults, ServedModel
    from dspark_jax.serving.http_server import HttpServer, build_app_server
    from dspark_jax.serving.metrics import watch_compilations
    from dspark_jax.sharding import describe_mesh
    from dspark_jax.tokenizer import renders_tools

    # dspark:jax_compilations_total counts the process's compilations from here on, loading's
    # included, not only those after the metrics exist.
    watch_compilations()
    target, draft, name, root = _model_paths(args)
    mesh = decoding_mesh_for(args, target, draft)
    check_mesh_slots(args.max_num_seqs, mesh)
    models = load_decoding_models(target, draft, dtype=args.dtype, progress=False, mesh=mesh)
    if args.tool_call_parser is not None and not renders_tools(models.tokenizer):
        raise UserError(
            f"--tool-call-parser {args.tool_call_parser}: the chat template of {name} does not "
            "render tools, so the model would never see them"
        )
    context = models.target.cfg.max_position_embeddings
    # The engine keeps one verification block beyond each request's last token: it gets those
    # positions on top, so a request may use all of --max-model-len for prompt + answer.
    block = block_positions(models.gamma)
    max_model_len = args.max_model_len or min(DEFAULT_MAX_MODEL_LEN, context - block)
    if max_model_len + block > context:
        raise UserError(
            f"--max-model-len {max_model_len} plus one verification block ({block} positions) "
            f"exceeds the model's context (max_position_embeddings {context}); use at most "
            f"{context - block}"
        )
    defaults = SamplingDefaults.from_model_dir(models.model_dir)
    penalties = args.penalties
    if defaults.repetition_penalty != 1.0 and not penalties:
        # The model's own default applies to every request that leaves the field out, as vLLM
        # applies it: the engine needs the penalties for it.
        penalties = True
        print(
            f"{name}'s generation_config.json sets repetition_penalty "
            f"{defaults.repetition_penalty:g}: --penalties turned on",
            flush=True,
        )
    cfg = EngineConfig(
        num_slots=args.max_num_seqs,
        max_model_len=max_model_len + block,
        page_size=args.page_size,
        num_pages=args.kv_pages,
        rounds_per_chunk=args.rounds_per_chunk,
        prefill_chunk=args.prefill_chunk,
        prefill_buckets=_buckets(args.prefill_buckets, "--prefill-buckets"),
        token_buckets=_buckets(args.token_buckets, "--token-buckets"),
        draft_buckets=_buckets(args.draft_buckets, "--draft-buckets"),
        penalties=penalties,
        max_logit_bias=args.max_logit_bias,
    )
    if cfg.pool_pages < cfg.pages_per_slot:
        raise UserError(
            f"--kv-pages {cfg.pool_pages} cannot hold one request of --max-model-len "
            f"{max_model_len} ({cfg.pages_per_slot} pages of {cfg.page_size} tokens)"
        )
    policy = sts = None
    if models.drafter is not None:
        policy, sts = speculative_parts(args, models, cfg, None, served_slots_advice)
    engine = models.engine(cfg, policy=policy, sts=sts)
    kv_bytes = engine.state_bytes
    model = ServedModel.of_engine(
        engine,
        name,
        models.tokenizer,
        defaults,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        root=root,
    )
    key = api_key(args)
    app_server = build_app_server(
        engine,
        model,
        max_waiting=args.max_waiting,
        limits=HttpLimits(read_timeout_s=args.read_timeout),
        prefix_caching=args.prefix_caching,
        priority_scheduling=args.scheduling_policy == "priority",
    )
    server = HttpServer(
        app_server,
        sock,
        read_timeout_s=args.read_timeout,
        drain_timeout_s=args.drain_timeout,
        max_connections=args.max_connections,
        log_level=args.log_level,
        api_key=key,
    )
    host, port = server.address
    mode = (
        f"speculative, block {engine.gamma}, policy {args.policy}"
        if models.drafter is not None
        else "plain decoding"
    )
    parsers = "".join(
        f"; {what} parser {parser}"
        for what, parser in (
            ("reasoning", args.reasoning_parser),
            ("tool-call", args.tool_call_parser),
        )
        if parser is not None
    )
    print(
        f"serving {name} ({mode}; {cfg.num_slots} slots x {max_model_len} tokens, KV "
        f"{format_bytes(kv_bytes)}{'' if mesh is None else ' per device'}; "
        f"{describe_mesh(mesh)}; prefix caching {'on' if args.prefix_caching else 'off'}"
        f"{'; priority scheduling' if args.scheduling_policy == 'priority' else ''}"
        f"{parsers}) on "
        f"http://{host}:{port}/v1{' (API key required)' if key else ''} -- warming up, /health "
        "turns 200 when ready; SIGTERM or Ctrl-C drains and stops",
        flush=True,
    )
    status = server.serve()
    if app_server.runner.alive:
        # Warm-up cannot be interrupted mid-compilation; leaving the interpreter while XLA runs
        # on another thread can crash in teardown, so end the process here.
        print("stopped during warm-up", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    print("stopped", flush=True)
    return status


@contextlib.contextmanager
def _server_logging(level: str):
    """The server's log lines on stderr at `level` while it runs, and the logger as it was
    afterwards: a second `serve` in the same process (a notebook's, a test's) neither prints
    each line twice nor writes to the stream the first one had (closed by then, perhaps)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger = logging.getLogger("dspark_jax.serving")
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
