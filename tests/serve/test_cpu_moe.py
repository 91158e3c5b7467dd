"""MoE blocks on CPU as one C call (serve/cpu_moe.py, kernels/cpu/moe.c): the block's output against MoE.routed
(torch's softmax, top-k and index_add over the same expert modules, the shared experts added) on tiny random models
of each family, bf16 and W4 experts; which blocks take the call, the fallback above the kernels' rows, routing ties
and a NaN token."""

from __future__ import annotations

import pytest
import torch

from quantkit.benchmark.step import rtn_quantize_linears
from quantkit.config import QuantScheme
from quantkit.kernels.cpu import gemv
from quantkit.kernels.cpu import moe as cpu_moe
from quantkit.models.loader import load_model
from quantkit.models.moe import BiasedRouter, MoE
from quantkit.models.qwen2_moe import SharedExpertMoE
from quantkit.quant.qlinear import QLinear
from quantkit.serve.cpu_linear import can_pack
from quantkit.serve.cpu_moe import CpuMoE
from quantkit.serve.prepare import FusedMixtralExpert, prepare_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not (cpu_moe.available() and can_pack(torch.bfloat16, torch.device("cpu"))),
                                 reason="no C kernels or no packed bf16 linears here: MoE blocks stay in Python")]
needs_gemv = pytest.mark.skipif(not gemv.available(), reason="no AVX2 + FMA + F16C: W4 experts have no C GEMV here")


def prepared(folder, weights: str, change=lambda model: None):
    """The model loaded in bf16 (W4: RTN experts, g32), changed by `change`, then prepared for serving on CPU as the
    default runner prepares it (batch-invariant: bf16 linears on a row-invariant kernel; oneDNN's, which moe.c
    cannot call, keep MoE.routed)."""
    model = load_model(str(folder), dtype=torch.bfloat16).model
    if weights == "w4":
        rtn_quantize_linears(model, QuantScheme(bits=4, group_size=32, sym=False))
    change(model)
    prepare_model(model, torch.device("cpu"), torch.bfloat16, 64, fused_ops=True, batch_invariant=True)
    return model


def moe_blocks(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def reference(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """MoE.routed over the block's modules (torch's routing and index_add), plus the shared experts (Qwen2-MoE's gated)
    in torch's ops."""
    out = MoE.routed(block, x)
    if block.shared_experts is not None:
        out = out + block.shared_experts(x)
    if isinstance(block, SharedExpertMoE):
        out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out


# softmax top-k (Mixtral: fp32 weights; Qwen2-MoE: a gated shared expert; OLMoE: not renormalised; Hunyuan: shared
# experts), GLM-4.5's grouped sigmoid (fp32 router, 4 experts in 2 groups, 1 eligible) and ERNIE 4.5's corrected
# softmax (fp32 router)
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "hunyuan_moe", "glm4_moe",
                                  "ernie4_5_moe"])
@pytest.mark.parametrize("weights", ["bf16", pytest.param("w4", marks=needs_gemv)])
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_the_c_call_computes_what_moe_forward_computes(family_folder, name, weights, tokens):
    def biased(model):  # the correction biases (zeros as built) of a scale that changes which experts are chosen
        torch.manual_seed(0)
        for block in moe_blocks(model):
            if isinstance(block.gate, BiasedRouter):
                block.gate.e_score_correction_bias.normal_(0, 0.3)

    model = prepared(family_folder(name), weights, biased)
    blocks = moe_blocks(model)
    assert blocks and all(isinstance(b, CpuMoE) for b in blocks)
    torch.manual_seed(tokens)
    for block in blocks:
        x = torch.randn(tokens, block.expert_calls.hidden).to(torch.bfloat16)
        got, want = block(x), reference(block, x)
        if not block.expert_calls.takes(x):  # W4 above the GEMV's rows without a larger kernel: MoE.routed itself
            assert weights == "w4" and tokens > gemv.MAX_ROWS and torch.equal(got, want)
            continue
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        # the same experts and kernels; the router's sums, exp and the bf16 weights may differ by an ulp
        assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max(), name


def test_mixtral_experts_fuse_and_routers_stay_float(family_folder):
    model = prepared(family_folder("mixtral"), "w4" if gemv.available() else "bf16")
    block = moe_blocks(model)[0]
    assert all(type(e) is FusedMixtralExpert for e in block.experts)
    assert not isinstance(block.gate, QLinear)  # rtn_quantize_linears quantizes what calibration does


def test_routing_ties_go_to_the_lower_expert(family_folder):
    """Experts 1 and 2 of equal router rows, far above the others: top-1 routes every token to expert 1, whose
    output (weight 1) is the block's, bit for bit."""
    def tie(model):
        block = moe_blocks(model)[0]
        with torch.no_grad():
            block.gate.weight.zero_()
            block.gate.weight[1:3] = 1.0
        block.top_k = 1

    block = moe_blocks(prepared(family_folder("qwen3_moe"), "bf16", tie))[0]
    x = torch.rand(5, block.expert_calls.hidden).add(0.5).to(torch.bfloat16)  # experts 1 and 2 lead by sum(x)
    got = block(x)
    assert torch.equal(got, block.experts[1](x))
    assert not torch.equal(got, block.experts[2](x))


def test_a_nan_token_routes_and_leaves_the_other_tokens_alone(family_folder):
    """NaN logits rank last (every choice stays an expert index); bf16 experts are row-invariant, so the other
    tokens' outputs are those of a call without the NaN token."""
    block = moe_blocks(prepared(family_folder("qwen3_moe"), "bf16"))[0]
    x = torch.randn(3, block.expert_calls.hidden).to(torch.bfloat16)
    x[1] = float("nan")
    got = block(x)
    assert got[1].isnan().all()
    assert torch.equal(got[[0, 2]], block(x[[0, 2]]))
