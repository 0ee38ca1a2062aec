"""The page vLLM's CPU attention kernel really writes (no server: vLLM's own op on a small cache).

``CPU_ATTN`` declares ``LBHNC`` and allocates ``[blocks, heads, tokens, 2 x head_size]``, viewed as K and V
halves per head; ``cpu_attn_reshape_and_cache`` (ISA ``vec``: fp32 here) stores each head's K half
transposed, ``[head_size, tokens]``, and its V half as ``[tokens, head_size]`` rows. kvgeom's model of it
(``KVLayout.HEAD_KV_MAJOR``, kvgeom/testing/_layout.py) places byte ``x`` of K of token ``t``, head ``h`` at
element ``h * 2 * B * D + d * B + t`` of a block (``B`` tokens, ``D`` = head size, ``d`` = x's element) and
V at ``h * 2 * B * D + B * D + t * D + d``; this checks both against the real op."""

from __future__ import annotations

import torch

H, B, D, T = 2, 32, 64, 40  # heads, block tokens, head size, tokens written (one block and a part)


def test_the_cpu_kernel_stores_k_transposed_then_v_rows() -> None:
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.float32, B, D)
    cache = torch.zeros(2, H, B, 2 * D, dtype=torch.float32)
    k_cache, v_cache = cache.view(2, H, B * 2, D).chunk(2, dim=2)
    t = torch.arange(T, dtype=torch.float32)[:, None, None]
    h = torch.arange(H, dtype=torch.float32)[None, :, None]
    d = torch.arange(D, dtype=torch.float32)[None, None, :]
    key = 1e6 + t * 1e3 + h * 100 + d  # every element its own value
    value = 2e6 + t * 1e3 + h * 100 + d
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.arange(T, dtype=torch.int64), isa)
    flat = cache.reshape(-1)
    for tok in range(T):
        block, n = divmod(tok, B)
        base = block * H * B * 2 * D
        for head in range(H):
            head_base = base + head * 2 * B * D
            k_at = head_base + torch.arange(D) * B + n
            v_at = head_base + B * D + n * D + torch.arange(D)
            assert torch.equal(flat[k_at], key[tok, head]), (isa, tok, head)
            assert torch.equal(flat[v_at], value[tok, head]), (isa, tok, head)
