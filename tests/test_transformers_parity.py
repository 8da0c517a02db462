"""Parity with transformers' own Qwen3ForCausalLM built from tiny random configs (no downloads)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from fixture_models import max_rel_err
from flax import nnx
from transformers import Qwen3Config as HFQwen3Config
from transformers import Qwen3ForCausalLM

from dspark_jax.checkpoints.convert import DictSource, target_from_torch
from dspark_jax.config import Qwen3Config
from dspark_jax.models import paged
from dspark_jax.models.paged import TokenBatch

TOL = 1e-5

CASES = {
    "tied-gqa": dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2),
    "untied-gqa": dict(tie_word_embeddings=False, num_attention_heads=6, num_key_value_heads=2),
    "untied-mha": dict(tie_word_embeddings=False, num_attention_heads=4, num_key_value_heads=4),
    "yarn": dict(
        tie_word_embeddings=False,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}


def _hf_model(case: str):
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(CASES[case])
    hf_cfg = HFQwen3Config(**kwargs)
    model = Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random init leaves norms at 1; perturb them so they are tested too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf_cfg, model


def _ours(hf_cfg, model):
    cfg = Qwen3Config.from_hf(hf_cfg.to_dict() | {"dtype": "float32"})
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return target_from_torch(cfg, DictSource(tensors))


@functools.partial(nnx.jit, static_argnums=(1,))
def _packed_forward(model, width, tokens_t, counts_s, starts_s, cache):
    # One program per width: run eagerly, the forward compiled each of its hundreds of small
    # operations once per new shape (700 compilations in one test).
    batch = TokenBatch.per_slot(starts_s, counts_s, width)
    out = model.paged_forward(tokens_t, batch, cache)
    return model.logits(out.hidden), paged.write(cache, out.kv, batch)


@nnx.jit
def _full_logits(model, ids_bt):
    return model.logits(model(ids_bt).hidden)


def _packed(model, cache, chunks, starts):
    """Runs slot b's tokens `chunks[b]` at positions starts[b].. in one packed forward; returns
    each slot's logits rows and the updated cache."""
    counts = np.array([len(c) for c in chunks])
    logits, cache = _packed_forward(
        model,
        int(counts.sum()),
        jnp.asarray(np.concatenate(chunks), jnp.int32),
        jnp.asarray(counts, jnp.int32),
        jnp.asarray(starts, jnp.int32),
        cache,
    )
    return np.split(np.asarray(logits), np.cumsum(counts)[:-1]), cache


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_hidden_states_match(case):
    hf_cfg, model = _hf_model(case)
    ours = _ours(hf_cfg, model)
    ids = np.random.default_rng(0).integers(0, hf_cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ref = model(torch.tensor(ids), output_hidden_states=True)
    out = ours(jnp.asarray(ids, jnp.int32), tap_layer_ids=(-1, 0, 1))
    assert max_rel_err(ours.logits(out.hidden), ref.logits.numpy()) < TOL
    taps = np.split(np.asarray(out.taps), 3, axis=-1)
    for i, tap in enumerate(taps):
        assert max_rel_err(tap, ref.hidden_states[i].numpy()) < TOL


@pytest.mark.parametrize("case", ["tied-gqa", "yarn"])
def test_cached_decoding_equals_full_forward(case):
    """Prefill of ragged prompts in one packed batch, then multi-token and single-token steps
    through the paged cache, equals one forward."""
    hf_cfg, model = _hf_model(case)
    ours = _ours(hf_cfg, model)
    ids = np.random.default_rng(1).integers(0, hf_cfg.vocab_size, (2, 30)).astype(np.int32)
    full = _full_logits(ours, jnp.asarray(ids))

    pos = np.array([9, 14])
    cache = ours.new_cache(2, 64, page_size=8, impl="dense")
    got, cache = _packed(ours, cache, [ids[0, :9], ids[1, :14]], [0, 0])
    got = [[g] for g in got]
    # A 3-token step (as verification does), then single-token steps.
    for width in (3, 1, 1, 1, 2):
        step = [ids[b, pos[b] : pos[b] + width] for b in range(2)]
        rows, cache = _packed(ours, cache, step, pos)
        for b in range(2):
            got[b].append(rows[b])
        pos = pos + width
    for b in range(2):
        stitched = np.concatenate(got[b])
        assert max_rel_err(stitched, full[b, : pos[b]]) < TOL

    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    assert max_rel_err(full, ref) < TOL


def test_rejected_tokens_roll_back_by_length():
    """Tokens written past a slot's length are forgotten: writing others there gives the right
    result, exactly as rejected drafts are rolled back."""
    hf_cfg, model = _hf_model("untied-gqa")
    ours = _ours(hf_cfg, model)
    ids = np.random.default_rng(2).integers(0, hf_cfg.vocab_size, (1, 20)).astype(np.int32)
    full = _full_logits(ours, jnp.asarray(ids))
    _, cache = _packed(ours, ours.new_cache(1, 32, page_size=8, impl="dense"), [ids[0, :12]], [0])
    wrong = (ids[0, 12:16] + 1) % hf_cfg.vocab_size
    _, cache = _packed(ours, cache, [wrong], [12])
    (rows,), _ = _packed(ours, cache, [ids[0, 12:20]], [12])
    assert max_rel_err(rows, full[0, 12:20]) < TOL


def test_page_placement_does_not_matter():
    """Which physical pages a slot owns changes nothing: a shuffled page table over a larger pool
    gives the logits of the plain one."""
    hf_cfg, model = _hf_model("tied-gqa")
    ours = _ours(hf_cfg, model)
    ids = np.random.default_rng(3).integers(0, hf_cfg.vocab_size, (2, 20)).astype(np.int32)
    plain = ours.new_cache(2, 24, page_size=4)
    big = ours.new_cache(2, 96, page_size=4)
    order = np.random.default_rng(4).permutation(big.layout.num_pages)[:12].reshape(2, 6)
    shuffled = big.replace(page_table_sp=jnp.asarray(order, jnp.int32))
    want, plain = _packed(ours, plain, [ids[0, :11], ids[1, :17]], [0, 0])
    got, shuffled = _packed(ours, shuffled, [ids[0, :11], ids[1, :17]], [0, 0])
    for w, g in zip(want, got, strict=True):
        assert max_rel_err(g, w) < TOL
    want, _ = _packed(ours, plain, [ids[0, 11:14], ids[1, 17:20]], [11, 17])
    got, _ = _packed(ours, shuffled, [ids[0, 11:14], ids[1, 17:20]], [11, 17])
    for w, g in zip(want, got, strict=True):
        assert max_rel_err(g, w) < TOL
