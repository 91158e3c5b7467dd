"""The linears of a CPU decode step as step-plan calls (kernels/cpu/step_plan.py): each recorder records the calls
its module's own forward makes at x's row count, with the same kernel, weight and bias rounding, and returns False
where no C kernel takes it (the caller then leaves the step, or the block, to the eager path). Used by the decode
step plans (serve/cpu_step_plans.py) and by the MoE experts' calls (serve/cpu_moe.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from quantkit.kernels.cpu.fused import CpuFusedOps
from quantkit.kernels.cpu.step_plan import Plan
from quantkit.quant.qlinear import QLinear, packed_kernel
from quantkit.serve.cpu_linear import FusedLinear, PackedLinear

# the W4/W8 kernels of qlinear.packed_kernel, by name, as a plan records them
_PLAN_KERNELS = {"gemv": Plan.qgemv, "rowwise": Plan.rowwise_qgemm, "amx": Plan.qgemm}


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """A bias as the bf16 row the add reads (the plan's add_rows keeps it alive)."""
    return t.detach().to(torch.bfloat16).contiguous()


def record_linear(plan: Plan, lin, x: torch.Tensor, y: torch.Tensor) -> bool:
    """y = lin(x), as lin's own forward computes it at x's row count (serve/cpu_linear.py, QLinear._cpu)."""
    if isinstance(lin, PackedLinear):
        if lin.kernel == "rowwise":
            plan.rowwise_gemm(x, lin.vnni, lin.bias, y)
        elif lin.kernel == "amx":
            _amx_gemm(plan, x, lin.vnni, lin.bias, y, False)
        return lin.kernel != "onednn"
    kind = packed_kernel(x.shape[0])
    if type(lin) is not QLinear or kind not in _PLAN_KERNELS:
        return False
    prepared = lin.prepared("amx")
    if prepared is None or prepared[0] is not None:
        return False
    _PLAN_KERNELS[kind](plan, x, prepared[1], lin.bits, y)
    if lin.bias is not None:
        plan.add_rows(y, _bf16(lin.bias))
    return True


def record_fused(plan: Plan, fusion: FusedLinear, x: torch.Tensor, y: torch.Tensor) -> bool:
    """y = fusion(x) as one [n, sum N_i] block (with act: silu(gate) * up [n, I]), as FusedLinear.forward."""
    if fusion.rowwise:
        plan.rowwise_gemm(x, fusion.weight, None if fusion.act else fusion.bias, y, fusion.act)
        return True
    if fusion.bits == 16:  # AMX's
        _amx_gemm(plan, x, fusion.weight, None if fusion.act else fusion.bias, y, fusion.act)
        return True
    kind = packed_kernel(x.shape[0])
    if kind not in _PLAN_KERNELS or fusion.perm is not None or (
            fusion.act and not isinstance(fusion.mlp.ops, CpuFusedOps)):
        return False
    _PLAN_KERNELS[kind](plan, x, fusion.weight, fusion.bits, y, fusion.act)
    if fusion.bias is not None and not fusion.act:
        plan.add_rows(y, _bf16(fusion.bias))
    return True


def _amx_gemm(plan: Plan, x: torch.Tensor, vnni: torch.Tensor, bias: Optional[torch.Tensor],
              y: torch.Tensor, act: bool) -> None:
    """y = x @ W^T on AMX's tile GEMM, then y += bias rounded to bf16 (PackedLinear's and FusedLinear's order)."""
    plan.gemm_bf16(x, vnni, y, act)
    if bias is not None:
        plan.add_rows(y, _bf16(bias))
