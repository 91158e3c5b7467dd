"""QLinear: the one quantized module. y = x @ W'.T + bias, W' = dequantize(self.qtensor()) (quant/scheme.py).

Storage (buffers, so .to(device) moves them; none is a float the model's dtype casts could round):
  qweight      4-bit: uint8 [N, ceil(K/2)], code 2j in the low nibble of byte j, 2j+1 in the high nibble
               8-bit: int8  [N, K] = codes - 128 (exactly the weight torch's int8 kernel takes)
  scales_bits  int16 [N, G]  the float16 scales' bits (viewed back as float16; immune to model.to(bf16))
  zeros        uint8 [N, G]
  g_idx        int32 [K] or None (act-order)
  bias         [N] or None (model dtype)
The QTensor is rebuilt exactly from these (`qtensor()`), so checkpoint writers save what was loaded.

Forward, chosen per call; each backend's `prepare(qtensor)` (its packed copy, or None where it does not take the
layer) is built on first use and cached per device (`prepared(backend)`):
  CUDA              "triton": quantkit.kernels.triton.qgemm, matmul(x, prepared) per call.
  CPU, bfloat16, on gemm.py's W4/W8 packing ("amx", built with or without AMX), the kernel `packed_kernel(M)`
  names:
    "amx"      AMX, M >= _AMX_MIN_M: kernels/cpu/gemm.py, matmul_packed: dequantize pairs of 16-column blocks
               into L2 and run AMX tile matmuls on them (~0.63 B/weight at 4 bit), where torch's per-row kernels
               are 6-8x slower than a bf16 matmul at 64 rows; at prefill sizes one C dequantization of the whole
               weight, then the same AMX GEMM
    "rowwise"  AVX512-BF16 without AMX, M >= _AMX_MIN_M: kernels/cpu/rowwise_gemm.py's qmatmul, each 64-column
               panel dequantized to bf16 once per call, then AVX-512 BF16 dot products for every row (on SmolLM2's
               shapes 1.0-1.2x torch's per-row int4 kernel at 5-8 rows, 1.4-3.1x at 16-64, 1.6-5.7x its int8
               ones, and 1.4-3.9x dequantize + matmul above 64 rows; bench/cpu_qmatmul.py)
    "gemv"     AVX512-BF16, 1 <= M <= gemv.MAX_ROWS (4): kernels/cpu/gemv.py's GEMV streams the packed codes once
               per call (decode of 1-4 sequences; 1.0-1.5x torch's per-row int4 kernel, 1.5-2.2x its two-call int8
               one on SmolLM2's shapes, bench/cpu_gemv.py)
    so no tinygemm copy is built where AVX512-BF16 is (SmolLM2 W4 g64: 1.48 -> 1.11 B/weight held)
  CPU, bfloat16, 0 < M <= _KERNEL_MAX_M[kind]   "tinygemm": kernels/cpu/tinygemm.py, torch's packed int4/int8
                    kernels (kind int4, int8 or int8_hilo; the layouts and identities are in that file; the int8
                    kind reuses qweight): CPUs without AVX512-BF16, and layers gemm.py's packing does not take
  otherwise         dequantize to x's dtype (fp32 math), then F.linear: no cached float weight (memory stays at
                    the packed size). torch vectorizes its int4/int8 CPU kernels for bfloat16 only: fp32/fp16 inputs
                    take a scalar path no faster than dequantize + matmul at one row and ~35x slower at 64 rows; and
                    above the row thresholds one dequantization beats the kernels (bench/qlinear_cpu.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu import gemv as cpu_gemv
from quantkit.kernels.cpu import rowwise_gemm, tinygemm
from quantkit.quant.scheme import QTensor, dequantize, in_group_order, num_groups, pack_nibbles, unpack_nibbles

# Largest row count M for which the packed kernel beats dequantize + matmul (bf16, 1 thread, bench/qlinear_cpu.py:
# a kernel costs ~22 us per row per 0.9M weights (~45 us for the two-call int8_hilo), one dequantization ~2 ms).
_KERNEL_MAX_M = {"int4": 64, "int8": 64, "int8_hilo": 32}
# CPUs with AMX (kernels/cpu/gemm.py): from _AMX_MIN_M rows the AMX dequant-GEMM; below, the GEMV of
# kernels/cpu/gemv.py on the same packing (bench/qlinear_cpu.py, bench/cpu_gemv.py)
_AMX_MIN_M = 5
assert cpu_gemv.MAX_ROWS == _AMX_MIN_M - 1  # every row count has one packed kernel


def packed_kernel(m: int) -> str | None:
    """The C kernel a bf16 call of m rows runs on gemm.py's W4/W8 packing here ("amx", "rowwise", "gemv": module
    docstring), or None (torch's per-row kernels, or the reference)."""
    if m >= _AMX_MIN_M:
        if cpu_gemm.available():
            return "amx"
        return "rowwise" if rowwise_gemm.quantized_available() else None
    return "gemv" if m > 0 and cpu_gemv.available() else None


# matmul_packed - kind of packed_kernel, x2 [M, K] bf16, gemm.prepare's (perm, packed) -> y [M, N] ([M, N/2] act)
def matmul_packed(kind: str, x2: torch.Tensor, perm: torch.Tensor | None, packed, bits: int,
                  act: bool = False) -> torch.Tensor:
    """y = x2 @ dequantize(W)^T through that kernel (act: silu(gate) * up of alternating gate/up blocks)."""
    if kind == "amx":
        return cpu_gemm.matmul_packed(x2, perm, packed, bits, act)
    kernel = rowwise_gemm.qmatmul if kind == "rowwise" else cpu_gemv.qgemv
    return kernel(in_group_order(x2, perm), packed, bits, act)


class QLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, sym: bool,
                 bias: bool = False, act_order: bool = False):
        super().__init__()
        if bits not in (4, 8):
            raise QuantkitError(f"QLinear supports 4 or 8 bits, got {bits}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.sym = bits, group_size, sym
        n, k, groups = out_features, in_features, num_groups(in_features, group_size)
        if bits == 4:
            self.register_buffer("qweight", torch.zeros(n, (k + 1) // 2, dtype=torch.uint8))
        else:
            self.register_buffer("qweight", torch.zeros(n, k, dtype=torch.int8))
        self.register_buffer("scales_bits", torch.zeros(n, groups, dtype=torch.int16))
        self.register_buffer("zeros", torch.zeros(n, groups, dtype=torch.uint8))
        self.register_buffer("g_idx", torch.zeros(k, dtype=torch.int32) if act_order else None)
        self.register_buffer("bias", torch.zeros(n) if bias else None)
        self._prepared: dict[str, Any] = {}  # backend -> its prepare(qtensor) (None: not taken), built lazily

    @classmethod
    def from_qtensor(cls, qt: QTensor, bias: Optional[torch.Tensor] = None) -> "QLinear":
        n, k = qt.shape
        layer = cls(k, n, qt.bits, qt.group_size, qt.sym, bias is not None, qt.g_idx is not None)
        device = qt.codes.device
        layer.to(device)
        with torch.no_grad():
            if qt.bits == 4:
                layer.qweight.copy_(pack_nibbles(F.pad(qt.codes, (0, qt.shape[1] % 2))))
            else:
                layer.qweight.copy_((qt.codes.to(torch.int16) - 128).to(torch.int8))
            layer.scales_bits.copy_(qt.scales.view(torch.int16))
            layer.zeros.copy_(qt.zeros)
            if qt.g_idx is not None:
                layer.g_idx.copy_(qt.g_idx)
            if bias is not None:
                layer.bias = bias.detach().clone().to(device)
        return layer

    def qtensor(self) -> QTensor:
        """The exact QTensor this module was built from (on the module's device)."""
        return QTensor(self._codes(), self.zeros, self.scales_bits.view(torch.float16), self.g_idx, self.bits,
                       self.group_size, self.sym)

    def _codes(self) -> torch.Tensor:
        """uint8 [N, K]."""
        if self.bits == 4:
            return unpack_nibbles(self.qweight, self.in_features)
        return (self.qweight.to(torch.int16) + 128).to(torch.uint8)

    def extra_repr(self) -> str:
        g = "per-channel" if self.group_size == -1 else f"group_size={self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, {g}, "
                f"sym={self.sym}, act_order={self.g_idx is not None}, bias={self.bias is not None}")

    def _apply(self, fn, recurse=True):
        self._prepared = {}  # device or dtype moves invalidate the backends' copies
        return super()._apply(fn, recurse)

    def prepared(self, backend: str) -> Any:
        """The backend's copy of this weight ("triton", "amx" or "tinygemm", module docstring), built once per
        device; None where that backend does not take this layer."""
        if backend not in self._prepared:
            qt = self.qtensor()
            if backend == "tinygemm":  # its per-channel int8 kind takes qweight (codes - 128) as it is
                self._prepared[backend] = tinygemm.prepare(qt, self.qweight if self.bits == 8 else None)
            elif backend == "amx":
                runs = packed_kernel(1) or packed_kernel(_AMX_MIN_M)  # a kernel reads it
                self._prepared[backend] = cpu_gemm.prepare(qt) if runs else None
            elif backend == "triton":
                from quantkit.kernels.triton import qgemm  # CUDA only: Triton loads on first use

                self._prepared[backend] = qgemm.prepare(qt)
            else:
                raise ValueError(f"unknown QLinear backend {backend!r} (triton, amx, tinygemm)")
        return self._prepared[backend]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> y [..., N] in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if x.is_cuda:
            return self._cuda(x2).reshape(*lead, self.out_features)
        return self._cpu(x2).reshape(*lead, self.out_features)

    def _cuda(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] -> [M, N] via the Triton dequant-GEMM kernels (bias fused there)."""
        from quantkit.kernels.triton import qgemm

        bias = None if self.bias is None else self.bias.to(x2.dtype)
        return qgemm.matmul(x2, self.prepared("triton"), bias)

    def _cpu(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] -> [M, N] in x2's dtype, bias added: the first backend that takes this call; otherwise
        dequantize + F.linear with the bias fused (the fp32 reference, bit for bit)."""
        y = self._cpu_kernel(x2)
        bias = None if self.bias is None else self.bias.to(x2.dtype)
        if y is None:
            return F.linear(x2, dequantize(self.qtensor(), x2.dtype), bias)
        return y if bias is None else y + bias

    def _cpu_kernel(self, x2: torch.Tensor) -> torch.Tensor | None:
        """x2 [M, K] -> [M, N] without bias from a bf16 kernel that takes this call, else None."""
        m = x2.shape[0]
        if x2.dtype == torch.bfloat16:
            kind = packed_kernel(m)
            amx = None if kind is None else self.prepared("amx")
            if amx is not None:
                return matmul_packed(kind, x2, *amx, self.bits)
            packed = self.prepared("tinygemm")
            if packed is not None and 0 < m <= _KERNEL_MAX_M[packed[0]]:
                return tinygemm.matmul(x2, packed)
        return None
