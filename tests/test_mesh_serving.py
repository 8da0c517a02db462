"""The OpenAI server over a slot engine sharded on a 1x1x2 mesh answers what one device answers:
greedy completions equal the PyTorch reference's greedy decoding, and a seeded sampled
completion equals the single-device engine's offline generation."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import httpx
import jax
from fixture_models import fixture_dir, reference_traces
from serving_helpers import SMALL_ENGINE

from dspark_jax.checkpoints.converted import load_decoding_models
from dspark_jax.decoding.batching import Request, generate
from dspark_jax.decoding.engine import Engine
from dspark_jax.sampling import SamplingConfig
from dspark_jax.serving.app import HttpLimits, SamplingDefaults, ServedModel
from dspark_jax.serving.http_server import HttpServer, bind_socket, build_app_server
from dspark_jax.sharding import MeshConfig, make_mesh

MODEL = "tiny-vanilla"
SEEDED = dict(temperature=0.9, top_p=0.9, seed=1234, max_tokens=32, ignore_eos=True)
PROMPT = "def parse_args(argv):\n"
# Two slots: four greedy requests queue for them, so slots change hands under the server.
CFG = dataclasses.replace(SMALL_ENGINE, num_slots=2, token_buckets=(16,))


def _complete(url: str, **body) -> list[int]:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "return_token_ids": True, **body},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_server_on_a_mesh_answers_as_one_device():
    root = fixture_dir("vanilla")
    single = load_decoding_models(root / "target", root / "draft", progress=False)
    engine = Engine(single.target, single.drafter, CFG, stop_tokens=single.stop_tokens)
    sampling = SamplingConfig(SEEDED["temperature"], 0, SEEDED["top_p"])
    request = Request(
        list(PROMPT.encode()), SEEDED["max_tokens"], seed=SEEDED["seed"], sampling=sampling,
        ignore_eos=True,
    )  # fmt: skip
    offline_seeded = generate(engine, [request])[0][0].tokens

    mesh = make_mesh(MeshConfig(1, 1, 2), jax.devices()[:2])
    models = load_decoding_models(root / "target", root / "draft", progress=False, mesh=mesh)
    sharded = Engine(models.target, models.drafter, CFG, stop_tokens=models.stop_tokens, mesh=mesh)
    served = ServedModel.of_engine(
        sharded, MODEL, models.tokenizer, SamplingDefaults.from_model_dir(models.model_dir)
    )
    app_server = build_app_server(
        sharded, served, max_waiting=16, limits=HttpLimits(read_timeout_s=5.0)
    )
    server = HttpServer(
        app_server, bind_socket("127.0.0.1", 0), read_timeout_s=5.0, log_level="warning"
    ).start()
    try:
        assert app_server.runner.wait_ready(600), app_server.runner.error
        host, port = server.address
        url = f"http://{host}:{port}"
        programs = sharded.compiled_programs()
        traces = reference_traces("vanilla")["traces"]

        def ask(trace):
            return _complete(url, prompt=trace["prompt"], max_tokens=48, temperature=0)

        with concurrent.futures.ThreadPoolExecutor(len(traces)) as pool:
            answers = list(pool.map(ask, traces))
        for trace, answer in zip(traces, answers, strict=True):
            assert answer == trace["greedy"][:48]
        assert _complete(url, prompt=PROMPT, **SEEDED) == offline_seeded
        assert sharded.compiled_programs() == programs
    finally:
        server.shutdown(60)
