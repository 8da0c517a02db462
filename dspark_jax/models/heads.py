"""DSpark's sequential heads: the Markov transition bias and the confidence head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models.layers import Embed, Linear


class MarkovHead(nnx.Module):
    """Low-rank transition bias B(prev, .) added to the backbone's base logits.

    vanilla: W2 e;  gated: W2 (sigmoid(gate_proj([h; e])) * e);  rnn: a gated recurrent state
    s_k over z = [s_{k-1}; e; h] with joint_proj split as (gate, candidate, output) and bias
    W2 tanh(output). e = W1[prev]. W2 is stored [vocab, rank] like the reference's Linear weight.
    """

    def __init__(
        self,
        kind: str,
        vocab: int,
        rank: int,
        hidden: int,
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
    ):
        self.kind = kind
        self.rank = rank
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.markov_w1 = Embed(vocab, rank, axes=("vocab", "markov"), **kw)
        self.markov_w2 = Embed(vocab, rank, axes=("vocab", "markov"), **kw)
        if kind == "gated":
            self.gate_proj = Linear(
                hidden + rank, rank, axes=("embed", "markov"), use_bias=True, **kw
            )
        elif kind == "rnn":
            self.joint_proj = Linear(
                2 * rank + hidden, 3 * rank, axes=("embed", "markov"), use_bias=True, **kw
            )

    def embed_prev(self, prev_tokens, dtype):
        return self.markov_w1(prev_tokens, dtype)

    def init_state(self, batch_shape, dtype):
        return jnp.zeros((*batch_shape, self.rank), dtype)

    def step(self, prev_emb_xr, h_xd, state_xr):
        """One transition for any leading shape: returns (bias_xv float32, next state)."""
        if self.kind == "vanilla":
            u = prev_emb_xr
        elif self.kind == "gated":
            gate = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h_xd, prev_emb_xr], axis=-1)))
            u = gate * prev_emb_xr
        else:
            z = jnp.concatenate([state_xr, prev_emb_xr, h_xd], axis=-1)
            gate, candidate, out = jnp.split(self.joint_proj(z), 3, axis=-1)
            g = jax.nn.sigmoid(gate)
            state_xr = g * state_xr + (1 - g) * jnp.tanh(candidate)
            u = jnp.tanh(out)
        return self.markov_w2.attend(u), state_xr

    def teacher_forced(self, prev_emb_bkr, h_bkd):
        """Biases for a whole block given the true previous tokens (training)."""
        if self.kind != "rnn":
            return self.step(prev_emb_bkr, h_bkd, None)[0]
        state = self.init_state(prev_emb_bkr.shape[:-2], prev_emb_bkr.dtype)

        def body(state_br, xs):
            bias, state_br = self.step(xs[0], xs[1], state_br)
            return state_br, bias

        xs = (jnp.moveaxis(prev_emb_bkr, -2, 0), jnp.moveaxis(h_bkd, -2, 0))
        _, bias_kbv = jax.lax.scan(body, state, xs)
        return jnp.moveaxis(bias_kbv, 0, -2)


class ConfidenceHead(nnx.Module):
    """c_k = sigmoid(proj([h_k; W1[x_{k-1}]])), or proj(h_k) without the Markov feature."""

    def __init__(self, hidden: int, markov_rank: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.proj = Linear(
            hidden + markov_rank,
            1,
            axes=("head_in", "scalar"),
            use_bias=True,
            rngs=rngs,
            param_dtype=param_dtype,
        )

    def __call__(self, h_xd, prev_emb_xr=None):
        feats = h_xd if prev_emb_xr is None else jnp.concatenate([h_xd, prev_emb_xr], axis=-1)
        return self.proj(feats.astype(jnp.float32))[..., 0]
