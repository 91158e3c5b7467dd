"""quantkit.kernels.cpu: the kernels of CPU serving, each a real .c file beside its Python launcher (asserting what
the C code assumes, with a `*_ref` in plain torch): gemm (AMX bf16 and W4/W8 GEMMs), gemv (W4/W8, 1-4 rows),
rowwise_gemm (the row-invariant bf16 GEMM of batch-invariant serving), paged_decode (also paged_rows: any query row
as a decode item), paged_prefill, fused (per-token ops); plus tinygemm.py, torch's own packed int4/int8 kernels (no C
of ours).

build.py compiles a kernel's sources once per machine (cached by source, headers, flags, CPU and torch) and loads
them with ctypes; a machine without a compiler, AVX-512 or AMX gets None from the loader and the torch path.
Each backend's `prepare(qtensor)` (gemm.py, tinygemm.py) is the one place that knows its packed weight layout.
"""
