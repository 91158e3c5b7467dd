"""quantkit.kernels: Triton kernels for CUDA, one op per file, each with an asserting launcher and a torch `*_ref`.

QLinear on CUDA: `prepared = prepare(qtensor)` once, then `matmul(x, prepared, bias)`.
Engine on CUDA: `kv_store.kv_store`, then `paged_attention_decode` / `paged_attention_prefill` over the paged
KV cache; `rmsnorm.rmsnorm` and `silu_gate.silu_gate` are the optional fused layer ops.
"""

from .paged_attention import paged_attention_decode
from .paged_prefill import paged_attention_prefill
from .qgemm import Prepared, matmul, prepare

__all__ = ["Prepared", "matmul", "paged_attention_decode", "paged_attention_prefill", "prepare"]
