"""The drafter train step: one jitted function over (train state, frozen weights, batch).

Per step:
1. Anchors for the whole batch (`sample_anchors`: a fixed number per sequence among positions
   whose token and next token are assistant tokens) and their labels / prefix masks.
2. The batch is split into micro-batches (a `lax.scan`, gradients summed): for each, the frozen
   target runs forward once (no gradient) and yields the tapped features (the drafter's context)
   and the final normed hidden state (the target distributions p_t).
3. The drafter's context K/V are computed once per micro-batch; the anchors are then processed in
   chunks (`lax.scan` over chunks): a chunk of c anchors is a packed query sequence of c blocks
   [anchor, MASK x (gamma-1)] at positions p..p+gamma-1, with a block-sparse mask (context keys
   j < p of the query's own block, block keys of that block only, bidirectionally), followed by
   the teacher-forced Markov heads, p_t through the frozen lm_head and `dspark_loss`. Each
   chunk's gradient is taken right after its forward, inside the same scan iteration
   (`drafter_loss_sums`).

Memory: the [B, N*gamma, V] logits of a whole sequence (3584 x 152k floats per sequence for the
released recipe) are never materialised; only one chunk's [B, c, gamma, V] logits, its attention
scores [B, heads, c*gamma, L + c*gamma] and its loss temporaries are live, and they are freed once
that chunk's backward is done. Nothing is recomputed: differentiating a scan of chunks from the
outside would have to store every chunk's residuals or, under `jax.checkpoint`, run every chunk's
forward twice (about 14% of the step's matmul FLOPs at the released recipe). Blocks are
independent given the context K/V, so chunking changes nothing but the order of the sums.

Normalisation: `dspark_loss` returns weighted means over the slots it is given. Each chunk's means
are multiplied back by the chunk's weight sums and divided by the weight sums of the whole batch
(known before the forward pass, from the prefix masks), so the result equals one `dspark_loss`
over the entire batch, independent of chunking, micro-batching and sharding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax.config import DrafterConfig
from dspark_jax.errors import UserError
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sharding import constrain, logical_sharding, state_shardings
from dspark_jax.training.loss import (
    DSPARK_WEIGHTS,
    BlockLabels,
    LossWeights,
    block_labels,
    decay_weights,
    dspark_loss,
    gather_blocks,
    sample_anchors,
)

# The drafter's embedding and lm_head are the target's, frozen (paper Section 3.3).
FROZEN_DRAFTER_PARAMS = nnx.All(
    nnx.Param, nnx.Any(nnx.PathContains("embed_tokens"), nnx.PathContains("lm_head"))
)

Batch = dict[str, jax.Array]


class StepConfigError(UserError):
    """Train-step settings that do not fit together."""


class TrainState(NamedTuple):
    """Everything a training run carries from step to step (and checkpoints)."""

    step: jax.Array  # int32 scalar: optimizer updates applied so far
    params: nnx.State  # trainable drafter parameters (the master copy, float32 by default)
    opt_state: optax.OptState
    rng: jax.Array  # uint32[2] raw PRNG key, split once per step


class FrozenParams(NamedTuple):
    target: nnx.State
    drafter: nnx.State  # embed_tokens and lm_head, normally the very arrays of the target


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the step. `num_microbatches` splits the batch for gradient accumulation;
    `anchors_per_chunk` bounds the memory of the drafter pass (it must divide `num_anchors`)."""

    num_anchors: int
    anchors_per_chunk: int
    num_microbatches: int = 1
    weights: LossWeights = DSPARK_WEIGHTS

    def __post_init__(self):
        if self.num_anchors < 1 or self.anchors_per_chunk < 1 or self.num_microbatches < 1:
            raise StepConfigError(
                "num_anchors, anchors_per_chunk and num_microbatches must be positive, got "
                f"{self.num_anchors}, {self.anchors_per_chunk}, {self.num_microbatches}"
            )
        if self.num_anchors % self.anchors_per_chunk:
            raise StepConfigError(
                f"anchors_per_chunk ({self.anchors_per_chunk}) must divide num_anchors "
                f"({self.num_anchors})"
            )


@dataclasses.dataclass(frozen=True)
class Models:
    """Graph definitions of the frozen target and the drafter (jit-static)."""

    target: nnx.GraphDef
    drafter: nnx.GraphDef
    drafter_cfg: DrafterConfig


# -- models ------------------------------------------------------------------------------------
def split_drafter(drafter: DSparkDrafter) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, trainable params, frozen params); `nnx.merge(graphdef, frozen, trainable)`."""
    graphdef, frozen, trainable = nnx.split(drafter, FROZEN_DRAFTER_PARAMS, ...)
    return graphdef, trainable, frozen


def new_drafter(
    cfg: DrafterConfig, target: Qwen3, *, seed: int, param_dtype: Any = jnp.float32
) -> DSparkDrafter:
    """A randomly initialised drafter whose embed_tokens and lm_head are the target's arrays."""
    cfg.check_target(target.cfg)
    drafter = DSparkDrafter(cfg, rngs=nnx.Rngs(seed), param_dtype=param_dtype)
    head = target.embed_tokens if target.lm_head is None else target.lm_head
    drafter.embed_tokens.embedding.set_value(target.embed_tokens.embedding.get_value())
    drafter.lm_head.embedding.set_value(head.embedding.get_value())
    return drafter


def make_optimizer(
    learning_rate: float,
    total_steps: int,
    warmup_steps: int,
    weight_decay: float,
    max_grad_norm: float,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW after global-norm clipping, lr: linear warmup from 0, then cosine decay to 0."""
    if not 0 <= warmup_steps < total_steps:
        raise StepConfigError(f"warmup_steps {warmup_steps} must be in [0, {total_steps})")
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup_steps, total_steps, end_value=0.0
    )
    tx = optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay),
    )
    return tx, schedule


def init_train_state(
    params: nnx.State, optimizer: optax.GradientTransformation, seed: int
) -> TrainState:
    """Step 0: `params`, a fresh optimizer state and the PRNG key of `seed`."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.PRNGKey(seed),
    )


# -- packed blocks -----------------------------------------------------------------------------
def packed_block_inputs(
    anchors_bc: jax.Array,
    anchor_tokens_bc: jax.Array,
    block_size: int,
    mask_token_id: int,
    context_len: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokens_bt, positions_bt and mask_bts of c packed blocks (t = c * block_size).

    Block i is [anchor token, MASK x (block_size-1)] at positions p_i..p_i+block_size-1. The mask
    covers [context keys 0..context_len-1 ; the t block keys]: a query of block i sees context
    keys j < p_i and all keys of block i, nothing of the other blocks.
    """
    b, c = anchors_bc.shape
    k_k = jnp.arange(block_size, dtype=jnp.int32)
    tokens_bck = jnp.where(k_k == 0, anchor_tokens_bc[:, :, None], mask_token_id)
    positions_bck = anchors_bc[:, :, None] + k_k
    t = c * block_size
    ctx_mask_bcs = jnp.arange(context_len)[None, None, :] < anchors_bc[:, :, None]
    ctx_mask_bts = jnp.repeat(ctx_mask_bcs, block_size, axis=1)
    block_of_t = jnp.arange(t) // block_size
    own_block_tt = block_of_t[:, None] == block_of_t[None, :]
    mask_bts = jnp.concatenate([ctx_mask_bts, jnp.broadcast_to(own_block_tt, (b, t, t))], axis=-1)
    return (
        tokens_bck.reshape(b, t).astype(jnp.int32),
        positions_bck.reshape(b, t).astype(jnp.int32),
        mask_bts,
    )


# -- loss over chunks --------------------------------------------------------------------------
# Which denominator turns each `dspark_loss` metric (a mean) back into a sum.
_METRIC_DENOMINATOR = {
    "loss": "weight",
    "ce": "weight",
    "l1": "weight",
    "bce": "weight",
    "conf_bias": "weight",
    "accept_rate_k": "slots_k",
    "tau": "blocks",
    "acc_k0": "blocks",
}


def denominators(prefix_mask_bnk: jax.Array, decay: float) -> dict[str, jax.Array]:
    """The weight sums behind each `dspark_loss` mean, over all given blocks."""
    m_bnk = prefix_mask_bnk.astype(jnp.float32)
    w_k = decay_weights(m_bnk.shape[-1], decay)
    return {
        "weight": (m_bnk * w_k).sum(),
        "slots_k": m_bnk.sum(axis=(0, 1)),
        "blocks": m_bnk[:, :, 0].sum(),
    }


def _to_sums(metrics: dict[str, jax.Array], dens: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {
        name: value if name == "num_tokens" else value * dens[_METRIC_DENOMINATOR[name]]
        for name, value in metrics.items()
    }


def finalize_metrics(
    sums: dict[str, jax.Array], dens: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """Sums from `drafter_loss_sums` (added over chunks and micro-batches) -> batch means."""
    out = {}
    for name, value in sums.items():
        if name == "num_tokens":
            out[name] = value
            continue
        den = dens[_METRIC_DENOMINATOR[name]]
        out[name] = jnp.where(den > 0, value / jnp.where(den > 0, den, 1.0), 0.0)
    return out


def _chunk_major(x_bn: jax.Array, chunk: int) -> jax.Array:
    """[b, n, ...] -> [n // chunk, b, chunk, ...]."""
    b, n = x_bn.shape[:2]
    return jnp.swapaxes(x_bn.reshape((b, n // chunk, chunk) + x_bn.shape[2:]), 0, 1)


def drafter_loss_sums(
    params: nnx.State,
    frozen_drafter: nnx.State,
    target_state: nnx.State,
    models: Models,
    hidden_bld: jax.Array,
    taps_blf: jax.Array,
    anchors_bn: jax.Array,
    labels: BlockLabels,
    cfg: StepConfig,
    mesh: Mesh | None = None,
) -> dict[str, jax.Array]:
    """Metric sums of `dspark_loss` over the given sequences' blocks (`finalize_metrics` divides).

    Differentiable in `params` only ("loss" is the weighted loss sum; the other sums carry no
    gradient). `hidden_bld` and `taps_blf` are the target's final normed hidden states and
    tapped features of the same sequences, constants here (`target_features` stops their
    gradient; differentiating through them raises JAX's closed-over-value error).

    The gradient is taken chunk by chunk inside the forward scan (`jax.vjp` of each chunk with
    respect to the parameters and the context K/V, summed in the scan carry); the context K/V
    cotangent goes back through their projection once, after the scan. A `jax.custom_vjp` hands
    that gradient, times the cotangent of "loss", to the caller's `jax.grad`. So one chunk's
    residuals are live at a time, as under `jax.checkpoint`, and no chunk's forward runs twice.
    Without differentiation (evaluation) only the forward scan runs.
    """
    dcfg = models.drafter_cfg
    gamma = dcfg.block_size
    b, seq_len = hidden_bld.shape[:2]
    kv_axes = ("batch", "length", "kv_heads", None)
    positions_bl = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (b, seq_len))

    def context(params):
        """([ctx_k_blhd per layer], [ctx_v_blhd per layer]): the drafter's context K/V."""
        drafter = nnx.merge(models.drafter, frozen_drafter, params)
        ctx_kv = drafter.context_kv(taps_blf, positions_bl)
        return (
            [constrain(k, kv_axes, mesh) for k, _ in ctx_kv],
            [constrain(v, kv_axes, mesh) for _, v in ctx_kv],
        )

    def chunk_sums(params, ctx, xs):
        """(loss sum, the other metric sums) of one chunk of anchors."""
        anchors_bc, labels_bck, prev_bck, prefix_bck = xs
        ctx_k, ctx_v = ctx
        drafter = nnx.merge(models.drafter, frozen_drafter, params)
        c = anchors_bc.shape[1]
        tokens_bt, positions_bt, mask_bts = packed_block_inputs(
            anchors_bc, prev_bck[:, :, 0], gamma, dcfg.mask_token_id, seq_len
        )
        h_btd = drafter.backbone(tokens_bt, positions_bt, ctx_k, ctx_v, mask_bts)
        h_bckd = h_btd.reshape(b, c, gamma, h_btd.shape[-1])
        draft_logits_bckv, conf_bck = drafter.teacher_forced(h_bckd, prev_bck)
        draft_logits_bckv = constrain(draft_logits_bckv, ("batch", None, None, "vocab"), mesh)
        target = nnx.merge(models.target, target_state)
        target_logits_bckv = target.logits(gather_blocks(hidden_bld, anchors_bc, gamma))
        target_logits_bckv = constrain(target_logits_bckv, ("batch", None, None, "vocab"), mesh)
        loss, metrics = dspark_loss(
            draft_logits_bckv, target_logits_bckv, labels_bck, prefix_bck, conf_bck, cfg.weights
        )
        # dspark_loss returns its metrics without gradient; the loss itself must keep one.
        metrics["loss"] = loss
        sums = _to_sums(metrics, denominators(prefix_bck, cfg.weights.decay))
        return sums.pop("loss"), sums

    chunk = cfg.anchors_per_chunk
    xs = (
        _chunk_major(anchors_bn, chunk),
        _chunk_major(labels.labels_bnk, chunk),
        _chunk_major(labels.prev_tokens_bnk, chunk),
        _chunk_major(labels.prefix_mask_bnk, chunk),
    )

    def zero_sums(params, ctx):
        first = jax.tree.map(lambda x: x[0], xs)
        shapes = jax.eval_shape(chunk_sums, params, ctx, first)
        return jax.tree.map(jnp.zeros_like, shapes)

    def add(a, b):
        return jax.tree.map(jnp.add, a, b)

    def param_sharded(grads):
        """Gradient accumulators pinned to the parameters' shardings (the rules table's)."""
        if mesh is None:
            return grads
        return jax.lax.with_sharding_constraint(grads, state_shardings(grads, mesh))

    def ctx_sharded(d_ctx):
        return jax.tree.map(lambda x: constrain(x, kv_axes, mesh), d_ctx)

    @jax.custom_vjp
    def loss_sums(params):
        ctx = context(params)

        def body(acc, xs):
            return add(acc, chunk_sums(params, ctx, xs)), None

        (loss, sums), _ = jax.lax.scan(body, zero_sums(params, ctx), xs)
        return {**sums, "loss": loss}

    def loss_sums_fwd(params):
        ctx, context_vjp = jax.vjp(context, params)

        def body(acc, xs):
            sums_acc, d_params_acc, d_ctx_acc = acc
            loss, chunk_vjp, sums = jax.vjp(
                lambda p, ctx: chunk_sums(p, ctx, xs), params, ctx, has_aux=True
            )
            d_params, d_ctx = chunk_vjp(jnp.ones_like(loss))
            d_ctx = jax.tree.map(lambda d: d.astype(jnp.float32), d_ctx)
            acc = (
                add(sums_acc, (loss, sums)),
                param_sharded(add(d_params_acc, d_params)),
                ctx_sharded(add(d_ctx_acc, d_ctx)),
            )
            return acc, None

        # The context cotangent is summed in float32 (the K/V may be bfloat16) and rounded once.
        zero_d_ctx = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), ctx)
        init = (
            zero_sums(params, ctx),
            param_sharded(jax.tree.map(jnp.zeros_like, params)),
            ctx_sharded(zero_d_ctx),
        )
        ((loss, sums), d_params, d_ctx), _ = jax.lax.scan(body, init, xs)
        d_ctx = jax.tree.map(lambda d, x: d.astype(x.dtype), d_ctx, ctx)
        (d_params_via_ctx,) = context_vjp(d_ctx)
        grads = param_sharded(add(d_params, d_params_via_ctx))
        return {**sums, "loss": loss}, grads

    def loss_sums_bwd(grads, sums_ct):
        # Only "loss" depends on the parameters; the gradient was taken with cotangent 1.
        return (jax.tree.map(lambda g: (sums_ct["loss"] * g).astype(g.dtype), grads),)

    loss_sums.defvjp(loss_sums_fwd, loss_sums_bwd)
    return loss_sums(params)


_EMBEDDING = "['embed_tokens']['embedding']"


def target_features(
    models: Models, target_state: nnx.State, tokens_bl: jax.Array, mesh: Mesh | None = None
) -> tuple[jax.Array, jax.Array]:
    """(final normed hidden states, tapped features) of the frozen target, without gradient."""
    if mesh is not None:
        # The lookup's rows come out split along the embedding (fsdp) and must end split along
        # the batch (data x fsdp): XLA's partitioner cannot move fsdp between those dimensions on
        # some meshes (2 x 2 x 2) and replicated the whole [batch, length, hidden] lookup to do
        # it ("Involuntary full rematerialization"). Gathering the table along the embedding
        # first, as FSDP does for every weight it uses, leaves a lookup it splits by batch.
        def gathered(path, x):
            name = jax.tree_util.keystr(path)
            return constrain(x, ("vocab", None), mesh) if name.startswith(_EMBEDDING) else x

        target_state = jax.tree_util.tree_map_with_path(gathered, target_state)
    target = nnx.merge(models.target, target_state)
    out = target(tokens_bl, tap_layer_ids=models.drafter_cfg.target_layer_ids)
    hidden = constrain(out.hidden, ("batch", "length", None), mesh)
    taps = constrain(out.taps, ("batch", "length", "features"), mesh)
    return jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(taps)


def _micro_major(x_b: jax.Array, num_micro: int) -> jax.Array:
    """[B, ...] -> [num_micro, B // num_micro, ...], micro-batch m = rows m, m + A, m + 2A, ...

    Interleaving keeps each device's rows on that device when the batch dimension is sharded.
    """
    b = x_b.shape[0]
    return jnp.swapaxes(x_b.reshape((b // num_micro, num_micro) + x_b.shape[1:]), 0, 1)


def batch_loss(
    params: nnx.State,
    frozen: FrozenParams,
    batch: Batch,
    key: jax.Array,
    models: Models,
    cfg: StepConfig,
    mesh: Mesh | None = None,
    *,
    with_grad: bool,
) -> tuple[nnx.State | None, dict[str, jax.Array]]:
    """(gradient of the batch loss or None, batch metrics) with anchors drawn from `key`."""
    tokens_bl = batch["tokens"].astype(jnp.int32)
    loss_mask_bl = batch["loss_mask"]
    gamma = models.drafter_cfg.block_size
    anchors_bn, _ = sample_anchors(key, loss_mask_bl, batch["length"], cfg.num_anchors)
    labels = block_labels(tokens_bl, loss_mask_bl, anchors_bn, gamma)
    dens = denominators(labels.prefix_mask_bnk, cfg.weights.decay)
    weight_total = jnp.maximum(dens["weight"], jnp.finfo(jnp.float32).tiny)

    def micro_sums(params, xs):
        tokens, anchors, labels = xs
        tokens = constrain(tokens, ("batch", "length"), mesh)
        hidden, taps = target_features(models, frozen.target, tokens, mesh)
        return drafter_loss_sums(
            params, frozen.drafter, frozen.target, models, hidden, taps, anchors, labels, cfg, mesh
        )

    def objective(params, xs):
        sums = micro_sums(params, xs)
        return sums["loss"] / weight_total, sums

    a = cfg.num_microbatches
    xs = jax.tree.map(lambda x: _micro_major(x, a), (tokens_bl, anchors_bn, labels))

    def body(acc, xs):
        grads_acc, sums_acc = acc
        if with_grad:
            grads, sums = jax.grad(objective, has_aux=True)(params, xs)
            grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        else:
            sums = micro_sums(params, xs)
        return (grads_acc, jax.tree.map(jnp.add, sums_acc, sums)), None

    first = jax.tree.map(lambda x: x[0], xs)
    zero_sums = jax.tree.map(jnp.zeros_like, jax.eval_shape(micro_sums, params, first))
    zero_grads = jax.tree.map(jnp.zeros_like, params) if with_grad else None
    (grads, sums), _ = jax.lax.scan(body, (zero_grads, zero_sums), xs)
    return grads, finalize_metrics(sums, dens)


# -- jitted entry points -----------------------------------------------------------------------
def batch_shardings(mesh: Mesh, batch_size: int, seq_len: int) -> dict[str, NamedSharding]:
    """Shardings of a batch dict: rows split over the data and fsdp axes."""
    return {
        "tokens": logical_sharding(("batch", "length"), (batch_size, seq_len), mesh),
        "loss_mask": logical_sharding(("batch", "length"), (batch_size, seq_len), mesh),
        "length": logical_sharding(("batch",), (batch_size,), mesh),
    }


def make_train_step(
    models: Models,
    cfg: StepConfig,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    mesh: Mesh,
    state: TrainState,
    frozen: FrozenParams,
    batch_size: int,
    seq_len: int,
) -> Callable[[TrainState, FrozenParams, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted step `(state, frozen, batch) -> (state, metrics)`; `state` is donated.

    `state` and `frozen` (real or abstract) fix the in/out shardings from the rules table.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    state_sh = state_shardings(state, mesh)
    frozen_sh = state_shardings(frozen, mesh)

    def step(state: TrainState, frozen: FrozenParams, batch: Batch):
        rng, key = jax.random.split(state.rng)
        grads, metrics = batch_loss(
            state.params, frozen, batch, key, models, cfg, mesh, with_grad=True
        )
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
        return TrainState(state.step + 1, params, opt_state, rng), metrics

    return jax.jit(
        step,
        in_shardings=(state_sh, frozen_sh, batch_shardings(mesh, batch_size, seq_len)),
        out_shardings=(state_sh, replicated),
        donate_argnums=(0,),
    )


def make_eval_step(
    models: Models,
    cfg: StepConfig,
    mesh: Mesh,
    params: nnx.State,
    frozen: FrozenParams,
    batch_size: int,
    seq_len: int,
) -> Callable[[nnx.State, FrozenParams, Batch, jax.Array], dict[str, jax.Array]]:
    """The jitted `(params, frozen, batch, key) -> metrics` (no update; anchors from `key`)."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def evaluate(params, frozen, batch, key):
        return batch_loss(params, frozen, batch, key, models, cfg, mesh, with_grad=False)[1]

    return jax.jit(
        evaluate,
        in_shardings=(
            state_shardings(params, mesh),
            state_shardings(frozen, mesh),
            batch_shardings(mesh, batch_size, seq_len),
            replicated,
        ),
        out_shardings=replicated,
    )
