"""quantkit.kernels.triton: the CUDA kernels, one op per file, each with an asserting launcher and a torch `*_ref`.

QLinear on CUDA: `prepared = qgemm.prepare(qtensor)` once, then `qgemm.matmul(x, prepared, bias)`.
Engine on CUDA: `kv_store.kv_store`, then `paged_attention_decode` / `paged_attention_prefill` over the paged
KV cache; `rmsnorm.rmsnorm`, `rope.rope_` and `silu_gate.silu_gate` run a served model's norms, RoPE and
SiLU-and-multiply (`layer_ops.TritonOps`, which serve/prepare.py sets).
MoE on CUDA: `fused_moe.fused_moe` runs a block's experts (float or packed_experts W4/W8) as two grouped GEMMs.
Importing a module here imports triton: callers import them where they run on CUDA (or under TRITON_INTERPRET=1).
"""
