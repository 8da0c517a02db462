"""Parity with transformers' own Qwen3ForCausalLM built from tiny random configs (no downloads)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from fixture_models import max_rel_err
from transformers import Qwen3Config as HFQwen3Config
from transformers import Qwen3ForCausalLM

from dspark_jax.checkpoints.convert import DictSource, target_from_torch
from dspark_jax.config import Qwen3Config

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


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_hidden_states_match(case):
    hf_cfg, model = _hf_model(case)
    ours = _ours(hf_cfg, model)
    ids = np.random.default_rng(0).integers(0, hf_cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ref = model(torch.tensor(ids), output_hidden_states=True)
    out = ours(jnp.asarray(ids, jnp.int32), None, tap_layer_ids=(-1, 0, 1))
    assert max_rel_err(ours.logits(out.hidden_btd), ref.logits.numpy()) < TOL
    taps = np.split(np.asarray(out.taps_btf), 3, axis=-1)
    for i, tap in enumerate(taps):
        assert max_rel_err(tap, ref.hidden_states[i].numpy()) < TOL


@pytest.mark.parametrize("case", ["tied-gqa", "yarn"])
def test_cached_decoding_equals_full_forward(case):
    """Prefill of a ragged batch, then multi-token and single-token steps, equals one forward."""
    hf_cfg, model = _hf_model(case)
    ours = _ours(hf_cfg, model)
    ids = np.random.default_rng(1).integers(0, hf_cfg.vocab_size, (2, 30)).astype(np.int32)
    full = ours.logits(ours(jnp.asarray(ids), None).hidden_btd)

    prompt_len = np.array([9, 14], np.int32)
    cache = ours.init_cache(2, 64)
    padded = np.where(np.arange(16)[None] < prompt_len[:, None], ids[:, :16], 0)
    out = ours(jnp.asarray(padded), cache)
    cache = out.cache.replace(lengths=jnp.asarray(prompt_len))
    got = [[ours.logits(out.hidden_btd)[b, : prompt_len[b]]] for b in range(2)]
    # A 3-token step (as verification does), then single-token steps.
    pos = prompt_len.copy()
    for width in (3, 1, 1, 1, 2):
        step = np.stack([ids[b, pos[b] : pos[b] + width] for b in range(2)])
        out = ours(jnp.asarray(step), cache)
        logits = ours.logits(out.hidden_btd)
        for b in range(2):
            got[b].append(logits[b])
        cache, pos = out.cache, pos + width
    for b in range(2):
        stitched = np.concatenate([np.asarray(x) for x in got[b]])
        assert max_rel_err(stitched, full[b, : pos[b]]) < TOL

    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    assert max_rel_err(full, ref) < TOL


def test_rejected_tokens_roll_back_by_length():
    """Lowering the cache length forgets tokens: writing others there gives the right result."""
    hf_cfg, model = _hf_model("untied-gqa")
    ours = _ours(hf_cfg, model)
    ids = np.random.default_rng(2).integers(0, hf_cfg.vocab_size, (1, 20)).astype(np.int32)
    full = ours.logits(ours(jnp.asarray(ids), None).hidden_btd)
    cache = ours(jnp.asarray(ids[:, :12]), ours.init_cache(1, 32)).cache
    wrong = (ids[:, 12:16] + 1) % hf_cfg.vocab_size
    cache = ours(jnp.asarray(wrong), cache).cache.replace(lengths=jnp.array([12]))
    out = ours(jnp.asarray(ids[:, 12:20]), cache)
    assert max_rel_err(ours.logits(out.hidden_btd), full[:, 12:20]) < TOL


def test_prefill_key_window_is_exact():
    """A prefill that attends only to its own T keys equals one that scans the whole cache.

    Masked keys contribute exact zeros, but the softmax sums over a different number of terms,
    so agreement is to float rounding, not bitwise.
    """
    hf_cfg, model = _hf_model("tied-gqa")
    ours = _ours(hf_cfg, model)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, hf_cfg.vocab_size, (2, 12)), jnp.int32)
    whole = ours(ids, ours.init_cache(2, 48))
    window = ours(ids, ours.init_cache(2, 48), key_window=12)
    assert max_rel_err(window.hidden_btd, whole.hidden_btd) < TOL
    for a, b in zip(window.cache.k, whole.cache.k, strict=True):
        assert max_rel_err(a, b) < TOL
