"""Markov heads (vanilla, gated, RNN) against an independent NumPy recurrence, RoPE config forms,
and a DFlash (rank-0, no confidence head) checkpoint running through the same code."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixture_models import fixture_dir, load_pair, max_rel_err, reference_traces
from flax import nnx

from dspark_jax.checkpoints.converted import load_drafter
from dspark_jax.checkpoints.safetensors_io import (
    CheckpointError,
    SafetensorsFolder,
    save_safetensors,
)
from dspark_jax.config import DrafterConfig, RopeConfig, read_config_json
from dspark_jax.decoding.batching import Request, generate
from dspark_jax.decoding.engine import Engine, EngineConfig
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.sampling import SamplingConfig

HEADS = ("vanilla", "gated", "rnn")


def _drafter(kind: str) -> DSparkDrafter:
    base = DrafterConfig.from_hf(read_config_json(fixture_dir("vanilla") / "draft"))
    cfg = dataclasses.replace(base, markov_head_type=kind)
    model = DSparkDrafter(cfg, rngs=nnx.Rngs(7))
    # Scale the head up from its 0.02 init so the bias visibly changes the argmax.
    _, state = nnx.split(model)
    state = jax.tree.map(lambda x: x * 40.0, state)
    nnx.update(model, state)
    return model


def _numpy_bias(kind, head, prev, h, s):
    """One transition written plainly from the paper / DeepSpec definitions."""
    w1 = np.asarray(head.markov_w1.embedding[...], np.float64)
    w2 = np.asarray(head.markov_w2.embedding[...], np.float64)
    e = w1[prev]
    if kind == "vanilla":
        u = e
    elif kind == "gated":
        k, b = (
            np.asarray(p[...], np.float64) for p in (head.gate_proj.kernel, head.gate_proj.bias)
        )
        u = 1 / (1 + np.exp(-(np.concatenate([h, e]) @ k + b))) * e
    else:
        k, b = (
            np.asarray(p[...], np.float64) for p in (head.joint_proj.kernel, head.joint_proj.bias)
        )
        gate, cand, out = np.split(np.concatenate([s, e, h]) @ k + b, 3)
        g = 1 / (1 + np.exp(-gate))
        s = g * s + (1 - g) * np.tanh(cand)
        u = np.tanh(out)
    return u @ w2.T, s


@pytest.mark.parametrize("kind", HEADS)
def test_greedy_block_matches_numpy_recurrence(kind):
    model = _drafter(kind)
    rng = np.random.default_rng(0)
    h_bkd = jnp.asarray(rng.normal(size=(2, 7, 96)), jnp.float32)
    anchor_b = jnp.array([65, 10], jnp.int32)
    keys_bk = jax.random.split(jax.random.key(0), 14).reshape(2, 7)
    block = model.sample_block(h_bkd, anchor_b, keys_bk, SamplingConfig())
    base = np.asarray(model.base_logits(h_bkd), np.float64)
    for b in range(2):
        prev, s = int(anchor_b[b]), np.zeros(model.cfg.markov_rank)
        for k in range(7):
            bias, s = _numpy_bias(kind, model.markov_head, prev, np.asarray(h_bkd[b, k]), s)
            logits = base[b, k] + bias
            assert max_rel_err(block.logits_bkv[b, k], logits) < 1e-5
            assert int(block.tokens_bk[b, k]) == int(np.argmax(logits))
            prev = int(np.argmax(logits))
    assert len(set(np.asarray(block.tokens_bk).ravel().tolist())) > 2, "bias should matter"


@pytest.mark.parametrize("kind", HEADS)
def test_teacher_forcing_reproduces_the_sampling_scan(kind):
    """Feeding the sampled tokens back as ground truth gives the scan's logits and confidences."""
    model = _drafter(kind)
    h_bkd = jnp.asarray(np.random.default_rng(1).normal(size=(3, 7, 96)), jnp.float32)
    anchor_b = jnp.array([1, 2, 3], jnp.int32)
    keys_bk = jax.random.split(jax.random.key(1), 21).reshape(3, 7)
    block = model.sample_block(h_bkd, anchor_b, keys_bk, SamplingConfig(temperature=1.0))
    prev_bk = jnp.concatenate([anchor_b[:, None], block.tokens_bk[:, :-1]], axis=1)
    logits, conf = model.teacher_forced(h_bkd, prev_bk)
    assert max_rel_err(logits, block.logits_bkv) < 1e-6
    assert max_rel_err(conf, block.conf_logits_bk) < 1e-6


def test_legacy_rope_fields_parse_like_rope_parameters():
    new = {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        }
    }
    old = {
        "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    assert RopeConfig.from_hf(old) == RopeConfig.from_hf(new)
    assert RopeConfig.from_hf({"rope_theta": 5e5}) == RopeConfig(theta=5e5)
    assert RopeConfig.from_hf(new).attention_scaling() == pytest.approx(0.1 * np.log(4.0) + 1)


def _write_dflash(tmp_path, extra_keys=()):
    """The vanilla fixture drafter stripped to a DFlash checkpoint (rank 0, no confidence)."""
    src = fixture_dir("vanilla") / "draft"
    cfg = read_config_json(src)
    cfg.update(markov_rank=0, enable_confidence_head=False)
    del cfg["markov_head_type"], cfg["confidence_head_with_markov"]
    folder = SafetensorsFolder(src)
    keep = [
        k
        for k in folder.keys()
        if not k.startswith(("markov_head.", "confidence_head.")) or k in extra_keys
    ]
    out = tmp_path / "dflash"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    save_safetensors({k: folder.get(k) for k in keep}, out / "model.safetensors")
    return out


def test_dflash_checkpoint_loads_and_decodes_losslessly(tmp_path):
    cfg, drafter, _ = load_drafter(_write_dflash(tmp_path), progress=False)
    assert (cfg.markov_rank, cfg.enable_confidence_head) == (0, False)
    assert drafter.markov_head is None and drafter.confidence_head is None
    target, _ = load_pair("vanilla")
    trace = reference_traces("vanilla")["traces"][0]
    engine_cfg = EngineConfig(
        num_slots=1, max_model_len=128, prefill_chunk=64, prefill_buckets=(64,), token_buckets=(8,)
    )
    request = [Request(trace["prompt"], max_new_tokens=64)]
    spec, _ = generate(Engine(target, drafter, engine_cfg), request)
    assert spec[0].tokens == trace["greedy"][:64]
    assert spec[0].tau > 1.0


def test_dflash_config_with_leftover_markov_weights_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="unexpected keys.*markov_head.markov_w1.weight"):
        load_drafter(
            _write_dflash(tmp_path, extra_keys=("markov_head.markov_w1.weight",)), progress=False
        )


def test_the_sampling_scan_takes_its_logits_without_a_transposed_copy():
    """The lm head runs over the block positions in the scan's order, so no [B, K, V] array of
    draft logits is transposed for the scan (a float32 copy of every draft logit, 272 MB a round
    at 64 slots, gamma 7 and Qwen3's vocabulary)."""
    model = _drafter("gated")
    vocab = model.cfg.model.vocab_size
    h_bkd = jnp.zeros((3, 7, 96), jnp.float32)
    keys_bk = jax.random.split(jax.random.key(0), 21).reshape(3, 7)
    jaxpr = jax.make_jaxpr(lambda h: model.sample_block(h, jnp.zeros(3, jnp.int32), keys_bk,
                                                        SamplingConfig(temperature=1.0)))(h_bkd)
    moved = [
        e.invars[0].aval.shape
        for e in jaxpr.jaxpr.eqns
        if e.primitive.name == "transpose" and e.invars[0].aval.shape[-1] == vocab
    ]
    # What it returns is swapped back to [B, K, V] (two transposes of [K, B, V]), which XLA
    # fuses into the verifier's gathers; the [B, K, V] logits are never swapped the other way.
    assert (3, 7, vocab) not in moved and moved, moved


def test_a_draft_position_looks_up_the_previous_token_with_one_gather():
    """Inside the sampling scan the Markov head's lookup of the token drawn before is a gather
    and nothing else: jnp.take's default mode wraps negative ids and fills out-of-range rows with
    NaN (a compare, a select and a clamp around the gather, each a kernel on a GPU at every draft
    position). Sampled ids are in range, and an id past the table reads its last row."""
    from jax.extend.core import ClosedJaxpr

    model = _drafter("vanilla")
    keys_bk = jax.random.split(jax.random.key(0), 14).reshape(2, 7)
    jaxpr = jax.make_jaxpr(lambda h: model.sample_block(h, jnp.zeros(2, jnp.int32), keys_bk,
                                                        SamplingConfig()))(jnp.zeros((2, 7, 96)))
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    body = scan.params["jaxpr"]
    body = body.jaxpr if isinstance(body, ClosedJaxpr) else body
    takes = [e.params["jaxpr"].jaxpr for e in body.eqns
             if e.primitive.name in ("jit", "pjit") and e.params["name"] == "_take"]  # fmt: skip
    assert len(takes) == 1, [e.primitive.name for e in body.eqns]
    ops = [e.primitive.name for e in takes[0].eqns]
    assert ops == ["broadcast_in_dim", "gather"], ops
    assert takes[0].eqns[-1].params["mode"] == jax.lax.GatherScatterMode.CLIP
    table = model.markov_head.markov_w1
    np.testing.assert_array_equal(table(jnp.array([10**6]), jnp.float32),
                                  table.embedding[...][-1:])  # fmt: skip


@pytest.mark.parametrize("kind", HEADS)
def test_the_written_out_positions_sample_what_the_loop_samples(kind):
    """`sample_block(unroll=True)` (a GPU's default) draws bitwise the tokens, logits,
    log-probabilities and confidences of the loop over positions, greedy, temperature and
    filtering rows in one batch; the loop is the CPU's default and a GPU's is written out."""
    from dspark_jax.decoding.engine import absent_gpu_target
    from dspark_jax.sampling import RowSampling

    model = _drafter(kind)
    rng = np.random.default_rng(3)
    rows = 6
    h_bkd = jnp.asarray(rng.normal(size=(rows, 7, 96)), jnp.float32)
    anchor_b = jnp.asarray(rng.integers(0, 200, rows), jnp.int32)
    keys_bk = jax.random.split(jax.random.key(4), rows * 7).reshape(rows, 7)
    settings = RowSampling(
        temperature=jnp.array([0.0, 1.0, 0.7, 1.3, 0.0, 1.0], jnp.float32),
        top_k=jnp.array([0, 0, 20, 0, 5, 3], jnp.int32),
        top_p=jnp.array([1.0, 1.0, 1.0, 0.8, 0.9, 0.95], jnp.float32),
        min_p=jnp.array([0.0, 0.1, 0.0, 0.05, 0.5, 0.0], jnp.float32),
    )
    graphdef, state = nnx.split(model)

    def draw(unroll):
        def run(state, h_bkd):
            return nnx.merge(graphdef, state).sample_block(h_bkd, anchor_b, keys_bk, settings,
                                                           unroll)  # fmt: skip

        return jax.jit(run)(state, h_bkd)

    looped, written = draw(False), draw(True)
    for name in ("tokens_bk", "logits_bkv", "logprobs_bkv", "conf_logits_bk"):
        np.testing.assert_array_equal(getattr(written, name), getattr(looped, name), err_msg=name)
    assert len(set(np.asarray(looped.tokens_bk).ravel().tolist())) > 3

    def unrolled(platform_gpu):
        trace = jax.make_jaxpr(lambda h: model.sample_block(h, anchor_b, keys_bk, settings))
        if platform_gpu:
            with absent_gpu_target(("cuda",), "NVIDIA H100"):
                jaxpr = trace(h_bkd)
        else:
            jaxpr = trace(h_bkd)
        (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        return scan.params["unroll"]

    assert unrolled(False) == 1 and unrolled(True) == 7
