"""`dspark-jax serve`: an HTTP server for batched speculative generation (`dspark_jax.serving`)."""

from __future__ import annotations

import argparse

from dspark_jax.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", help="target folder or hub id (default: the embedded tiny model)"
    )
    parser.add_argument(
        "--draft",
        help="drafter folder or hub id (default: the embedded tiny drafter when "
        "--target is not given either; without it a --target serves plain decoding only)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    parser.add_argument("--batch-size", type=int, default=8, help="most requests per batch")
    parser.add_argument(
        "--max-len",
        type=int,
        default=2048,
        help="cache positions per request: prompt + new tokens + block + 1",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=512,
        help="most new tokens a request may ask for (and the default)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="cast parameters and compute in this dtype (default: as stored)",
    )
    parser.add_argument(
        "--max-wait-ms",
        type=float,
        default=5.0,
        help="how long a batch waits for more requests after its first",
    )
    parser.add_argument(
        "--max-engines",
        type=int,
        default=4,
        help="engines (one per sampling config) kept compiled, least recently used dropped first",
    )
    parser.add_argument(
        "--rounds-per-chunk", type=int, default=8, help="decode rounds between streamed chunks"
    )


def run(args: argparse.Namespace) -> int:
    import logging

    from dspark_jax.checkpoints.converted import load_decoding_models
    from dspark_jax.decoding.engine import EngineConfig, power_of_two_buckets
    from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET
    from dspark_jax.serving.server import DSparkServer, ServerConfig, log

    # An imported library already configured the root logger, so the access log gets its own.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    cfg = ServerConfig(
        batch_size=args.batch_size,
        max_wait_s=args.max_wait_ms / 1000.0,
        max_engines=args.max_engines,
        engine=EngineConfig(
            max_len=args.max_len,
            max_new_tokens=args.max_new_tokens,
            batch_buckets=power_of_two_buckets(args.batch_size),
            rounds_per_chunk=args.rounds_per_chunk,
        ),
    )
    target, draft = args.target, args.draft
    if target is None and draft is None:
        target, draft = EMBEDDED_TARGET, EMBEDDED_DRAFT
    if target is None:
        raise UserError("a drafter needs its target: give --target too")
    model = load_decoding_models(target, draft, args.dtype)
    server = DSparkServer(model, cfg, args.host, args.port)
    host, port = server.address
    mode = "speculative" if model.drafter is not None else "plain decoding only"
    print(
        f"serving {target} ({mode}) on http://{host}:{port}  (Ctrl-C stops)",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("shutting down: finishing the running batch", flush=True)
    finally:
        server.shutdown()
    return 0
