"""Serving on CPU, bf16: every MoE block of models/moe.py's routings (softmax top-k: Mixtral, Qwen2/3-MoE, OLMoE,
Hunyuan; ERNIE 4.5's corrected softmax; GLM-4.5's grouped sigmoid) whose experts are FusedMLPs (gate/up and SiLU as
one FusedLinear, serve/prepare.py) on the C kernels runs its routing and routed experts as one kernels/cpu/moe.py
call instead of a Python loop over the active experts, and the decode step plans record that call
(serve/cpu_step_plans.py); shared experts (an MLP added after) stay modules.

The block keeps its identity, router, parameters and children; only its class changes (to a subclass whose routed()
calls moe_forward) and it gains `expert_calls` (not in the state dict). A block of experts a kernel does not take
(oneDNN's bf16, act-order W4, a bias) or a step of more tokens than the kernels take (max_rows) keeps MoE.routed.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from quantkit.kernels.cpu import moe as cpu_moe
from quantkit.kernels.cpu.step_plan import KINDS, ROW_LIMITS, Plan
from quantkit.models.moe import BiasedRouter, CorrectedSoftmaxMoE, GroupedTopKMoE, MoE
from quantkit.models.qwen2_moe import SharedExpertMoE
from quantkit.serve.cpu_linear import FusedLinear
from quantkit.serve.cpu_plan_linears import record_fused, record_linear

log = logging.getLogger("quantkit.serve")

class CpuMoE(MoE):
    """MoE whose routed() runs as one moe_forward call (bf16, up to expert_calls.max_rows tokens): the routing
    moe.c computes is expert_calls.routing, which routing() takes from the block's class."""

    expert_calls: cpu_moe.ExpertCalls

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """x [*lead, H] -> [*lead, H], as MoE.routed (MoE.forward adds the shared experts)."""
        flat = x.reshape(-1, x.shape[-1])
        if not self.expert_calls.takes(flat):
            return super().routed(x)
        return cpu_moe.moe_forward(flat.contiguous(), self.expert_calls).view(x.shape)


class CpuSharedExpertMoE(SharedExpertMoE, CpuMoE):
    """Qwen2-MoE: the routed experts on CpuMoE's call, then sigmoid(shared_expert_gate(x)) * shared_expert(x) added
    by moe.c's sigmoid_gated_add (over shared_gate, the gate's weight)."""

    shared_gate: torch.Tensor  # bf16 [H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if not self.expert_calls.takes(flat):
            return super().forward(x)  # SharedExpertMoE's in torch ops (routed(): MoE.routed there)
        flat = flat.contiguous()
        shared = self.shared_expert(flat).contiguous()
        return cpu_moe.sigmoid_gated_add(self.routed(flat), shared, flat, self.shared_gate).view(x.shape)


class CpuGroupedTopKMoE(GroupedTopKMoE, CpuMoE):
    """GLM-4.5's block: GroupedTopKMoE's select (for MoE.routed's steps), CpuMoE's routed."""


class CpuCorrectedSoftmaxMoE(CorrectedSoftmaxMoE, CpuMoE):
    """ERNIE 4.5's block: CorrectedSoftmaxMoE's select (for MoE.routed's steps), CpuMoE's routed."""


CPU_MOE = {MoE: CpuMoE, SharedExpertMoE: CpuSharedExpertMoE, GroupedTopKMoE: CpuGroupedTopKMoE,
           CorrectedSoftmaxMoE: CpuCorrectedSoftmaxMoE}  # the blocks moe.c routes, and their classes here


def routing(block: MoE) -> cpu_moe.Routing:
    """The routing of a block of a CPU_MOE class, as its select() computes it."""
    if isinstance(block, GroupedTopKMoE):
        return cpu_moe.Routing("grouped_sigmoid", block.top_k, block.normalize, True, block.gate.score_bias,
                               block.n_groups, block.topk_groups, block.scaling)
    if isinstance(block, CorrectedSoftmaxMoE):
        return cpu_moe.Routing("corrected_softmax", block.top_k, True, False, block.gate.score_bias,
                               param=block.norm_min)
    return cpu_moe.Routing("softmax", block.top_k, block.normalize, block.fp32_weights)


def _recorded(experts: list[nn.Module], rows: int, hidden: int, inter: int) -> Optional[Plan]:
    """Each expert's gate_up and down calls at `rows` rows, in order, on dummy x/act/y; None where a kernel does not
    take one (or it needs more than one call)."""
    plan = Plan()
    x, act, y = (torch.zeros(rows, width, dtype=torch.bfloat16) for width in (hidden, inter, hidden))
    try:
        for expert in experts:
            if not (record_fused(plan, expert.fused_gate_up, x, act) and record_linear(plan, expert.down_proj, act, y)):
                return None
    except ValueError:  # a launcher's check
        return None
    return plan if len(plan) == 2 * len(experts) else None


def routers(model: nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    """(id(block), name) -> the weight of its linear `name` that moe.c reads, for every block of a CPU_MOE class:
    "gate", the router [E, H] when an nn.Linear (in bf16) or a BiasedRouter (in fp32, as it computes), and
    Qwen2-MoE's "shared_expert_gate" (bf16 [H]). Taken before pack_linears replaces plain Linears by PackedLinears
    (which keep only their kernel's layout)."""
    dtypes = {nn.Linear: torch.bfloat16, BiasedRouter: torch.float32}
    weights = {}
    for block in model.modules():
        if type(block) not in CPU_MOE:
            continue
        if type(block.gate) in dtypes:
            weights[id(block), "gate"] = block.gate.weight.detach().to(dtypes[type(block.gate)]).contiguous()
        gate = getattr(block, "shared_expert_gate", None)
        if type(gate) is nn.Linear and gate.bias is None:
            weights[id(block), "shared_expert_gate"] = gate.weight.detach().to(torch.bfloat16).reshape(-1)
    return weights


def expert_calls(moe: MoE, router: torch.Tensor) -> Optional[cpu_moe.ExpertCalls]:
    """The block's calls (kernels/cpu/moe.py's ExpertCalls, over `router`: routers()'), or None unless every expert
    is a FusedMLP (its fused_gate_up a FusedLinear with the SiLU epilogue) of one shape whose linears a C kernel
    takes at one row."""
    experts = list(moe.experts)
    if not all(isinstance(getattr(e, "fused_gate_up", None), FusedLinear) and e.fused_gate_up.act for e in experts):
        return None
    hidden, inter = experts[0].down_proj.out_features, experts[0].down_proj.in_features
    if any((e.down_proj.out_features, e.down_proj.in_features) != (hidden, inter) for e in experts):
        return None
    small = _recorded(experts, 1, hidden, inter)
    if small is None:
        return None
    limits = {ROW_LIMITS.get(KINDS[row[0]], 0) for row in small.rows}
    if len(limits) != 1:
        return None  # gate_up and down on kernels of different limits: not a case prepare makes
    limit = limits.pop()
    large = _recorded(experts, limit + 1, hidden, inter) if limit else None
    if not limit:
        max_rows = None  # the small kernel takes any row count
    elif large is None:
        max_rows = limit  # no larger kernel here
    else:
        max_rows = ROW_LIMITS.get(KINDS[large.rows[0][0]])  # None: any
    table = [row + [limit, large.rows[i][1] if large is not None else 0] for i, row in enumerate(small.rows)]
    calls = torch.tensor(table, dtype=torch.int64).view(len(experts), 2, cpu_moe.CALL_WORDS)
    recordings = [p for p in (small, large) if p is not None]
    try:
        return cpu_moe.ExpertCalls(router, routing(moe), calls, hidden, inter, max_rows, recordings)
    except ValueError as e:  # a routing or router moe.c does not take
        log.info("MoE block of %d experts keeps MoE.routed: %s", len(experts), e)
        return None


def fuse_cpu_moe(model: nn.Module, weights: dict[tuple[int, str], torch.Tensor]) -> int:
    """Turn each MoE block of a CPU bf16 model prepared for serving into its CPU_MOE class where expert_calls takes
    its experts (weights: routers(model) before the packing); returns how many."""
    if not cpu_moe.available():
        return 0
    fused = 0
    for block in list(model.modules()):
        cls = CPU_MOE.get(type(block))
        router, shared_gate = weights.get((id(block), "gate")), weights.get((id(block), "shared_expert_gate"))
        if cls is None or router is None or (cls is CpuSharedExpertMoE and shared_gate is None):
            continue
        calls = expert_calls(block, router)
        if calls is None:
            continue
        block.__class__ = cls
        block.expert_calls = calls
        if cls is CpuSharedExpertMoE:
            block.shared_gate = shared_gate
        fused += 1
    return fused
