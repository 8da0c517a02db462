"""The packed multi-anchor train step against an independent computation on the fixture models.

The independent side drafts every block on its own through the inference path (a context KV
cache holding positions < anchor, `draft_hidden`), which the fixture parity tests tie to the
PyTorch reference, and then computes heads, labels, prefix masks and the loss by hand: in NumPy
(float64) for the values, and with the same formulas in jax.numpy for the parameter gradients.
The training side is one call of `batch_loss`: packed blocks with the block-sparse mask, anchor
chunks, two micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.models.paged import TokenBatch
from dspark_jax.sharding import MeshConfig, make_mesh
from dspark_jax.training import step as S
from dspark_jax.training.loss import (
    DSPARK_WEIGHTS,
    block_labels,
    dspark_loss,
    gather_blocks,
    sample_anchors,
)
from tests.fixture_models import load_pair

GAMMA = 7
DECAY = DSPARK_WEIGHTS.decay
TEXT = (
    b"def parse_args(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n"
    b"    parser.add_argument('--verbose', action='store_true')\n    return parser.parse_args"
)


def _batch(seq_len: int = 64):
    """Two byte sequences: prompt tokens then assistant tokens, the second one padded."""
    tokens = np.full((2, seq_len), 256, np.int32)
    tokens[0] = np.frombuffer(TEXT[:seq_len], np.uint8)
    tokens[1, :50] = np.frombuffer(TEXT[70:120], np.uint8)
    length = np.array([seq_len, 50], np.int32)
    pos = np.arange(seq_len)[None]
    loss_mask = (pos >= np.array([[20], [6]])) & (pos < length[:, None])
    return {"tokens": tokens, "loss_mask": loss_mask, "length": length}


def _softmax(xp, x):
    z = x - xp.max(x, axis=-1, keepdims=True)
    e = xp.exp(z)
    return e / xp.sum(e, axis=-1, keepdims=True), z - xp.log(xp.sum(e, axis=-1, keepdims=True))


def _reference_terms(xp, h_nkd, prev_nk, t_logits_nkv, labels_nk, valid_nk, heads):
    """Per-slot loss terms of independently drafted blocks, written out by hand (xp = np | jnp)."""
    w1, w2, lm_head, conf_kernel, conf_bias = heads
    e_nkr = w1[prev_nk]
    logits = xp.einsum("nkd,vd->nkv", h_nkd, lm_head) + xp.einsum("nkr,vr->nkv", e_nkr, w2)
    conf_nk = xp.einsum("nkf,f->nk", xp.concatenate([h_nkd, e_nkr], -1), conf_kernel[:, 0])
    conf_nk = conf_nk + conf_bias[0]
    p_d, logp_d = _softmax(xp, logits)
    p_t, _ = _softmax(xp, t_logits_nkv)
    ce = -xp.take_along_axis(logp_d, labels_nk[..., None], axis=-1)[..., 0]
    l1 = xp.abs(p_d - p_t).sum(-1)
    p_d_label = jax.lax.stop_gradient(p_d) if xp is jnp else p_d  # c* is a label: no gradient
    c_star = xp.clip(1.0 - 0.5 * xp.abs(p_d_label - p_t).sum(-1), 0.0, 1.0)
    sig = 1.0 / (1.0 + xp.exp(-conf_nk))
    bce = -(c_star * xp.log(sig) + (1.0 - c_star) * xp.log(1.0 - sig))
    m_nk = xp.cumprod(valid_nk.astype(h_nkd.dtype), axis=-1)
    w_nk = xp.exp(-xp.arange(GAMMA) / DECAY)[None, :] * m_nk
    return dict(
        logits=logits,
        p_d=p_d,
        p_t=p_t,
        ce=ce,
        l1=l1,
        bce=bce,
        conf=conf_nk,
        sig=sig,
        c_star=c_star,
        m=m_nk,
        w=w_nk,
    )


def _reference_loss(xp, terms):
    w = terms["w"]
    mean = lambda x: (w * x).sum() / w.sum()  # noqa: E731
    return 0.1 * mean(terms["ce"]) + 0.9 * mean(terms["l1"]) + 1.0 * mean(terms["bce"])


def _independent_blocks(drafter, hidden_bld, taps_blf, target, tokens, loss_mask, length, anchors):
    """(h [n, k, d], prev, target logits, labels, valid) of every (row, anchor) block, drafted as
    n separate requests whose context caches hold the positions before their anchor."""
    seq_len = tokens.shape[1]
    rows = np.repeat(np.arange(tokens.shape[0]), anchors.shape[1])
    starts = anchors.reshape(-1)
    n = len(starts)
    context = TokenBatch.per_slot(jnp.zeros(n, jnp.int32), jnp.asarray(starts), int(starts.sum()))
    features = jnp.concatenate([taps_blf[r, :s] for r, s in zip(rows, starts, strict=True)])
    # Room for the block after the last context position: its keys are written there. The dense
    # attention path, because the reference is differentiated (the paged loop's trip count is
    # dynamic).
    cache = drafter.new_context_cache(n, seq_len + GAMMA, impl="dense")
    cache = drafter.append_context(cache, features, context)
    h = drafter.draft_hidden(
        jnp.asarray(tokens[rows, starts]), jnp.asarray(starts), jnp.ones(n, bool), cache
    )
    pos = np.minimum(starts[:, None] + np.arange(GAMMA), seq_len - 1)
    label_pos = starts[:, None] + 1 + np.arange(GAMMA)
    clipped = np.minimum(label_pos, seq_len - 1)
    valid = (label_pos < length[rows, None]) & loss_mask[rows[:, None], clipped]
    t_logits = target.logits(hidden_bld[rows[:, None], pos])
    return h, tokens[rows[:, None], pos], t_logits, tokens[rows[:, None], clipped], valid


def _heads(params, frozen_drafter):
    return (
        params["markov_head"]["markov_w1"]["embedding"][...],
        params["markov_head"]["markov_w2"]["embedding"][...],
        frozen_drafter["lm_head"]["embedding"][...],
        params["confidence_head"]["proj"]["kernel"][...],
        params["confidence_head"]["proj"]["bias"][...],
    )


@pytest.fixture(scope="module")
def setup():
    target, drafter = load_pair("vanilla")
    drafter_gd, params, frozen_drafter = S.split_drafter(drafter)
    target_gd, target_state = nnx.split(target)
    models = S.Models(target_gd, drafter_gd, drafter.cfg)
    cfg = S.StepConfig(num_anchors=8, anchors_per_chunk=4, num_microbatches=2)
    frozen = S.FrozenParams(target_state, frozen_drafter)
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    key = jax.random.PRNGKey(3)

    @jax.jit
    def packed(params, frozen, batch, key):
        return S.batch_loss(params, frozen, batch, key, models, cfg, with_grad=True)

    grads, metrics = packed(params, frozen, batch, key)
    anchors, valid = sample_anchors(key, batch["loss_mask"], batch["length"], cfg.num_anchors)
    hidden, taps = S.target_features(models, target_state, batch["tokens"])
    return dict(
        target=target,
        drafter=drafter,
        models=models,
        params=params,
        frozen_drafter=frozen_drafter,
        batch=jax.device_get(batch),
        anchors=np.asarray(anchors),
        valid=np.asarray(valid),
        hidden=hidden,
        taps=taps,
        grads=grads,
        metrics=jax.device_get(metrics),
    )


def test_packed_block_inputs_layout():
    tokens, positions, mask = S.packed_block_inputs(
        jnp.array([[2, 5]]), jnp.array([[11, 12]]), block_size=3, mask_token_id=99, context_len=6
    )
    np.testing.assert_array_equal(tokens, [[11, 99, 99, 12, 99, 99]])
    np.testing.assert_array_equal(positions, [[2, 3, 4, 5, 6, 7]])
    ctx = np.array([[1, 1, 0, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 1, 0]] * 3, bool)
    blocks = np.kron(np.eye(2, dtype=bool), np.ones((3, 3), bool))
    np.testing.assert_array_equal(mask[0], np.concatenate([ctx, blocks], axis=1))


def test_loss_matches_independent_numpy(setup):
    s = setup
    tokens, loss_mask, length = (s["batch"][k] for k in ("tokens", "loss_mask", "length"))
    anchors = s["anchors"]
    assert s["valid"].all() and anchors.shape == (2, 8)
    h, prev, t_logits, labels, valid = _independent_blocks(
        s["drafter"], s["hidden"], s["taps"], s["target"], tokens, loss_mask, length, anchors
    )
    heads = [np.asarray(x, np.float64) for x in _heads(s["params"], s["frozen_drafter"])]
    t = _reference_terms(
        np, np.asarray(h, np.float64), prev, np.asarray(t_logits, np.float64), labels, valid, heads
    )
    assert 0 < t["m"].sum() < t["m"].size, "the case should include blocks cut by the mask"
    w, m = t["w"], t["m"]
    first = m[:, 0] > 0
    expected = {
        "loss": _reference_loss(np, t),
        "ce": (w * t["ce"]).sum() / w.sum(),
        "l1": (w * t["l1"]).sum() / w.sum(),
        "bce": (w * t["bce"]).sum() / w.sum(),
        "conf_bias": (w * (t["sig"] - t["c_star"])).sum() / w.sum(),
        "accept_rate_k": (m * t["c_star"]).sum(0) / m.sum(0),
        "tau": (1 + np.cumprod(t["c_star"] * m, axis=-1).sum(-1))[first].mean(),
        "acc_k0": (t["logits"][:, 0].argmax(-1) == labels[:, 0])[first].mean(),
        "num_tokens": m.sum(),
    }
    for name, value in expected.items():
        np.testing.assert_allclose(s["metrics"][name], value, rtol=2e-6, atol=1e-7, err_msg=name)


def test_gradients_match_independent_path(setup):
    """Parameter gradients of the packed step equal those of per-block drafting + the loss by hand;
    the head gradients also equal the per-token gradients derived on paper:
    dL/dlogits = w/W (0.1 (p_d - onehot) + 0.9 p_d (s - <p_d, s>)), s = sign(p_d - p_t),
    dL/dconf = w/W (sigmoid(conf) - c*)."""
    s = setup
    tokens, loss_mask, length = (s["batch"][k] for k in ("tokens", "loss_mask", "length"))
    models = s["models"]

    @jax.jit
    def reference(params):
        drafter = nnx.merge(models.drafter, s["frozen_drafter"], params)
        h, prev, t_logits, labels, valid = _independent_blocks(
            drafter, s["hidden"], s["taps"], s["target"], tokens, loss_mask, length, s["anchors"]
        )
        terms = _reference_terms(
            jnp, h, prev, t_logits, labels, jnp.asarray(valid), _heads(params, s["frozen_drafter"])
        )
        return _reference_loss(jnp, terms), (h, prev, labels, terms)

    ref_grads, (h, prev, labels, t) = jax.grad(reference, has_aux=True)(s["params"])
    ours = dict(jax.tree_util.tree_flatten_with_path(s["grads"])[0])
    theirs = dict(jax.tree_util.tree_flatten_with_path(ref_grads)[0])
    assert ours.keys() == theirs.keys()
    for path, g_ref in theirs.items():
        scale = float(jnp.max(jnp.abs(g_ref)))
        err = float(jnp.max(jnp.abs(ours[path] - g_ref)))
        assert scale > 0, path
        assert err <= 1e-4 * scale, (jax.tree_util.keystr(path), err, scale)

    # per-token gradients, in float64
    p_d, p_t, w = (np.asarray(t[k], np.float64) for k in ("p_d", "p_t", "w"))
    w = w / w.sum()
    onehot = np.eye(p_d.shape[-1])[np.asarray(labels)]
    sgn = np.sign(p_d - p_t)
    g_logits = w[..., None] * (
        0.1 * (p_d - onehot) + 0.9 * p_d * (sgn - (p_d * sgn).sum(-1, keepdims=True))
    )
    g_conf = w * (np.asarray(t["sig"], np.float64) - np.asarray(t["c_star"], np.float64))
    w1 = np.asarray(s["params"]["markov_head"]["markov_w1"]["embedding"][...], np.float64)
    e = w1[np.asarray(prev)]
    feats = np.concatenate([np.asarray(h, np.float64), e], axis=-1)
    expected = {
        ("markov_head", "markov_w2"): np.einsum("nkv,nkr->vr", g_logits, e),
        ("confidence_head", "kernel"): np.einsum("nk,nkf->f", g_conf, feats)[:, None],
        ("confidence_head", "bias"): g_conf.sum()[None],
    }
    # The sums cancel heavily, so the float32 error scales with the sum of |contributions|.
    magnitude = {
        ("markov_head", "markov_w2"): np.einsum("nkv,nkr->vr", np.abs(g_logits), np.abs(e)),
        ("confidence_head", "kernel"): np.einsum("nk,nkf->f", np.abs(g_conf), np.abs(feats))[
            :, None
        ],
        ("confidence_head", "bias"): np.abs(g_conf).sum()[None],
    }
    got = {
        ("markov_head", "markov_w2"): s["grads"]["markov_head"]["markov_w2"]["embedding"][...],
        ("confidence_head", "kernel"): s["grads"]["confidence_head"]["proj"]["kernel"][...],
        ("confidence_head", "bias"): s["grads"]["confidence_head"]["proj"]["bias"][...],
    }
    for name, value in expected.items():
        err = np.abs(np.asarray(got[name], np.float64) - value)
        assert np.all(err <= 1e-5 * magnitude[name] + 1e-12), (name, np.max(err / magnitude[name]))


def test_frozen_embeddings_are_the_targets_and_not_trained():
    target, drafter = load_pair("gated")
    fresh = S.new_drafter(drafter.cfg, target, seed=0)
    _, params, frozen = S.split_drafter(fresh)
    assert frozen["embed_tokens"]["embedding"][...] is target.embed_tokens.embedding[...]
    assert frozen["lm_head"]["embedding"][...] is target.lm_head.embedding[...]
    paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert not any("embed_tokens" in p or "lm_head" in p for p in paths)
    assert any("markov_w1" in p for p in paths) and any("confidence_head" in p for p in paths)


def test_step_config_and_schedule_validation():
    with pytest.raises(S.StepConfigError, match="divide"):
        S.StepConfig(num_anchors=10, anchors_per_chunk=4)
    with pytest.raises(S.StepConfigError, match="positive"):
        S.StepConfig(num_anchors=8, anchors_per_chunk=4, num_microbatches=0)
    with pytest.raises(S.StepConfigError, match="warmup"):
        S.make_optimizer(1e-3, 10, 10, 0.0, 1.0)
    _, schedule = S.make_optimizer(1e-3, 100, 4, 0.0, 1.0)
    np.testing.assert_allclose(
        [schedule(i) for i in (0, 2, 4, 52, 100)], [0.0, 5e-4, 1e-3, 5e-4, 0.0], atol=1e-9
    )


# -- the per-chunk gradient against plain autodiff -----------------------------------------------
def _plain_batch_loss(params, frozen, batch, key, models, num_anchors):
    """The batch loss by plain `jax.grad`-able code: every anchor of the batch in one packed chunk,
    no micro-batches, no custom VJP, no remat."""
    tokens_bl, loss_mask_bl = batch["tokens"], batch["loss_mask"]
    b, seq_len = tokens_bl.shape
    anchors_bn, _ = sample_anchors(key, loss_mask_bl, batch["length"], num_anchors)
    labels = block_labels(tokens_bl, loss_mask_bl, anchors_bn, GAMMA)
    hidden_bld, taps_blf = S.target_features(models, frozen.target, tokens_bl)
    drafter = nnx.merge(models.drafter, frozen.drafter, params)
    positions_bl = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (b, seq_len))
    ctx_kv = drafter.context_kv(taps_blf, positions_bl)
    tokens_bt, positions_bt, mask_bts = S.packed_block_inputs(
        anchors_bn,
        labels.prev_tokens_bnk[:, :, 0],
        GAMMA,
        models.drafter_cfg.mask_token_id,
        seq_len,
    )
    h_btd = drafter.backbone(
        tokens_bt, positions_bt, [k for k, _ in ctx_kv], [v for _, v in ctx_kv], mask_bts
    )
    h_bnkd = h_btd.reshape(b, num_anchors, GAMMA, -1)
    logits_bnkv, conf_bnk = drafter.teacher_forced(h_bnkd, labels.prev_tokens_bnk)
    target = nnx.merge(models.target, frozen.target)
    target_logits_bnkv = target.logits(gather_blocks(hidden_bld, anchors_bn, GAMMA))
    loss, _ = dspark_loss(
        logits_bnkv,
        target_logits_bnkv,
        labels.labels_bnk,
        labels.prefix_mask_bnk,
        conf_bnk,
        DSPARK_WEIGHTS,
    )
    return loss


@pytest.fixture(scope="module")
def plain(setup):
    s = setup
    frozen = S.FrozenParams(nnx.split(s["target"])[1], s["frozen_drafter"])
    batch = {k: jnp.asarray(v) for k, v in s["batch"].items()}
    key = jax.random.PRNGKey(3)

    def plain_grad(params):
        return jax.value_and_grad(_plain_batch_loss)(params, frozen, batch, key, s["models"], 8)

    def chunked_grad(cfg):
        return lambda params: S.batch_loss(
            params, frozen, batch, key, s["models"], cfg, with_grad=True
        )

    return dict(frozen=frozen, batch=batch, key=key, plain_grad=plain_grad, chunked=chunked_grad)


@pytest.mark.parametrize(
    "chunk, micro",
    [(2, 2), (4, 1), (8, 2)],
    ids=["4-chunks-2-micro", "2-chunks", "1-chunk-2-micro"],
)
def test_chunked_gradients_equal_plain_autodiff(setup, plain, chunk, micro):
    """`batch_loss`'s gradient (per-chunk VJPs inside the chunk scan, micro-batches summed) equals
    plain `jax.grad` of the whole batch's loss in one piece, to float32 rounding.

    Both sides run the same float32 operations; they differ in how the sums over slots are split
    and ordered (per chunk and micro-batch, the loss's 1/weight applied after the sum instead of
    before it), so an entry may move by a few float32 roundings (eps = 1.2e-7) of the terms it
    sums. Bound: 1e-5 (~80 eps) of the leaf's largest entry, plus 2e-6 of the largest entry of
    all for sums that cancel -- the confidence bias adds ~100 slot terms of both signs whose
    absolute sum (0.12) is 75x the result and 4x the largest entry, so that floor is ~4 eps of
    it. A real fault (a chunk counted twice or not at all, a lost context cotangent) moves
    entries by a sizeable fraction of themselves."""
    s = setup
    loss_ref, grads_ref = jax.jit(plain["plain_grad"])(s["params"])
    cfg = S.StepConfig(num_anchors=8, anchors_per_chunk=chunk, num_microbatches=micro)
    grads, metrics = jax.jit(plain["chunked"](cfg))(s["params"])
    np.testing.assert_allclose(metrics["loss"], loss_ref, rtol=2e-6)
    ours = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
    theirs = dict(jax.tree_util.tree_flatten_with_path(grads_ref)[0])
    assert ours.keys() == theirs.keys()
    largest = max(float(jnp.max(jnp.abs(g))) for g in theirs.values())
    for path, g_ref in theirs.items():
        scale = float(jnp.max(jnp.abs(g_ref)))
        err = float(jnp.max(jnp.abs(ours[path] - g_ref)))
        assert scale > 0, jax.tree_util.keystr(path)
        assert err <= 1e-5 * scale + 2e-6 * largest, (jax.tree_util.keystr(path), err, scale)


def _executed(jaxpr, mult=1, acc=None):
    """(matmul FLOPs, primitive names) of a jaxpr as executed: scan bodies times their length."""
    acc = acc if acc is not None else {"flops": 0.0, "primitives": set()}
    for eqn in jaxpr.eqns:
        acc["primitives"].add(eqn.primitive.name)
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            # out = batch x lhs free x rhs free; each output entry sums over the contracted dims
            acc["flops"] += mult * 2.0 * np.prod(out) * np.prod([lhs[i] for i in lc])
        inner = mult * eqn.params["length"] if eqn.primitive.name == "scan" else mult
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _executed(sub.jaxpr, inner, acc)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _executed(sub, inner, acc)
    return acc


def test_no_chunk_forward_runs_twice(setup, plain):
    """The gradient costs the matmuls of plain autodiff, not one more forward per chunk (what
    `jax.checkpoint` around each chunk costs), and the train step holds no remat at all."""
    s = setup
    one_chunk = S.StepConfig(num_anchors=8, anchors_per_chunk=8)
    ours = _executed(jax.make_jaxpr(plain["chunked"](one_chunk))(s["params"]).jaxpr)
    reference = _executed(jax.make_jaxpr(plain["plain_grad"])(s["params"]).jaxpr)
    assert ours["flops"] == reference["flops"]
    # With more chunks and micro-batches only the block keys each query scores shrink.
    cfg = S.StepConfig(num_anchors=8, anchors_per_chunk=2, num_microbatches=2)
    chunked = _executed(jax.make_jaxpr(plain["chunked"](cfg))(s["params"]).jaxpr)
    assert chunked["flops"] <= reference["flops"]

    tx, schedule = S.make_optimizer(1e-3, 10, 0, 0.0, 1.0)
    state = S.init_train_state(s["params"], tx, 0)
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    batch = plain["batch"]
    step = S.make_train_step(
        s["models"], cfg, tx, schedule, mesh, state, plain["frozen"], *batch["tokens"].shape
    )
    primitives = _executed(step.trace(state, plain["frozen"], batch).jaxpr.jaxpr)["primitives"]
    assert not {p for p in primitives if "remat" in p or "checkpoint" in p}, primitives
