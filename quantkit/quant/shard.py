"""Tensor-parallel slices of a quantized weight (quant/scheme.py's QTensor), each dequantizing to exactly that slice
of the full W' (tests/serve/test_tensor_parallel.py checks it bit for bit, with and without act-order):

  rows(qt, index)               output channels `index` int64 [n] (column-parallel q/k/v, gate/up, lm_head): the
                                rows of codes, scales and zeros; g_idx (it indexes K) is unchanged
  columns(qt, lo, hi, layer)    input channels [lo, hi) (row-parallel o_proj, down_proj):
    per-channel (g = -1)        the one group, any range
    no g_idx                    whole groups only: lo and hi multiples of g, scales/zeros columns lo/g .. hi/g;
                                otherwise a QuantkitError naming the layer (vLLM refuses the same split: "input size
                                is not aligned with the quantized weight shape")
    g_idx (GPTQ act-order)      column k belongs to group g_idx[k], and the groups are scattered over K (GPTQ formed
                                them in its column order). The slice keeps its columns' g_idx entries, renumbered over
                                the groups they reference, and those groups' scales/zeros. When they lie wholly inside
                                [lo, hi) it is an ordinary act-order QTensor of group size g. Otherwise a group is
                                split between workers (the usual case: K / N columns reference nearly every group);
                                every worker then keeps each group it references (as vLLM keeps all scales on every
                                worker of an act-order row-parallel layer), and the slice's group_size is only the
                                width that makes the [n, G] qparams hold them: floor(K_l / G_used), padded with
                                unreferenced groups when that does not come out even. W' is exact either way; the
                                CPU and CUDA kernels need equal groups (scheme.contiguous_groups), so such a slice
                                takes QLinear's dequantize + matmul path.
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.quant.scheme import SCALE_FLOOR, QTensor, canonical_g_idx, num_groups


def rows(qt: QTensor, index: torch.Tensor) -> QTensor:
    """The output channels `index` (int64 [n]) of qt [N, K] -> QTensor [n, K]."""
    index = index.to(qt.codes.device)
    return QTensor(qt.codes[index], qt.zeros[index], qt.scales[index], qt.g_idx, qt.bits, qt.group_size, qt.sym)


def columns(qt: QTensor, lo: int, hi: int, layer: str) -> QTensor:
    """The input channels [lo, hi) of qt [N, K] -> QTensor [N, hi - lo] (module docstring)."""
    n, k = qt.shape
    width = hi - lo
    codes = qt.codes[:, lo:hi].contiguous()
    g = qt.group_size
    if g == -1:
        return QTensor(codes, qt.zeros.clone(), qt.scales.clone(), None, qt.bits, g, qt.sym)
    if qt.g_idx is None:
        if lo % g or hi % g:
            raise QuantkitError(
                f"layer {layer}: input columns {lo}..{hi} of its {k} do not hold whole groups of {g}, so this "
                f"tensor-parallel split cannot shard it: choose a tensor_parallel_size that leaves each worker a "
                f"multiple of {g} columns")
        return QTensor(codes, qt.zeros[:, lo // g : hi // g].contiguous(), qt.scales[:, lo // g : hi // g].contiguous(),
                       None, qt.bits, g, qt.sym)
    used, local = torch.unique(qt.g_idx[lo:hi].long(), sorted=True, return_inverse=True)  # [G_used], [K_l]
    group_size = g if used.numel() * g == width else width // used.numel()  # whole groups: each has its g columns
    pad = num_groups(width, group_size) - used.numel()  # unreferenced groups that complete [n, G]
    scales = torch.cat([qt.scales[:, used], torch.full((n, pad), SCALE_FLOOR, dtype=torch.float16,
                                                       device=codes.device)], dim=1)
    zeros = torch.cat([qt.zeros[:, used], torch.zeros(n, pad, dtype=torch.uint8, device=codes.device)], dim=1)
    return QTensor(codes, zeros, scales, canonical_g_idx(local.to(torch.int32), width, group_size), qt.bits,
                   group_size, qt.sym)
