"""The serving runner's preparation of a loaded model, once, before the first step: what runs each op is chosen
here, so the model definition (quantkit/models/llama.py) stays the reference and holds no serving state.

On CPU, bf16:
  1. every plain nn.Linear becomes a PackedLinear (its weight reordered once for the matmul kernel);
  2. the per-token ops (norms, RoPE, SiLU-and-multiply, the KV store) become the fused C kernels of
     quantkit.kernels.cpu.fused (any CPU dtype, with the torch ops as their fallback);
  3. on AMX CPUs q/k/v and gate/up run as one GEMM each: the Attention and MLP modules become FusedAttention and
     FusedMLP, whose project() / activated() call a FusedLinear over the same parts (outputs bit-identical).
State-dict keys and parameters are unchanged by all three (the fused weights are views of the parts').
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu.fused import CpuFusedOps
from quantkit.models.llama import MLP, Attention, TorchOps
from quantkit.serve.cpu_linear import FusedLinear, can_pack, pack_linears

log = logging.getLogger("quantkit.serve")


class FusedAttention(Attention):
    """Attention whose q/k/v projections run as one FusedLinear (`fused_qkv`)."""

    fused_qkv: FusedLinear

    def project(self, x: torch.Tensor):
        return self.fused_qkv(x)


class FusedMLP(MLP):
    """An MLP whose gate/up projections and SiLU-and-multiply run as one FusedLinear with the act epilogue."""

    fused_gate_up: FusedLinear

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused_gate_up(x)


def prepare_model(model: nn.Module, device: torch.device, dtype: torch.dtype, batch_hint: int,
                  fused_ops: bool) -> Optional[CpuFusedOps]:
    """Prepare `model` in place for serving on `device` in `dtype` (batch_hint: the largest step's token count,
    for oneDNN's packing); fused_ops: use the C per-token kernels where they build. Returns the ops in use when
    they are the C kernels (the attention backend's KV store uses them too), else None."""
    if can_pack(dtype, device):
        log.info("prepacked %d Linear weights (bf16)", pack_linears(model, batch_hint))
    ops = CpuFusedOps.load(TorchOps) if device.type == "cpu" and fused_ops else None
    if ops is not None:
        model.set_ops(ops)
    if device.type == "cpu" and dtype == torch.bfloat16 and cpu_gemm.available():
        log.info("fused %d q/k/v and gate/up-SiLU projections", fuse_projections(model))
    return ops


def fuse_projections(model: nn.Module) -> int:
    """Turn each Attention into a FusedAttention and each MLP into a FusedMLP where their parts share one AMX
    packing (the module keeps its identity, parameters and children; only its class and one attribute change);
    returns how many were fused."""
    fused = 0
    for module in list(model.modules()):
        if type(module) is Attention:
            fusion = FusedLinear.of([module.q_proj, module.k_proj, module.v_proj])
            cls, name = FusedAttention, "fused_qkv"
        elif type(module) is MLP:
            fusion = FusedLinear.of([module.gate_proj, module.up_proj], module)
            cls, name = FusedMLP, "fused_gate_up"
        else:
            continue
        if fusion is None:
            continue
        module.__class__ = cls  # a subclass that only overrides the projection: every attribute stays valid
        setattr(module, name, fusion)  # a submodule without parameters: its weights are views of the parts'
        fused += 1
    return fused
