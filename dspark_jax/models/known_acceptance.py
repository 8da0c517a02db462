"""A drafter whose acceptance is chosen, for measuring serving at real shapes without real weights.

Speed depends on shapes, not weight values, but a policy benchmark also needs acceptance that
looks like a trained drafter's; random weights accept nothing. `KnownAcceptanceDrafter` runs the
full DSpark drafter (backbone, Markov head, confidence head: every FLOP and byte of the real one)
and then replaces what it proposes so that, against a target muted by `mute_target`, draft
position k is accepted -- given every earlier position was -- with probability `acceptance[k]`,
at any temperature:

- the muted target's final norm is zero, so its logits are all zero: greedy rows always emit
  token 0 and sampling rows draw uniformly from the vocabulary;
- for each draft the drafter draws a difficulty d ~ Beta(c * a_k, c * (1 - a_k)) (mean a_k,
  concentration c) and proposes token 0 when a uniform draw falls below d, token 1 otherwise;
  a greedy target accepts exactly the 0s, so with probability E[d] = a_k;
- its proposal distribution gives the proposed token 1 / (V d) and spreads the rest evenly, so
  rejection sampling against the uniform target accepts with probability min(1, (1/V) / q) = d;
- its confidence logit is logit(d): calibrated (P(accept | confidence d) = d) and as informative
  as the concentration makes it (large c: every draft at position k looks alike; small c:
  confidences spread towards 0 and 1), so thresholds and the scheduler have something to act on.

Draws come from the engine's per-request, per-position draft keys, so runs are reproducible.
The replacements depend on the real drafter's outputs so that XLA keeps the work whose cost is
being measured. Generated text is meaningless; only speed and acceptance are.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.models.drafter import DraftBlock, DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sampling import RowSampling, SamplingConfig

ACCEPTED_TOKEN = 0  # what a muted target always emits at temperature 0
REJECTED_TOKEN = 1


class KnownAcceptanceError(ValueError):
    """An acceptance profile that cannot be realised."""


class KnownAcceptanceDrafter(DSparkDrafter):
    """A DSpark drafter whose draft at block position k is accepted with probability
    `acceptance[k]` given the earlier ones were (see the module docstring)."""

    def __init__(
        self,
        cfg: DrafterConfig,
        acceptance: Sequence[float],
        *,
        concentration: float = 4.0,
        rngs: nnx.Rngs,
        param_dtype=None,
    ):
        acceptance = tuple(float(a) for a in acceptance)
        if len(acceptance) != cfg.block_size:
            raise KnownAcceptanceError(
                f"{len(acceptance)} acceptance rates for a block of {cfg.block_size} drafts"
            )
        if not all(0.0 < a < 1.0 for a in acceptance):
            raise KnownAcceptanceError(f"acceptance rates must lie in (0, 1), got {acceptance}")
        if not concentration > 0.0:
            raise KnownAcceptanceError(f"concentration must be > 0, got {concentration}")
        super().__init__(cfg, rngs=rngs, param_dtype=param_dtype)
        self.acceptance = acceptance
        self.concentration = float(concentration)

    def sample_block(
        self,
        h_bkd,
        anchor_b,
        keys_bk,
        sampling: SamplingConfig | RowSampling,
        unroll: bool | None = None,
        adjust=None,
    ) -> DraftBlock:
        real = super().sample_block(h_bkd, anchor_b, keys_bk, sampling, unroll, adjust)
        a_k = jnp.asarray(self.acceptance, jnp.float32)
        c = self.concentration
        flat_keys = keys_bk.reshape(-1)
        split = jax.vmap(lambda key: jax.random.split(key, 2))(flat_keys)
        shape = keys_bk.shape
        a_bk = jnp.broadcast_to(a_k, shape).reshape(-1)
        d_x = jax.vmap(lambda key, a: jax.random.beta(key, c * a, c * (1.0 - a)))(split[:, 0], a_bk)
        # Beta draws can round to exactly 0 or 1 in float32; the logit must stay finite.
        d_bk = jnp.clip(d_x, 1e-6, 1.0 - 1e-6).reshape(shape)
        u_bk = jax.vmap(lambda key: jax.random.uniform(key))(split[:, 1]).reshape(shape)
        tokens_bk = jnp.where(u_bk < d_bk, ACCEPTED_TOKEN, REJECTED_TOKEN).astype(jnp.int32)

        vocab = real.logprobs_bkv.shape[-1]
        log_v = jnp.log(jnp.float32(vocab))
        chosen_bk = -log_v - jnp.log(d_bk)  # q(x) = 1 / (V d) >= 1 / V
        rest_bk = jnp.log1p(-jnp.exp(chosen_bk)) - jnp.log(jnp.float32(vocab - 1))
        is_chosen_bkv = jnp.arange(vocab, dtype=jnp.int32) == tokens_bk[..., None]
        logprobs_bkv = jnp.where(is_chosen_bkv, chosen_bk[..., None], rest_bk[..., None])
        conf_bk = jnp.log(d_bk) - jnp.log1p(-d_bk)

        # Data dependencies on the real block that XLA cannot fold away (it does not simplify
        # float x * 0, nor min(t, 0) of tokens it cannot bound), so the measured work stays.
        tokens_bk = tokens_bk + jnp.minimum(real.tokens_bk, 0)
        if real.conf_logits_bk is not None:
            conf_bk = conf_bk + 0.0 * real.conf_logits_bk
        return DraftBlock(tokens_bk, real.logits_bkv, logprobs_bkv, conf_bk)


def mute_target(target: Qwen3) -> Qwen3:
    """Zeroes the target's final norm (in place; returns it): every logit becomes 0, so greedy
    decoding emits token 0 and sampling is uniform. The hidden states the drafter reads are
    untouched, and so is the cost of every layer."""
    weight = target.norm.weight
    weight[...] = jnp.zeros_like(weight[...])
    return target
