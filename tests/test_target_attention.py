"""The target's whole-sequence forward (training's `target_features`, the parity checks) runs
its causal attention through `jax.nn.dot_product_attention(is_causal=True)`.

On a GPU with 16-bit weights that is cuDNN's flash attention: per layer one fused call, and no
[T, T] mask or float32 score tensor (2 GiB per layer of Qwen3-4B at 4096 tokens with the dense
path). Elsewhere it is XLA's dense attention, the same math as `layers.attention` under a
lower-triangular mask. The GPU program is lowered here from shapes alone; this machine has no
cuDNN, so its version check is stood in for (lowering reads only the version number).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import Qwen3Config
from dspark_jax.decoding.engine import absent_gpu_target
from dspark_jax.models import layers
from dspark_jax.models.qwen3 import Qwen3

CFG = Qwen3Config(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    dtype="bfloat16",
)
SEQ = 256
CUDNN = "__cudnn$fmhaSoftmax"
# Any tensor whose last two dimensions are [SEQ, SEQ]: the dense path's mask and scores.
SEQ_BY_SEQ = re.compile(rf"tensor<(?:\d+x)*{SEQ}x{SEQ}x\w+>")


def _lowered_forward(platform: str):
    """The forward `target_features` runs (taps included), lowered from abstract weights."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3(CFG, rngs=nnx.Rngs(0))))

    def forward(state, tokens_bt):
        out = nnx.merge(graphdef, state)(tokens_bt, tap_layer_ids=(0, 1))
        return out.hidden, out.taps

    tokens = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)
    return jax.jit(forward).trace(state, tokens).lower(lowering_platforms=(platform,))


@pytest.fixture
def gpu_backend(monkeypatch):
    """`causal_attention` choosing as it does when the default backend is a GPU."""
    impl = functools.partial(layers.causal_attention_impl, backend="gpu")
    monkeypatch.setattr(layers, "causal_attention_impl", impl)


def test_gpu_forward_is_cudnn_flash_attention_without_seq_by_seq_tensors(gpu_backend, monkeypatch):
    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    text = _lowered_forward("cuda").as_text()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    # One fused call in the one layer body that every layer calls (`qwen3._layer_program`).
    assert calls == [CUDNN], calls
    assert len(re.findall(r"call @decoder_layer\b", text)) == CFG.num_hidden_layers
    assert not SEQ_BY_SEQ.search(text), SEQ_BY_SEQ.search(text).group(0)


def test_gpu_forward_without_cudnn_falls_back_to_xla(gpu_backend, monkeypatch):
    """No cuDNN (a ROCm GPU, a jaxlib without it): XLA's dense path. Its absence is made
    here, as JAX reports it, so the test holds where cuDNN is installed too."""
    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")

    def absent():
        raise RuntimeError("cuDNN is not detected.")

    monkeypatch.setattr(fused, "check_cudnn_version", absent)
    with pytest.warns(RuntimeWarning, match="cuDNN attention is not available"):
        text = _lowered_forward("cuda").as_text()
    assert "__cudnn" not in text
    assert SEQ_BY_SEQ.search(text)


def test_impl_choice():
    assert layers.causal_attention_impl(jnp.bfloat16, "gpu") == "cudnn"
    assert layers.causal_attention_impl(jnp.float16, "gpu") == "cudnn"
    assert layers.causal_attention_impl(jnp.float32, "gpu") == "xla"
    assert layers.causal_attention_impl(jnp.bfloat16, "cpu") == "xla"
    assert layers.causal_attention_impl(jnp.bfloat16, "tpu") == "xla"


def test_impl_choice_follows_the_gpu_compiled_for():
    """Traced for a GPU this machine lacks (an abstract device names it, as when compiling for
    an H100 without one), the forward takes the GPU's path; outside, this backend's again."""
    assert jax.default_backend() != "gpu"
    assert layers.causal_attention_impl(jnp.bfloat16) == "xla"
    with absent_gpu_target(("cuda",), "NVIDIA H100"):
        assert layers.target_backend() == "gpu"
        assert layers.causal_attention_impl(jnp.bfloat16) == "cudnn"
        assert layers.causal_attention_impl(jnp.float32) == "xla"
    assert layers.target_backend() == jax.default_backend()
    assert layers.causal_attention_impl(jnp.bfloat16) == "xla"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_path_matches_dense_attention_under_a_causal_mask(dtype):
    """Grouped-query (3 query heads per k/v head), odd length, batch of two."""
    b, t, heads, kv_heads, d = 2, 37, 6, 2, 16
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = ((b, t, heads, d), (b, t, kv_heads, d), (b, t, kv_heads, d))
    q, k, v = (
        jax.random.normal(key, shape).astype(dtype) for key, shape in zip(keys, shapes, strict=True)
    )
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
    dense = jax.jit(lambda q, k, v: layers.attention(q, k, v, mask, d**-0.5))(q, k, v)
    causal = jax.jit(lambda q, k, v: layers.causal_attention(q, k, v, d**-0.5, "xla"))(q, k, v)
    assert causal.dtype == dense.dtype
    tol = 1e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(
        np.asarray(causal, np.float32), np.asarray(dense, np.float32), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_query_key_value_is_the_three_projections(dtype):
    """`Attention.query_key_value(fused=True)` (one GEMM over the kernels side by side, for a
    GPU) computes what query() and key_value() do apart: the same products, one matrix."""
    cfg = dataclasses.replace(CFG, dtype=dtype, num_attention_heads=8, num_key_value_heads=2)
    attn = layers.Attention(cfg, rngs=nnx.Rngs(3), param_dtype=dtype)
    x = jax.random.normal(jax.random.key(1), (2, 5, cfg.hidden_size), dtype)
    positions = jnp.broadcast_to(jnp.arange(7, 12), (2, 5))
    apart = attn.query_key_value(x, positions, fused=False)
    fused = attn.query_key_value(x, positions, fused=True)
    tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    for one, other, name in zip(apart, fused, "qkv", strict=True):
        assert one.shape == other.shape and one.dtype == other.dtype, name
        np.testing.assert_allclose(
            np.asarray(other, np.float32),
            np.asarray(one, np.float32),
            rtol=tol,
            atol=tol,
            err_msg=name,
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_query_key_value_normalises_q_and_k_heads_as_their_own_norms_do(dtype):
    """The fused path takes every q and k head's RMS in one reduction: bit for bit what q_norm
    and k_norm give applied apart to the same GEMM's q and k columns (different weights, so a
    swapped norm would show)."""
    cfg = dataclasses.replace(CFG, dtype=dtype, num_attention_heads=8, num_key_value_heads=2)
    attn = layers.Attention(cfg, rngs=nnx.Rngs(3), param_dtype=dtype)
    rng = np.random.default_rng(5)
    attn.q_norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, cfg.head_dim), dtype)
    attn.k_norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, cfg.head_dim), dtype)
    x = jax.random.normal(jax.random.key(1), (2, 5, cfg.hidden_size), dtype)
    positions = jnp.broadcast_to(jnp.arange(7, 12), (2, 5))
    hd, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def apart_norms(x, positions):
        kernel = jnp.concatenate(
            [p.kernel[...] for p in (attn.q_proj, attn.k_proj, attn.v_proj)], 1
        )
        qkv = jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype))
        q, k, v = jnp.split(qkv, [heads * hd, (heads + kv_heads) * hd], -1)
        q = attn.q_norm(q.reshape(2, 5, heads, hd))
        k = attn.k_norm(k.reshape(2, 5, kv_heads, hd))
        return attn.rope(q, positions), attn.rope(k, positions), v.reshape(2, 5, kv_heads, hd)

    fused = jax.jit(lambda x, p: attn.query_key_value(x, p, fused=True))(x, positions)
    for one, other, name in zip(jax.jit(apart_norms)(x, positions), fused, "qkv", strict=True):
        np.testing.assert_array_equal(np.asarray(other, np.float32), np.asarray(one, np.float32),
                                      err_msg=name)


def test_fused_query_key_value_only_for_a_gpu_and_unsplit_heads(monkeypatch):
    """`qwen3.fuse_qkv`: on a GPU backend, unless a mesh splits the heads over `tensor` (the
    side-by-side kernel is not a layout of the three kernels' head shards)."""
    from dspark_jax import sharding
    from dspark_jax.models import paged, qwen3

    cache = paged.new_cache(CFG, num_slots=1, max_len=32, dtype="float32")
    assert not qwen3.fuse_qkv(cache)  # this machine: CPU
    monkeypatch.setattr(qwen3, "target_backend", lambda: "gpu")
    assert qwen3.fuse_qkv(cache)
    one = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    assert qwen3.fuse_qkv(cache.replace(mesh=one))
    data = sharding.make_mesh(sharding.MeshConfig(2, 1, 1), jax.devices()[:2])
    assert qwen3.fuse_qkv(cache.replace(mesh=data))  # slots split, heads whole
    heads = sharding.make_mesh(sharding.MeshConfig(1, 1, 2), jax.devices()[:2])
    assert not qwen3.fuse_qkv(cache.replace(mesh=heads))
