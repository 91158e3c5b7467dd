# aot - compile a quantkit Triton kernel for a GPU architecture on a machine without a GPU
"""Ahead-of-time compilation to a cubin (the ptxas bundled with triton does the last step), for the compile check
(tests/kernels/kernel_compile_check.py) and the instruction counts of bench/gpu_sass.py. Needs triton imported
without TRITON_INTERPRET=1: the kernels must be compiler JITFunctions."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_for(arch: int, fn, pointers: dict, consts: dict, floats=(), wide=(), warps=4, stages=3,
                aligned=()):
    """`fn` compiled for sm_<arch> -> triton's CompiledKernel (asm["cubin"], metadata.shared): pointer args typed by
    `pointers` (name -> triton dtype string such as "fp16"), `floats` fp32 scalars, `wide` int64 scalars, every
    other non-constexpr argument int32. `aligned`: the arguments known divisible by 16 (a pointer: its address in
    bytes), as the JIT specialises a launch whose values are (what lets it vectorise loads)."""
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i64" if name in wide else "i32"
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
