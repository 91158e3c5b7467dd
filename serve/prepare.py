"""The serving runner's preparation of a loaded model, once, before the first step: what runs each op is chosen
here, so the model definition (quantkit/models/llama.py) stays the reference and holds no serving state.

On CPU, bf16:
  1. every plain nn.Linear becomes a PackedLinear (its weight reordered once for the matmul kernel);
  2. the per-token ops (norms, RoPE, SiLU-and-multiply, the KV store) become the fused C kernels of
     quantkit.kernels.cpu.fused (any CPU dtype, with the torch ops as their fallback);
  3. on AMX CPUs q/k/v and gate/up run as one GEMM each (W4/W8 also on CPUs with the GEMV, AVX512-BF16, for
     decode-sized calls): the Attention and MLP modules become FusedAttention and FusedMLP, whose project() /
     activated() call a FusedLinear over the same parts (outputs bit-identical);
  4. with the C kernels, each MoE block whose experts step 3 fused routes and runs them as one C call
     (serve/cpu_moe.py).
Batch-invariant (EngineConfig.batch_invariant, bf16 on CPU with the C kernels): step 1 packs every plain Linear,
the lm_head included, for a row-invariant kernel (AMX's tile GEMM where it runs, else kernels/cpu/rowwise_gemm.py's
GEMM: serve/cpu_linear.py), and step 3 fuses on it on any CPU; the attention backend then runs every query row as a
decode item (serve/attention.py).
State-dict keys and parameters are unchanged by all four (the fused weights are views of the parts').
On CUDA, the norms (with their residual adds), RoPE and SiLU-and-multiply run on the Triton kernels
(kernels/triton/layer_ops.py), q/k/v and gate/up as one matmul each (serve/cuda_linear.py: float or W4/W8, outside
MoE blocks), and each MoE block with float or W4/W8 experts runs them as fused grouped GEMMs (serve/moe_fusion.py).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu import rowwise_gemm
from quantkit.kernels.cpu.fused import CpuFusedOps
from quantkit.kernels.cpu.paged_decode import load_rows_kernel
from quantkit.models.llama import MLP, Attention, TorchOps
from quantkit.models.mixtral import MixtralExpert
from quantkit.models.moe import MoE
from quantkit.quant.qlinear import QLinear
from quantkit.serve.cpu_linear import FusedLinear, can_pack, pack_linears
from quantkit.serve.cpu_moe import fuse_cpu_moe, routers

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


class FusedMixtralExpert(MixtralExpert, FusedMLP):
    """Mixtral's expert (its w1/w3/w2 names) with FusedMLP's activated()."""


FUSED_MLPS = {MLP: FusedMLP, MixtralExpert: FusedMixtralExpert}  # the SwiGLU classes and their fused ones


def batch_invariant_mode(asked: bool, device: torch.device, dtype: torch.dtype, native_kernels: bool) -> bool:
    """Whether a runner serves batch-invariantly: asked (EngineConfig.batch_invariant), bf16 on CPU, the C kernels
    in use (attention_backend auto) and the rowwise GEMM and row attention kernel built here. Other dtypes and
    devices are served as before; asked but impossible here is logged."""
    if not (asked and device.type == "cpu" and dtype == torch.bfloat16):
        return False
    if not can_pack(dtype, device):
        log.warning("batch-invariant serving needs oneDNN's bf16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT) or the "
                    "rowwise GEMM's AVX2 build, neither of which runs here: bf16 runs on torch's own kernels, and "
                    "greedy output may depend on what a request is batched with")
        return False
    if native_kernels and rowwise_gemm.available() and load_rows_kernel() is not None:
        if not (cpu_gemm.available() or rowwise_gemm.vectorised()):
            log.warning("batch-invariant serving: the row-invariant GEMM runs its portable C path here (slower than "
                        "oneDNN); --no-batch-invariant trades invariance for speed")
        return True
    log.warning("batch-invariant serving needs the C kernels (attention_backend auto and a C compiler): greedy "
                "output may depend on what a request is batched with")
    return False


def prepare_model(model: nn.Module, device: torch.device, dtype: torch.dtype, batch_hint: int,
                  fused_ops: bool, batch_invariant: bool = False) -> Optional[CpuFusedOps]:
    """Prepare `model` in place for serving on `device` in `dtype` (batch_hint: the largest step's token count,
    for oneDNN's packing); fused_ops: the per-token ops on kernels (the C ones where they build, the Triton ones on
    CUDA); batch_invariant: the rowwise GEMM for every plain Linear (batch_invariant_mode said yes). Returns the ops
    in use when they are the C kernels (the attention backend's KV store uses them too), else None."""
    moe_routers = routers(model) if device.type == "cpu" and dtype == torch.bfloat16 and fused_ops else {}
    if can_pack(dtype, device):
        packed = pack_linears(model, batch_hint, rowwise=batch_invariant)
        log.info("prepacked %d Linear weights (bf16%s)", packed, ", row-invariant GEMM" if batch_invariant else "")
    quantized = sum(isinstance(m, QLinear) for m in model.modules())
    if batch_invariant and quantized:
        log.warning("batch-invariant serving: %d W4/W8 layers keep kernels chosen by the row count (their greedy "
                    "output may still depend on batching; invariance holds for bf16 weights)", quantized)
    ops = CpuFusedOps.load(TorchOps) if device.type == "cpu" and fused_ops else None
    if ops is not None:
        model.set_ops(ops)
    if device.type == "cpu" and dtype == torch.bfloat16:  # FusedLinear.of refuses parts without a shared packing
        log.info("fused %d q/k/v and gate/up-SiLU projections", fuse_projections(model))
        moe_blocks = fuse_cpu_moe(model, moe_routers) if ops is not None else 0  # on the experts just fused
        if moe_blocks:
            log.info("MoE: %d blocks route and run their experts as one C call", moe_blocks)
    if device.type == "cuda":
        from quantkit.kernels.triton.layer_ops import TritonOps  # imports triton: CUDA only
        from quantkit.serve.cuda_linear import StackedLinear
        from quantkit.serve.moe_fusion import fuse_moe

        if fused_ops:
            model.set_ops(TritonOps(TorchOps))
        experts = {id(m) for block in model.modules() if isinstance(block, MoE) for m in block.modules()}
        log.info("stacked %d q/k/v and gate/up projections", fuse_projections(model, StackedLinear.of, experts))
        fused_moe_blocks = fuse_moe(model)  # the experts' weights: its own stacking
        if fused_moe_blocks:
            log.info("MoE: %d blocks run their experts as fused Triton grouped GEMMs", fused_moe_blocks)
    return ops


def fuse_projections(model: nn.Module, fuse=FusedLinear.of, skip: frozenset[int] | set[int] = frozenset()) -> int:
    """Turn each Attention into a FusedAttention and each MLP (Mixtral's expert) into a FusedMLP (FusedMixtralExpert),
    but the modules whose id is in `skip`, where `fuse` takes their parts: FusedLinear.of on CPU (one AMX packing),
    cuda_linear.StackedLinear.of on CUDA. The module keeps its identity, parameters and children; only its class and
    one attribute change. Returns how many were fused."""
    fused = 0
    for module in list(model.modules()):
        if id(module) in skip:
            continue
        if type(module) is Attention:
            fusion = fuse([module.q_proj, module.k_proj, module.v_proj])
            cls, name = FusedAttention, "fused_qkv"
        elif type(module) in FUSED_MLPS:
            fusion = fuse([module.gate_proj, module.up_proj], module)
            cls, name = FUSED_MLPS[type(module)], "fused_gate_up"
        else:
            continue
        if fusion is None:
            continue
        module.__class__ = cls  # a subclass that only overrides the projection: every attribute stays valid
        setattr(module, name, fusion)  # a submodule without parameters: its weights are views of the parts'
        fused += 1
    return fused
