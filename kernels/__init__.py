"""quantkit.kernels: every kernel of the project, each with an asserting launcher and its torch reference.

  triton/   CUDA (Triton): dequant-GEMM/GEMV for the packed W4/W8 weights, paged attention, KV store, fused ops
  cpu/      CPU (C, AMX/AVX-512): the AMX GEMMs, paged decode and prefill attention, fused per-token ops; the C
            sources are real .c/.h files beside their launchers, compiled once per machine and cached

quant/, models/ and serve/ reach kernels only through this package; nothing here imports serve/.
"""
