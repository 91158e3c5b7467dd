# kv_store - k/v [T, Hkv, D] -> k/v_cache [num_blocks, block_size, Hkv, D] at slot_mapping int64 [T], fp16/bf16
"""Write this step's new keys and values into their cache slots.

slot = block_tables[s][t // block_size] * block_size + t % block_size (docs/CONTRACTS.md), so slot // block_size
is the physical block and slot % block_size the row in it. A negative slot (padding token) writes nothing.
Grid (T, cdiv(Hkv * D, BLOCK)): program (t, c) copies elements [c*BLOCK, +BLOCK) of token t's flattened (Hkv, D).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_store_kernel(
    k_ptr, v_ptr,  # [T, Hkv, D], head_dim stride 1
    kc_ptr, vc_ptr,  # [num_blocks, block_size, Hkv, D], head_dim stride 1
    slot_ptr,  # int64 [T]
    block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, NUM_ELEMS: tl.constexpr, BLOCK: tl.constexpr,  # NUM_ELEMS = Hkv * D
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat (head, d) index
    slot = tl.load(slot_ptr + t + tl.zeros_like(offs))  # [BLOCK] int64, the token's slot broadcast
    mask = (offs < NUM_ELEMS) & (slot >= 0)
    head = offs // HEAD_DIM
    d = offs % HEAD_DIM
    # source (t, head, d) at t * stride_t + head * stride_h + d
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + d, mask=mask)
    # cache (slot // block_size, slot % block_size, head, d)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + head * stride_ch + d  # int64
    tl.store(kc_ptr + dst, k, mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, block: int = 1024) -> None:
    """In place: k_cache/v_cache[slot // block_size, slot % block_size] = k/v[t] for every t with slot >= 0."""
    assert k.dim() == 3 and k.shape == v.shape, "k, v [T, Hkv, D]"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), \
        "caches [num_blocks, block_size, Hkv, D] alike"
    assert k.shape[1:] == k_cache.shape[2:], f"k {tuple(k.shape)} vs cache {tuple(k_cache.shape)}"
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, "k, v and caches share one dtype"
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be contiguous"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (k.shape[0],), "slot_mapping int64 [T]"
    assert k.device == k_cache.device == slot_mapping.device, "one device"
    t, hkv, d = k.shape
    if t == 0:
        return
    block = min(block, triton.next_power_of_2(hkv * d))
    _kv_store_kernel[(t, triton.cdiv(hkv * d, block))](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=d, NUM_ELEMS=hkv * d, BLOCK=block,
    )


def kv_store_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Pure torch `kv_store` (in place)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = k[keep]
    v_cache[slots // block_size, slots % block_size] = v[keep]
