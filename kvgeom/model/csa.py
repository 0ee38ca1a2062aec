"""A hand-built CSA-linear model: compressed-sparse-attention layers with a compressor ring, linear-attention
(GDN) layers and a TP-replicated short-conv (PLE) state, overlaid on the compressed layers' tensors.

The layer kinds and how they overlay follow vLLM 0.33.0's ``qwen4_exp`` model (``QSAKeyStateCache``: a
``CircularBufferSpec`` ring of ``round_up(compress_ratio + speculative tokens, compress_ratio)`` rows of one
head; ``QSACompressedKeyCache``: the compressed keys, an MLA-format cache of one head; GDN linear attention;
the PLE short-conv state, a ``MambaSpec`` with ``tp_replicated``, of ``hidden_size * hc_count`` channels and
``(ple_conv_kernel_size - 1) * ngram_size`` rows). The sizes are parameters with small defaults (the oracle
tags every byte); the compressed keys are modelled as one MLA row per token. See docs/vllm-behaviour.md
B.6.14 for what vLLM moves for such a model.
"""

from __future__ import annotations

from kvgeom.errors import SpecError
from kvgeom.model.layers import (
    AttentionSpec,
    CircularBufferSpec,
    Layer,
    MambaSpec,
    MLASpec,
    ReplicatedStateSpec,
)
from kvgeom.model.spec import ModelSpec

__all__ = ["ring_capacity", "csa_linear_model"]


def ring_capacity(compress_ratio: int, speculative_tokens: int = 0) -> int:
    """Rows of a QSA ring: the open group's keys plus every speculative row, rounded up to whole groups
    (``compress_ratio`` 4, 1 speculative token -> 8)."""
    if compress_ratio < 1 or speculative_tokens < 0:
        raise SpecError(
            "compress_ratio",
            "needs compress_ratio >= 1 and speculative_tokens >= 0",
            value=compress_ratio,
            speculative_tokens=speculative_tokens,
        )
    span = compress_ratio + speculative_tokens
    return -(-span // compress_ratio) * compress_ratio


def csa_linear_model(
    name: str = "csa-linear",
    *,
    num_csa_layers: int = 2,
    head_size: int = 8,
    compress_ratio: int = 4,
    speculative_tokens: int = 0,
    gdn: MambaSpec | None = None,
    ple_channels: int = 8,
    ple_conv_kernel: int = 4,
    dtype: str = "bfloat16",
    main_kv_heads: int = 0,
) -> ModelSpec:
    """``num_csa_layers`` decoder layers ``2i`` with compressed keys (``layers.2i.attn``, owner of tensor
    ``i``) and a ring overlaying them (``layers.2i.ring``), each followed by a GDN layer ``2i + 1`` whose state
    overlays the same tensor; the PLE state (``ple``) overlays the first tensor. ``main_kv_heads`` > 0 gives
    each decoder layer ``2i`` a head-sharded full-attention main KV of that many KV heads of ``head_size``
    (``layers.2i.kv``, a tensor of its own, before the compressed keys: vLLM's ``Qwen4ExpQSAAttention``)."""
    if num_csa_layers < 1:
        raise SpecError("num_csa_layers", "needs at least one layer", value=num_csa_layers)
    if main_kv_heads < 0:
        raise SpecError("main_kv_heads", "needs main_kv_heads >= 0 (0: no main KV)", value=main_kv_heads)
    state = gdn if gdn is not None else MambaSpec.gdn(2, 4, 2, 4)
    mla = MLASpec(head_size, dtype)
    ring = CircularBufferSpec(ring_capacity(compress_ratio, speculative_tokens), head_size, dtype)
    layers: list[Layer] = []
    for i in range(num_csa_layers):
        owner = f"layers.{2 * i}.attn"
        if main_kv_heads:
            layers.append(Layer(f"layers.{2 * i}.kv", 2 * i, AttentionSpec(main_kv_heads, head_size, dtype)))
        layers.append(Layer(owner, 2 * i, mla))
        layers.append(Layer(f"layers.{2 * i}.ring", 2 * i, ring, shares=owner))
        layers.append(Layer(f"layers.{2 * i + 1}.gdn", 2 * i + 1, state, shares=owner))
    layers.append(
        Layer("ple", 0, ReplicatedStateSpec(ple_channels, ple_conv_kernel, dtype), shares="layers.0.attn")
    )
    return ModelSpec(name, tuple(layers))
