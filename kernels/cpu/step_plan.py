"""A list of C kernel calls recorded once and replayed by one call (step_plan.c): the CPU's counterpart of a CUDA
graph, for a decode step whose per-op Python cost (~0.3 ms a layer) is larger than its kernels at batch 1.

Plan records each call with the arguments its launcher would pass: tensor pointers, strides, sizes. The tensors
must stay where they are (the plan holds a reference to each), so a replay reads the inputs the caller wrote into
them and writes the same outputs; the thread count is read at replay. The launchers' checks (shapes, strides,
dtypes) are the recorder's: each method checks what its kernel assumes, once, when the plan is built.
Kernels: fused.c (add_rms_norm, rope, silu_mul, kv_store), gemv.c (qgemv), rowwise_gemm.c (rowwise_gemm,
rowwise_qgemm), gemm.c (gemm_bf16, qgemm: the AMX tile GEMMs, where AMX runs), paged_decode.c (paged_decode,
paged_rows), moe.c (moe_forward, sigmoid_gated_add: recorded by kernels/cpu/moe.py) and step_plan.c's own
copy_rows, add_rows and scale_rows. bf16 activations (the GEMV and the GEMMs are bf16 kernels); the attention and
per-token kernels are recorded in their tensors' dtype.
"""

from __future__ import annotations

import ctypes
import struct

import torch

from quantkit.kernels.cpu import fused, gemv, paged_decode, rowwise_gemm
from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu.build import DTYPE_CODES, load_library
from quantkit.kernels.cpu.gemm import _FUSED_MAX_M, _check_quantized, _check_vnni, _check_x, _strides

OP_WORDS = 20  # plan_call.h's OP_WORDS: kind, function, up to 18 arguments
KINDS = ["add_rms_norm", "rope", "silu_mul", "kv_store", "qgemv", "rowwise_gemm", "paged_decode", "paged_rows",
         "copy_rows", "add_rows", "rowwise_qgemm", "gemm_bf16", "qgemm", "scale_rows", "add_fp32_norm",
         "gelu_tanh_mul", "scale_rows_at", "activation", "moe", "sigmoid_gated_add"]  # plan_call.h's enum, in order
# the most rows of x each quantized kernel takes in one call (a kind not here: any)
ROW_LIMITS = {"qgemv": gemv.MAX_ROWS, "qgemm": _FUSED_MAX_M}
_P, _INT, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {"run_plan": [_P, _INT, _INT], "copy_rows": [_P, _I64, _P, _P, _I64, _INT, _I64],
              "add_rows": [_P, _I64, _P, _I64, _INT, _INT], "scale_rows": [_P, _I64, ctypes.c_float, _INT, _INT],
              "scale_rows_at": [_P, _I64, _P, _P, _INT, _INT]}


def _library():
    return load_library("step_plan", SIGNATURES)


def available() -> bool:
    """Whether plans run here: this library, the per-token and attention kernels and the rowwise GEMM build (the
    GEMV, AVX2 + FMA + F16C or AVX512-BF16, is checked per linear: qgemv_available)."""
    return _library() is not None and load_library("fused", fused.SIGNATURES) is not None \
        and paged_decode._library() is not None and rowwise_gemm.available()


def _amx_library(kind: str) -> ctypes.CDLL:
    if not cpu_gemm.available():
        raise ValueError(f"{kind}: this CPU has no AMX (or the AMX GEMMs did not build)")
    return cpu_gemm._library()


def _check_gemm(kind: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                act: bool) -> tuple[int, int]:
    """What the bf16 GEMMs assume of x, the VNNI weight, the bias (bf16 [N] or None, never with act) and y -> (M, N)."""
    _check_x(x, _check_vnni(packed))
    m, n = x.shape[0], packed.shape[0] * 16
    if y.shape != (m, n // 2 if act else n) or y.dtype is not torch.bfloat16 or not y.is_contiguous() or (
            bias is not None and (act or bias.dtype is not torch.bfloat16 or bias.shape != (n,)
                                  or not bias.is_contiguous())):
        raise ValueError(f"{kind}: x {tuple(x.shape)}, weight of {n} columns, y {tuple(y.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} (act {act})")
    return m, n


def _address(lib: ctypes.CDLL, name: str) -> int:
    """The C function's address (a fresh lookup: a timing wrapper set on the library's attribute is not it)."""
    return ctypes.cast(lib[name], ctypes.c_void_p).value


def float_bits(value: float) -> int:
    """value as the 32 bits of its fp32 (a float argument of a recorded call)."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class Plan:
    """Recorded calls (`ops` int64 [n, OP_WORDS]) and every tensor they read or write (kept alive)."""

    def __init__(self):
        self.rows: list[list[int]] = []  # the calls, OP_WORDS each
        self._keep: list[torch.Tensor] = []
        self._ops: torch.Tensor | None = None
        self.lib = _library()
        self._fused = load_library("fused", fused.SIGNATURES)

    def __len__(self) -> int:
        return len(self.rows)

    def record(self, kind: str, lib: ctypes.CDLL | None, args: list[int], *tensors, function: str = "") -> None:
        """One call of `kind` (lib: the library exporting the C function of that name, or of `function`; None:
        step_plan.c's own); `tensors`: those it reads or writes (kept alive). Each kind's method below checks its
        arguments; a kernel of another module (kernels/cpu/moe.py) records itself."""
        if len(args) > OP_WORDS - 2:
            raise ValueError(f"{kind}: {len(args)} arguments, the plan holds {OP_WORDS - 2}")
        self.rows.append([KINDS.index(kind), 0 if lib is None else _address(lib, function or kind), *args]
                          + [0] * (OP_WORDS - 2 - len(args)))
        self._keep.extend(t for t in tensors if t is not None)
        self._ops = None

    def run(self) -> None:
        """Replay every call in order, on torch's current thread count."""
        if self._ops is None:
            self._ops = torch.tensor(self.rows, dtype=torch.int64)
        self.lib.run_plan(self._ops.data_ptr(), len(self.rows), torch.get_num_threads())

    # add_rms_norm - x [n, H] (rows at stride), residual/sum [n, H] contiguous or None, weight [H] -> out [n, H]
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, total: torch.Tensor | None,
                     weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
        """out = weight * norm(x + residual), total = x + residual (residual may be total: in place)."""
        self._norm("add_rms_norm", x, residual, total, weight, out, eps)

    # add_fp32_norm - as add_rms_norm, the normed value times (offset + weight) in fp32 plus bias [H] (or None)
    #                 (centered: LayerNorm's)
    def add_fp32_norm(self, x: torch.Tensor, residual: torch.Tensor | None, total: torch.Tensor | None,
                      weight: torch.Tensor, out: torch.Tensor, eps: float, offset: float, centered: bool,
                      bias: torch.Tensor | None = None) -> None:
        self._norm("add_fp32_norm", x, residual, total, weight, out, eps, bias, float_bits(offset), int(centered),
                   _ptr(bias))

    def _norm(self, kind: str, x, residual, total, weight, out, eps: float, bias=None, *scaling: int) -> None:
        n, xs = fused._rows(x)
        h = x.shape[-1]
        for t in (out, weight) + ((residual, total) if residual is not None else ()) + (
                (bias,) if bias is not None else ()):
            if t.dtype != x.dtype or not t.is_contiguous() or t.shape[-1] != h:
                raise ValueError(f"{kind}: {tuple(t.shape)} {t.dtype} is not a contiguous [.., {h}] {x.dtype}")
        self.record(kind, self._fused,
                     [x.data_ptr(), xs, _ptr(residual), _ptr(total), weight.data_ptr(), out.data_ptr(), n, h,
                      float_bits(eps), *scaling, DTYPE_CODES[x.dtype]], x, residual, total, weight, out, bias)

    # rope - q [n, Hq, D], k [n, Hk, D] (tokens at stride, heads contiguous), positions int64 [n], table fp32 [P, R]
    #        (R <= D: the first R dims of each head rotate)
    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> None:
        n, qs = fused._rows(q)
        nk, ks = fused._rows(k)
        if nk != n or positions.shape != (n,) or positions.dtype is not torch.int64 \
                or table.dtype is not torch.float32 or not fused.rotates_within(table, q) \
                or k.shape[2] != q.shape[2] or not table.is_contiguous():
            raise ValueError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}, "
                             f"table {tuple(table.shape)}")
        self.record("rope", self._fused, [q.data_ptr(), qs, q.shape[1], k.data_ptr(), ks, k.shape[1],
                                                positions.data_ptr(), table.data_ptr(), n, q.shape[2],
                                                table.shape[1], DTYPE_CODES[q.dtype]], q, k, positions, table)

    # silu_mul - gate, up [n, I] (rows at stride) -> out [n, I] contiguous
    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
        self._gated("silu_mul", gate, up, out)

    # gelu_tanh_mul - as silu_mul, with gelu's tanh approximation
    def gelu_tanh_mul(self, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
        self._gated("gelu_tanh_mul", gate, up, out)

    # activation - x [n, I] (rows at stride), a key of fused.ACTIVATIONS -> out [n, I] contiguous
    def activation(self, x: torch.Tensor, out: torch.Tensor, kind: str) -> None:
        n, xs = fused._rows(x)
        if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous() or kind not in fused.ACTIVATIONS:
            raise ValueError(f"activation {kind!r}: x {tuple(x.shape)} {x.dtype}, out {tuple(out.shape)} {out.dtype}")
        self.record("activation", self._fused, [x.data_ptr(), xs, out.data_ptr(), n, x.shape[1],
                                                 DTYPE_CODES[x.dtype]], x, out, function=fused.ACTIVATIONS[kind])

    def _gated(self, kind: str, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
        n, gs = fused._rows(gate)
        _, us = fused._rows(up)
        if up.shape != gate.shape or out.shape != gate.shape or not out.is_contiguous():
            raise ValueError(f"{kind}: gate {tuple(gate.shape)}, up {tuple(up.shape)}, out {tuple(out.shape)}")
        self.record(kind, self._fused, [gate.data_ptr(), gs, up.data_ptr(), us, out.data_ptr(), n,
                                         gate.shape[1], DTYPE_CODES[gate.dtype]], gate, up, out)

    # kv_store - k, v [n, Hkv, D] (tokens at stride) -> caches [NB, BS, Hkv, D] at slots int64 [n]
    def kv_store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        n, ks = fused._rows(k)
        _, vs = fused._rows(v)
        if k_cache.shape[2:] != k.shape[1:] or v.shape != k.shape or slots.shape != (n,) \
                or slots.dtype is not torch.int64 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError(f"kv_store: k {tuple(k.shape)}, caches {tuple(k_cache.shape)}, slots {tuple(slots.shape)}")
        es = k.element_size()
        self.record("kv_store", self._fused,
                     [k.data_ptr(), ks * es, v.data_ptr(), vs * es, k_cache.data_ptr(), v_cache.data_ptr(),
                      slots.data_ptr(), n, k.shape[1] * k.shape[2] * es], k, v, k_cache, v_cache, slots)

    # qgemv - x [M, K] bf16 contiguous (M <= gemv.MAX_ROWS), pack_quantized's weight -> y [M, N] ([M, N/2] act)
    def qgemv(self, x: torch.Tensor, packed, bits: int, y: torch.Tensor, act: bool = False) -> None:
        self._quantized("qgemv", gemv._library(), x, packed, bits, y, act)

    # rowwise_qgemm - as qgemv, any M (rowwise_gemm.quantized_available() must hold)
    def rowwise_qgemm(self, x: torch.Tensor, packed, bits: int, y: torch.Tensor, act: bool = False) -> None:
        if not rowwise_gemm.quantized_available():
            raise ValueError("rowwise_qgemm: this build has no AVX-512 BF16 rowwise GEMM")
        self._quantized("rowwise_qgemm", rowwise_gemm._library(), x, packed, bits, y, act)

    # qgemm - as qgemv, up to gemm._FUSED_MAX_M rows (where matmul_quantized runs it; gemm.available() must hold)
    def qgemm(self, x: torch.Tensor, packed, bits: int, y: torch.Tensor, act: bool = False) -> None:
        self._quantized("qgemm", _amx_library("qgemm"), x, packed, bits, y, act)

    def _quantized(self, kind: str, lib, x, packed, bits: int, y, act: bool) -> None:
        """One of the three kernels of gemm.c's qgemm arguments, from 1 to ROW_LIMITS[kind] (absent: any) rows."""
        max_rows = ROW_LIMITS.get(kind)
        _check_x(x, _check_quantized(packed, bits))
        codes, qparams, gs = packed
        m, n = x.shape[0], codes.shape[0] * 16
        if not 1 <= m <= (max_rows or m) or y.shape != (m, n // 2 if act else n) or y.dtype is not torch.bfloat16 \
                or not y.is_contiguous():
            raise ValueError(f"{kind}: x {tuple(x.shape)} (1 to {max_rows or 'any'} rows), y {tuple(y.shape)} "
                             f"{y.dtype}")
        cs, qs = _strides(packed)
        self.record(kind, lib, [x.data_ptr(), m, x.shape[1], codes.data_ptr(), cs, qparams.data_ptr(), qs, n, gs,
                                 bits, y.data_ptr(), int(act)], x, codes, qparams, y)

    # rowwise_gemm - x [M, K] bf16 contiguous, pack_bf16's weight [N/16, K/2, 16], bias bf16 [N] or None -> y
    def rowwise_gemm(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                     act: bool = False) -> None:
        m, n = _check_gemm("rowwise_gemm", x, packed, bias, y, act)
        self.record("rowwise_gemm", rowwise_gemm._library(),
                     [x.data_ptr(), m, x.shape[1], packed.data_ptr(), packed.stride(0), n, _ptr(bias), y.data_ptr(),
                      int(act)], x, packed, bias, y)

    # gemm_bf16 - as rowwise_gemm without a bias (gemm.c's AMX tile GEMM; gemm.available() must hold)
    def gemm_bf16(self, x: torch.Tensor, packed: torch.Tensor, y: torch.Tensor, act: bool = False) -> None:
        lib = _amx_library("gemm_bf16")
        m, n = _check_gemm("gemm_bf16", x, packed, None, y, act)
        self.record("gemm_bf16", lib, [x.data_ptr(), m, x.shape[1], packed.data_ptr(), packed.stride(0), n,
                                        y.data_ptr(), int(act)], x, packed, y)

    # paged_decode - q [S, Hq, D] contiguous, caches [NB, BS, Hkv, D], tables int32 [S, MB], lens int32 [S] -> out
    def paged_decode(self, q, k_cache, v_cache, tables, lens, scale: float, out) -> None:
        paged_decode._check(q, k_cache, v_cache, out, lens, "paged_decode")
        paged_decode._check_tables(tables, q.shape[0], "paged_decode")
        s, hq, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        self.record("paged_decode", paged_decode._library(),
                     [q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                      out.data_ptr(), s, hq, hkv, d, bs, tables.shape[1], float_bits(scale), DTYPE_CODES[q.dtype]],
                     q, k_cache, v_cache, tables, lens, out)

    # paged_rows - as paged_decode, each row r of sequence row_seqs[r] with length row_lens[r], window and soft-cap
    def paged_rows(self, q, k_cache, v_cache, tables, row_seqs, row_lens, scale: float, out,
                   window: int | None, softcap: float | None) -> None:
        paged_decode._check(q, k_cache, v_cache, out, row_lens, "paged_rows")
        paged_decode._check_tables(tables, None, "paged_rows")
        r, hq, d = q.shape
        if row_seqs.dtype is not torch.int32 or row_seqs.shape != (r,) or not row_seqs.is_contiguous():
            raise ValueError(f"paged_rows: row_seqs int32 [{r}] contiguous; got {row_seqs.dtype} "
                             f"{tuple(row_seqs.shape)}")
        _, bs, hkv, _ = k_cache.shape
        self.record("paged_rows", paged_decode._library(),
                     [q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), row_seqs.data_ptr(),
                      row_lens.data_ptr(), out.data_ptr(), r, hq, hkv, d, bs, tables.shape[1], float_bits(scale),
                      window or 0, float_bits(softcap or 0.0), DTYPE_CODES[q.dtype]],
                     q, k_cache, v_cache, tables, row_seqs, row_lens, out)

    # copy_rows - src [*, ...] rows (at stride), index int64 [n] or None -> dst [n, ...] rows (at stride)
    def copy_rows(self, src: torch.Tensor, index: torch.Tensor | None, dst: torch.Tensor) -> None:
        """dst[t] = src[index[t]] (index None: src[t]); each row contiguous, of one dtype and width."""
        n, ds = fused._rows(dst)
        _, ss = fused._rows(src)
        if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:] or (
                index is None and src.shape[0] < n) or (index is not None and (
                index.shape != (n,) or index.dtype is not torch.int64 or not index.is_contiguous())):
            raise ValueError(f"copy_rows: src {tuple(src.shape)} {src.dtype}, dst {tuple(dst.shape)} {dst.dtype}, "
                             f"index {None if index is None else tuple(index.shape)}")
        es = src.element_size()
        self.record("copy_rows", None, [src.data_ptr(), ss * es, _ptr(index), dst.data_ptr(), ds * es, n,
                                         dst[0].numel() * es], src, index, dst)

    # add_rows - y [n, H] bf16 (rows at stride) += b [n, H] (rows at stride) or a bias [H], each sum rounded once
    def add_rows(self, y: torch.Tensor, b: torch.Tensor) -> None:
        n, ys = fused._rows(y)
        bs = 0 if b.dim() == 1 else fused._rows(b)[1]
        if y.dtype is not torch.bfloat16 or b.dtype is not torch.bfloat16 or b.shape[-1] != y.shape[-1] or (
                b.dim() == 2 and b.shape[0] != n) or b.stride(-1) != 1:
            raise ValueError(f"add_rows: y {tuple(y.shape)} {y.dtype} += b {tuple(b.shape)} {b.dtype} (bf16)")
        self.record("add_rows", None, [y.data_ptr(), ys, b.data_ptr(), bs, n, y.shape[-1]], y, b)

    # scale_rows - y [n, H] bf16 (rows at stride) *= s, each product rounded once (torch's bf16 y * float)
    def scale_rows(self, y: torch.Tensor, s: float) -> None:
        n, ys = fused._rows(y)
        if y.dtype is not torch.bfloat16 or y.dim() != 2:
            raise ValueError(f"scale_rows: y {tuple(y.shape)} {y.dtype} (bf16 rows)")
        self.record("scale_rows", None, [y.data_ptr(), ys, float_bits(s), n, y.shape[-1]], y)

    # scale_rows_at - y [n, H] bf16 (rows at stride), index int64 [n], table bf16 [P] -> y[t] *= table[index[t]]
    def scale_rows_at(self, y: torch.Tensor, index: torch.Tensor, table: torch.Tensor) -> None:
        """Each product rounded once (torch's bf16 y times a bf16 tensor); index values must lie in [0, P)."""
        n, ys = fused._rows(y)
        if y.dtype is not torch.bfloat16 or y.dim() != 2 or table.dtype is not torch.bfloat16 or table.dim() != 1 \
                or not table.is_contiguous() or index.shape != (n,) or index.dtype is not torch.int64 \
                or not index.is_contiguous():
            raise ValueError(f"scale_rows_at: y {tuple(y.shape)} {y.dtype} (bf16 rows), index {tuple(index.shape)} "
                             f"{index.dtype} (int64 [n]), table {tuple(table.shape)} {table.dtype} (bf16 [P])")
        self.record("scale_rows_at", None, [y.data_ptr(), ys, index.data_ptr(), table.data_ptr(), n, y.shape[-1]],
                     y, index, table)
