"""The logits rows of a CPU decode step (logits.c, built once by build.py): a decode step of 64 sequences ends with
[64, 49152] logits, where torch's bf16 -> fp32 conversion and max(dim=-1) took 4-10 ms each on 2 cores, a tenth of
the step (bench: `quantkit bench step`, batch 64). Both are exact, so they are torch's results bit for bit:

  to_float(x, out)   out [R, V] fp32 = x [R, V] bf16 (rows at any stride, each row contiguous); returns out
  first_argmax(x)    int64 [R]: the first index of each row's maximum of x [R, V] fp32 (NaN: the first NaN,
                     as torch.max(dim=-1) propagates it); torch's own max on other devices and dtypes, or where
                     the library does not build
"""

from __future__ import annotations

import ctypes

import torch

from quantkit.kernels.cpu.build import load_library
from quantkit.kernels.cpu.fused import _rows

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {"bf16_rows_to_f32": [_P, _I64, _P, _I64, _INT, _INT, _INT],
              "argmax_rows": [_P, _I64, _INT, _INT, _P, _INT]}


def _library():
    return load_library("logits", SIGNATURES)


def available() -> bool:
    return _library() is not None


# to_float - x [R, V] bf16, out [R, V] fp32 (rows at any stride, each row contiguous), on the CPU -> out
def to_float(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    (n, xs), (_, os) = _rows(x), _rows(out)
    if x.dtype is not torch.bfloat16 or out.dtype is not torch.float32 or x.dim() != 2 or out.shape != x.shape \
            or not (x.is_cpu and out.is_cpu):
        raise ValueError(f"to_float: x [R, V] bf16 and out of its shape fp32, on the CPU; got x {tuple(x.shape)} "
                         f"{x.dtype}, out {tuple(out.shape)} {out.dtype}")
    _library().bf16_rows_to_f32(x.data_ptr(), xs, out.data_ptr(), os, n, x.shape[1], torch.get_num_threads())
    return out


# first_argmax - x [R, V] -> int64 [R]
def first_argmax(x: torch.Tensor) -> torch.Tensor:
    lib = _library() if x.is_cpu and x.dtype is torch.float32 and x.dim() == 2 and x.shape[1] > 0 else None
    if lib is None or x.stride(-1) != 1:
        return x.max(dim=-1).indices
    idx = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], idx.data_ptr(), torch.get_num_threads())
    return idx
