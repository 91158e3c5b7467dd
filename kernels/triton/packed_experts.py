# packed_experts - E experts' quantized weights (repack.py's PackedWeight layout) stacked for fused_moe.py
"""One W4/W8 weight [N, K] per expert in the packed layout of repack.py, stacked along a leading expert dim so one
grouped-GEMM launch addresses every expert (expert e's tile at base + e * stride(0)). An expert may be the
concatenation along N of several parts read from one input (gate and up): they must share bits, group and the
act-order permutation, and their scales, zeros and words are concatenated along N (repack.py's layout keeps N
contiguous, so a part is a column range).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .dequantize import dequantize_ref
from .repack import PackedWeight


@dataclass(frozen=True)
class PackedExperts:
    qweight: torch.Tensor  # int32 [E, ceil(K / p), N]
    scales: torch.Tensor  # float16 [E, G, N]
    zeros: torch.Tensor  # uint8 [E, G, N] (same strides as scales)
    perm: Optional[torch.Tensor]  # int32 [E, K] (packed row k of expert e holds x column perm[e, k]) or None
    bits: int
    group_k: int  # packed rows per group (repack.GROUP_PER_CHANNEL for per-channel)
    sym: bool  # every zero is 2^(bits - 1)
    in_features: int  # K
    out_features: int  # N

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def expert(self, e: int) -> PackedWeight:
        """Expert e as one PackedWeight (views)."""
        return PackedWeight(self.qweight[e], self.scales[e], self.zeros[e], None if self.perm is None else self.perm[e],
                            self.bits, self.group_k, self.sym, self.in_features, self.out_features)


def stack_packed(experts: list[list[PackedWeight]]) -> Optional[PackedExperts]:
    """experts[e]: the parts of expert e, concatenated along N (gate, up) -> PackedExperts; None when the parts do
    not share one K, bits and group, the experts one N, or an expert's parts one permutation."""
    parts = [p for expert in experts for p in expert]
    if len({(p.in_features, p.bits, p.group_k) for p in parts}) != 1:
        return None
    if len({sum(p.out_features for p in expert) for expert in experts}) != 1:
        return None
    perms = []
    for expert in experts:
        first = expert[0].perm
        if any((p.perm is None) != (first is None) or (first is not None and not torch.equal(p.perm, first))
               for p in expert):
            return None
        perms.append(first)
    k = parts[0].in_features
    if all(q is None for q in perms):
        perm = None
    else:  # an expert without act-order reads x in order
        identity = torch.arange(k, dtype=torch.int32, device=parts[0].device)
        perm = torch.stack([identity if q is None else q for q in perms])
    qweight, scales, zeros = (torch.stack([torch.cat([getattr(p, field) for p in expert], dim=1) for expert in experts])
                              for field in ("qweight", "scales", "zeros"))  # each [E, rows, N]
    return PackedExperts(qweight, scales, zeros, perm, parts[0].bits, parts[0].group_k, all(p.sym for p in parts), k,
                         sum(p.out_features for p in experts[0]))


def dequantize_experts_ref(packed: PackedExperts) -> torch.Tensor:
    """Pure torch: the dequantized weights [E, N, K] fp32 (repack.dequantize_ref per expert)."""
    return torch.stack([dequantize_ref(packed.expert(e)).t() for e in range(packed.num_experts)])
