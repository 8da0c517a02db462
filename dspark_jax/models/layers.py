"""Building blocks shared by the Qwen3 target and the DSpark drafter.

Parameters carry `logical_axes` metadata (one name per dimension); `dspark_jax.sharding` maps
those names to mesh axes with a single rules table. Kernels are stored [in, out] (PyTorch's
Linear weights are [out, in]; conversion transposes).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import Qwen3Config, RopeConfig
from dspark_jax.errors import UserError

# Large negative instead of -inf: a fully masked row (padding) must stay finite, not NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """Qwen3's RMSNorm: normalise in float32, cast back, then scale (matches transformers)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32, axis: str = "norm"):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(axis,))
        self.eps = eps

    def __call__(self, x):
        return self.scale(x, self.inverse_rms(x))

    def inverse_rms(self, x):
        """1 / RMS of x over its last axis, float32 with that axis kept (size 1)."""
        x32 = x.astype(jnp.float32)
        return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)

    def scale(self, x, inverse_rms):
        """x normalised by its `inverse_rms`, cast back, then scaled by the weight."""
        y = x.astype(jnp.float32) * inverse_rms
        return self.weight[...].astype(x.dtype) * y.astype(x.dtype)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), kernel [in, out]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[str, str],
        rngs: nnx.Rngs,
        use_bias: bool = False,
        param_dtype=jnp.float32,
    ):
        self.kernel = nnx.Param(
            _normal(rngs, (in_features, out_features), param_dtype), logical_axes=axes
        )
        self.bias = (
            nnx.Param(jnp.zeros((out_features,), param_dtype), logical_axes=(axes[1],))
            if use_bias
            else None
        )

    def __call__(self, x):
        y = jnp.einsum("...i,io->...o", x, self.kernel[...].astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


class Embed(nnx.Module):
    """A [vocab, dim] table, usable as a lookup and (tied or not) as an output projection."""

    def __init__(
        self,
        vocab: int,
        dim: int,
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        axes: tuple[str, str] = ("vocab", "embed"),
    ):
        self.embedding = nnx.Param(_normal(rngs, (vocab, dim), param_dtype), logical_axes=axes)

    def __call__(self, ids, dtype):
        # Ids are in range (the engine checks prompts; sampled ids are). "clip" is the gather
        # alone: the default mode wraps negative ids and fills out-of-range rows with NaN, which
        # on a GPU adds three scalar kernels to every lookup -- at every draft position, for the
        # Markov head's embedding of the token drawn before.
        return jnp.take(self.embedding[...], ids, axis=0, mode="clip").astype(dtype)

    def attend(self, h):
        return jnp.einsum(
            "...d,vd->...v",
            h,
            self.embedding[...].astype(h.dtype),
            preferred_element_type=jnp.float32,
        )


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, computed as transformers does."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    pos_freqs = np.float32(rope.theta) ** exponents
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope.rope_type == "default":
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return (
            head_dim * np.log(rope.original_max_position_embeddings / (rotations * 2 * np.pi))
        ) / (2 * np.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)
    return (interpolation * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Rope:
    """Static RoPE tables: hashable, so modules holding one stay jit-static."""

    inv_freq: tuple[float, ...]
    scaling: float

    @classmethod
    def from_config(cls, cfg: Qwen3Config) -> Rope:
        inv = rope_inv_freq(cfg.rope, cfg.head_dim)
        return cls(tuple(float(f) for f in inv), cfg.rope.attention_scaling())

    def __call__(self, x_bthd, positions_bt):
        """Rotates the halves of the head dim (transformers' rotate_half convention)."""
        inv_freq = jnp.asarray(np.asarray(self.inv_freq, np.float32))
        freqs = positions_bt[..., None].astype(jnp.float32) * inv_freq
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        cos = (jnp.cos(emb) * self.scaling).astype(x_bthd.dtype)[:, :, None, :]
        sin = (jnp.sin(emb) * self.scaling).astype(x_bthd.dtype)[:, :, None, :]
        x1, x2 = jnp.split(x_bthd, 2, axis=-1)
        rotated = jnp.concatenate([-x2, x1], axis=-1)
        return x_bthd * cos + rotated * sin


def attention(q_bthd, k_bshd, v_bshd, mask_bts, scale: float):
    """Grouped-query attention; scores and softmax in float32, masked keys get ~-inf."""
    b, t, h, d = q_bthd.shape
    kv_heads = k_bshd.shape[2]
    q = q_bthd.reshape(b, t, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_bshd, preferred_element_type=jnp.float32)
    scores = jnp.where(mask_bts[:, None, None], scores * scale, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bshd.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_bshd)
    return out.reshape(b, t, h, d)


# cuDNN's fused attention takes 16-bit floats only; float32 stays on XLA's path.
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def _abstract_target():
    """The device an abstract mesh context names (a GPU or TPU compiled for without one), or
    None outside such a context."""
    return getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)


def target_backend() -> str:
    """The backend a program being traced is for: the platform of the device an abstract mesh
    context names (`jax.sharding.use_abstract_mesh`: how a GPU that is not here is compiled
    for, see `decoding.engine.absent_gpu_target`), else JAX's default backend."""
    device = _abstract_target()
    if device is None:
        return jax.default_backend()
    return "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform


# Set to 0, XLA's own choice of what goes into CUDA graphs: loops run on the host (see
# `graph_loops`), and the sampling filters' search is written out instead.
GRAPH_LOOPS_ENV = "DSPARK_JAX_GRAPH_LOOPS"
# What XLA:GPU records into CUDA graphs (its command buffers): its defaults (kernels, cuBLAS,
# cuBLASLt, custom calls, cuDNN, dynamic-slice fusions) with conditionals and while loops.
_GRAPH_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE"


def graph_loops(device=None) -> bool:
    """Whether the programs compiled for `device` (None: the target being traced for, as in
    `target_backend`) run their loops inside CUDA graphs: on an NVIDIA GPU, unless
    DSPARK_JAX_GRAPH_LOOPS=0.

    XLA:GPU leaves while loops out of its CUDA graphs by default: each trip then ends with the
    host reading the loop's predicate back before it launches the next, the GPU idle meanwhile,
    and a conditional with a loop anywhere inside it stays on the host too. With loops recorded
    (`compiler_options`), the device decides both, and a decode chunk -- its rounds loop, the
    token-bucket conditionals, the sampling filters' searches -- is one graph launch. Loops in
    graphs need the driver's conditional graph nodes (CUDA 12.3 or later; with an older
    driver XLA keeps loops and conditionals on the host, and DSPARK_JAX_GRAPH_LOOPS=0, which
    writes the sampling filters' searches out, leaves fewer of them there)."""
    setting = os.environ.get(GRAPH_LOOPS_ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise UserError(f"{GRAPH_LOOPS_ENV}={setting!r}: expected 0 (off) or 1 (on, the default)")
    if setting == "0":
        return False
    if device is None:
        device = _abstract_target() or jax.local_devices()[0]
    return device.platform in ("gpu", "cuda") and device.device_kind.startswith("NVIDIA")


def compiler_options(device) -> dict[str, str] | None:
    """XLA options for a program that runs on `device` (`jax.jit(..., compiler_options=)`):
    loops and conditionals recorded into CUDA graphs where `graph_loops(device)`, else none."""
    if not graph_loops(device):
        return None
    return {"xla_gpu_enable_command_buffer": _GRAPH_COMMANDS}


def causal_attention_impl(dtype, backend: str | None = None) -> str:
    """The `implementation` `causal_attention` asks `jax.nn.dot_product_attention` for: "cudnn"
    (flash attention: no [T, T] scores in memory, the masked half skipped) for 16-bit inputs
    on a GPU backend (None: `target_backend()`), else "xla". Not JAX's None, which means
    "xla" (jax 0.10) and would keep the dense float32 scores on a GPU too."""
    gpu = (backend or target_backend()) == "gpu"
    return "cudnn" if gpu and jnp.dtype(dtype) in _CUDNN_DTYPES else "xla"


def causal_attention(q_bthd, k_bshd, v_bshd, scale: float, implementation: str | None = None):
    """Causal self-attention over whole sequences (query t sees keys 0..t), grouped-query
    (q heads a multiple of k/v heads), through `jax.nn.dot_product_attention(is_causal=True)`.

    The "xla" path is `attention` itself with a lower-triangular mask (scores and softmax in
    float32, the same mask value), not JAX's own XLA path, which refuses float16 inputs on CPU.
    Where cuDNN refuses the call while tracing (no cuDNN, a ROCm GPU, a head dim it does not
    take), it warns and takes that path."""
    impl = implementation or causal_attention_impl(q_bthd.dtype)
    if impl == "cudnn":
        try:
            return jax.nn.dot_product_attention(
                q_bthd, k_bshd, v_bshd, scale=scale, is_causal=True, implementation="cudnn"
            )
        except (NotImplementedError, RuntimeError) as e:
            warnings.warn(
                f"cuDNN attention is not available here ({e}); causal attention runs as XLA's "
                "dense attention, with [T, T] float32 scores per layer",
                RuntimeWarning,
                stacklevel=2,
            )
    t, s = q_bthd.shape[1], k_bshd.shape[1]
    mask_bts = jnp.tril(jnp.ones((t, s), bool))[None]
    return attention(q_bthd, k_bshd, v_bshd, mask_bts, scale)


class Attention(nnx.Module):
    """Qwen3 attention projections: q/k per-head RMSNorm before RoPE, no biases."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.q_proj = Linear(d, self.num_heads * hd, axes=("embed", "q_heads"), **kw)
        self.k_proj = Linear(d, self.num_kv_heads * hd, axes=("embed", "kv_heads"), **kw)
        self.v_proj = Linear(d, self.num_kv_heads * hd, axes=("embed", "kv_heads"), **kw)
        self.o_proj = Linear(self.num_heads * hd, d, axes=("q_heads", "embed"), **kw)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype, axis="head_dim")
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype, axis="head_dim")
        self.rope = Rope.from_config(cfg)
        self.scale = hd**-0.5

    def query(self, x_btd, positions_bt):
        b, t, _ = x_btd.shape
        q = self.q_norm(self.q_proj(x_btd).reshape(b, t, self.num_heads, self.head_dim))
        return self.rope(q, positions_bt)

    def key_value(self, x_bsd, positions_bs):
        b, s, _ = x_bsd.shape
        k = self.k_norm(self.k_proj(x_bsd).reshape(b, s, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_bsd).reshape(b, s, self.num_kv_heads, self.head_dim)
        return self.rope(k, positions_bs), v

    def query_key_value(self, x_btd, positions_bt, *, fused: bool):
        """`query` and `key_value` of the same tokens: (q, k, v).

        `fused`: the three projections as one GEMM over their kernels side by side, for a GPU.
        Apart, XLA's GPU compiler turns a projection of one token whose kernel is small (K and
        V of Qwen3-4B: 2560 x 1024) into an elementwise multiply and a reduction, and in a
        decode step it writes the multiply's [in, out] product to memory and reads it back:
        twice the kernel's bytes more than a GEMM reads, and two kernels more, in every layer
        of a batch-1 step. Side by side, the kernels are one operand of one GEMM (XLA reads
        each in place: no concatenated copy), whatever the token count. Only where each
        device holds every head's columns: on a mesh that splits heads, the side-by-side
        kernel would be another layout than the three kernels' shards.
        """
        if not fused:
            return (self.query(x_btd, positions_bt), *self.key_value(x_btd, positions_bt))
        b, t, _ = x_btd.shape
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if any(p.bias is not None for p in projections):
            raise ValueError("a fused query/key/value projection takes kernels without biases")
        kernel = jnp.concatenate([p.kernel[...].astype(x_btd.dtype) for p in projections], 1)
        qkv = jnp.einsum("...i,io->...o", x_btd, kernel)
        q_width = self.num_heads * self.head_dim
        qk_width = q_width + self.num_kv_heads * self.head_dim
        # The q and k heads' RMS in one reduction over them all (two on a GPU otherwise: one
        # kernel each in every layer); q_norm's and k_norm's eps are both the config's.
        qk = qkv[..., :qk_width].reshape(b, t, self.num_heads + self.num_kv_heads, self.head_dim)
        inverse_rms = self.q_norm.inverse_rms(qk)
        q = self.q_norm.scale(qk[:, :, : self.num_heads], inverse_rms[:, :, : self.num_heads])
        k = self.k_norm.scale(qk[:, :, self.num_heads :], inverse_rms[:, :, self.num_heads :])
        v = qkv[..., qk_width:].reshape(b, t, self.num_kv_heads, self.head_dim)
        return self.rope(q, positions_bt), self.rope(k, positions_bt), v

    def output(self, o_bthd):
        b, t = o_bthd.shape[:2]
        return self.o_proj(o_bthd.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        d, f = cfg.hidden_size, cfg.intermediate_size
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.gate_proj = Linear(d, f, axes=("embed", "mlp"), **kw)
        self.up_proj = Linear(d, f, axes=("embed", "mlp"), **kw)
        self.down_proj = Linear(f, d, axes=("mlp", "embed"), **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
