"""Fused CPU kernels for the per-token work between the matmuls (fused.c, built once by build.py; OpenMP over
rows, fp32 math):

  add_rms_norm   sum = residual + x (rounded to the dtype), out = weight * rms_norm(sum): one pass instead of
                 the eight ops of the torch path
  rope           rotate-half RoPE of q and k in place, cos/sin from a fp32 table [positions, R] (cos | sin) over
                 the first R <= D dims of each head (R < D: partial rotary, the rest pass through)
  add_fp32_norm  add_rms_norm with the normed value times (offset + weight) in fp32, plus an optional bias, rounded
                 once (OLMo 2's and Gemma's order), optionally mean-centred first (LayerNorm)
  silu_mul       out = silu(gate) * up
  gelu_tanh_mul  out = gelu(gate) * up, gelu's tanh approximation (Gemma's GeGLU)
  *_rows         out = relu(x)^2 or gelu(x): the activation of an MLP without gate (ACTIVATIONS)
  kv_store       copy each token's K and V rows into the paged cache at its slot (replaces index_copy_)

Rounding follows the model's torch ops: the normalised value is rounded to the dtype before the weight multiplies
it, as in Hugging Face's LlamaRMSNorm; products are otherwise rounded once (a torch path that rounds after every op
differs by at most a rounding step in bf16). The `*_ref` functions are the kernels' math in plain torch.
CpuFusedOps is a model's `ops` (TorchOps' contract: rms_norm, fp32_norm, rope, silu_mul, gelu_tanh_mul,
activation) when the library builds; it is given the ops to fall back on (the model's torch ops) for inputs the
kernels do not cover, so this file knows nothing of the model.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from quantkit.kernels.cpu.build import DTYPE_CODES, load_library

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "add_rms_norm": [_P, _I64, _P, _P, _P, _P, _INT, _INT, _F, _INT, _INT],
    "rope": [_P, _I64, _INT, _P, _I64, _INT, _P, _P, _INT, _INT, _INT, _INT, _INT],
    "add_fp32_norm": [_P, _I64, _P, _P, _P, _P, _INT, _INT, _F, _F, _INT, _P, _INT, _INT],
    "silu_mul": [_P, _I64, _P, _I64, _P, _INT, _INT, _INT, _INT],
    "gelu_tanh_mul": [_P, _I64, _P, _I64, _P, _INT, _INT, _INT, _INT],
    "relu2_rows": [_P, _I64, _P, _INT, _INT, _INT, _INT],
    "gelu_tanh_rows": [_P, _I64, _P, _INT, _INT, _INT, _INT],
    "kv_store": [_P, _I64, _P, _I64, _P, _P, _P, _INT, _I64, _INT],
}
ACTIVATIONS = {"relu2": "relu2_rows", "gelu_tanh": "gelu_tanh_rows"}  # activation(kind) -> its kernel
_MIN_ROPE_TABLE = 256  # rows of the first RoPE table; it grows by doubling
_MAX_ROPE_TABLES = 8  # inv_freq tensors with a cached table (a model has one or two)
_NO_TABLE = torch.empty(0, 0)


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """t [T, ...] -> (T, token stride in elements); the trailing dims must be contiguous (checked once per call: on
    the decode path these checks cost as much as the kernels, so the contiguous case goes first)."""
    if not t.is_contiguous() and (t.stride(-1) != 1 or any(t.stride(i) != t.stride(i + 1) * t.shape[i + 1]
                                                           for i in range(1, t.dim() - 1))):
        raise ValueError(f"the kernels take rows at any stride, each row contiguous; got {tuple(t.shape)} strides "
                         f"{t.stride()}")
    return t.shape[0], t.stride(0)


def _ours(*tensors: torch.Tensor) -> bool:
    """Tensors the kernels take: on CPU, one dtype among DTYPE_CODES."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:
            return False
    return True


# add_rms_norm_ref - x [..., H], residual [..., H] or None, weight [H] -> (out, sum) [..., H], x's dtype
def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    total = x if residual is None else (residual.float() + x.float()).to(x.dtype)
    t = total.float()
    normed = (t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) / t.shape[-1] + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype), total


# rope_ref - x [T, H, D], positions int [T], table fp32 [P, R] (cos | sin; R <= D rotated dims) -> [T, H, D], x's dtype
def rope_ref(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    cos, sin = table[positions.long()][:, None].chunk(2, dim=-1)  # [T, 1, R/2] each
    a, b = x[..., : table.shape[1]].float().chunk(2, dim=-1)
    rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)
    return torch.cat((rotated, x[..., table.shape[1]:]), dim=-1)


# add_fp32_norm_ref - as add_rms_norm_ref, the normed value times (offset + weight) in fp32 plus bias [H] or None
#                     (centered: x - mean(x) normed)
def add_fp32_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      offset: float, centered: bool, bias: torch.Tensor | None = None):
    total = x if residual is None else (residual.float() + x.float()).to(x.dtype)
    t = total.float()
    t = t - t.mean(-1, keepdim=True) if centered else t
    y = t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) / t.shape[-1] + eps) * (offset + weight.float())
    return (y if bias is None else y + bias.float()).to(x.dtype), total


# silu_mul_ref - gate, up [..., I] -> [..., I], gate's dtype
def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


# gelu_tanh_mul_ref - as silu_mul_ref with gelu's tanh approximation
def gelu_tanh_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.gelu(gate.float(), approximate="tanh") * up.float()).to(gate.dtype)


# activation_ref - x [..., I], a key of ACTIVATIONS -> [..., I], x's dtype
def activation_ref(x: torch.Tensor, kind: str) -> torch.Tensor:
    x32 = x.float()
    return (torch.square(F.relu(x32)) if kind == "relu2" else F.gelu(x32, approximate="tanh")).to(x.dtype)


# kv_store_ref - k, v [T, Hkv, D] -> k_cache, v_cache [NB, BS, Hkv, D] at slots int64 [T] (in place)
def kv_store_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def rotates_within(table: torch.Tensor, q: torch.Tensor) -> bool:
    """A RoPE table [P, R] fits heads [.., D]: R even, 0 < R <= D (R < D: partial rotary, the rest passes)."""
    r = table.shape[1]
    return 0 < r <= q.shape[-1] and r % 2 == 0


# rope_table_rows - rotary (inv_freq fp32 [R/2], attention_factor), size -> fp32 [size, R] (R: the rotated dims)
def rope_table_rows(rotary, size: int) -> torch.Tensor:
    """Row p = cos(p * inv_freq) | sin(p * inv_freq) of the rotary embedding, in fp32, times its attention factor
    (longrope, YaRN) as its forward scales them (each row is computed alone: a longer table's first rows are a
    shorter one's)."""
    freqs = torch.arange(size, device=rotary.inv_freq.device).to(torch.float32)[:, None] * rotary.inv_freq  # [P, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    if rotary.attention_factor != 1.0:
        cos, sin = cos * rotary.attention_factor, sin * rotary.attention_factor
    return torch.cat((cos, sin), dim=-1).contiguous()


class CpuFusedOps:
    """A model's per-token ops (TorchOps' five) as fused C kernels, plus kv_store for the attention backend. Inputs
    the kernels do not cover (another device or dtype, mixed dtypes, the dense [B, L, H, D] layout) take
    `fallback`, an object with the same ops (the model's torch ops)."""

    def __init__(self, lib: ctypes.CDLL, fallback):
        self.lib, self.fallback = lib, fallback
        # id(inv_freq) -> (inv_freq, positions of its latest call, table): one table per rotary embedding (Gemma 3
        # alternates a local and a global one layer by layer); the entry keeps inv_freq alive, so its id stays its own
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}

    @classmethod
    def load(cls, fallback) -> "CpuFusedOps | None":
        lib = load_library("fused", SIGNATURES)
        return None if lib is None else cls(lib, fallback)

    # a copied or unpickled model shares the loaded kernels; the RoPE table is a cache checked on every forward
    def __deepcopy__(self, memo) -> "CpuFusedOps":
        return self

    def __reduce__(self):
        return CpuFusedOps.load, (self.fallback,)

    # rms_norm - x [..., H] (rows at any stride), residual [..., H] or None, weight [H] -> (out, sum) [..., H]
    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        """-> (weight * norm(x + residual), x + residual) (x alone when residual is None)."""
        if not _ours(x, weight) or (residual is not None and residual.dtype != x.dtype):
            return self.fallback.rms_norm(x, residual, weight, eps)
        return self._norm(self.lib.add_rms_norm, x, residual, weight, eps)

    # fp32_norm - as rms_norm; the normed x times (offset + weight) in fp32 plus bias [H] (or None), rounded once;
    #             centered: LayerNorm's
    def fp32_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  offset: float, centered: bool, bias: torch.Tensor | None = None):
        if not _ours(x, weight, *(() if bias is None else (bias,))) or (
                residual is not None and residual.dtype != x.dtype):
            return self.fallback.fp32_norm(x, residual, weight, eps, offset, centered, bias)
        if bias is not None and (bias.shape != weight.shape or not bias.is_contiguous()):
            raise ValueError(f"fp32_norm: bias {tuple(bias.shape)} is not a contiguous weight-shaped vector")
        return self._norm(self.lib.add_fp32_norm, x, residual, weight, eps, offset, int(centered),
                          None if bias is None else bias.data_ptr())

    def _norm(self, kernel, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
              *scaling) -> tuple[torch.Tensor, torch.Tensor]:
        """One of the two norm kernels (their leading arguments, then `scaling`, dtype and threads)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        n, xs = _rows(x2)
        out = torch.empty(x2.shape, dtype=x.dtype)
        total = x
        if residual is not None:
            residual = residual.contiguous()
            if residual.shape != shape:
                raise ValueError(f"{kernel.__name__}: residual {tuple(residual.shape)} is not x's {tuple(shape)}")
            total = torch.empty(shape, dtype=x.dtype)
        if weight.shape != (shape[-1],) or not weight.is_contiguous():
            raise ValueError(f"{kernel.__name__}: weight must be contiguous [{shape[-1]}], got {tuple(weight.shape)}")
        kernel(x2.data_ptr(), xs, None if residual is None else residual.data_ptr(),
               None if residual is None else total.data_ptr(), weight.data_ptr(), out.data_ptr(), n, shape[-1], eps,
               *scaling, DTYPE_CODES[x.dtype], torch.get_num_threads())
        return out.view(shape), total

    # rope_table - positions int [T], rotary (its inv_freq fp32 [R/2]) -> fp32 [P, R], P > max(positions)
    def rope_table(self, positions: torch.Tensor, rotary) -> torch.Tensor:
        """rope_table_rows' table, long enough for positions. Every layer of one forward passes the same positions
        tensor: checked once per forward (the cache holds that tensor, so its identity cannot be recycled for
        another), grown by doubling; one table per inv_freq tensor (at most _MAX_ROPE_TABLES, the oldest dropped),
        so alternating rotaries do not rebuild each layer."""
        inv_freq = rotary.inv_freq
        _, last_positions, table = self._rope.get(id(inv_freq), (inv_freq, None, _NO_TABLE))
        if last_positions is positions:
            return table
        need, rows = int(positions.max()) + 1 if positions.numel() else 0, table.shape[0]
        if rows < need:  # grown by doubling; a new inv_freq's table as long as the others (the same positions)
            floor = 2 * rows if rows else max((t.shape[0] for _, _, t in self._rope.values()), default=0)
            size = max(need, floor, _MIN_ROPE_TABLE)
            table = rope_table_rows(rotary, size)
        if id(inv_freq) not in self._rope and len(self._rope) >= _MAX_ROPE_TABLES:
            del self._rope[next(iter(self._rope))]
        self._rope[id(inv_freq)] = (inv_freq, positions, table)
        return table

    # rope - q [T, Hq, D], k [T, Hkv, D] (tokens at any stride, heads contiguous), positions int [T] -> (q, k)
    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary):
        """q and k rotated in place at positions (rotary: the model's rotary embedding, for its inv_freq and
        attention factor; an unsettled longrope one, whose frequencies switch with the positions, takes the
        fallback)."""
        if q.dim() != 3 or positions.dim() != 1 or not _ours(q, k) or rotary.long_inv_freq is not None:
            return self.fallback.rope(q, k, positions, rotary)
        table = self.rope_table(positions, rotary)
        positions = positions.to(torch.int64).contiguous()
        n, qs = _rows(q)
        nk, ks = _rows(k)
        if nk != n or positions.shape[0] != n or k.shape[2] != q.shape[2] or not rotates_within(table, q):
            raise ValueError(f"rope: q [T, Hq, D], k [T, Hkv, D], positions [T], table [P, R <= D]; got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}, table "
                             f"{tuple(table.shape)}")
        self.lib.rope(q.data_ptr(), qs, q.shape[1], k.data_ptr(), ks, k.shape[1], positions.data_ptr(),
                      table.data_ptr(), n, q.shape[-1], table.shape[1], DTYPE_CODES[q.dtype], torch.get_num_threads())
        return q, k

    # silu_mul - gate, up [..., I] (rows at any stride) -> [..., I] contiguous, gate's dtype
    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not _ours(gate, up):
            return self.fallback.silu_mul(gate, up)
        return self._gated(self.lib.silu_mul, gate, up)

    # gelu_tanh_mul - as silu_mul, gelu's tanh approximation for silu
    def gelu_tanh_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not _ours(gate, up):
            return self.fallback.gelu_tanh_mul(gate, up)
        return self._gated(self.lib.gelu_tanh_mul, gate, up)

    # activation - x [..., I] (rows at any stride), a key of ACTIVATIONS -> [..., I] contiguous, x's dtype
    def activation(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        if not _ours(x):
            return self.fallback.activation(x, kind)
        x2 = x.reshape(-1, x.shape[-1])
        n, xs = _rows(x2)
        out = torch.empty(x2.shape, dtype=x.dtype)
        getattr(self.lib, ACTIVATIONS[kind])(x2.data_ptr(), xs, out.data_ptr(), n, x.shape[-1], DTYPE_CODES[x.dtype],
                                             torch.get_num_threads())
        return out.view(x.shape)

    @staticmethod
    def _gated(kernel, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        shape = gate.shape
        if up.shape != shape:
            raise ValueError(f"{kernel.__name__}: gate {tuple(shape)} and up {tuple(up.shape)} differ")
        g2, u2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
        n, gs = _rows(g2)
        _, us = _rows(u2)
        out = torch.empty(g2.shape, dtype=gate.dtype)
        kernel(g2.data_ptr(), gs, u2.data_ptr(), us, out.data_ptr(), n, shape[-1], DTYPE_CODES[gate.dtype],
               torch.get_num_threads())
        return out.view(shape)

    # kv_store - k, v [T, Hkv, D] (tokens at any stride) -> k_cache, v_cache [NB, BS, Hkv, D] contiguous at flat
    #            slots int64 [T] (in place)
    def kv_store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        n, ks = _rows(k)
        _, vs = _rows(v)
        shape, cache, dtype = k.shape, k_cache.shape, k.dtype
        if len(shape) != 3 or len(cache) != 4 or v.shape != shape or v_cache.shape != cache or cache[2] != shape[1] \
                or cache[3] != shape[2] or slots.shape != (n,) or slots.dtype is not torch.int64 \
                or v.dtype is not dtype or k_cache.dtype is not dtype or v_cache.dtype is not dtype \
                or not (k_cache.is_contiguous() and v_cache.is_contiguous() and slots.is_contiguous()):
            raise ValueError(f"kv_store: k, v [T, Hkv, D] into contiguous caches [NB, BS, Hkv, D] of their dtype at "
                             f"int64 slots [T]; got k {tuple(shape)} {dtype}, v {tuple(v.shape)}, caches "
                             f"{tuple(cache)} {k_cache.dtype}, slots {tuple(slots.shape)} {slots.dtype}")
        row = k.shape[1] * k.shape[2] * k.element_size()
        self.lib.kv_store(k.data_ptr(), ks * k.element_size(), v.data_ptr(), vs * v.element_size(),
                          k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), n, row,
                          torch.get_num_threads())
