"""Parity with the golden outputs of the PyTorch reference (DeepSpec) in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixture_models import VARIANTS, load_pair, max_rel_err, reference_arrays, reference_traces

from dspark_jax.models import paged
from dspark_jax.models.paged import TokenBatch
from dspark_jax.sampling import SamplingConfig

TOL = 1e-5


def _prefill_and_draft(variant, prompt_ids):
    target, drafter = load_pair(variant)
    ids = jnp.asarray(prompt_ids, jnp.int32)[None]
    out = target(ids, tap_layer_ids=(-1, *range(target.cfg.num_hidden_layers - 1)))
    logits = target.logits(out.hidden)
    anchor = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    layer_ids = drafter.cfg.target_layer_ids
    taps = jnp.split(out.taps, target.cfg.num_hidden_layers, axis=-1)
    features = jnp.concatenate([taps[i + 1] for i in layer_ids], axis=-1)
    n = ids.shape[1]
    context = TokenBatch.per_slot(jnp.zeros(1, jnp.int32), jnp.array([n], jnp.int32), n)
    cache = drafter.new_context_cache(1, n + 16, impl="dense")
    cache = drafter.append_context(cache, features[0], context)
    h = drafter.draft_hidden(anchor, jnp.array([n]), jnp.array([True]), cache)
    keys = jax.random.split(jax.random.key(0), drafter.cfg.block_size)[None]
    block = drafter.sample_block(h, anchor, keys, SamplingConfig(temperature=0.0))
    return out, logits, taps, features, anchor, h, block


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_block_matches_reference(variant):
    ref = reference_arrays(variant)
    target, drafter = load_pair(variant)
    out, logits, taps, features, anchor, h, block = _prefill_and_draft(
        variant, ref["prompt_ids"][0]
    )

    assert max_rel_err(logits, ref["target_logits"]) < TOL
    hidden_states = ref["target_hidden_states"]
    for i in range(target.cfg.num_hidden_layers):
        assert max_rel_err(taps[i], hidden_states[i]) < TOL, f"hidden_states[{i}]"
    assert max_rel_err(out.hidden, hidden_states[-1]) < TOL, "final normed hidden state"
    assert max_rel_err(features, ref["context_features"]) < TOL
    assert int(anchor[0]) == int(ref["anchor"])
    assert max_rel_err(h, ref["block_hidden"]) < TOL
    assert max_rel_err(drafter.base_logits(h), ref["base_logits"]) < TOL
    np.testing.assert_array_equal(np.asarray(block.tokens_bk), ref["draft_tokens"])
    assert max_rel_err(block.logits_bkv, ref["corrected_logits"]) < TOL
    assert max_rel_err(block.conf_logits_bk, ref["confidence_logits"]) < TOL


@pytest.mark.optimized
@pytest.mark.parametrize("variant", VARIANTS)
def test_first_round_of_every_trace(variant):
    """Prefill, one greedy block, greedy verification: the trace's first round."""
    target, drafter = load_pair(variant)
    traces = reference_traces(variant)["traces"]
    assert len(traces) == 4
    for trace in traces:
        prompt = jnp.asarray(trace["prompt"], jnp.int32)
        n = prompt.shape[0]
        batch = TokenBatch.per_slot(jnp.zeros(1, jnp.int32), jnp.array([n], jnp.int32), n)
        cache = target.new_cache(1, n + 16, impl="dense")
        pre = target.paged_forward(prompt, batch, cache)
        cache = paged.write(cache, pre.kv, batch)
        anchor = jnp.argmax(target.logits(pre.hidden[-1:]), axis=-1).astype(jnp.int32)
        assert int(anchor[0]) == trace["output"][0]

        _, _, _, _, anchor2, _, block = _prefill_and_draft(variant, trace["prompt"])
        assert int(anchor2[0]) == int(anchor[0])
        drafts = np.asarray(block.tokens_bk[0])
        verify_in = jnp.concatenate([anchor[:, None], block.tokens_bk], axis=1)[0]
        width = verify_in.shape[0]
        batch = TokenBatch.per_slot(jnp.array([n]), jnp.array([width], jnp.int32), width)
        ver = target.paged_forward(verify_in, batch, cache)
        greedy = np.asarray(jnp.argmax(target.logits(ver.hidden), axis=-1))
        n_acc = 0
        while n_acc < len(drafts) and drafts[n_acc] == greedy[n_acc]:
            n_acc += 1
        committed = [*drafts[:n_acc].tolist(), int(greedy[n_acc])]
        assert len(committed) == trace["acceptance_lengths"][0]
        assert committed == trace["output"][1 : 1 + len(committed)]
