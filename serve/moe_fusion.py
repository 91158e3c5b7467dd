"""Serving on CUDA: every MoE block (any of models/moe.py's routings; shared experts stay modules, added by
MoE.forward) whose experts are SwiGLU MLPs of bias-free nn.Linear (float) or of bias-free QLinear (W4/W8) runs them
as the fused grouped GEMMs of kernels/triton/fused_moe.py instead of one module call per active expert.

The block keeps its identity, router, select() and children; only its class changes (to a subclass whose routed()
calls fused_moe) and it gains w_gate_up [E, 2I, H] and w_down [E, H, I], plain attributes (not in the state dict):
  float   one tensor each; every expert's gate/up/down weight becomes a view into them, so parameters and values
          are unchanged and nothing is stored twice;
  QLinear PackedExperts (kernels/triton/packed_experts.py) repacked from each part's QTensor, beside the QLinear
          buffers (which stay as loaded, as they do beside QLinear's own CUDA copy); refused (module path) when
          an expert's gate and up do not share bits, group and act-order permutation.
State-dict keys and values are unchanged either way. Mixed experts keep the module path, as does every block on CPU.
Imports triton: import this module only where the kernels run (CUDA, or TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from quantkit.kernels.triton.fused_moe import FLOAT_DTYPES, ExpertWeights, fused_moe
from quantkit.kernels.triton.packed_experts import stack_packed
from quantkit.kernels.triton.repack import repack
from quantkit.models.layers import MLP
from quantkit.models.moe import CorrectedSoftmaxMoE, GroupedTopKMoE, MoE
from quantkit.models.qwen2_moe import SharedExpertMoE
from quantkit.quant.qlinear import QLinear


class FusedMoE(MoE):
    """MoE whose routed experts run as one fused_moe call over the stacked weights."""

    w_gate_up: ExpertWeights  # [E, 2I, H]: expert e's gate rows [0, I), up rows [I, 2I) (float or PackedExperts)
    w_down: ExpertWeights  # [E, H, I]

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """x [*lead, H] -> [*lead, H], as MoE.routed (MoE.forward adds the shared experts)."""
        weights, chosen = self.select(self.gate(x), x.dtype)
        out = fused_moe(x.reshape(-1, x.shape[-1]), self.w_gate_up, self.w_down, weights, chosen)
        return out.view(x.shape)


class FusedSharedExpertMoE(SharedExpertMoE, FusedMoE):
    """Qwen2-MoE: SharedExpertMoE.forward adds the shared expert to MoE.forward's, whose routed() is FusedMoE's."""


class FusedGroupedTopKMoE(GroupedTopKMoE, FusedMoE):
    """GLM-4.5: GroupedTopKMoE's select, FusedMoE's routed (MoE.forward adds the shared experts)."""


class FusedCorrectedSoftmaxMoE(CorrectedSoftmaxMoE, FusedMoE):
    """ERNIE 4.5 MoE: CorrectedSoftmaxMoE's select, FusedMoE's routed (MoE.forward adds the shared experts)."""


FUSED = {MoE: FusedMoE, SharedExpertMoE: FusedSharedExpertMoE, GroupedTopKMoE: FusedGroupedTopKMoE,
         CorrectedSoftmaxMoE: FusedCorrectedSoftmaxMoE}  # the MoE classes whose routed() is known


def swiglu_parts(expert: nn.Module) -> Optional[tuple[nn.Module, nn.Module, nn.Module]]:
    """(gate, up, down) of a SwiGLU expert (MLP, Mixtral's MixtralExpert) whose parts are bias-free nn.Linear or
    QLinear, of shapes [I, H], [I, H], [H, I]; else None."""
    if not isinstance(expert, MLP):
        return None
    gate, up, down = parts = (expert.gate_proj, expert.up_proj, expert.down_proj)
    if not all(type(p) in (nn.Linear, QLinear) and p.bias is None for p in parts):
        return None
    if not (gate.out_features == up.out_features == down.in_features and gate.in_features == up.in_features
            == down.out_features):
        return None
    return parts


def stack_float(experts: list[tuple[nn.Linear, ...]]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(w_gate_up, w_down) with every part's weight rebound to a view of them; None unless one dtype and device."""
    weights = [p.weight for trio in experts for p in trio]
    if len({(w.dtype, w.device) for w in weights}) != 1 or weights[0].dtype not in FLOAT_DTYPES:
        return None
    inter, hidden = experts[0][0].weight.shape
    like = dict(dtype=weights[0].dtype, device=weights[0].device)
    w_gate_up = torch.empty((len(experts), 2 * inter, hidden), **like)
    w_down = torch.empty((len(experts), hidden, inter), **like)
    with torch.no_grad():
        for e, (g, u, d) in enumerate(experts):
            for linear, view in ((g, w_gate_up[e, :inter]), (u, w_gate_up[e, inter:]), (d, w_down[e])):
                view.copy_(linear.weight)
                linear.weight.data = view  # the same Parameter, now a view into the stack
    return w_gate_up, w_down


def stack_quantized(experts: list[tuple[QLinear, ...]]):
    """(w_gate_up, w_down) as PackedExperts repacked from the parts' QTensors; None when stack_packed refuses."""
    packed = [[repack(p.qtensor()) for p in trio] for trio in experts]
    w_gate_up = stack_packed([[g, u] for g, u, _ in packed])
    w_down = stack_packed([[d] for _, _, d in packed])
    return None if w_gate_up is None or w_down is None else (w_gate_up, w_down)


def fuse_moe_block(moe: nn.Module) -> bool:
    """Turn `moe` into its fused class in place when its experts are float or quantized SwiGLU MLPs of one shape
    that stack (see the module docstring); returns whether it did."""
    cls = FUSED.get(type(moe))
    if cls is None:
        return False
    experts = [swiglu_parts(expert) for expert in moe.experts]
    if any(p is None for p in experts) or len({(g.out_features, g.in_features) for g, _, _ in experts}) != 1:
        return False  # not SwiGLU, or experts of different sizes
    kinds = {type(p) for trio in experts for p in trio}
    stacked: Optional[tuple[ExpertWeights, ExpertWeights]] = None
    if kinds == {nn.Linear}:
        stacked = stack_float(experts)
    elif kinds == {QLinear}:
        stacked = stack_quantized(experts)
    if stacked is None:
        return False
    moe.__class__ = cls
    moe.w_gate_up, moe.w_down = stacked
    return True


def fuse_moe(model: nn.Module) -> int:
    """fuse_moe_block on every MoE block of `model`; returns how many were fused."""
    return sum(fuse_moe_block(m) for m in list(model.modules()) if isinstance(m, MoE))
