"""QLinear: the one quantized module. y = x @ W'.T + bias, W' = dequantize(self.qtensor()) (quant/scheme.py).

Storage (buffers, so .to(device) moves them; none is a float the model's dtype casts could round):
  qweight      4-bit: uint8 [N, ceil(K/2)], code 2j in the low nibble of byte j, 2j+1 in the high nibble
               8-bit: int8  [N, K] = codes - 128 (exactly the weight torch's int8 kernel takes)
  scales_bits  int16 [N, G]  the float16 scales' bits (viewed back as float16; immune to model.to(bf16))
  zeros        uint8 [N, G]
  g_idx        int32 [K] or None (act-order)
  bias         [N] or None (model dtype)
The QTensor is rebuilt exactly from these (`qtensor()`), so checkpoint writers save what was loaded.

Forward, chosen per call:
  CUDA              quantkit.kernels.triton.qgemm: prepare(qtensor) once per device, matmul(x, prepared) per call.
  CPU with AMX, bfloat16, M >= _AMX_MIN_M   kernels/cpu/gemm.py: dequantize pairs of 16-column blocks into L2 and
                    run AMX tile matmuls on them (its own packed copy: ~0.63 B/weight at 4 bit), where torch's
                    per-row kernels are 6-8x slower than a bf16 matmul at 64 rows; at prefill sizes one C
                    dequantization of the whole weight, then the same AMX GEMM
  CPU, bfloat16, few rows (M <= _KERNEL_MAX_M)   torch's packed CPU kernels, repacked once per device (a second
                    copy of the codes: ~0.56 B/weight at 4 bit, ~1.1 for int8_hilo; the int8 path reuses qweight):
      4-bit         _weight_int4pack_mm_for_cpu (tinygemm: w = s * (q - 8) + zf with zf = s * (8 - z))
      8-bit, G = 1  _weight_int8pack_mm on qweight (+ x.sum * s * (128 - z) when asymmetric)
      8-bit, G > 1  two tinygemm calls on the high and low nibbles: q = 16 * hi + lo
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
from quantkit.quant.scheme import QTensor, dequantize, num_groups, pack_nibbles, unpack_nibbles

# Largest row count M for which the packed kernel beats dequantize + matmul (bf16, 1 thread, bench/qlinear_cpu.py:
# a kernel costs ~22 us per row per 0.9M weights (~45 us for the two-call int8_hilo), one dequantization ~2 ms).
_KERNEL_MAX_M = {"int4": 64, "int8": 64, "int8_hilo": 32}
_TINYGEMM_GROUPS = (256, 128, 64, 32)  # group sizes _weight_int4pack_mm_for_cpu accepts
# CPUs with AMX (kernels/cpu/gemm.py): below _AMX_MIN_M rows torch's per-row kernel skips the dequantization and
# wins; from there the AMX dequant-GEMM (bench/qlinear_cpu.py)
_AMX_MIN_M = 5


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
        self._kernel: Optional[tuple[str, Any]] = None  # (kind, kernel tensors), built lazily per device
        self._amx: Optional[tuple[str, Any]] = None  # ("amx", (perm, packed)) or ("none", None), built lazily

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
        self._kernel = self._amx = None  # device or dtype moves invalidate the repacked kernel tensors
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> y [..., N] in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if x.is_cuda:
            return self._cuda(x2).reshape(*lead, self.out_features)
        m = x2.shape[0]
        amx = self._amx_kernel() if x.dtype == torch.bfloat16 and m >= _AMX_MIN_M else None
        kernel = self._cpu_kernel() if x.dtype == torch.bfloat16 and amx is None else None
        if amx is not None:
            y = _run_amx(amx, x2, self.bits)
        elif kernel is not None and 0 < m <= _KERNEL_MAX_M[kernel[0]]:
            y = _run_cpu_kernel(kernel, x2)
        else:
            y = F.linear(x2, dequantize(self.qtensor(), x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _cuda(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] -> [M, N] via the Triton dequant-GEMM kernels (bias fused there)."""
        from quantkit.kernels.triton import qgemm

        if self._kernel is None:
            self._kernel = ("cuda", qgemm.prepare(self.qtensor()))
        bias = None if self.bias is None else self.bias.to(x2.dtype)
        return qgemm.matmul(x2, self._kernel[1], bias)

    def _cpu_kernel(self) -> Optional[tuple[str, Any]]:
        """Build (once) the packed-kernel tensors for bf16 inputs; None where no kernel fits this layer."""
        if self._kernel is None:
            int8_weight = self.qweight if self.bits == 8 else None
            self._kernel = _build_cpu_kernel(self.qtensor(), int8_weight) or ("none", None)
        return None if self._kernel[0] == "none" else self._kernel

    def _amx_kernel(self) -> Optional[tuple[str, Any]]:
        """Build (once) the AMX dequant-GEMM's packed weight; None without AMX or for shapes it does not take."""
        if self._amx is None:
            self._amx = ("none", None)
            from quantkit.kernels.cpu import gemm as cpu_gemm

            qt = self.qtensor()
            layout = _contiguous_groups(qt) if cpu_gemm.available() else None
            if layout is not None:
                perm, g, codes = layout
                packed = cpu_gemm.pack_quantized(codes, qt.scales, qt.zeros, qt.bits, g)
                if packed is not None:
                    self._amx = ("amx", (perm, packed))
        return None if self._amx[0] == "none" else self._amx


def _run_amx(kernel: tuple[str, Any], x2: torch.Tensor, bits: int) -> torch.Tensor:
    """x2 [M, K] bf16 -> [M, N] bf16 through kernels/cpu/gemm.py's AMX dequant-GEMM."""
    from quantkit.kernels.cpu import gemm as cpu_gemm

    perm, packed = kernel[1]
    return cpu_gemm.matmul_packed(x2, perm, packed, bits)


def _contiguous_groups(qt: QTensor) -> Optional[tuple[Optional[torch.Tensor], int, torch.Tensor]]:
    """(perm [K] or None, g, codes[:, perm] [N, K]) such that input columns x[:, perm] fall in contiguous groups of
    g in group order; None when act-order groups differ in size (no permutation makes them contiguous runs of one
    length)."""
    n, k = qt.shape
    g = k if qt.group_size == -1 else qt.group_size
    if qt.g_idx is None:
        return None, g, qt.codes
    counts = torch.bincount(qt.g_idx.to(torch.int64), minlength=num_groups(k, qt.group_size))
    if not bool((counts == g).all()):
        return None
    perm = torch.argsort(qt.g_idx, stable=True)
    return perm, g, qt.codes[:, perm]


def _tinygemm_group(g: int, k: int) -> Optional[int]:
    """Largest tinygemm group size dividing both our group length g and K (each of our groups spans g / tg)."""
    return next((tg for tg in _TINYGEMM_GROUPS if g % tg == 0 and k % tg == 0), None)


def _build_cpu_kernel(qt: QTensor, int8_weight: Optional[torch.Tensor] = None) -> Optional[tuple[str, Any]]:
    """Kernel tensors for bf16 inputs; int8_weight (codes - 128, [N, K]) is reused as is by the per-channel path."""
    n, k = qt.shape
    s = qt.scales.float()  # [N, G]
    z = qt.zeros.float()  # [N, G]
    if qt.bits == 8 and s.shape[1] == 1:  # one group: column order does not matter, no permutation
        # y = s * (x @ (q - 128).T) + s * (128 - z) * x.sum(-1)
        w8 = int8_weight if int8_weight is not None else (qt.codes.to(torch.int16) - 128).to(torch.int8)
        correction = None if bool((qt.zeros == 128).all()) else (s[:, 0] * (128 - z[:, 0]))  # [N] fp32
        return "int8", (None, w8, s[:, 0].to(torch.bfloat16), correction)
    layout = _contiguous_groups(qt)
    if layout is None:
        return None
    perm, g, codes = layout  # codes [N, K], groups now contiguous in order
    tg = _tinygemm_group(g, k)
    if tg is None or n % 16 or k % 2:
        return None
    repeat = g // tg  # tinygemm groups per quantkit group

    def scale_zero(scale: torch.Tensor, zero_float: torch.Tensor) -> torch.Tensor:
        """[N, G] each -> qScaleAndZeros bf16 [K / tg, N, 2] (w = scale * (q - 8) + zero_float)."""
        rep = lambda t: t.repeat_interleave(repeat, dim=1).T  # noqa: E731  [K/tg, N]
        return torch.stack([rep(scale), rep(zero_float)], dim=-1).to(torch.bfloat16).contiguous()

    pack4 = lambda c: torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.to(torch.int32).contiguous(), 1)  # noqa: E731
    if qt.bits == 4:
        return "int4", (perm, tg, [(pack4(codes), scale_zero(s, s * (8 - z)))])
    # 8-bit as two 4-bit halves: s*(q - z) = 16s*(hi - 8) + s*(lo - 8) + s*(136 - z)
    hi = (pack4(codes >> 4), scale_zero(16 * s, s * (136 - z)))
    lo = (pack4(codes & 0xF), scale_zero(s, torch.zeros_like(s)))
    return "int8_hilo", (perm, tg, [hi, lo])


def _run_cpu_kernel(kernel: tuple[str, Any], x2: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] bf16 -> [M, N] bf16."""
    kind, tensors = kernel
    perm = tensors[0]
    if perm is not None:
        x2 = x2.index_select(1, perm)  # act-order: columns into group order
    x2 = x2.contiguous()
    if kind == "int8":
        _, w8, scale, correction = tensors
        y = torch.ops.aten._weight_int8pack_mm(x2, w8, scale)
        if correction is not None:
            y = (y.float() + x2.float().sum(dim=1, keepdim=True) * correction).to(x2.dtype)
        return y
    _, tg, parts = tensors
    y = None
    for w4, sz in parts:
        part = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w4, tg, sz).float()
        y = part if y is None else y + part
    return y.to(x2.dtype)
